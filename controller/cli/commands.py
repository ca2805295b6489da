"""The subcommands: read a snapshot, validate, write, follow. The logic lives in ``validate`` and
``render`` (pure); this module is the glue around :class:`~controller.cli.kube.Session`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from controller.cli import render, validate
from controller.cli import teardown as forced
from controller.cli import verify as checking
from controller.cli.errors import EXIT_OK, Failed, Interrupted, NotFound, Refused
from controller.cli.kube import OPERATORS, NameTaken, Session, follow_operator
from controller.cli.snapshot import Snapshot
from controller.kube.client import LEASES, RESOURCES, ApiError, Resource, remove_finalizer
from controller.model.keys import KeyRange
from controller.model.records import SpanOperator
from controller.model.states import Kind, OpPhase, OpType

Command = Callable[[Session, argparse.Namespace], Awaitable[int]]
JSON = dict[str, Any]

#: What each command lists (docs/kubectl-plugin.md, "RBAC", says the same): a capture's liveness needs
#: its Lease, so Captures and Leases always go together; Dispatchers are never read.
CHANGEFEEDS, TABLES, SPANS, CAPTURES = (RESOURCES[k] for k in (Kind.CHANGEFEED, Kind.TABLE, Kind.SPAN, Kind.CAPTURE))
LIVENESS = (CAPTURES, LEASES)
READS: dict[str, tuple[Resource, ...]] = {
    "status": (CHANGEFEEDS, SPANS, OPERATORS, *LIVENESS),
    "spans": (CHANGEFEEDS, SPANS),
    "operators": (CHANGEFEEDS, OPERATORS),
    "move": (CHANGEFEEDS, SPANS, OPERATORS, *LIVENESS),
    "split": (CHANGEFEEDS, TABLES, SPANS, OPERATORS),
    "merge": (CHANGEFEEDS, SPANS, OPERATORS),
    "drain": (CHANGEFEEDS, *LIVENESS),
    "drain --wait": (SPANS, OPERATORS),
}
#: Attempts at creating a SpanOperator, each under a fresh random name, while the name is taken (409).
CREATE_ATTEMPTS = 4


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


async def _snapshot(session: Session, command: str) -> Snapshot:
    snap = await session.snapshot(READS[command])
    warn(snap)
    return snap


@contextlib.contextmanager
def on_interrupt(message: str) -> Iterator[None]:
    """Ctrl-C inside the block (``asyncio.run`` cancels the main task) becomes ``Interrupted(message)``.
    Only around code whose own timeouts are inside the block: it takes any cancellation for a Ctrl-C."""
    try:
        yield
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise Interrupted(message) from None


# -- reading ---------------------------------------------------------------------------------------


async def status(session: Session, args: argparse.Namespace) -> int:
    snap = await _snapshot(session, "status")
    out("\n\n".join(render.render_status(snap, cf) for cf in _changefeeds(snap, args.changefeed)))
    return EXIT_OK


async def spans(session: Session, args: argparse.Namespace) -> int:
    snap = await _snapshot(session, "spans")
    cf = validate.resolve_changefeed(snap.changefeeds, args.changefeed, snap.namespace)
    out(render.render_spans(snap, cf, args.table, args.mode))
    return EXIT_OK


async def operators(session: Session, args: argparse.Namespace) -> int:
    snap = await _snapshot(session, "operators")
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
    for attempt in range(1, CREATE_ATTEMPTS + 1):
        try:
            with on_interrupt(
                f"interrupted while creating SpanOperator {op.name}; see whether it exists: "
                f"kubectl get spanoperators {op.name} -n {session.namespace}"
            ):
                created = await session.create(OPERATORS, body)
            break
        except NameTaken:  # a random name that collided with an existing operator's: draw another
            if attempt == CREATE_ATTEMPTS:
                raise
            op = replace(op, name=_name(op.type))
            body = validate.operator_body(op)
    out(op.name)
    if not args.wait:
        return EXIT_OK
    with on_interrupt(f"interrupted; {render.still_running(op.name, session.namespace)}"):
        final = await follow_operator(session, created, args.timeout, out)
    if final.phase is not OpPhase.SUCCEEDED:
        raise Failed(render.outcome(final)[0])
    for line in render.outcome(final):
        out(line)
    return EXIT_OK


def _ranges(ranges: Sequence[KeyRange]) -> str:
    return " ".join(str(r) for r in ranges)


async def move(session: Session, args: argparse.Namespace) -> int:
    snap = await _snapshot(session, "move")
    cf = validate.resolve_changefeed(snap.changefeeds, args.changefeed, snap.namespace)
    op = validate.plan_move(snap, cf, args.span, args.to, _name(OpType.MOVE))
    span = snap.spans[args.span]
    return await _submit(
        session, args, op, [f"move span {span.name} {span.key_range} from {span.capture} to {args.to}"]
    )


async def split(session: Session, args: argparse.Namespace) -> int:
    snap = await _snapshot(session, "split")
    cf = validate.resolve_changefeed(snap.changefeeds, args.changefeed, snap.namespace)
    keys = validate.parse_keys(args.at or [])
    into = args.into if args.into is not None else 0  # --into and --at are exclusive, one required
    op, pieces = validate.plan_split(snap, cf, args.span, _name(OpType.SPLIT), into=into, keys=keys)
    return await _submit(session, args, op, [f"split span {args.span} into {len(pieces)}: {_ranges(pieces)}"])


async def merge(session: Session, args: argparse.Namespace) -> int:
    snap = await _snapshot(session, "merge")
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
    snap = await _snapshot(session, "drain")
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
    """Poll until nothing remains on ``capture``; the budget bounds the whole wait, a slow listing too."""
    start = time.monotonic()
    last = ""
    with on_interrupt(
        f"interrupted; capture {capture} stays draining (the maintainer keeps moving spans off it); "
        f"kubectl changefeed undrain {capture} -n {session.namespace} to stop"
    ):
        try:
            async with asyncio.timeout(budget):
                while True:
                    snap = await session.snapshot(READS["drain --wait"])
                    held, ops = snap.remaining_on(capture, cfs)
                    line = f"{len(held)} spans and {len(ops)} operators remain on {capture}"
                    if line != last:
                        out(f"{render.elapsed(time.monotonic() - start):>7}  {line}")
                        last = line
                    if not held and not ops:
                        out(f"capture {capture} drained")
                        return EXIT_OK
                    await asyncio.sleep(interval)
        except TimeoutError:
            seen = last or "no listing answered in time"
            raise Failed(
                f"timed out after {budget:g}s draining capture {capture!r}: {seen}; it stays draining"
            ) from None


async def undrain(session: Session, args: argparse.Namespace) -> int:
    await _set_draining(session, args.capture, False)
    out(f"capture {args.capture} no longer draining")
    return EXIT_OK


async def _set_paused(session: Session, args: argparse.Namespace, paused: bool) -> int:
    items = await session.list(RESOURCES[Kind.CHANGEFEED])
    names = [str(o.get("metadata", {}).get("name")) for o in items]
    cf = validate.resolve_changefeed(names, args.changefeed, session.namespace)
    if args.schedulers_only:
        await session.patch_spec(Kind.CHANGEFEED, cf, {"scheduler": {"paused": paused}})
        out(f"changefeed {cf}: automatic schedulers {'paused' if paused else 'resumed'} (replication goes on)")
        return EXIT_OK
    await session.patch_spec(Kind.CHANGEFEED, cf, {"paused": paused})
    if paused:
        out(f"changefeed {cf} paused: its captures stop reading and writing within 10 s; the checkpoint holds")
    else:
        out(f"changefeed {cf} resumed: replication continues from the checkpoint")
    return EXIT_OK


async def pause(session: Session, args: argparse.Namespace) -> int:
    return await _set_paused(session, args, True)


async def resume(session: Session, args: argparse.Namespace) -> int:
    return await _set_paused(session, args, False)


# -- forced teardown -------------------------------------------------------------------------------

DISPATCHERS = RESOURCES[Kind.DISPATCHER]
#: Attempts at a finalizer removal whose resourceVersion precondition failed (the object changed meanwhile).
RELEASE_ATTEMPTS = 5


async def _read_teardown(session: Session) -> tuple[list[JSON], list[JSON], list[JSON], list[JSON]]:
    cfs, dispatchers, tables, leases = await asyncio.gather(
        *(session.list(r) for r in (CHANGEFEEDS, DISPATCHERS, TABLES, LEASES))
    )
    return cfs, dispatchers, tables, leases


def _teardown_targets(cfs: list[JSON], wanted: str | None, namespace: str) -> list[JSON]:
    """The Changefeeds to finish: ``wanted`` (being deleted), else every one being deleted (at least one)."""
    if wanted:
        named = [c for c in cfs if (c.get("metadata") or {}).get("name") == wanted]
        if not named:
            raise NotFound(f"changefeed {wanted!r} not found in namespace {namespace!r}")
        if not (named[0].get("metadata") or {}).get("deletionTimestamp"):
            raise Refused(forced.not_being_deleted(wanted))
        return named
    deleting = [c for c in cfs if (c.get("metadata") or {}).get("deletionTimestamp")]
    if not deleting:
        raise NotFound(f"no Changefeed is being deleted in namespace {namespace!r}")
    return deleting


async def _awaiting_marks(session: Session, cfs: list[JSON], wanted: str | None) -> str:
    """With --wait: the Changefeeds a namespace being deleted has yet to mark (forced.awaiting_marks); the
    Namespace is read only when one of them is not marked."""
    if all((c.get("metadata") or {}).get("deletionTimestamp") for c in cfs if wanted is None or _cf_name(c) == wanted):
        return ""
    return forced.awaiting_marks(cfs, wanted, await session.read_namespace())


def _cf_name(obj: JSON) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


async def _release(session: Session, res: Resource, obj: JSON, finalizer: str) -> None:
    name = str(obj["metadata"]["name"])
    with session.errors(f"releasing {res.kind} {name}"):
        if await remove_finalizer(session.client, res, session.namespace, obj, finalizer, RELEASE_ATTEMPTS):
            return
    raise Failed(f"{res.kind} {name} kept changing; its finalizer {finalizer} is still there: run the command again")


async def _lease_gone(session: Session, name: str) -> bool:
    """After a 409 on taking Lease ``name``: whether it was deleted since it was read (nothing to take)."""
    try:
        await session.client.get(LEASES, session.namespace, name)
    except ApiError as exc:
        if exc.not_found:
            return True
        raise
    return False


async def _force(session: Session, p: forced.Plan, raw: dict[str, JSON]) -> None:
    """Carry out ``p``: fences first (a renewal since the reading fails the command), then the releases."""
    ns = session.namespace
    for lease in p.fences:
        with session.errors(f"taking the lapsed Lease {lease.name}"):
            try:
                # The Lease as read, uid included: one deleted since is refused (409), not created again.
                await session.client.replace(LEASES, ns, lease.name, forced.fenced_lease(raw[f"leases/{lease.name}"]))
            except ApiError as exc:
                if exc.conflict:
                    if not await _lease_gone(session, lease.name):
                        raise Failed(
                            f"Lease {lease.name} changed since it was read (its holder {lease.holder} renewed it?): "
                            "nothing was released; run the command again"
                        ) from None
                elif not exc.not_found:
                    raise
        out(f"lease {lease.name} taken from {lease.holder} (lapsed, {forced.describe_age(lease)})")
    for name, uid, deleting in p.dispatchers:
        if not deleting:
            with session.errors(f"deleting Dispatcher {name}"):
                try:
                    await session.client.delete(DISPATCHERS, ns, name, uid)
                except ApiError as exc:
                    if not exc.not_found:
                        raise
        await _release(session, DISPATCHERS, raw[f"dispatchers/{name}"], forced.FINALIZERS["dispatchers"])
        out(f"dispatcher {name} released")
    for name, deleting in p.tables:
        table = raw[f"tables/{name}"]
        if not deleting:
            with session.errors(f"detaching Table {name}"):
                table = await session.client.patch(TABLES, ns, name, forced.detached_status(table), sub="status")
        await _release(session, TABLES, table, forced.FINALIZERS["tables"])
        out(f"table {name} detached")
    if p.release_changefeed:
        await _release(session, CHANGEFEEDS, raw[f"changefeeds/{p.changefeed}"], forced.FINALIZERS["changefeeds"])
    out(f"changefeed {p.changefeed} released: the garbage collector removes what it owned")


async def teardown(session: Session, args: argparse.Namespace) -> int:
    """Finish the deletion of Changefeeds whose maintainer and captures are all gone (controller.cli.teardown)."""
    start = time.monotonic()
    shown: tuple[str, ...] = ()
    with on_interrupt("interrupted; what was released stays released, run the command again to finish"):
        while True:
            cfs, dispatchers, tables, leases = await _read_teardown(session)
            awaiting = await _awaiting_marks(session, cfs, args.changefeed) if args.wait else ""
            waited = time.monotonic() - start
            if awaiting:
                blockers: tuple[str, ...] = (awaiting,)
                if waited >= args.timeout:
                    raise Failed(
                        f"timed out after {args.timeout:g}s: {awaiting} (a namespace controller marks them a few "
                        "seconds after the namespace's deletion: is the cluster's controller manager running?)"
                    )
            else:
                targets = _teardown_targets(cfs, args.changefeed, session.namespace)
                raw = {
                    f"{plural}/{(o.get('metadata') or {}).get('name')}": o
                    for plural, items in (
                        ("changefeeds", targets),
                        ("dispatchers", dispatchers),
                        ("tables", tables),
                        ("leases", leases),
                    )
                    for o in items
                }
                plans = [forced.plan(cf, dispatchers, tables, leases, time.time()) for cf in targets]
                blockers = tuple(b for p in plans for b in p.blockers)
                if not blockers:
                    for p in plans:
                        await _force(session, p, raw)
                    return EXIT_OK
                if not args.wait or waited >= args.timeout:
                    after = f" after {args.timeout:g}s" if args.wait else ""
                    raise Failed(
                        f"cannot force the teardown{after}: " + "; ".join(blockers) + ". A live maintainer or "
                        "capture finishes the teardown itself; --wait waits for that or for its Lease to lapse"
                    )
            if blockers != shown:
                for b in blockers:
                    out(f"waiting: {b}")
                shown = blockers
            await asyncio.sleep(min(args.interval, max(0.0, args.timeout - waited)))


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
    "teardown": teardown,
    "verify": checking.verify,
}
