"""The object store: etcd-like versioning, the write semantics of kube-apiserver's generic registry, watches.

Everything here runs on the server's event loop thread, so no locks: a write and the notification of every
watcher and controller happen synchronously, with no ``await`` in between, which is what makes "list at rv N,
then watch from N" gap-free. Stored objects are never mutated after a commit (every write builds a new top-level
dict and a new ``metadata`` dict), so an object can be shared by the store, the history and the watch queues.

Versions and compaction are realistic: the resourceVersion counter starts at :data:`RV_BASE`, everything before
it counts as compacted (a watch from ``1`` gets ``410 Expired``), and only the last ``history_size`` events stay
in the window that watches resume from and consistent lists (``resourceVersionMatch=Exact``, continue tokens)
are served from. Watches are served as by kube-apiserver's watch cache, which begins at the resourceVersion
current when it starts: when the server starts or restarts (:meth:`Store.restart_watch_cache`), and for a
custom resource when its CRD is established. A watch from before that start gets the ``410`` too, while a LIST
(served from storage) does not (see :meth:`Store.watch_start`).

A write, as the real registry does it: decode (typed for built-in kinds, pruned and defaulted for custom
resources), check the preconditions (uid, resourceVersion; a PUT of a kind without unconditional updates must
carry one), apply the server's rules (server-set metadata, status subresource, generation, finalizers,
deletion), validate (ObjectMeta, then the kind), record field ownership, commit. ``dryRun`` stops before the
commit. Costs: a get or write is a dict lookup plus the work proportional to the written object; a list scans
only its own kind; watching from a resourceVersion indexes straight into the history window.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import bisect
import copy
import json
import random
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import islice
from typing import Any

from controller.apiserver import builtins as B
from controller.apiserver import crd as crds
from controller.apiserver import gojson, managed, meta, patches
from controller.apiserver.errors import (
    ApiError,
    FieldError,
    already_exists,
    bad_request,
    conflict,
    details,
    internal,
    invalid,
    invalid_error,
    not_found,
    not_supported,
    required,
    unsupported_media_type,
)
from controller.apiserver.gotypes import OBJECT_META, DecodeError, decode
from controller.apiserver.resources import CRD_KEY, NS_KEY, ResourceType, builtin_types, from_crd
from controller.apiserver.schema import BLOCKING, NOT_CHECKED, Schema
from controller.apiserver.selectors import Predicate

JSON = dict[str, Any]
RV_BASE = 100_000
_GEN_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_SERVER_META = (
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "managedFields",
)
_USER_META = ("name", "generateName", "namespace", "labels", "annotations", "finalizers", "ownerReferences")
CONTROLLER_MANAGER = "kube-controller-manager"
CUSTOM_PATCH_TYPES = [patches.JSON_PATCH, patches.MERGE, patches.APPLY]
BUILTIN_PATCH_TYPES = [patches.JSON_PATCH, patches.MERGE, patches.APPLY, patches.STRATEGIC]
BODY_TYPES = ["application/json", "application/yaml", "application/vnd.kubernetes.protobuf"]
NS_FINALIZER = "kubernetes"
CRD_CLEANUP = "customresourcecleanup.apiextensions.k8s.io"


_NOW: list[Any] = [0, ""]


def now() -> str:
    """RFC 3339 to the second, as metav1.Time is written (formatted once per second)."""
    second = int(time.time())
    if second != _NOW[0]:
        _NOW[0] = second
        _NOW[1] = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(_NOW[1])


@dataclass
class WriteOptions:
    """How a write was asked for: its field manager, dryRun, fieldValidation, force (apply), raw body."""

    manager: str = ""
    dry_run: bool = False
    validation: str = "Warn"  # Strict | Warn | Ignore
    force: bool = False
    raw: bytes = b""
    #: A PUT that would create (see ``Store._create_on_update``) is authorized as a ``create`` of that name too;
    #: this raises the 403 when the requester may not (None: everything allowed).
    authorize_create: Callable[[], None] | None = None


@dataclass
class Outcome:
    obj: JSON
    warnings: list[str] = field(default_factory=list)
    created: bool = False


@dataclass
class Event:
    rv: int
    skey: tuple[str, str]
    type: str
    obj: JSON
    old: JSON | None
    encoded: bytes | None = None  # the object's JSON, when the store has it already
    _data: dict[tuple[str, str, str] | None, bytes] = field(default_factory=dict)

    def data(self, view: ResourceType | None) -> bytes:
        key = view.key if view is not None and view.group == "events.k8s.io" else None
        cached = self._data.get(key)
        if cached is None:
            if key is None and self.encoded is not None:
                cached = event_line(self.type, self.encoded)
            else:
                obj = B.event_to_v1(self.obj) if key is not None else self.obj
                cached = encode_event(self.type, obj)
            self._data[key] = cached
        return cached


def encode_event(kind: str, obj: JSON) -> bytes:
    return gojson.dumps({"type": kind, "object": obj}) + b"\n"


def event_line(kind: str, encoded: bytes) -> bytes:
    """A watch event around an object already encoded."""
    return b'{"type":"' + kind.encode() + b'","object":' + encoded + b"}\n"


@dataclass(eq=False)
class Watcher:
    """One watch stream: its filter and the queue of encoded events (``None`` ends the stream)."""

    skey: tuple[str, str]
    namespace: str | None
    predicate: Predicate | None
    view: ResourceType | None = None
    min_rv: int = 0
    queue: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)

    def offer(self, event: Event) -> None:
        if event.rv <= self.min_rv:
            return
        ns = event.obj["metadata"].get("namespace", "")
        if self.namespace is not None and ns != self.namespace:
            return
        if self.predicate is None:
            self.queue.put_nowait(event.data(self.view))
            return
        now_match = self.predicate(event.obj)
        if event.type == "DELETED":
            if now_match:
                self.queue.put_nowait(event.data(self.view))
            return
        was_match = event.old is not None and self.predicate(event.old)
        if now_match and was_match:
            self.queue.put_nowait(event.data(self.view))
        elif now_match:
            self.queue.put_nowait(encode_event("ADDED", self._shown(event.obj)))
        elif was_match and event.old is not None:
            # Leaving the selection: DELETED with the previous content at the event's resourceVersion (as the
            # real watch cache does).
            old = dict(event.old)
            old["metadata"] = dict(event.old["metadata"], resourceVersion=event.obj["metadata"]["resourceVersion"])
            self.queue.put_nowait(encode_event("DELETED", self._shown(old)))

    def _shown(self, obj: JSON) -> JSON:
        return B.event_to_v1(obj) if self.view is not None and self.view.group == "events.k8s.io" else obj


@dataclass
class Fault:
    code: int
    remaining: int


@dataclass
class ListResult:
    items: list[JSON]
    rv: int
    cont: str = ""
    remaining: int = 0


class TooLargeResourceVersion(Exception):
    """A list asked for a resourceVersion the store has not reached (the server waits, then answers 504)."""

    def __init__(self, wanted: int, current: int) -> None:
        super().__init__(f"Too large resource version: {wanted}, current: {current}")
        self.wanted = wanted
        self.current = current


def _too_old_list() -> ApiError:
    return ApiError(410, "Expired", "The resourceVersion for the provided list is too old.")


_CONTINUE_TOO_OLD = (
    "The provided continue parameter is too old to display a consistent list result. You can start a new list "
    "without the continue parameter, or use the continue token in this response to retrieve the remainder of the "
    "results. Continuing with the provided token results in an inconsistent list - objects that were created, "
    "modified, or deleted between the time the first chunk was returned and now may show up in the list."
)


#: Paged LISTs whose snapshot is kept for their next pages (``Store._paged``).
PAGED_LISTS = 4
#: A kind's objects at a resourceVersion, and their keys in order.
Paged = tuple[dict[tuple[str, str], "JSON"], list[tuple[str, str]]]


class Store:
    """All objects of all kinds, the global resourceVersion counter and the bounded event history."""

    def __init__(self, history_size: int = 10_000, rv_base: int = RV_BASE) -> None:
        self.rv = rv_base
        self.types: dict[tuple[str, str, str], ResourceType] = {}
        self.schemas: dict[tuple[str, str, str], Schema | None] = {}
        self.objects: dict[tuple[str, str], dict[tuple[str, str], JSON]] = {}
        self.history: deque[Event] = deque(maxlen=history_size)
        self.compacted_rv = rv_base  # events up to this rv have left the window
        #: Where the watch cache began: at the start and at every restart of the server (watches only).
        self.cache_start = rv_base
        #: Where each custom resource's watch cache began (its CRD's establishment, or the last restart).
        self.kind_cache_start: dict[tuple[str, str], int] = {}
        self.watchers: dict[tuple[str, str], set[Watcher]] = {}
        self.listeners: list[Callable[[Event], None]] = []
        self.faults: dict[str, Fault] = {}
        self.crd_order: list[tuple[str, str]] = []  # (group, plural) in establishment order
        #: Field ownership of each object: managedFields entry -> its fieldsV1 trie (see managed.py).
        self.fields: dict[tuple[tuple[str, str], str, str], dict[tuple[str, str, str], managed.Trie]] = {}
        #: The JSON of stored objects, encoded once (they never change), by id: answers, watches and lists
        #: reuse it. Holds only current objects (an entry goes when its object is replaced or deleted).
        self._encoded: dict[int, tuple[JSON, bytes]] = {}
        #: Paged LISTs in progress: (kind, resourceVersion, namespace) -> the objects at that version and their
        #: keys in order, so that a page costs what it reads, as etcd's range read from the continue key does
        #: (rebuilding and sorting the snapshot for each page made a LIST of 100,000 objects quadratic: 18 s).
        self._paging: OrderedDict[tuple[tuple[str, str], int, str | None], Paged] = OrderedDict()
        for rt in builtin_types():
            self.register(rt)
        ns_type = self.types[NS_KEY]
        for name in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.create(
                ns_type,
                "",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
                WriteOptions("kube-apiserver"),
            )

    # -- kinds -----------------------------------------------------------------------------------------

    def register(self, rt: ResourceType) -> None:
        self.types[rt.key] = rt
        self.schemas[rt.key] = Schema(rt.schema) if rt.schema else None
        self.objects.setdefault(rt.storage_key, {})

    def find(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self.types.get((group, version, plural))

    def _apply_crd(self, obj: JSON) -> None:
        if not crds.established(obj):
            return
        group, plural = crds.served_names(obj)
        for key in [k for k in self.types if k[0] == group and k[2] == plural]:
            del self.types[key]
        for rt in from_crd(obj):
            self.register(rt)
        if (group, plural) not in self.crd_order:
            self.crd_order.append((group, plural))
            self.kind_cache_start[(group, plural)] = self.rv  # its watch cache starts now

    def _drop_crd(self, obj: JSON) -> None:
        group, plural = crds.served_names(obj)
        for key in [k for k in self.types if k[0] == group and k[2] == plural]:
            del self.types[key]
            self.schemas.pop(key, None)
        self.objects.pop((group, plural), None)
        if (group, plural) in self.crd_order:
            self.crd_order.remove((group, plural))
        self.kind_cache_start.pop((group, plural), None)
        for watcher in self.watchers.pop((group, plural), set()):
            watcher.queue.put_nowait(None)

    # -- faults ----------------------------------------------------------------------------------------

    def inject_failures(self, plural: str, count: int, code: int = 500) -> None:
        """The next ``count`` writes to ``plural`` fail with ``code`` (test hook; ``count=0`` clears)."""
        if count <= 0:
            self.faults.pop(plural, None)
        else:
            self.faults[plural] = Fault(code, count)

    def _maybe_fail(self, rt: ResourceType, name: str) -> None:
        fault = self.faults.get(rt.plural)
        if fault is None:
            return
        fault.remaining -= 1
        if fault.remaining <= 0:
            del self.faults[rt.plural]
        reasons = {409: "Conflict", 500: "InternalError", 503: "ServiceUnavailable", 429: "TooManyRequests"}
        raise ApiError(
            fault.code, reasons.get(fault.code, "InternalError"), f"injected failure for {rt.plural} {name!r}"
        )

    def close_watches(self) -> int:
        """End every open watch stream (as an API server restart would); returns how many were closed."""
        count = 0
        for watchers in self.watchers.values():
            for watcher in watchers:
                watcher.queue.put_nowait(None)
                count += 1
            watchers.clear()
        return count

    def restart_watch_cache(self) -> int:
        """What a restart of kube-apiserver does to watches (the stored objects and the resourceVersion counter,
        etcd's, stay): every open watch ends, and the watch cache starts again at the current resourceVersion, so
        a watch resumed from an older one gets ``410 Expired``. Returns how many watches were closed."""
        self.cache_start = self.rv
        for skey in self.kind_cache_start:
            self.kind_cache_start[skey] = self.rv
        return self.close_watches()

    def watch_start(self, skey: tuple[str, str]) -> int:
        """The oldest resourceVersion a watch of a kind can resume from: where its watch cache began, or the
        compaction of the history, whichever is later (the real watch cache's ``oldest - 1``). LISTs are
        served from storage and only see the compaction."""
        return max(self.compacted_rv, self.cache_start, self.kind_cache_start.get(skey, 0))

    # -- views -----------------------------------------------------------------------------------------

    def encoded(self, obj: JSON) -> bytes:
        """The JSON of a stored object (call it for current stored objects only: they are cached)."""
        hit = self._encoded.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        data = gojson.dumps(obj)
        self._encoded[id(obj)] = (obj, data)
        return data

    def is_stored(self, rt: ResourceType, obj: JSON) -> bool:
        m = obj.get("metadata") or {}
        return self.objects.get(rt.storage_key, {}).get((m.get("namespace", ""), m.get("name", ""))) is obj

    @staticmethod
    def view(rt: ResourceType, obj: JSON) -> JSON:
        """A stored object as ``rt`` presents it (events.k8s.io/v1 Events are stored as core/v1 ones)."""
        if rt.group == "events.k8s.io":
            return B.event_to_v1(obj)
        return obj

    # -- reads -----------------------------------------------------------------------------------------

    def _stored(self, rt: ResourceType, ns: str, name: str) -> JSON:
        obj = self.objects[rt.storage_key].get((ns if rt.namespaced else "", name))
        if obj is None:
            raise not_found(rt.group, rt.plural, name)
        return obj

    def get(self, rt: ResourceType, ns: str, name: str) -> JSON:
        return self.view(rt, self._stored(rt, ns, name))

    def list_objects(self, rt: ResourceType, ns: str | None, predicate: Predicate | None) -> list[JSON]:
        """Current objects, sorted by (namespace, name), in the storage form."""
        objs = self.objects[rt.storage_key]
        keys = sorted(objs) if ns is None else sorted(k for k in objs if k[0] == ns)
        items = [objs[k] for k in keys]
        if predicate is not None:
            items = [o for o in items if predicate(o)]
        return items

    def snapshot(self, skey: tuple[str, str], rv: int) -> dict[tuple[str, str], JSON]:
        """The objects of a kind as they were at ``rv`` (within the history window)."""
        if rv < self.compacted_rv:
            raise _too_old_list()
        current = self.objects.get(skey, {})
        if rv >= self.rv:
            return current
        undo: dict[tuple[str, str], JSON | None] = {}
        for event in reversed(self.history):
            if event.rv <= rv:
                break
            if event.skey != skey:
                continue
            m = event.obj["metadata"]
            undo[(m.get("namespace", ""), m["name"])] = None if event.type == "ADDED" else event.old
        if not undo:
            return current
        out = dict(current)
        for key, obj in undo.items():
            if obj is None:
                out.pop(key, None)
            else:
                out[key] = obj
        return out

    def list_page(
        self,
        rt: ResourceType,
        ns: str | None,
        predicate: Predicate | None,
        *,
        resource_version: str | None = None,
        match: str | None = None,
        limit: int = 0,
        cont: str | None = None,
    ) -> ListResult:
        """A LIST with the real server's resourceVersion semantics (unset: consistent; ``0``: any, no paging;
        N: not older than N, or exactly N with ``Exact`` or with a limit); :class:`TooLargeResourceVersion`."""
        skey = rt.storage_key
        start_after: tuple[str, ...] | None = None
        at: int | None = None
        if cont:
            at, start_after = self._decode_continue(cont, ns)
            if at < self.compacted_rv:
                raise ApiError(410, "Expired", _CONTINUE_TOO_OLD)
        elif resource_version not in (None, ""):
            wanted = int(str(resource_version))
            if wanted > self.rv and wanted != 0:
                raise TooLargeResourceVersion(wanted, self.rv)
            if match == "Exact" or (match is None and limit > 0 and wanted != 0):
                at = wanted
            if wanted == 0:
                limit = 0  # served from the watch cache: no paging
        if limit > 0 and resource_version != "0":
            objs, keys = self._paged(skey, at if at is not None else self.rv, ns)
        else:
            objs = self.snapshot(skey, at) if at is not None else self.objects[skey]
            keys = sorted(objs) if ns is None else sorted(k for k in objs if k[0] == ns)
        start = 0
        if start_after is not None:
            start = bisect.bisect_right(keys, start_after, key=lambda k: self._continue_key(k, ns))
        rv = at if at is not None else self.rv
        if limit <= 0:
            items = [objs[k] for k in keys[start:]]
            return ListResult([o for o in items if predicate(o)] if predicate is not None else items, rv)
        # As etcd3's GetList: read keys in order until the page is full; continue after the last key read
        # when more keys follow (matching or not); remainingItemCount only without a selector (the server
        # cannot count what would match). A page costs what it reads, not the whole list.
        items = []
        i = start
        while i < len(keys) and len(items) < limit:
            obj = objs[keys[i]]
            i += 1
            if predicate is None or predicate(obj):
                items.append(obj)
        if i >= len(keys):
            return ListResult(items, rv)
        remaining = len(keys) - i if predicate is None else 0
        return ListResult(items, rv, self._encode_continue(rv, self._continue_key(keys[i - 1], ns)), remaining)

    def _paged(self, skey: tuple[str, str], rv: int, ns: str | None) -> Paged:
        """The objects of a kind at ``rv`` (a copy: stored objects never change, the map does) and their keys
        in order, kept for the LIST's next pages (the last few LISTs)."""
        key = (skey, rv, ns)
        hit = self._paging.get(key)
        if hit is None:
            objs = dict(self.snapshot(skey, rv))
            keys = sorted(objs) if ns is None else sorted(k for k in objs if k[0] == ns)
            hit = self._paging[key] = (objs, keys)
            while len(self._paging) > PAGED_LISTS:
                self._paging.popitem(last=False)
        else:
            self._paging.move_to_end(key)
        return hit

    @staticmethod
    def _continue_key(key: tuple[str, str], ns: str | None) -> tuple[str, ...]:
        return (key[1],) if ns is not None or not key[0] else key

    @staticmethod
    def _encode_continue(rv: int, key: tuple[str, ...]) -> str:
        start = "/" + "/".join(key) + "\u0000"
        raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start}, separators=(",", ":"))
        return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")

    def _decode_continue(self, token: str, ns: str | None) -> tuple[int, tuple[str, ...]]:
        def bad(why: str) -> ApiError:
            return bad_request(f"invalid continue token: continue key is not valid: {why}")

        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        except (binascii.Error, ValueError):
            raise bad("illegal base64 data at input byte 0") from None
        try:
            data = gojson.loads(raw)
        except gojson.JSONSyntaxError as exc:
            raise bad(str(exc)) from None
        if not isinstance(data, dict) or data.get("v") != "meta.k8s.io/v1":
            raise bad("incorrect encoded start resourceVersion (version meta.k8s.io/v1)")
        rv = data.get("rv")
        start = data.get("start")
        if not isinstance(rv, int) or rv <= 0 or not isinstance(start, str):
            raise bad("incorrect encoded start resourceVersion (version meta.k8s.io/v1)")
        parts = tuple(start.rstrip("\u0000").lstrip("/").split("/"))
        return rv, parts

    # -- the write path --------------------------------------------------------------------------------

    def _commit(
        self, rt: ResourceType, kind: str, new: JSON, old: JSON | None, tries: dict[Any, managed.Trie] | None = None
    ) -> JSON:
        self.rv += 1
        new["metadata"]["resourceVersion"] = str(self.rv)
        skey = rt.storage_key
        key = (new["metadata"].get("namespace", ""), new["metadata"]["name"])
        if old is not None:
            self._encoded.pop(id(old), None)
        encoded = None
        if kind == "DELETED":
            self.objects[skey].pop(key, None)
            self.fields.pop((skey, *key), None)
        else:
            self.objects[skey][key] = new
            if tries is not None:
                self.fields[(skey, *key)] = tries
            if self.watchers.get(skey):
                encoded = self.encoded(new)
        event = Event(self.rv, skey, kind, new, old, encoded)
        if self.history.maxlen is not None and len(self.history) == self.history.maxlen:
            self.compacted_rv = self.history[0].rv
        self.history.append(event)
        for watcher in list(self.watchers.get(skey, ())):
            watcher.offer(event)
        if rt.key == CRD_KEY:
            if kind == "DELETED":
                self._drop_crd(new)
            else:
                self._apply_crd(new)
        for listener in self.listeners:
            listener(event)
        return new

    def _entries(self, rt: ResourceType, obj: JSON) -> list[JSON]:
        """An object's managedFields entries with their fieldsV1 (kept beside the object)."""
        m = obj["metadata"]
        tries = self.fields.get((rt.storage_key, m.get("namespace", ""), m["name"]), {})
        return [
            dict(e, fieldsType="FieldsV1", fieldsV1=tries.get(managed.entry_key(e), {}))
            for e in m.get("managedFields") or []
        ]

    @staticmethod
    def _split(entries: list[JSON]) -> tuple[list[JSON], dict[Any, managed.Trie]]:
        """(the entries an object shows, without fieldsV1; the tries the store keeps)."""
        shown: list[JSON] = []
        tries: dict[Any, managed.Trie] = {}
        for e in entries:
            tries[managed.entry_key(e)] = e.get("fieldsV1") or {}
            shown.append({k: v for k, v in e.items() if k not in ("fieldsV1", "fieldsType")})
        return shown, tries

    # decoding --------------------------------------------------------------------------------------------

    def _unrecognized(self, rt: ResourceType, why: str, raw: bytes) -> ApiError:
        text = raw.decode("utf-8", errors="replace")
        if not text:
            summary = "<empty>"
        elif text.startswith("{"):
            summary = text if len(text) <= 30 else text[:30] + " ..."
        else:
            summary = raw[:30].hex() + (" ..." if len(raw) > 30 else "")
        return bad_request(f"the object provided is unrecognized (must be of type {rt.kind}): {why} ({summary})")

    def _cannot_handle(self, rt: ResourceType, why: str) -> ApiError:
        return bad_request(f"{rt.kind} in version {gojson.quote(rt.version)} cannot be handled as a {rt.kind}: {why}")

    def decode_body(
        self, rt: ResourceType, body: Any, opts: WriteOptions, *, check_type: bool = True, old: JSON | None = None
    ) -> tuple[JSON, list[str]]:
        """A request body as the real decoder takes it: kind and apiVersion checked, the object typed (built-in
        kinds) or pruned and defaulted (custom resources). Returns the object in storage form and the warnings."""
        if not isinstance(body, dict):
            raise self._unrecognized(
                rt,
                f"couldn't get version/kind; json parse error: json: cannot unmarshal {gojson.json_type(body)} into Go "
                'value of type struct { APIVersion string "json:\\"apiVersion,omitempty\\""; Kind string '
                '"json:\\"kind,omitempty\\"" }',
                opts.raw,
            )
        if check_type:
            kind = body.get("kind")
            api_version = body.get("apiVersion")
            if not rt.custom:
                # A typed (built-in) kind: the decoder defaults what is missing from the endpoint's group, version
                # and kind. Only custom resources, decoded as unstructured, must carry both.
                if not kind:
                    kind = rt.kind
                    if not api_version:
                        api_version = rt.api_version
                elif not api_version:
                    api_version = rt.api_version
            if not kind:
                raw = opts.raw.decode("utf-8", errors="replace") if opts.raw else gojson.dumps(body).decode()
                raise self._unrecognized(rt, f"Object 'Kind' is missing in '{raw}'", opts.raw or raw.encode())
            if api_version != rt.api_version:
                err = bad_request(
                    f"the API version in the data ({api_version or ''}) does not match the expected API version "
                    f"({rt.api_version})"
                )
                if rt.custom and api_version:
                    err.warnings = [
                        f'unknown field "{k}"' for k in sorted(body) if k not in ("apiVersion", "kind", "metadata")
                    ]
                raise err
            if kind != rt.kind:
                name = (
                    str((body.get("metadata") or {}).get("name") or "")
                    if isinstance(body.get("metadata"), dict)
                    else ""
                )
                raise invalid_error(rt.group, str(kind), name, [invalid("kind", kind, f"must be {rt.kind}")])
        unknown: list[str]
        if rt.struct is not None:
            try:
                obj, unknown = decode(rt.struct, body)
            except DecodeError as exc:
                raise self._cannot_handle(rt, str(exc)) from None
            if rt.group == "events.k8s.io":
                obj = B.event_to_core(obj)
            elif rt.kind == "Secret":
                obj = B.secret_string_data(obj)
        else:
            obj = dict(body)
            if old is not None and body.get("metadata") is old["metadata"]:
                unknown = []  # a patch that left metadata alone: it is the stored, already decoded one
            else:
                try:
                    meta_obj, unknown = decode(OBJECT_META, body.get("metadata") or {})
                except DecodeError as exc:
                    raise self._cannot_handle(rt, str(exc)) from None
                unknown = [f"metadata.{u}" for u in unknown]
                obj["metadata"] = meta_obj
            if rt.key == CRD_KEY:
                obj = copy.deepcopy(obj)
                crds.default(obj)
            else:
                schema = self.schemas.get(rt.key)
                if schema is not None:
                    unknown += schema.prune(obj, old)
                    schema.default(obj, old)
        obj["apiVersion"] = "v1" if rt.is_event else rt.api_version
        obj["kind"] = rt.kind
        warnings: list[str] = []
        if unknown and opts.validation != "Ignore":
            unknown = sorted(unknown)
            if opts.validation == "Strict":
                raise self._cannot_handle(
                    rt, "strict decoding error: " + ", ".join(f'unknown field "{u}"' for u in unknown)
                )
            warnings = [f'unknown field "{u}"' for u in unknown]
        return obj, warnings

    # validation --------------------------------------------------------------------------------------------

    @staticmethod
    def _name_func(rt: ResourceType) -> meta.NameFunc:
        if rt.key == NS_KEY:
            return meta.dns1123_label
        if rt.is_event and rt.group == "":
            return meta.path_segment
        return meta.dns1123_subdomain

    def _validate(self, rt: ResourceType, obj: JSON, old: JSON | None, sub: str | None) -> list[FieldError]:
        """ObjectMeta, then the kind; for custom resources the schema, list types and CEL (or the
        "not checked" error when an earlier one blocks it)."""
        errors: list[FieldError] = []
        m = obj["metadata"]
        legacy_event = rt.is_event and rt.group == ""
        if old is None:
            if not legacy_event:
                errors += meta.validate_create(m, rt.namespaced, self._name_func(rt))
        elif sub is None:
            common = meta.validate_create(m, rt.namespaced, meta.path_segment) + meta.validate_update(
                m, old["metadata"]
            )
            errors += common
            if not legacy_event:
                errors += meta.validate_update(m, old["metadata"])
        if rt.custom:
            schema = self.schemas.get(rt.key)
            if schema is not None:
                errors += schema.validate(obj, old, status_only=sub == "status")
                errors += schema.validate_lists(obj, old)
                if schema.has_cel:
                    if any(e.type in BLOCKING for e in errors):
                        errors.append(NOT_CHECKED)
                    else:
                        errors += schema.validate_cel(obj, old)
        elif rt.key == NS_KEY:
            errors += B.validate_namespace(obj)
        elif rt.kind in ("ConfigMap", "Secret"):
            errors += B.validate_configmap(obj, old)
        elif rt.kind == "Lease":
            errors += B.validate_lease(obj)
        elif rt.is_event:
            errors += B.validate_event(obj, m.get("namespace", ""), strict=rt.group == "events.k8s.io")
        elif rt.key == CRD_KEY and sub is None:
            errors += crds.validate(obj)
        return errors

    def _invalid(self, rt: ResourceType, obj: JSON, errors: list[FieldError]) -> ApiError:
        group = "" if rt.is_event else rt.group  # Events are validated as the internal (core) kind
        return invalid_error(group, rt.kind, str(obj["metadata"].get("name") or ""), errors)

    # namespace admission -----------------------------------------------------------------------------------

    def _admit_namespace(self, rt: ResourceType, ns: str, name: str) -> None:
        if not rt.namespaced:
            return
        namespace = self.objects[("", "namespaces")].get(("", ns))
        if namespace is None:
            raise ApiError(404, "NotFound", f"namespaces {gojson.quote(ns)} not found", details(ns, "", "namespaces"))
        if namespace["metadata"].get("deletionTimestamp"):
            cause = {
                "reason": "NamespaceTerminating",
                "message": f"namespace {ns} is being terminated",
                "field": "metadata.namespace",
            }
            raise ApiError(
                403,
                "Forbidden",
                f"{rt.group_resource} {gojson.quote(name)} is forbidden: unable to create new content in namespace "
                f"{ns} "
                "because it is being terminated",
                details(name, rt.group, rt.plural, causes=[cause]),
            )

    # create ---------------------------------------------------------------------------------------------------

    def create(self, rt: ResourceType, ns: str, body: Any, opts: WriteOptions | None = None) -> Outcome:
        opts = opts or WriteOptions()
        obj, warnings = self.decode_body(rt, body, opts)
        return self._create(rt, ns, obj, warnings, opts)

    def _create(
        self,
        rt: ResourceType,
        ns: str,
        obj: JSON,
        warnings: list[str],
        opts: WriteOptions,
        entries: list[JSON] | None = None,
    ) -> Outcome:
        m = obj["metadata"]
        name = str(m.get("name") or "")
        self._maybe_fail(rt, name)
        if rt.namespaced:
            if m.get("namespace") and m["namespace"] != ns:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            m["namespace"] = ns
        else:
            m.pop("namespace", None)
            ns = ""
        client_rv = m.pop("resourceVersion", None)
        for key in (
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "managedFields",
            "selfLink",
        ):
            m.pop(key, None)
        self._admit_namespace(rt, ns, name or str(m.get("generateName") or ""))
        objs = self.objects[rt.storage_key]
        if not name and m.get("generateName"):
            for _ in range(100):
                name = str(m["generateName"]) + "".join(random.choice(_GEN_ALPHABET) for _ in range(5))
                if (ns, name) not in objs:
                    break
            m["name"] = name
        if rt.status_subresource and rt.custom:
            obj.pop("status", None)  # create cannot set status when the status subresource is enabled
        stamp = now()
        m["uid"] = str(uuid.uuid4())
        m["creationTimestamp"] = stamp
        if rt.generation:
            m["generation"] = 1
        if rt.key == NS_KEY:
            labels = dict(m.get("labels") or {})
            labels["kubernetes.io/metadata.name"] = name
            m["labels"] = labels
            obj["spec"] = {"finalizers": [NS_FINALIZER]}
            obj["status"] = {"phase": "Active"}
        elif rt.key == CRD_KEY:
            obj["status"] = crds.initial_status(obj)
        errors = self._validate(rt, obj, None, None)
        if errors:
            raise self._invalid(rt, obj, errors)
        if opts.authorize_create is not None:
            opts.authorize_create()
        if client_rv:
            raise internal("resourceVersion should not be set on objects to be created")
        if (ns, name) in objs:
            raise already_exists(rt.group, rt.plural, name)
        warnings = warnings + meta.finalizer_warnings(m.get("finalizers"))
        status_mode = None if not rt.status_subresource else False
        if entries is None:
            owned = managed.owned(managed.project(obj, status_mode))
            entries = managed.record(None, opts.manager, "Update", "", rt.api_version, owned, {}, stamp)
        shown, tries = self._split(entries)
        if shown:
            m["managedFields"] = shown
        if opts.dry_run:
            return Outcome(self.view(rt, obj), warnings, created=True)
        return Outcome(self.view(rt, self._commit(rt, "ADDED", obj, None, tries)), warnings, created=True)

    # update ---------------------------------------------------------------------------------------------------

    def replace(
        self, rt: ResourceType, ns: str, name: str, body: Any, opts: WriteOptions | None = None, sub: str | None = None
    ) -> Outcome:
        opts = opts or WriteOptions()
        obj, warnings = self.decode_body(rt, body, opts)
        m = obj["metadata"]
        if m.get("name") not in (None, "", name):
            raise bad_request(f"the name of the object ({m.get('name')}) does not match the name on the URL ({name})")
        if rt.namespaced and m.get("namespace") not in (None, "", ns):
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        missing = (ns if rt.namespaced else "", name) not in self.objects[rt.storage_key]
        if sub is None and rt.create_on_update and missing:
            return self._create_on_update(rt, ns, name, obj, warnings, opts)
        old = self._stored(rt, ns, name)
        return self._update(rt, old, obj, opts, sub, warnings)

    def _create_on_update(
        self, rt: ResourceType, ns: str, name: str, obj: JSON, warnings: list[str], opts: WriteOptions
    ) -> Outcome:
        """A PUT to a missing object of a kind whose strategy allows create on update (Leases, Events) creates
        it, as the real registry's ``Store.Update`` does when the stored object's resourceVersion is 0: 201, a
        fresh uid and creationTimestamp, a new resourceVersion (the body's is ignored), create admission and
        validation. The uid precondition a body's ``metadata.uid`` sets is checked first, against the missing
        (zero) object, whose uid is empty: 409."""
        m = obj["metadata"]
        given_uid = m.get("uid")
        if given_uid:
            raise self._storage_error(rt, ns, name, str(given_uid), "")
        m["name"] = name
        m.pop("resourceVersion", None)
        return self._create(rt, ns, obj, warnings, opts)

    def _storage_error(self, rt: ResourceType, ns: str, name: str, given_uid: str, stored_uid: str) -> ApiError:
        """The uid precondition failed in storage (``storage.Preconditions.Check``): the StorageError the registry
        turns into a 409. Its key is etcd's: ``/registry/<group>/<plural>/...`` for CRDs and custom resources,
        ``/registry/<plural>/...`` for the built-in kinds (Events of both APIs are ``/registry/events``)."""
        plural = rt.storage_key[1]
        prefix = [rt.group] if rt.custom or rt.key == CRD_KEY else []
        parts = ["/registry", *prefix, plural, *([ns] if rt.namespaced and ns else []), name]
        return conflict(
            rt.group,
            rt.plural,
            name,
            f"StorageError: invalid object, Code: 4, Key: {'/'.join(parts)}, ResourceVersion: 0, AdditionalErrorMsg: "
            f"Precondition failed: UID in precondition: {given_uid}, UID in object meta: {stored_uid}",
        )

    def _update(
        self,
        rt: ResourceType,
        old: JSON,
        cand: JSON,
        opts: WriteOptions,
        sub: str | None,
        warnings: list[str],
        entries: list[JSON] | None = None,
    ) -> Outcome:
        old_meta = old["metadata"]
        name = old_meta["name"]
        self._maybe_fail(rt, name)
        cmeta = cand.get("metadata") or {}
        given_uid = cmeta.get("uid")
        if given_uid and given_uid != old_meta["uid"]:
            raise self._storage_error(rt, old_meta.get("namespace", ""), name, str(given_uid), old_meta["uid"])
        rv = cmeta.get("resourceVersion")
        if not rv:
            if not rt.unconditional_update:
                raise invalid_error(
                    rt.group,
                    rt.plural,
                    name,
                    [invalid("metadata.resourceVersion", 0, "must be specified for an update")],
                )
        elif str(rv) != old_meta["resourceVersion"]:
            raise conflict(rt.group, rt.plural, name)
        if sub == "status":
            new = dict(old)
            new["metadata"] = dict(old_meta)
            if cand.get("status") is not None:
                new["status"] = cand["status"]
            else:
                new.pop("status", None)
        elif sub == "finalize":
            new = dict(old)
            new["metadata"] = dict(old_meta)
            new["spec"] = dict(old.get("spec") or {}, finalizers=list((cand.get("spec") or {}).get("finalizers") or []))
            if not new["spec"]["finalizers"]:
                del new["spec"]["finalizers"]
        else:
            m = {k: cmeta[k] for k in _USER_META if cmeta.get(k) not in (None, "", [], {})}
            for key in ("name", "namespace", *_SERVER_META):
                if key in old_meta:
                    m[key] = old_meta[key]
                else:
                    m.pop(key, None)
            m["resourceVersion"] = old_meta["resourceVersion"]
            body = {k: v for k, v in cand.items() if k != "metadata"}
            new = {**body, "metadata": m}
            if rt.status_subresource:
                if "status" in old:
                    new["status"] = old["status"]
                else:
                    new.pop("status", None)
            if rt.key == NS_KEY:
                m["labels"] = dict(m.get("labels") or {}, **{"kubernetes.io/metadata.name": name})
                new["spec"] = old.get("spec", {})
            elif rt.key == CRD_KEY:
                new["status"] = old.get("status")
        errors = self._validate(rt, new, old, sub)
        if errors:
            raise self._invalid(rt, new, errors)
        new_meta = new["metadata"]
        if (
            rt.generation
            and "generation" in old_meta
            and sub is None
            and self._spec_part(rt, new) != self._spec_part(rt, old)
        ):
            new_meta["generation"] = old_meta["generation"] + 1
        status_mode = True if sub == "status" else (False if rt.status_subresource else None)
        tries: dict[Any, managed.Trie] | None = None
        if entries is None:
            changed, removed = managed.diff(managed.project(old, status_mode), managed.project(new, status_mode))
            if changed or removed:
                kept = self.fields.get((rt.storage_key, old_meta.get("namespace", ""), name), {})
                new_meta["managedFields"], tries = managed.record_kept(
                    old_meta.get("managedFields") or [],
                    kept,
                    opts.manager,
                    "Update",
                    sub or "",
                    rt.api_version,
                    changed,
                    removed,
                    now(),
                )
        else:
            new_meta["managedFields"], tries = self._split(entries)
        if not new_meta.get("managedFields"):
            new_meta.pop("managedFields", None)
        if new == old:
            return Outcome(self.view(rt, old), warnings)  # a no-op write: no new resourceVersion, no event
        if old_meta.get("deletionTimestamp") and not new_meta.get("finalizers") and not self._held(rt, new):
            # The last finalizer is gone: the object is deleted. As the real registry: the answer is the updated
            # object with its previous resourceVersion (it is never stored); the DELETED event carries the last
            # stored state at the deletion's resourceVersion.
            if not opts.dry_run:
                gone = dict(old)
                gone["metadata"] = dict(old_meta)
                self._commit(rt, "DELETED", gone, old)
            return Outcome(self.view(rt, new), warnings)
        if opts.dry_run:
            return Outcome(self.view(rt, new), warnings)
        return Outcome(self.view(rt, self._commit(rt, "MODIFIED", new, old, tries)), warnings)

    @staticmethod
    def _held(rt: ResourceType, obj: JSON) -> bool:
        """A Namespace stays while ``spec.finalizers`` is not empty."""
        return rt.key == NS_KEY and bool((obj.get("spec") or {}).get("finalizers"))

    @staticmethod
    def _spec_part(rt: ResourceType, obj: JSON) -> JSON:
        skip = (
            ("apiVersion", "kind", "metadata", "status")
            if rt.status_subresource
            else ("apiVersion", "kind", "metadata")
        )
        return {k: v for k, v in obj.items() if k not in skip}

    # patch ----------------------------------------------------------------------------------------------------

    def patch(
        self,
        rt: ResourceType,
        ns: str,
        name: str,
        content_type: str,
        body: Any,
        opts: WriteOptions | None = None,
        sub: str | None = None,
    ) -> Outcome:
        """PATCH with a JSON merge patch, a JSON patch, a strategic merge patch (built-in kinds only) or a
        server-side apply configuration (``body`` already decoded from JSON or YAML)."""
        opts = opts or WriteOptions()
        allowed = CUSTOM_PATCH_TYPES if rt.custom else BUILTIN_PATCH_TYPES
        if content_type not in allowed:
            raise unsupported_media_type(allowed)
        if content_type == patches.APPLY:
            return self._apply(rt, ns, name, body, opts, sub)
        if content_type == patches.JSON_PATCH:
            if not isinstance(body, list):
                raise bad_request(
                    f"error decoding patch: json: cannot unmarshal {gojson.json_type(body)} into Go value of type "
                    "[]handlers.jsonPatchOp"
                )
        elif not isinstance(body, dict):
            raise bad_request(
                f"error decoding patch: json: cannot unmarshal {gojson.json_type(body)} into Go value of type "
                "map[string]interface {}"
            )
        old = self._stored(rt, ns, name)
        current = self.view(rt, old)
        try:
            if content_type == patches.MERGE:
                candidate = patches.merge_patch(current, body)
            elif content_type == patches.JSON_PATCH:
                candidate = patches.json_patch(current, body)
            else:
                candidate = patches.strategic_merge_patch(current, body)
        except patches.PatchError:
            raise ApiError(
                422, "Invalid", "the server rejected our request due to an error in our request", {}
            ) from None
        if not isinstance(candidate, dict):
            raise bad_request("the patched object must be a JSON object")
        cmeta: JSON = candidate["metadata"] if isinstance(candidate.get("metadata"), dict) else {}
        if cmeta.get("name") not in (None, name):
            raise bad_request(
                f"the name of the object ({cmeta.get('name')}) does not match the name on the URL ({name})"
            )
        obj, warnings = self.decode_body(rt, candidate, opts, check_type=False, old=current)
        return self._update(rt, old, obj, opts, sub, warnings)

    def _apply(self, rt: ResourceType, ns: str, name: str, config: Any, opts: WriteOptions, sub: str | None) -> Outcome:
        if not opts.manager:
            raise ApiError(
                422,
                "Invalid",
                'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: is required for apply patch',
                details(
                    "",
                    "meta.k8s.io",
                    "PatchOptions",
                    causes=[required("fieldManager", "is required for apply patch").cause()],
                ),
            )
        if not isinstance(config, dict):
            raise bad_request(f"error decoding YAML: cannot apply a {gojson.json_type(config)}")
        cfg, warnings = self.decode_body(rt, config, opts)
        cmeta = cfg["metadata"]
        if cmeta.get("name") not in (None, "", name):
            raise bad_request(
                f"the name of the object ({cmeta.get('name')}) does not match the name on the URL ({name})"
            )
        cmeta["name"] = name
        key = (ns if rt.namespaced else "", name)
        old = self.objects[rt.storage_key].get(key)
        status_mode = True if sub == "status" else (False if rt.status_subresource else None)
        stamp = now()
        if old is None:
            if sub is not None:
                raise not_found(rt.group, rt.plural, name)
            merged, entries = managed.apply(
                {}, cfg, None, opts.manager, "", status_mode, opts.force, rt.api_version, stamp
            )
            merged.setdefault("metadata", {})["name"] = name
            merged["apiVersion"], merged["kind"] = cfg["apiVersion"], cfg["kind"]
            return self._create(rt, ns, merged, warnings, opts, entries)
        merged, entries = managed.apply(
            self.view(rt, old),
            cfg,
            self._entries(rt, old),
            opts.manager,
            sub or "",
            status_mode,
            opts.force,
            rt.api_version,
            stamp,
        )
        if cmeta.get("resourceVersion"):
            merged["metadata"]["resourceVersion"] = cmeta["resourceVersion"]
        obj, _ = self.decode_body(rt, merged, WriteOptions(validation="Ignore"), check_type=False)
        return self._update(rt, old, obj, opts, sub, warnings, entries)

    # delete ---------------------------------------------------------------------------------------------------

    @staticmethod
    def delete_options(options: Any) -> JSON:
        """Validated DeleteOptions (a 422 for an unknown propagationPolicy)."""
        if not isinstance(options, dict):
            options = {}
        policy = options.get("propagationPolicy")
        if policy is not None and policy not in ("Foreground", "Background", "Orphan"):
            err = not_supported("propagationPolicy", policy, ["Foreground", "Background", "Orphan", "nil"])
            raise invalid_error("meta.k8s.io", "DeleteOptions", "", [err])
        if policy is not None and options.get("orphanDependents") is not None:
            err = invalid("propagationPolicy", policy, "orphanDependents and deletionPropagation cannot be both set")
            raise invalid_error("meta.k8s.io", "DeleteOptions", "", [err])
        out: JSON = options
        return out

    def delete(
        self, rt: ResourceType, ns: str, name: str, options: Any, opts: WriteOptions | None = None
    ) -> tuple[JSON, bool]:
        """DELETE: (the object as it is now, True if it is gone). Objects held by finalizers, and Namespaces,
        get a deletionTimestamp; ``Orphan``/``Foreground`` add the garbage collector's finalizer."""
        opts = opts or WriteOptions()
        options = self.delete_options(options)
        old = self._stored(rt, ns, name)
        self._maybe_fail(rt, name)
        m = old["metadata"]
        pre = options.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != m["uid"]:
            raise ApiError(
                409,
                "Conflict",
                f"Operation cannot be fulfilled on {rt.qualified_kind} {gojson.quote(name)}: the UID in the "
                "precondition "
                f"({pre['uid']}) does not match the UID in record ({m['uid']}). The object might have been deleted and "
                "then recreated",
                details(name, rt.group, rt.kind),
            )
        if pre.get("resourceVersion") and pre["resourceVersion"] != m["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f"Operation cannot be fulfilled on {rt.qualified_kind} {gojson.quote(name)}: the ResourceVersion in "
                "the "
                f"precondition ({pre['resourceVersion']}) does not match the ResourceVersion in record "
                f"({m['resourceVersion']}). "
                "The object might have been modified",
                details(name, rt.group, rt.kind),
            )
        policy = options.get("propagationPolicy")
        if policy is None and options.get("orphanDependents") is not None:
            policy = "Orphan" if options["orphanDependents"] else "Background"
        finalizers = list(m.get("finalizers") or [])
        if rt.key == CRD_KEY and CRD_CLEANUP not in finalizers:
            finalizers.append(CRD_CLEANUP)  # the CRD stays until its custom resources are gone
        if policy == "Orphan" and meta.ORPHAN not in finalizers:
            finalizers = [f for f in finalizers if f != meta.FOREGROUND] + [meta.ORPHAN]
        elif policy == "Foreground" and meta.FOREGROUND not in finalizers:
            finalizers = [f for f in finalizers if f != meta.ORPHAN] + [meta.FOREGROUND]
        if m.get("deletionTimestamp"):
            if finalizers == list(m.get("finalizers") or []):
                return self.view(rt, old), False
            new = dict(old)
            new["metadata"] = dict(m, finalizers=finalizers)
            if opts.dry_run:
                return self.view(rt, new), False
            return self.view(rt, self._commit(rt, "MODIFIED", new, old)), False
        if rt.key == NS_KEY:
            new = dict(old)
            new["metadata"] = dict(m, deletionTimestamp=now())
            if finalizers:
                new["metadata"]["finalizers"] = finalizers
            new["status"] = dict(old.get("status") or {}, phase="Terminating")
            if opts.dry_run:
                return self.view(rt, new), False
            return self.view(rt, self._commit(rt, "MODIFIED", new, old)), False
        if finalizers:
            new = dict(old)
            new_meta = new["metadata"] = dict(m)
            new_meta["deletionTimestamp"] = now()
            new_meta["deletionGracePeriodSeconds"] = 0
            new_meta["finalizers"] = finalizers
            if rt.generation and "generation" in m:
                new_meta["generation"] = m["generation"] + 1
            if opts.dry_run:
                return self.view(rt, new), False
            return self.view(rt, self._commit(rt, "MODIFIED", new, old)), False
        if opts.dry_run:
            return self.view(rt, old), True
        new = dict(old)
        new["metadata"] = dict(m)
        return self.view(rt, self._commit(rt, "DELETED", new, old)), True

    # watches ---------------------------------------------------------------------------------------------------

    def watch(
        self,
        rt: ResourceType,
        ns: str | None,
        predicate: Predicate | None,
        since: str | None,
        *,
        initial: bool | None = None,
    ) -> tuple[Watcher, bool]:
        """Register a watcher with its initial events already queued (synchronously: no gap, no duplicate).

        ``since`` unset or ``0`` (or ``initial``) sends the current objects as ADDED first; returns (watcher,
        whether initial events were sent). A ``since`` older than :meth:`watch_start` queues one ERROR 410 and
        ends the stream, as the recorded server did (probes ``watch-too-old-rv*``)."""
        skey = rt.storage_key
        watcher = Watcher(skey, ns, predicate, rt if rt.group == "events.k8s.io" else None)
        send_initial = initial if initial is not None else since in (None, "", "0")
        if send_initial:
            events_view = rt.group == "events.k8s.io"
            for obj in self.list_objects(rt, ns, predicate):
                if events_view:
                    watcher.queue.put_nowait(encode_event("ADDED", self.view(rt, obj)))
                else:
                    watcher.queue.put_nowait(event_line("ADDED", self.encoded(obj)))
            watcher.min_rv = self.rv
        else:
            start = int(str(since))
            oldest = self.watch_start(skey)
            if start < oldest:
                status = ApiError(410, "Expired", f"too old resource version: {start} ({oldest})").status()
                watcher.queue.put_nowait(encode_event("ERROR", status))
                watcher.queue.put_nowait(None)
                return watcher, False
            watcher.min_rv = start
            if start < self.rv:
                for event in islice(self.history, start - self.compacted_rv, None):
                    if event.skey == skey:
                        watcher.offer(event)
        self.watchers.setdefault(skey, set()).add(watcher)
        return watcher, send_initial

    def unwatch(self, watcher: Watcher) -> None:
        self.watchers.get(watcher.skey, set()).discard(watcher)

    # helpers for controllers ---------------------------------------------------------------------------------

    def types_by_storage(self) -> dict[tuple[str, str], ResourceType]:
        """One resource type per storage (the first registered: core Events before events.k8s.io)."""
        out: dict[tuple[str, str], ResourceType] = {}
        for rt in self.types.values():
            out.setdefault(rt.storage_key, rt)
        return out

    def controller_update(
        self, rt: ResourceType, old: JSON, new: JSON, sub: str | None, manager: str = CONTROLLER_MANAGER
    ) -> JSON:
        """A write by a built-in controller: ``new`` carries ``old``'s resourceVersion."""
        new.setdefault("metadata", {})["resourceVersion"] = old["metadata"]["resourceVersion"]
        return self._update(rt, old, new, WriteOptions(manager), sub, []).obj
