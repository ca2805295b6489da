"""``python -m controller.apiserver --port 0 --crds crds/ --kubeconfig PATH [--tls]``: serve until interrupted.

Prints the URL, then the kubeconfig path, on stdout; logs (controllers.py's warnings) go to stderr in the
schema of every process of the project (``controller.logs``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from controller import logs
from controller.apiserver import cost
from controller.apiserver.controllers import NAMESPACE_DELAY
from controller.apiserver.server import start_server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controller.apiserver", description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--crds", default=None, help="directory of CRD YAML files to load at startup")
    parser.add_argument("--kubeconfig", default=None, help="where to write a kubeconfig pointing at the server")
    parser.add_argument(
        "--bookmark-interval",
        type=float,
        default=60.0,
        help="seconds between watch BOOKMARKs (a real server: about a minute, but it promises none)",
    )
    parser.add_argument(
        "--no-bookmarks",
        action="store_true",
        help="send no watch BOOKMARK at all, not even before a watch's timeout (only the initial-events-end one "
        "that sendInitialEvents requires), as a real watch cache for a kind it has seen no event for",
    )
    parser.add_argument("--history-size", type=int, default=10_000, help="watch events kept for resuming watches")
    parser.add_argument(
        "--api-cost",
        action="store_true",
        help="the storage's cost model (controller/apiserver/cost.py): writes wait for commits in batches, "
        f"calibrated to a real server ({cost.DEFAULT_LATENCY_MS} ms a commit + {cost.DEFAULT_PER_WRITE_MS} ms a write)",
    )
    parser.add_argument("--commit-latency-ms", type=float, help="with --api-cost: ms a commit lasts")
    parser.add_argument("--commit-per-write-ms", type=float, help="with --api-cost: ms each write adds to its commit")
    parser.add_argument(
        "--namespace-delay",
        type=float,
        default=NAMESPACE_DELAY,
        help="seconds from a namespace's deletion to the namespace controller's first pass over its content "
        f"(default {NAMESPACE_DELAY:g}, about what a real cluster takes)",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="serve HTTPS with a self-signed certificate made at start (the kubeconfig carries it as its CA)",
    )
    logs.add_arguments(parser)
    args = parser.parse_args(argv)
    logs.setup(args.log_level, args.log_format)
    # celpy logs every CEL rule it transpiles at info (the generated Python): the library's detail, not ours.
    logging.getLogger("celpy").setLevel(logging.WARNING)
    model = None
    if args.api_cost:
        latency = cost.DEFAULT_LATENCY_MS if args.commit_latency_ms is None else args.commit_latency_ms
        per_write = cost.DEFAULT_PER_WRITE_MS if args.commit_per_write_ms is None else args.commit_per_write_ms
        if latency < 0 or per_write < 0:
            parser.error("--commit-latency-ms and --commit-per-write-ms must not be negative")
        model = cost.CostModel(latency / 1000, per_write / 1000)
    elif args.commit_latency_ms is not None or args.commit_per_write_ms is not None:
        parser.error("--commit-latency-ms and --commit-per-write-ms need --api-cost")
    if args.namespace_delay < 0:
        parser.error("--namespace-delay must not be negative")
    handle = start_server(
        args.crds,
        args.port,
        host=args.host,
        kubeconfig_path=args.kubeconfig,
        bookmark_interval=None if args.no_bookmarks else args.bookmark_interval,
        history_size=args.history_size,
        cost=model,
        namespace_delay=args.namespace_delay,
        tls=args.tls,
    )
    done = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: done.set())
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    print(handle.url, flush=True)
    print(f"kubeconfig: {handle.kubeconfig_path}", flush=True)
    done.wait()
    handle.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
