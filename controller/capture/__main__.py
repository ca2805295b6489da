"""``python -m controller.capture`` / ``changefeed-capture``: run one capture agent.

Exit status: 0 after SIGTERM/SIGINT (with ``--drain-timeout``, after the maintainer moved its dispatchers
off or the timeout ran out; then dispatchers stopped, Lease released), 1 when the capture may not read its own
Lease (a pod beyond the chart's capture.maxReplicas), 2 for bad arguments or an
unloadable kubeconfig, 3 when the agent fenced itself: a renewal found its Lease deleted or taken (another
holder, or another process of the same name), or an internal task died. A supervisor (kubelet, systemd) is
expected to restart it. A Lease it cannot renew (the API unreachable) does not end it: past
``--renew-deadline`` it pauses its dispatchers and resumes them once a renewal succeeds again
(docs/architecture.md, "Captures: pause, resume, or fence").
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from controller import logs
from controller.capture.agent import Agent, Settings, install_signal_handlers
from controller.capture.lease_keeper import RETRY_AFTER_FAILURE
from controller.capture.ledger import LEDGER_ENV
from controller.kube.client import Client, Config
from controller.process import tenure

log = logging.getLogger("controller.capture")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="changefeed-capture", description="Run a capture agent (hosts dispatchers).")
    p.add_argument("--name", required=True, help="capture name (the Capture object and Lease capture-<name>)")
    p.add_argument("--namespace", required=True, help="namespace of the changefeed resources")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig path (default: $KUBECONFIG, ~/.kube, in-cluster)")
    p.add_argument("--context", default=None, help="kubeconfig context")
    p.add_argument("--lease-duration", type=int, default=10, help="Lease duration, whole seconds (default 10)")
    p.add_argument(
        "--renew-interval",
        type=float,
        default=2.0,
        help="seconds between Lease renewals, each carrying the checkpoints of the Working dispatchers (default 2); "
        f"after a failed renewal it retries every {RETRY_AFTER_FAILURE:g} s (or this interval, if shorter)",
    )
    p.add_argument(
        "--renew-deadline",
        type=float,
        default=7.0,
        help="pause when the last successful renewal was sent this many seconds ago: every dispatcher stops "
        "delivering but keeps its position, and the agent keeps renewing; once a renewal succeeds it resumes "
        "the dispatchers still assigned to it. It exits 3 only when a renewal finds its Lease deleted or taken. "
        "< --lease-duration (default 7)",
    )
    p.add_argument(
        "--report-interval",
        type=float,
        default=2.0,
        help="a status write the API does not show is sent again after twice this, a dispatcher still "
        "Initializing after this is reported so, and the Capture's status is written at most this often "
        "(default 2). A dispatcher's traffic is checked when its Table's changes; every dispatcher is looked at "
        "once a minute. Checkpoints travel with every Lease renewal (--renew-interval)",
    )
    p.add_argument(
        "--init-delay", type=float, default=0.5, help="seconds a new dispatcher stays Initializing (default 0.5)"
    )
    p.add_argument(
        "--tick",
        type=float,
        default=0.2,
        help="at most this many seconds between loop iterations; a watch event wakes the loop at once (default 0.2)",
    )
    p.add_argument("--address", default=os.environ.get("POD_IP", ""), help="status.address (default: $POD_IP)")
    p.add_argument(
        "--readiness",
        default="",
        help="e.g. http://0.0.0.0:8081/readyz: 200 while registered, not paused, with a renewal younger than "
        "--renew-deadline, and its Dispatchers and Capture listed; else 503",
    )
    p.add_argument(
        "--ledger-dir",
        default=os.environ.get(LEDGER_ENV, ""),
        help=f"append what the dispatchers deliver to DIR/<name>.<incarnation>.jsonl (default: ${LEDGER_ENV}; "
        "none when empty), for the no-gap check of controller.capture.ledger",
    )
    p.add_argument(
        "--test-hooks",
        action="store_true",
        help="honour the test hooks (annotations cdc.maintainer.dev/hold-close and pause-create on the Capture): "
        "for tests and the demo only; without it they are reported and ignored",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=0.0,
        help="on SIGTERM, mark the Capture draining and wait up to this many seconds for the maintainer to move "
        "its dispatchers off (Move operators: no span goes Absent) before stopping what is left and releasing "
        "the Lease; keep it below the pod's termination grace period. 0 (default): stop at once. A second "
        "SIGTERM stops at once too",
    )
    p.add_argument(
        "--gc-tenure",
        type=float,
        default=tenure.PERIOD,
        help="seconds between tenure steps: what survived is frozen out of the garbage collector's full passes, so "
        f"that one never holds the loop for long however many dispatchers run here (0: off; default {tenure.PERIOD:g})",
    )
    logs.add_arguments(p)
    return p.parse_args(argv)


async def _run(settings: Settings, config: Config) -> int:
    client = Client(config)
    try:
        agent = Agent(client, settings)
        install_signal_handlers(agent)
        return await agent.run()
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs.setup(args.log_level, args.log_format)
    settings = Settings(
        name=args.name,
        namespace=args.namespace,
        lease_duration=args.lease_duration,
        renew_interval=args.renew_interval,
        renew_deadline=args.renew_deadline,
        report_interval=args.report_interval,
        tick=args.tick,
        init_delay=args.init_delay,
        pod=os.environ.get("POD_NAME", ""),
        address=args.address,
        readiness=args.readiness,
        ledger_dir=args.ledger_dir,
        test_hooks=args.test_hooks,
        drain_timeout=args.drain_timeout,
        gc_tenure=args.gc_tenure,
    )
    try:
        settings.check()
    except ValueError as exc:
        log.error("bad arguments", extra=logs.fields(error=str(exc)))
        return 2
    try:
        config = Config.load(args.kubeconfig, args.context)
    except Exception as exc:  # the kubernetes package raises several unrelated types here
        log.error("cannot load the Kubernetes configuration", extra=logs.fields(error=repr(exc)))
        return 2
    return asyncio.run(_run(settings, config))


if __name__ == "__main__":
    sys.exit(main())
