"""The subcommands: read a snapshot, validate, write, follow. The logic lives in ``validate`` and
``render`` (pure); this module is the glue around :class:`~controller.cli.kube.Session`."""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

from controller.cli import render, validate
from controller.cli.errors import EXIT_OK, Failed, NotFound
from controller.cli.kube import OPERATORS, Session, follow_operator
from controller.cli.snapshot import Snapshot
from controller.kube.client import RESOURCES
from controller.model.keys import KeyRange
from controller.model.records import SpanOperator
from controller.model.states import Kind, OpPhase, OpType

Command = Callable[[Session, argparse.Namespace], Awaitable[int]]


def out(line: str = "") -> None:
    print(line, flush=True)


def warn(snap: Snapshot) -> None:
    for w in snap.warnings:
        print(f"warning: {w}", file=sys.stderr)


def _changefeeds(snap: Snapshot, wanted: str | None) -> list[str]:
    """``wanted`` (checked), else every changefeed of the namespace (at least one)."""
    if wanted:
        return [validate.resolve_changefeed(snap.changefeeds, wanted, snap.namespace)]
    if not snap.changefeeds:
        raise NotFound(f"no Changefeed in namespace {snap.namespace!r}")
    return sorted(snap.changefeeds)


async def _snapshot(session: Session) -> Snapshot:
    snap = await session.snapshot()
    warn(snap)
    return snap


# -- reading ---------------------------------------------------------------------------------------


async def status(session: Session, args: argparse.Namespace) -> int:
    snap = await _snapshot(session)
    out("\n\n".join(render.render_status(snap, cf) for cf in _changefeeds(snap, args.changefeed)))
    return EXIT_OK


async def spans(session: Session, args: argparse.Namespace) -> int:
    snap = await _snapshot(session)
    cf = validate.resolve_changefeed(snap.changefeeds, args.changefeed, snap.namespace)
    out(render.render_spans(snap, cf, args.table, args.mode))
    return EXIT_OK


async def operators(session: Session, args: argparse.Namespace) -> int:
    snap = await _snapshot(session)
    cf = validate.resolve_changefeed(snap.changefeeds, args.changefeed, snap.namespace)
    out(render.render_operators(snap, cf, args.all))
    return EXIT_OK


# -- operators -------------------------------------------------------------------------------------


def _name(type_: OpType) -> str:
    return validate.operator_name(type_, secrets.token_hex(3))


async def _submit(session: Session, args: argparse.Namespace, op: SpanOperator, comments: Sequence[str]) -> int:
    body = validate.operator_body(op)
    if args.dry_run:
        out(render.to_yaml(body, comments).rstrip("\n"))
        return EXIT_OK
    created = await session.create(OPERATORS, body)
    out(op.name)
    if not args.wait:
        return EXIT_OK
    final = await follow_operator(session, created, args.timeout, out)
    if final.phase is not OpPhase.SUCCEEDED:
        raise Failed(render.outcome(final)[0])
    for line in render.outcome(final):
        out(line)
    return EXIT_OK


def _ranges(ranges: Sequence[KeyRange]) -> str:
    return " ".join(str(r) for r in ranges)


async def move(session: Session, args: argparse.Namespace) -> int:
    snap = await _snapshot(session)
    cf = validate.resolve_changefeed(snap.changefeeds, args.changefeed, snap.namespace)
    op = validate.plan_move(snap, cf, args.span, args.to, _name(OpType.MOVE))
    span = snap.spans[args.span]
    return await _submit(
        session, args, op, [f"move span {span.name} {span.key_range} from {span.capture} to {args.to}"]
    )


async def split(session: Session, args: argparse.Namespace) -> int:
    snap = await _snapshot(session)
    cf = validate.resolve_changefeed(snap.changefeeds, args.changefeed, snap.namespace)
    keys = validate.parse_keys(args.at or [])
    op, pieces = validate.plan_split(snap, cf, args.span, _name(OpType.SPLIT), into=args.into or 0, keys=keys)
    return await _submit(session, args, op, [f"split span {args.span} into {len(pieces)}: {_ranges(pieces)}"])


async def merge(session: Session, args: argparse.Namespace) -> int:
    snap = await _snapshot(session)
    cf = validate.resolve_changefeed(snap.changefeeds, args.changefeed, snap.namespace)
    op, merged = validate.plan_merge(snap, cf, args.spans, _name(OpType.MERGE))
    return await _submit(session, args, op, [f"merge {len(op.spans)} spans into {merged}"])


# -- captures and changefeeds ----------------------------------------------------------------------


async def _set_draining(session: Session, capture: str, draining: bool) -> None:
    try:
        await session.patch_spec(Kind.CAPTURE, capture, {"draining": draining})
    except NotFound:
        raise NotFound(f"capture {capture!r} not found in namespace {session.namespace!r}") from None


async def drain(session: Session, args: argparse.Namespace) -> int:
    snap = await _snapshot(session)
    validate.find_capture(snap, args.capture)
    cfs = _changefeeds(snap, args.changefeed)
    others = [c for c in snap.captures.values() if c.name != args.capture and c.alive(snap.now) and not c.draining]
    if not others:
        print(f"warning: no other live, non-draining capture: spans cannot move off {args.capture}", file=sys.stderr)
    await _set_draining(session, args.capture, True)
    out(f"capture {args.capture} draining")
    if not args.wait:
        return EXIT_OK
    return await _wait_drained(session, args.capture, cfs, args.timeout, args.interval)


async def _wait_drained(session: Session, capture: str, cfs: list[str], budget: float, interval: float) -> int:
    start = time.monotonic()
    last = ""
    while True:
        snap = await session.snapshot()
        held, ops = snap.remaining_on(capture, cfs)
        line = f"{len(held)} spans and {len(ops)} operators remain on {capture}"
        if line != last:
            out(f"{render.elapsed(time.monotonic() - start):>7}  {line}")
            last = line
        if not held and not ops:
            out(f"capture {capture} drained")
            return EXIT_OK
        if time.monotonic() - start >= budget:
            raise Failed(f"timed out after {budget:g}s draining capture {capture!r}: {line}")
        await asyncio.sleep(interval)


async def undrain(session: Session, args: argparse.Namespace) -> int:
    await _set_draining(session, args.capture, False)
    out(f"capture {args.capture} no longer draining")
    return EXIT_OK


async def _set_paused(session: Session, args: argparse.Namespace, paused: bool) -> int:
    items = await session.list(RESOURCES[Kind.CHANGEFEED])
    names = [str(o.get("metadata", {}).get("name")) for o in items]
    cf = validate.resolve_changefeed(names, args.changefeed, session.namespace)
    await session.patch_spec(Kind.CHANGEFEED, cf, {"paused": paused})
    out(f"changefeed {cf} {'paused' if paused else 'resumed'}")
    return EXIT_OK


async def pause(session: Session, args: argparse.Namespace) -> int:
    return await _set_paused(session, args, True)


async def resume(session: Session, args: argparse.Namespace) -> int:
    return await _set_paused(session, args, False)


COMMANDS: dict[str, Command] = {
    "status": status,
    "spans": spans,
    "operators": operators,
    "move": move,
    "split": split,
    "merge": merge,
    "drain": drain,
    "undrain": undrain,
    "pause": pause,
    "resume": resume,
}
