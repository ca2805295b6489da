"""``make demo`` end to end, with either sink: the demo's own process starts a real etcd and PostgreSQL or MariaDB,
the embedded
Kubernetes API, a maintainer and three captures, writes rows throughout, runs the failover scenario and ends
with ``kubectl changefeed verify``; its exit code is verify's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sink", ["postgres", "mysql"])
def test_the_demo_replicates_rows_through_the_failover_and_verifies_them(tmp_path: Path, sink: str) -> None:
    cmd = [sys.executable, "-m", "controller.demo", "--scenario", "failover", "--rate", "100", "--sink", sink,
           "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the demo did not finish: {exc.stdout!r}") from exc
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "recovered: every operator finished" in out, out
    rows = [int(n) for n in re.findall(r"rows downstream=(\d+)", out)]
    assert rows, out
    assert max(rows) > 0, out  # rows arrived downstream while the demo ran
    lags = re.findall(r"lag=(\d+\.\d)s", out)
    assert lags, out  # the lag in seconds is shown once the captures report
    assert re.search(r"table 101 \(default\): [\d,]+ keys at revision \d+: 0 differences", out), out
    assert "verify: 0 differences" in out, out
