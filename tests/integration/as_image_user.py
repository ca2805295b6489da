"""Run a module as the image's user runs it: ``python tests/integration/as_image_user.py MODULE ARGS...``.

The image runs as uid 65532, which has no passwd entry, with no USER or LOGNAME in the environment. This
machine's interpreter lives where another uid cannot read it, so the test cannot switch uid; it makes the
two facts true inside the process instead: the user-name variables are removed and ``pwd.getpwuid``
raises exactly what it raises for a uid without an entry. ``getpass.getuser()`` then fails as it did in the
pod (Kopf's peering identity crashed the maintainer at startup with this KeyError).
"""

from __future__ import annotations

import os
import pwd
import runpy
import sys
from typing import NoReturn


def _no_entry(uid: int) -> NoReturn:
    raise KeyError(f"getpwuid(): uid not found: {uid}")


def main() -> None:
    for var in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        os.environ.pop(var, None)
    pwd.getpwuid = _no_entry  # type: ignore[assignment]
    module, args = sys.argv[1], sys.argv[2:]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
