"""Small kubectl helpers for the e2e suite: every call names the checked context and the test namespace."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, TypeVar

T = TypeVar("T")
GROUP = "cdc.maintainer.dev"
KINDS = ("changefeeds", "tables", "spans", "dispatchers", "spanoperators", "captures")


@dataclass(frozen=True)
class Kube:
    context: str
    namespace: str

    def run(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120) -> str:
        cmd = ["kubectl", "--context", self.context, "--namespace", self.namespace, *args]
        out = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout, check=False)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout

    @contextmanager
    def background(self, *args: str) -> Iterator[Background]:
        """kubectl ``args`` in the background while the block runs (e.g. ``rollout status``, to sample the cluster
        while it waits); killed on leaving the block if it still runs."""
        cmd = ["kubectl", "--context", self.context, "--namespace", self.namespace, *args]
        with (
            tempfile.TemporaryFile(mode="w+") as out,
            subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, text=True) as proc,
        ):
            try:
                yield Background(proc, out)
            finally:
                if proc.poll() is None:
                    proc.kill()

    def items(self, resource: str, selector: str = "") -> list[dict[str, Any]]:
        args = ["get", f"{resource}.{GROUP}" if resource in KINDS else resource, "-o", "json"]
        if selector:
            args += ["-l", selector]
        return list(json.loads(self.run(*args))["items"])

    def get(self, resource: str, name: str) -> dict[str, Any] | None:
        out = self.run("get", resource, name, "-o", "json", "--ignore-not-found", check=False)
        return json.loads(out) if out.strip() else None

    def apply(self, *docs: dict[str, Any]) -> None:
        self.run("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(docs)}))

    def annotate(self, resource: str, name: str, key: str, value: str | None) -> None:
        self.run("annotate", "--overwrite", resource, name, f"{key}-" if value is None else f"{key}={value}")


@dataclass(frozen=True)
class Background:
    """A command running in the background (``Kube.background``); its output (stdout and stderr) goes to a
    temporary file, not to a pipe that could fill up."""

    proc: subprocess.Popen[str]
    out: IO[str]

    def poll(self) -> int | None:
        """Its exit code, or None while it runs."""
        return self.proc.poll()

    def output(self) -> str:
        self.out.flush()
        self.out.seek(0)
        return self.out.read()


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 180, every: float = 1.0) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` and the last value seen."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last  # type: ignore[no-any-return]
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
