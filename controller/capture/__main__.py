"""``python -m controller.capture`` / ``changefeed-capture``: run one capture agent.

Exit status: 0 after SIGTERM/SIGINT (dispatchers stopped, Lease released), 2 for bad arguments or an
unloadable kubeconfig, 3 when the agent fenced itself (Lease not renewable, lost, or an internal task
died): a supervisor (kubelet, systemd) is expected to restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from controller.capture import logs
from controller.capture.agent import Agent, Settings, install_signal_handlers
from controller.kube.client import Client, Config

log = logging.getLogger("controller.capture")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="changefeed-capture", description="Run a capture agent (hosts dispatchers).")
    p.add_argument("--name", required=True, help="capture name (the Capture object and Lease capture-<name>)")
    p.add_argument("--namespace", required=True, help="namespace of the changefeed resources")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig path (default: $KUBECONFIG, ~/.kube, in-cluster)")
    p.add_argument("--context", default=None, help="kubeconfig context")
    p.add_argument("--lease-duration", type=int, default=10, help="Lease duration, whole seconds (default 10)")
    p.add_argument("--renew-interval", type=float, default=2.0, help="seconds between renewals (default 2)")
    p.add_argument(
        "--renew-deadline",
        type=float,
        default=7.0,
        help="fence (stop everything, exit 3) after this many seconds without a renewal; < lease duration (default 7)",
    )
    p.add_argument("--report-interval", type=float, default=2.0, help="seconds between checkpoint reports (default 2)")
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=10.0,
        help="seconds between status writes of an unchanged Working dispatcher (default 10)",
    )
    p.add_argument("--init-delay", type=float, default=0.5, help="seconds a new dispatcher stays Initializing")
    p.add_argument("--tick", type=float, default=0.2, help="seconds between loop iterations (default 0.2)")
    p.add_argument("--address", default=os.environ.get("POD_IP", ""), help="status.address (default: $POD_IP)")
    p.add_argument(
        "--readiness",
        default="",
        help="e.g. http://0.0.0.0:8081/readyz: 200 while registered with a current Lease and its kinds listed",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
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
    logs.setup(args.log_level)
    settings = Settings(
        name=args.name,
        namespace=args.namespace,
        lease_duration=args.lease_duration,
        renew_interval=args.renew_interval,
        renew_deadline=args.renew_deadline,
        report_interval=args.report_interval,
        heartbeat_interval=args.heartbeat_interval,
        tick=args.tick,
        init_delay=args.init_delay,
        pod=os.environ.get("POD_NAME", ""),
        address=args.address,
        readiness=args.readiness,
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
