"""The embedded API answers like the recorded kube-apiserver v1.36.2 (``corpus/transcript.json``).

Every probe of the transcript is replayed against a fresh embedded server (``replay.py``); each probe is a test
that fails on any difference not listed in ``corpus/exceptions.yaml``. The exception list is itself checked:
an entry that no longer matches a difference fails, and for probes that do not depend on the project's CRDs no
entry may excuse a status code or a reason.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from controller.apiserver import start_server
from tests.apiserver import replay

EXCEPTIONS = replay.VENDORED_DIR / "exceptions.yaml"
TRANSCRIPT = replay.load_transcript()
PROJECT_PROBES = {p["id"] for p in TRANSCRIPT["probes"] if p["dependsOnProjectCRDs"]}
PROBE_IDS = ["globalSetup"] + [p["id"] for p in TRANSCRIPT["probes"]]


@dataclass(frozen=True)
class Exception_:
    probe: str
    step: str | None
    field: str | None
    reason: str

    def covers(self, diff: replay.Diff) -> bool:
        if diff.probe != self.probe or (self.step is not None and diff.step != self.step):
            return False
        if self.field is None:
            return True
        return diff.field == self.field or diff.field.startswith((self.field + ".", self.field + "["))


def load_exceptions(path: Path = EXCEPTIONS) -> list[Exception_]:
    out = []
    for entry in yaml.safe_load(path.read_text()) or []:
        assert set(entry) <= {"probe", "step", "field", "reason"}, entry
        assert entry.get("reason"), f"an exception needs a reason: {entry}"
        out.append(
            Exception_(entry["probe"], entry.get("step"), entry.get("field"), " ".join(str(entry["reason"]).split()))
        )
    return out


@pytest.fixture(scope="module")
def report() -> Iterator[replay.Report]:
    handle = start_server(None, **replay.REPLAY_SERVER)
    try:
        crds = list(replay.iter_crd_files(replay.ROOT / "crds"))
        result = asyncio.run(replay.replay(handle.url, TRANSCRIPT, crds))
    finally:
        handle.stop()
    slowest = sorted(result.probe_seconds.items(), key=lambda kv: -kv[1])[:3]
    print(f"\ncorpus replay: {len(PROBE_IDS) - 1} probes in {result.seconds:.1f}s (slowest: {slowest})")
    return result


def test_vendored_transcript_is_the_shared_one() -> None:
    """The copy in the repository is what CI replays when ../shared is absent; it must not drift."""
    vendored = replay.VENDORED_DIR / "transcript.json"
    assert vendored.exists()
    for name in ("transcript.json", "README.md"):
        shared = replay.SHARED_DIR / name
        if shared.exists():
            assert (replay.VENDORED_DIR / name).read_bytes() == shared.read_bytes(), (
                f"corpus/{name} differs from {shared}"
            )
    assert json.loads(vendored.read_text())["server"]["gitVersion"] == "v1.36.2"


@pytest.mark.parametrize("probe", PROBE_IDS)
def test_probe_answers_as_recorded(report: replay.Report, probe: str) -> None:
    exceptions = load_exceptions()
    unexplained = [d for d in report.for_probe(probe) if not any(e.covers(d) for e in exceptions)]
    assert not unexplained, f"{len(unexplained)} difference(s) from the recorded kube-apiserver:\n" + "\n".join(
        str(d) for d in unexplained
    )


def test_every_exception_still_applies(report: replay.Report) -> None:
    stale = [e for e in load_exceptions() if not any(e.covers(d) for d in report.diffs)]
    assert not stale, "exceptions that match no difference any more (remove them):\n" + "\n".join(map(str, stale))


def test_exceptions_keep_status_and_reason_exact() -> None:
    """For probes independent of the project's CRDs, status codes and reasons must match without exception."""
    known = set(PROBE_IDS)
    for e in load_exceptions():
        assert e.probe in known, f"unknown probe in exceptions.yaml: {e.probe}"
        if e.probe in PROJECT_PROBES:
            continue
        assert e.field is not None, f"{e.probe}: an exception for a whole step or probe would hide status and reason"
        assert e.field not in ("status", "reason", "body", "body.code", "body.reason"), (
            f"{e.probe}: status and reason must match exactly"
        )
