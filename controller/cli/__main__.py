"""``kubectl-changefeed`` (``kubectl changefeed ...``): inspect and steer changefeeds by hand.

Commands: ``status``, ``spans``, ``operators``, ``move``, ``split``, ``merge``, ``drain``, ``undrain``,
``pause``, ``resume``, ``teardown``, ``verify`` (see docs/kubectl-plugin.md). ``move``/``split``/``merge`` create a
SpanOperator (source ``user``) after checking it would be accepted; the maintainer carries it out.

Exit codes:

* 0: success (with ``--wait``: the operator Succeeded, or the capture is drained);
* 1: the operation failed or timed out: the operator Failed or was Canceled, ``--wait`` timed out, or the
  API could not be reached or refused the request (403, 5xx);
* 2: bad usage (flags, a kubeconfig that cannot be loaded or used), a validation refused the request
  (the plugin's or the API's, 422: nothing was written), or an object was not found;
* 130: interrupted (Ctrl-C); an operator already created keeps running, and the message says how to follow it;
* 141: standard output was closed early (``kubectl changefeed spans | head -1``); nothing is printed.

Errors are printed to stderr as one line, ``error: <message>``; an unexpected exception too
(``error: <type>: <message>``, exit 1), with its traceback only when ``KUBECTL_CHANGEFEED_DEBUG`` is set.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import traceback

from controller.cli import kube
from controller.cli.commands import COMMANDS
from controller.cli.errors import EXIT_BROKEN_PIPE, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, CliError
from controller.engine.operators.split import MAX_PIECES
from controller.kube.client import Config

#: Set (to anything but empty) to print the traceback of an unexpected error.
DEBUG_ENV = "KUBECTL_CHANGEFEED_DEBUG"

EPILOG = """\
exit codes:
  0    success (with --wait: the operator Succeeded, or the capture is drained; verify: no difference)
  1    the operation failed or timed out (operator Failed/Canceled, --wait timeout, API unreachable or 403/5xx);
       verify: differences found, or etcd/PostgreSQL unreachable
  2    bad usage or kubeconfig, validation refused (nothing written), or object not found
  130  interrupted (Ctrl-C); an operator already created keeps running
  141  standard output closed early (e.g. piped into head)

