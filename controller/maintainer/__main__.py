"""``python -m controller.maintainer``: run the maintainer (Kopf process, our informer and loops)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from urllib.parse import urlsplit

import kopf
import prometheus_client

from controller import logs
from controller.engine.world import AUDIT_INTERVAL
from controller.kube.informer import PROGRESS_WINDOW
from controller.kube.probes import parse_endpoint
from controller.kube.reflector import WATCH_TIMEOUT
from controller.maintainer import operator
from controller.maintainer.runner import Settings, default_identity
from controller.process import heap, tenure


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="changefeed-maintainer", description=__doc__)
    p.add_argument("--namespace", default=operator.pod_namespace(), help="namespace of the changefeeds")
    p.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG"),
        help="kubeconfig path (default: $KUBECONFIG, ~/.kube/config, in-cluster)",
    )
    p.add_argument("--context", default=None, help="kubeconfig context")
    p.add_argument(
        "--identity",
        default=None,
        help="leader-election identity (default: $POD_NAME or the host name, plus a random suffix)",
    )
    p.add_argument(
        "--tick",
        type=float,
        default=30.0,
        help="at most this many seconds between decisions when nothing happens (decisions come on events and "
        "when something is due; default 30)",
    )
    p.add_argument(
        "--audit-interval",
        type=float,
        default=AUDIT_INTERVAL,
        help="seconds between full audits, decisions over every record instead of the index's candidates "
        f"(0: every decision; default {AUDIT_INTERVAL:g})",
    )
    p.add_argument(
        "--lease-duration",
        type=float,
        default=15.0,
        help="seconds a changefeed's Lease cfm-<changefeed> may go unrenewed before another replica takes it "
        "(default 15)",
    )
    p.add_argument(
        "--renew-deadline",
        type=float,
        default=10.0,
        help="seconds without a successful renewal after which this replica stops writing for that changefeed and "
        "competes for its Lease again (it resumes the same term if nobody took it); < --lease-duration (default 10)",
    )
    p.add_argument(
        "--retry-period", type=float, default=2.0, help="seconds between Lease renewals and bids (default 2)"
    )
    p.add_argument(
        "--max-leases", type=int, default=0, help="lead at most this many changefeeds, a hard cap (0: no cap)"
    )
    p.add_argument(
        "--no-balance",
        dest="balance",
        action="store_false",
        help="do not spread the changefeeds evenly over the live replicas (by default each replica announces "
        "itself with a member Lease cfmm-<identity>, bids only while it leads fewer than its share, "
        "ceil(changefeeds/replicas), and hands changefeeds over above it)",
    )
    p.add_argument(
        "--expected-replicas",
        type=int,
        default=1,
        help="how many replicas the Deployment runs (the chart passes maintainer.replicas): for its first lease "
        "duration a replica takes only its share as if that many were up, so that the first to start does not lead "
        "every changefeed and then hand most of them over (default 1)",
    )
    p.add_argument(
        "--cache",
        choices=("warm", "sharded"),
        default="warm",
        help="warm (default): cache every object of the namespace, so a standby that takes a changefeed over "
        "decides at once; sharded: cache Tables, Spans, Dispatchers and SpanOperators only of the changefeeds "
        "this replica leads (one label-selected LIST and WATCH per kind and changefeed, on "
        "cdc.maintainer.dev/changefeed; objects created without that label are labelled by their leader), so each "
        "replica's memory follows its share, and a taker lists a changefeed before its first decision",
    )
    p.add_argument(
        "--liveness",
        default="",
        help="e.g. http://0.0.0.0:8080/healthz: Kopf's liveness endpoint, failing when a watch task has ended or no "
        "request has been answered by the API for --liveness-window seconds (a quiet watch is no failure)",
    )
    p.add_argument(
        "--liveness-window",
        type=float,
        default=PROGRESS_WINDOW,
        help="seconds without a request answered by the API (a Lease renewal, a LIST, a watch that connected or "
        f"delivered) after which the liveness endpoint fails (default {PROGRESS_WINDOW:g})",
    )
    p.add_argument(
        "--watch-timeout",
        type=float,
        default=WATCH_TIMEOUT,
        help="each watch asks the API server to end it after a random timeoutSeconds between this and twice this, "
        f"then resumes it from its last resourceVersion, as client-go does (default {WATCH_TIMEOUT:g})",
    )
    p.add_argument(
        "--readiness",
        default="",
        help="e.g. http://0.0.0.0:8081/readyz: 200 once every kind is listed and every Changefeed's Lease is "
        "competed for, else 503",
    )
    p.add_argument(
        "--metrics-port", type=int, default=9090, help="port of the Prometheus endpoint /metrics (0: disabled)"
    )
    p.add_argument("--metrics-address", default="0.0.0.0", help="address the Prometheus endpoint listens on")
    p.add_argument(
        "--gc-tenure",
        type=float,
        default=tenure.PERIOD,
        help="seconds between tenure steps: what survived is frozen out of the garbage collector's full passes, "
        "so that a pass never holds the event loop for long however many records are cached (0: off; "
        f"default {tenure.PERIOD:g})",
    )
    p.add_argument(
        "--heap-reserve",
        type=int,
        default=0,
        metavar="MIB",
        help="opt in to free heap kept paged in by a thread of its own (it rewires glibc's allocator: one arena, "
        "no mmap below the ceiling), so that a table that grows in the event loop does not stall it in page faults "
        "where they are slow (a VM): a quarter of the heap in use, at least 4 and at most this many MiB (up to 1.75 "
        f"times that just after a refill); glibc only (0: off, the default; 4 to 1024; {heap.CEILING // heap.MiB} "
        "is a good start)",
    )
    logs.add_arguments(p)
    p.add_argument("--verbose", action="store_true", help="the same as --log-level DEBUG")
    a = p.parse_args(argv)
    if a.verbose:
        a.log_level = "DEBUG"
    if a.gc_tenure < 0:
        p.error(f"--gc-tenure {a.gc_tenure:g}: must be 0 (off) or a positive number of seconds")
    if a.heap_reserve != 0 and not heap.FLOOR // heap.MiB <= a.heap_reserve <= heap.MAX_CEILING // heap.MiB:
        p.error(
            f"--heap-reserve {a.heap_reserve}: must be 0 (off) or {heap.FLOOR // heap.MiB} to "
            f"{heap.MAX_CEILING // heap.MiB} (MiB)"
        )
    if a.liveness_window <= 0:
        p.error(f"--liveness-window {a.liveness_window:g}: must be a positive number of seconds")
    if a.watch_timeout < 1:
        p.error(f"--watch-timeout {a.watch_timeout:g}: must be at least 1 second")
    if not 0 <= a.metrics_port <= 65535:
        p.error(f"--metrics-port {a.metrics_port}: not a port (0 disables the endpoint)")
    if a.metrics_port and a.liveness and liveness_port(a.liveness) == a.metrics_port:
        p.error(f"--metrics-port {a.metrics_port} is the port of Kopf's liveness endpoint ({a.liveness})")
    if a.readiness:
        try:
            _, port, _ = parse_endpoint(a.readiness)
        except ValueError as exc:
            p.error(f"--readiness {exc}")
        taken = {"--metrics-port": a.metrics_port, "--liveness": liveness_port(a.liveness) if a.liveness else 0}
        for flag, other in taken.items():
            if port and port == other:
                p.error(f"--readiness {a.readiness}: port {port} is already the port of {flag}")
    return a


def liveness_port(url: str) -> int | None:
    """The port of a ``--liveness`` URL (http: 80 when none is given)."""
    try:
        parts = urlsplit(url)
        return parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    operator.setup_logging(a.log_level, a.log_format)
    if a.heap_reserve:
        heap.configure(a.heap_reserve * heap.MiB)  # glibc's allocator settings, before any thread allocates
    settings = Settings(
        namespace=a.namespace,
        identity=a.identity or default_identity(),
        tick=a.tick,
        audit_interval=a.audit_interval,
        lease_duration=a.lease_duration,
        renew_deadline=a.renew_deadline,
        retry=a.retry_period,
        max_leases=a.max_leases,
        balance=a.balance,
        cache=a.cache,
        expected_replicas=max(1, a.expected_replicas),
        gc_tenure=a.gc_tenure,
        heap_reserve=a.heap_reserve * heap.MiB,
        metrics_port=a.metrics_port,
        metrics_address=a.metrics_address,
        watch_timeout=a.watch_timeout,
        liveness_window=a.liveness_window,
    )
    if a.kubeconfig:
        os.environ["KUBECONFIG"] = a.kubeconfig  # for Kopf's own login as well
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series
    operator.configure(settings, a.kubeconfig, a.context, readiness=a.readiness)
    try:
        asyncio.run(
            kopf.operator(
                standalone=True,
                namespaces=[a.namespace],
                liveness_endpoint=a.liveness or None,
                # Given, so Kopf never derives one from getpass.getuser(): in the image the uid (65532) has
                # no passwd entry and no USER is set, and Kopf's own detection raised KeyError at startup.
                identity=settings.identity,  # type: ignore[arg-type]  # kopf's Identity: a NewType of str
            )
        )
    except Exception:
        if not operator.fatal():
            raise
        print(f"changefeed-maintainer: {operator.fatal()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
