"""``kubectl-changefeed`` (``kubectl changefeed ...``): inspect and steer changefeeds by hand.

Commands: ``status``, ``spans``, ``operators``, ``move``, ``split``, ``merge``, ``drain``, ``undrain``,
``pause``, ``resume`` (see docs/kubectl-plugin.md). ``move``/``split``/``merge`` create a SpanOperator
(source ``user``) after checking it would be accepted; the maintainer carries it out.

Exit codes:

* 0: success (with ``--wait``: the operator Succeeded, or the capture is drained);
* 1: the operation failed or timed out: the operator Failed or was Canceled, ``--wait`` timed out, or the
  API could not be reached or refused the request (403, 5xx);
* 2: bad usage, a validation refused the request (nothing was written), or an object was not found.

Errors are printed to stderr as one line, ``error: <message>``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from controller.cli import kube
from controller.cli.commands import COMMANDS
from controller.cli.errors import EXIT_FAILED, EXIT_USAGE, CliError
from controller.kube.client import Client, Config

EPILOG = """\
exit codes:
  0  success (with --wait: the operator Succeeded, or the capture is drained)
  1  the operation failed or timed out (operator Failed/Canceled, --wait timeout, API unreachable or 403/5xx)
  2  bad usage, validation refused (nothing written), or object not found

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
    how.add_argument("--into", type=int, metavar="N", help="this many even pieces (2 or more)")
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

    command("pause", "stop the automatic schedulers (spec.paused: true)")
    command("resume", "resume the automatic schedulers (spec.paused: false)")
    return parser


async def _run(args: argparse.Namespace, config: Config, namespace: str) -> int:
    async with Client(config) as client:
        return await COMMANDS[args.command](kube.Session(client, namespace), args)


def main(argv: list[str] | None = None) -> int:
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
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