Installed as kubectl-changefeed on PATH, kubectl runs it as `kubectl changefeed`."""


def _globals(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """The global flags; on subcommands with SUPPRESS defaults, so that they may come after the command."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--kubeconfig", default=default(None), help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)"
    )
    parser.add_argument("--context", default=default(None), help="kubeconfig context (default: the current one)")
    parser.add_argument(
        "-n", "--namespace", default=default(None), help="namespace (default: the context's namespace, else 'default')"
    )
    parser.add_argument(
        "-c",
        "--changefeed",
        default=default(None),
        help="changefeed (default: the only one in the namespace; status and drain: all of them)",
    )


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _pieces(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 2 <= value <= MAX_PIECES:
        raise argparse.ArgumentTypeError(f"must be between 2 and {MAX_PIECES}, got {value}")
    return value


def _wait_flags(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--wait", action="store_true", help=f"follow {what}, printing each transition")
    p.add_argument("--timeout", type=_positive, default=120.0, help="seconds --wait waits (default 120)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubectl changefeed",
        description="Inspect and steer the changefeeds of changefeed-maintainer.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _globals(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name, help=help_, description=help_, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        _globals(p, suppress=True)
        return p

    command("status", "epoch, checkpoint and lag, spans per state and capture, captures, operators in flight")

    p = command("spans", "the spans of the changefeed")
    p.add_argument("--table", type=int, default=None, metavar="ID", help="only this table ID")
    p.add_argument("--mode", choices=["default", "redo"], default=None, help="only this mode")

    p = command("operators", "in-flight operators, and those finished in the last 10 minutes")
    p.add_argument("--all", action="store_true", help="every finished operator still kept, not only recent ones")

    def operator_command(name: str, help_: str) -> argparse.ArgumentParser:
        p = command(name, help_)
        p.add_argument(
            "--dry-run", action="store_true", help="print the SpanOperator that would be created; create nothing"
        )
        _wait_flags(p, "the operator until it ends")
        return p

    p = operator_command("move", "move a span to another capture")
    p.add_argument("span", metavar="SPAN")
    p.add_argument("--to", required=True, metavar="CAPTURE", help="destination capture (alive, not draining)")

    p = operator_command("split", "split a span at even points (--into) or at keys (--at)")
    p.add_argument("span", metavar="SPAN")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--into", type=_pieces, metavar="N", help=f"this many even pieces (2 to {MAX_PIECES})")
    how.add_argument(
        "--at", nargs="+", metavar="KEY", help="cut at these keys (hex, strictly increasing, inside the span)"
    )

    p = operator_command("merge", "merge adjacent spans of one table and mode")
    p.add_argument("spans", nargs="+", metavar="SPAN")

    p = command("drain", "move every span off a capture (sets Capture.spec.draining)")
    p.add_argument("capture", metavar="CAPTURE")
    _wait_flags(p, "until no span and no in-flight operator is on the capture")
    p.add_argument("--interval", type=_positive, default=1.0, help=argparse.SUPPRESS)

    p = command("undrain", "let a drained capture receive spans again")
    p.add_argument("capture", metavar="CAPTURE")

    for verb, what in (("pause", "pause"), ("resume", "resume")):
        p = command(
            verb,
            f"{what} replication (spec.paused: {str(verb == 'pause').lower()}): the captures "
            + ("stop reading and writing, the checkpoint holds" if verb == "pause" else "continue from the checkpoint"),
        )
        p.add_argument(
            "--schedulers-only",
            action="store_true",
            help=f"{what} only the automatic schedulers (spec.scheduler.paused), replication going on",
        )

    p = command(
        "teardown",
        "finish deleting a Changefeed (-c; default: every one being deleted) whose maintainer and captures are "
        "all gone: prove that none of them runs (their Leases lapsed), take those Leases, release the finalizers",
    )
    _wait_flags(p, "while a maintainer or capture still runs (until it finishes or its Lease lapses)")
    p.add_argument("--interval", type=_positive, default=1.0, help=argparse.SUPPRESS)

    p = command(
        "verify",
        "compare the sink with etcd at a revision R at or below the checkpoint, row by row, while writes go on "
        "(exit 1 when they differ); records the result on the Changefeed (annotation cdc.maintainer.dev/last-verify)",
    )
    p.add_argument("--revision", type=int, default=None, metavar="R", help="etcd revision (default: the checkpoint)")
    p.add_argument("--limit", type=_count, default=20, metavar="N", help="differences printed (default 20)")
    p.add_argument(
        "--etcd-endpoints", default=None, metavar="HOST:PORT,...", help="etcd (default: the source's Secret)"
    )
    for flag, what in (("cacert", "the CA bundle of https:// endpoints (default: the system's roots)"),
                       ("cert", "a client certificate for etcd"), ("key", "the client certificate's key")):  # fmt: skip
        p.add_argument(f"--etcd-{flag}", default=None, metavar="FILE", help=f"{what}, PEM; with --etcd-endpoints")
    p.add_argument(
        "--dsn",
        default=None,
        metavar="DSN",
        help="the sink's DSN (default: its Secret's dsn; of the changefeed's sink kind, else mysql:// or PostgreSQL); "
        "never printed",
    )
    return parser


async def _run(args: argparse.Namespace, config: Config, namespace: str) -> int:
    async with kube.connect(config) as client:
        return await COMMANDS[args.command](kube.Session(client, namespace), args)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, message already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        config, default_namespace = kube.load_config(args.kubeconfig, args.context)
        return asyncio.run(_run(args, config, args.namespace or default_namespace))
    except CliError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.code


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (stdout replaced, e.g. under test)
        pass


def main(argv: list[str] | None = None) -> int:
    """Run one command; never lets a traceback through (see the exit codes in the module docstring)."""
    try:
        return _main(argv)
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as a process killed by SIGPIPE
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:  # Ctrl-C outside the steps that say what they leave behind
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if os.environ.get(DEBUG_ENV):
            traceback.print_exc()
        print(f"error: {type(exc).__name__}: {kube.one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
