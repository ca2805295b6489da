"""``python -m controller.apiserver.bench``: throughput of the embedded API server, measured from one client.

The server runs in a subprocess (``python -m controller.apiserver``) so that it does not share the GIL with
the measuring client, as in the integration tests where Kopf and the agents are separate processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

NS = "/apis/cdc.maintainer.dev/v1alpha1/namespaces/default"
MERGE = {"Content-Type": "application/merge-patch+json"}


def _span(name: str) -> dict[str, object]:
    spec = {"changefeed": "cf", "tableID": 1, "startKey": "00", "endKey": "ff"}
    return {
        "apiVersion": "cdc.maintainer.dev/v1alpha1",
        "kind": "Span",
        "metadata": {"name": name, "labels": {"bench": "yes"}},
        "spec": spec,
    }


async def run(url: str, writes: int, objects: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with aiohttp.ClientSession(url) as session:
        async with session.post(f"{NS}/spans", json=_span("bench-0")) as resp:
            assert resp.status == 201, await resp.text()
        start = time.perf_counter()
        for i in range(writes):
            body = json.dumps({"status": {"state": "Replicating", "checkpointTs": i}})
            async with session.patch(f"{NS}/spans/bench-0/status", data=body, headers=MERGE) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
        out["status_patches_per_s"] = writes / (time.perf_counter() - start)

        received = 0

        async def watch() -> None:
            nonlocal received
            params = {"watch": "true", "resourceVersion": "0", "labelSelector": "bench=yes"}
            async with session.get(f"{NS}/spans", params=params) as resp:
                async for _line in resp.content:
                    received += 1
                    if received >= objects:
                        return

        watcher = asyncio.create_task(watch())
        start = time.perf_counter()
        for i in range(1, objects):
            async with session.post(f"{NS}/spans", json=_span(f"bench-{i}")) as resp:
                assert resp.status == 201, await resp.text()
        out["creates_per_s"] = (objects - 1) / (time.perf_counter() - start)
        await asyncio.wait_for(watcher, 60)
        out["watch_events_delivered"] = received

        timings = []
        for _ in range(5):
            start = time.perf_counter()
            async with session.get(f"{NS}/spans") as resp:
                body = await resp.json()
            timings.append(time.perf_counter() - start)
            assert len(body["items"]) == objects
        out["list_10k_seconds_median"] = sorted(timings)[2]

        start = time.perf_counter()
        count = 0
        params = {"watch": "true", "resourceVersion": "0"}
        async with session.get(f"{NS}/spans", params=params) as resp:
            async for _line in resp.content:
                count += 1
                if count >= objects:
                    break
        out["watch_replay_events_per_s"] = count / (time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--writes", type=int, default=5000)
    parser.add_argument("--objects", type=int, default=10_000)
    args = parser.parse_args(argv)
    crds = Path(__file__).resolve().parents[2] / "crds"
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller.apiserver", "--crds", str(crds), "--history-size", "50000"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        results = asyncio.run(run(url, args.writes, args.objects))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for key, value in results.items():
        print(f"{key}: {value:.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
