"""The object store: etcd-like versioning, the write semantics of kube-apiserver's generic registry, watches.

Everything here runs on the server's event loop thread, so no locks: a write and the notification of every
watcher happen synchronously, with no ``await`` in between, which is what makes "list at rv N, then watch
from N" gap-free. Stored objects are never mutated after a commit (every write builds a new top-level dict
and a new ``metadata`` dict), so an object can be shared by the store, the history and the watch queues.

Costs: a get/write is a dict lookup plus the validation of the written object; a list scans only its own
kind; watching from a resourceVersion indexes straight into the history window (one event per rv).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import islice
from typing import Any

from controller.apiserver import patches
from controller.apiserver.resources import JSON, ResourceType, builtin_types, from_crd
from controller.apiserver.schema import FieldError, Schema
from controller.apiserver.selectors import Predicate

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_USER_META = ("name", "generateName", "namespace", "labels", "annotations", "finalizers", "ownerReferences")
_SERVER_META = (
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "namespace",
    "name",
    "generateName",
)
_GEN_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
CRD_KEY = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NS_KEY = ("", "v1", "namespaces")


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    """An API failure; :meth:`status` is the ``kind: Status`` body the real server would send."""

    def __init__(self, code: int, reason: str, message: str, details: JSON | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> JSON:
        body: JSON = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(
        404,
        "NotFound",
        f'{rt.group_resource} "{name}" not found',
        {"name": name, "group": rt.group, "kind": rt.plural},
    )


def conflict(rt: ResourceType, name: str, message: str | None = None) -> ApiError:
    text = message or "the object has been modified; please apply your changes to the latest version and try again"
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rt.group_resource} "{name}": {text}',
        {"name": name, "group": rt.group, "kind": rt.plural},
    )


def invalid(rt: ResourceType, name: str, errors: list[FieldError]) -> ApiError:
    bodies = [e.message for e in errors]
    summary = bodies[0] if len(bodies) == 1 else "[" + ", ".join(bodies) + "]"
    return ApiError(
        422,
        "Invalid",
        f'{rt.qualified_kind} "{name}" is invalid: {summary}',
        {
            "name": name,
            "group": rt.group,
            "kind": rt.kind,
            "causes": [{"reason": e.reason, "message": e.message.split(": ", 1)[-1], "field": e.field} for e in errors],
        },
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


@dataclass
class Event:
    rv: int
    skey: tuple[str, str]
    type: str
    obj: JSON
    old: JSON | None
    _data: bytes | None = None

    def data(self) -> bytes:
        if self._data is None:
            self._data = encode_event(self.type, self.obj)
        return self._data


def encode_event(kind: str, obj: JSON) -> bytes:
    return json.dumps({"type": kind, "object": obj}, separators=(",", ":")).encode() + b"\n"


@dataclass(eq=False)
class Watcher:
    """One watch stream: its filter and the queue of encoded events (``None`` ends the stream)."""

    skey: tuple[str, str]
    namespace: str | None
    predicate: Predicate | None
    queue: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)

    def offer(self, event: Event) -> None:
        ns = event.obj["metadata"].get("namespace", "")
        if self.namespace is not None and ns != self.namespace:
            return
        if self.predicate is None:
            self.queue.put_nowait(event.data())
            return
        now_match = self.predicate(event.obj)
        if event.type == "DELETED":
            if now_match:
                self.queue.put_nowait(event.data())
            return
        was_match = event.old is not None and self.predicate(event.old)
        if now_match and was_match:
            self.queue.put_nowait(event.data())
        elif now_match:
            self.queue.put_nowait(encode_event("ADDED", event.obj))
        elif was_match:
            self.queue.put_nowait(encode_event("DELETED", event.obj))


@dataclass
class Fault:
    code: int
    remaining: int


class Store:
    """All objects of all kinds, the global resourceVersion counter and the bounded event history."""

    def __init__(self, history_size: int = 10_000) -> None:
        self.rv = 0
        self.types: dict[tuple[str, str, str], ResourceType] = {}
        self.schemas: dict[tuple[str, str], Schema | None] = {}
        self.objects: dict[tuple[str, str], dict[tuple[str, str], JSON]] = {}
        self.history: deque[Event] = deque(maxlen=history_size)
        self.compacted_rv = 0  # events up to this rv have left the window
        self.watchers: dict[tuple[str, str], set[Watcher]] = {}
        self.faults: dict[str, Fault] = {}
        for rt in builtin_types():
            self.register(rt)
        ns_type = self.types[NS_KEY]
        for name in ("default", "kube-system", "kube-public"):
            self.create(ns_type, "", {"metadata": {"name": name}})

    # -- kinds -----------------------------------------------------------------------------------------

    def register(self, rt: ResourceType) -> None:
        self.types[rt.key] = rt
        skey = (rt.group, rt.plural)
        self.schemas[skey] = Schema(rt.schema) if rt.schema else None
        self.objects.setdefault(skey, {})

    def find(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self.types.get((group, version, plural))

    def _apply_crd(self, crd: JSON) -> None:
        for rt in from_crd(crd):
            self.register(rt)

    def _drop_crd(self, crd: JSON) -> None:
        spec = crd.get("spec") or {}
        group, plural = spec.get("group", ""), (spec.get("names") or {}).get("plural", "")
        for key in [k for k in self.types if k[0] == group and k[2] == plural]:
            del self.types[key]
        self.objects.pop((group, plural), None)
        for watcher in self.watchers.pop((group, plural), set()):
            watcher.queue.put_nowait(None)

    # -- faults ----------------------------------------------------------------------------------------

    def inject_failures(self, plural: str, count: int, code: int = 500) -> None:
        """Make the next ``count`` writes (create/update/patch/delete) to resources named ``plural`` fail."""
        self.faults[plural] = Fault(code, count)

    def _maybe_fail(self, rt: ResourceType, name: str) -> None:
        fault = self.faults.get(rt.plural)
        if fault is None or fault.remaining <= 0:
            return
        fault.remaining -= 1
        if fault.code == 409:
            raise conflict(rt, name)
        raise ApiError(fault.code, "InternalError", f"Internal error occurred: injected failure on {rt.plural}")

    def close_watches(self) -> int:
        """End every watch stream (as an API server restart would); returns how many were closed."""
        count = 0
        for watchers in self.watchers.values():
            for watcher in watchers:
                watcher.queue.put_nowait(None)
                count += 1
            watchers.clear()
        return count

    # -- reads -----------------------------------------------------------------------------------------

    def get(self, rt: ResourceType, ns: str, name: str) -> JSON:
        obj = self.objects[(rt.group, rt.plural)].get((ns, name))
        if obj is None:
            raise not_found(rt, name)
        return obj

    def list_objects(self, rt: ResourceType, ns: str | None, predicate: Predicate | None) -> list[JSON]:
        objs = self.objects[(rt.group, rt.plural)]
        keys = sorted(objs) if ns is None else sorted(k for k in objs if k[0] == ns)
        items = [objs[k] for k in keys]
        if predicate is not None:
            items = [o for o in items if predicate(o)]
        return items

    # -- writes ----------------------------------------------------------------------------------------

    def _commit(self, rt: ResourceType, kind: str, new: JSON, old: JSON | None) -> JSON:
        self.rv += 1
        new["metadata"]["resourceVersion"] = str(self.rv)
        skey = (rt.group, rt.plural)
        key = (new["metadata"].get("namespace", ""), new["metadata"]["name"])
        if kind == "DELETED":
            self.objects[skey].pop(key, None)
        else:
            self.objects[skey][key] = new
        event = Event(self.rv, skey, kind, new, old)
        if self.history.maxlen is not None and len(self.history) == self.history.maxlen:
            self.compacted_rv = self.history[0].rv
        self.history.append(event)
        for watcher in self.watchers.get(skey, ()):
            watcher.offer(event)
        if rt.key == CRD_KEY:
            if kind == "DELETED":
                self._drop_crd(new)
            else:
                self._apply_crd(new)
        return new

    def _check_namespace(self, rt: ResourceType, ns: str) -> None:
        if rt.namespaced and ("", ns) not in self.objects[("", "namespaces")]:
            raise ApiError(404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"})

    def _user_meta(self, meta: Any, rt: ResourceType, name: str) -> JSON:
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        out = {k: meta[k] for k in _USER_META if meta.get(k) is not None}
        errors: list[FieldError] = []
        for key, value in (out.get("labels") or {}).items():
            if not isinstance(value, str):
                raise bad_request(
                    f"json: cannot unmarshal {type(value).__name__} into Go struct field "
                    f"ObjectMeta.metadata.labels of type string"
                )
            if len(value) > 63 or not _LABEL_VALUE_RE.match(value):
                errors.append(
                    FieldError(
                        "FieldValueInvalid",
                        "metadata.labels",
                        f'metadata.labels: Invalid value: "{value}": a valid label must be an empty string or '
                        "consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                        "alphanumeric character",
                    )
                )
            if not key or len(key.split("/")[-1]) > 63:
                errors.append(
                    FieldError("FieldValueInvalid", "metadata.labels", f'metadata.labels: Invalid value: "{key}"')
                )
        for key, value in (out.get("annotations") or {}).items():
            if not isinstance(value, str):
                raise bad_request(f"annotation {key} must be a string")
        finalizers = out.get("finalizers")
        if finalizers is not None and (
            not isinstance(finalizers, list) or not all(isinstance(f, str) for f in finalizers)
        ):
            raise bad_request("metadata.finalizers must be a list of strings")
        if errors:
            raise invalid(rt, name, errors)
        return out

    def create(self, rt: ResourceType, ns: str, body: Any, strict: bool = False) -> tuple[JSON, list[str]]:
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be a JSON object")
        meta_in = body.get("metadata") or {}
        name = meta_in.get("name") if isinstance(meta_in, dict) else None
        self._maybe_fail(rt, name or "")
        meta = self._user_meta(meta_in, rt, name or "")
        body_ns = meta.get("namespace")
        if rt.namespaced:
            if body_ns and body_ns != ns:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = ns
            self._check_namespace(rt, ns)
        else:
            meta.pop("namespace", None)
            ns = ""
        if not name:
            prefix = meta.get("generateName")
            if not prefix:
                raise invalid(
                    rt,
                    "",
                    [
                        FieldError(
                            "FieldValueRequired",
                            "metadata.name",
                            "metadata.name: Required value: name or generateName is required",
                        )
                    ],
                )
            objs = self.objects[(rt.group, rt.plural)]
            for _ in range(100):
                name = str(prefix) + "".join(random.choice(_GEN_ALPHABET) for _ in range(5))
                if (ns, name) not in objs:
                    break
            meta["name"] = name
        assert isinstance(name, str)
        self._validate_name(rt, name)
        if (ns, name) in self.objects[(rt.group, rt.plural)]:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{rt.group_resource} "{name}" already exists',
                {"name": name, "group": rt.group, "kind": rt.plural},
            )
        obj = {k: v for k, v in body.items() if k not in ("apiVersion", "kind", "metadata")}
        obj = {"apiVersion": rt.api_version, "kind": rt.kind, "metadata": meta, **obj}
        if rt.status_subresource:
            obj.pop("status", None)  # create cannot set status when the status subresource is enabled
        pruned = self._admit(rt, name, obj, None, strict)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        if rt.generation:
            meta["generation"] = 1
        if rt.key == NS_KEY:
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
        if rt.key == CRD_KEY:
            self._admit_crd(rt, obj)
        return self._commit(rt, "ADDED", obj, None), pruned

    def _validate_name(self, rt: ResourceType, name: str) -> None:
        if rt.plural == "events":
            ok = bool(name) and len(name) <= 253 and "/" not in name
        else:
            ok = len(name) <= 253 and _NAME_RE.match(name) is not None
        if not ok:
            raise invalid(
                rt,
                name,
                [
                    FieldError(
                        "FieldValueInvalid",
                        "metadata.name",
                        f'metadata.name: Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of lower '
                        "case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric "
                        "character (e.g. 'example.com', regex used for validation is "
                        "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')",
                    )
                ],
            )

    def _admit_crd(self, rt: ResourceType, obj: JSON) -> None:
        spec = obj.get("spec") or {}
        names = spec.get("names") or {}
        expected = f"{names.get('plural', '')}.{spec.get('group', '')}"
        name = obj["metadata"]["name"]
        if name != expected:
            raise invalid(
                rt,
                name,
                [
                    FieldError(
                        "FieldValueInvalid",
                        "metadata.name",
                        f'metadata.name: Invalid value: "{name}": must be spec.names.plural+"."+spec.group',
                    )
                ],
            )
        try:
            from_crd(obj)
        except (ValueError, KeyError, TypeError) as exc:
            raise invalid(rt, name, [FieldError("FieldValueInvalid", "spec", f"spec: Invalid value: {exc}")]) from exc
        obj["status"] = {
            "acceptedNames": names,
            "conditions": [
                {"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": now()}
                for t, r, m in (
                    ("NamesAccepted", "NoConflicts", "no conflicts found"),
                    ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
                )
            ],
            "storedVersions": [v["name"] for v in spec.get("versions") or [] if v.get("storage")],
        }

    def _admit(self, rt: ResourceType, name: str, obj: JSON, old: JSON | None, strict: bool) -> list[str]:
        """Prune, default and validate ``obj`` in place; returns the pruned (unknown) field paths."""
        schema = self.schemas.get((rt.group, rt.plural))
        if schema is None:
            return []
        pruned = schema.prune(obj)
        if strict and pruned:
            raise bad_request("strict decoding error: " + ", ".join(f'unknown field "{p}"' for p in pruned))
        schema.default(obj)
        errors = schema.validate(obj, old)
        if errors:
            raise invalid(rt, name, errors)
        return pruned

    def replace(
        self, rt: ResourceType, ns: str, name: str, body: Any, subresource: str | None = None, strict: bool = False
    ) -> tuple[JSON, list[str]]:
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be a JSON object")
        old = self.get(rt, ns if rt.namespaced else "", name)
        return self._update(rt, old, body, subresource, strict)

    def patch(
        self,
        rt: ResourceType,
        ns: str,
        name: str,
        content_type: str,
        patch: Any,
        subresource: str | None = None,
        strict: bool = False,
    ) -> tuple[JSON, list[str]]:
        old = self.get(rt, ns if rt.namespaced else "", name)
        try:
            if content_type == patches.MERGE:
                candidate = patches.merge_patch(old, patch)
            elif content_type == patches.JSON_PATCH:
                candidate = patches.json_patch(old, patch)
            elif content_type == patches.STRATEGIC:
                candidate = patches.strategic_merge_patch(old, patch)
            else:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format - accepted media "
                    f"types include: {patches.JSON_PATCH}, {patches.MERGE}, {patches.STRATEGIC}",
                )
        except patches.PatchError as exc:
            raise ApiError(422, "Invalid", str(exc)) from exc
        if not isinstance(candidate, dict):
            raise bad_request("the patched object must be a JSON object")
        return self._update(rt, old, candidate, subresource, strict)

    def _update(
        self, rt: ResourceType, old: JSON, candidate: JSON, subresource: str | None, strict: bool
    ) -> tuple[JSON, list[str]]:
        old_meta = old["metadata"]
        name = old_meta["name"]
        self._maybe_fail(rt, name)
        cmeta = candidate.get("metadata")
        if cmeta is not None and not isinstance(cmeta, dict):
            raise bad_request("metadata must be an object")
        cmeta = cmeta or {}
        if cmeta.get("name") not in (None, "", name):
            raise bad_request(
                f"the name of the object ({cmeta.get('name')}) does not match the name on the URL ({name})"
            )
        if rt.namespaced and cmeta.get("namespace") not in (None, "", old_meta.get("namespace")):
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        rv = cmeta.get("resourceVersion")
        if rv not in (None, "") and str(rv) != old_meta["resourceVersion"]:
            raise conflict(rt, name)
        if subresource == "status":
            new = dict(old)
            new["metadata"] = dict(old_meta)
            if candidate.get("status") is not None:
                new["status"] = candidate["status"]
            else:
                new.pop("status", None)
        else:
            meta = self._user_meta(cmeta, rt, name)
            for key in _SERVER_META:
                if key in old_meta:
                    meta[key] = old_meta[key]
                else:
                    meta.pop(key, None)
            meta["resourceVersion"] = old_meta["resourceVersion"]
            body = {k: v for k, v in candidate.items() if k not in ("apiVersion", "kind", "metadata")}
            new = {"apiVersion": rt.api_version, "kind": rt.kind, "metadata": meta, **body}
            if rt.status_subresource:
                if "status" in old:
                    new["status"] = old["status"]
                else:
                    new.pop("status", None)
            if old_meta.get("deletionTimestamp"):
                added = [f for f in meta.get("finalizers") or [] if f not in (old_meta.get("finalizers") or [])]
                if added:
                    quoted = ", ".join(json.dumps(f) for f in added)
                    raise invalid(
                        rt,
                        name,
                        [
                            FieldError(
                                "FieldValueForbidden",
                                "metadata.finalizers",
                                "metadata.finalizers: Forbidden: no new finalizers can be added if the object is "
                                f"being deleted, found new finalizers []string{{{quoted}}}",
                            )
                        ],
                    )
        pruned = self._admit(rt, name, new, old, strict)
        if rt.key == CRD_KEY and subresource != "status":
            self._admit_crd(rt, new)
        new_meta = new["metadata"]
        if rt.generation and "generation" in old_meta and self._spec_part(rt, new) != self._spec_part(rt, old):
            new_meta["generation"] = old_meta["generation"] + 1
        if new == old:
            return old, pruned  # a no-op write: no new resourceVersion, no event (as the real server)
        if old_meta.get("deletionTimestamp") and not new_meta.get("finalizers"):
            return self._commit(rt, "DELETED", new, old), pruned
        return self._commit(rt, "MODIFIED", new, old), pruned

    @staticmethod
    def _spec_part(rt: ResourceType, obj: JSON) -> JSON:
        skip = (
            ("apiVersion", "kind", "metadata", "status")
            if rt.status_subresource
            else ("apiVersion", "kind", "metadata")
        )
        return {k: v for k, v in obj.items() if k not in skip}

    def delete(self, rt: ResourceType, ns: str, name: str, options: Any) -> JSON:
        old = self.get(rt, ns if rt.namespaced else "", name)
        self._maybe_fail(rt, name)
        options = options if isinstance(options, dict) else {}
        pre = options.get("preconditions") or {}
        meta = old["metadata"]
        if pre.get("uid") and pre["uid"] != meta["uid"]:
            raise conflict(
                rt, name, f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: {meta['uid']}"
            )
        if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
            raise conflict(
                rt,
                name,
                f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, "
                f"ResourceVersion in meta: {meta['resourceVersion']}",
            )
        new = dict(old)
        new["metadata"] = new_meta = dict(meta)
        if meta.get("finalizers"):
            if meta.get("deletionTimestamp"):
                return old
            new_meta["deletionTimestamp"] = now()
            new_meta["deletionGracePeriodSeconds"] = 0
            if rt.generation and "generation" in meta:
                new_meta["generation"] = meta["generation"] + 1
            return self._commit(rt, "MODIFIED", new, old)
        return self._commit(rt, "DELETED", new, old)

    # -- watches ---------------------------------------------------------------------------------------

    def watch(self, rt: ResourceType, ns: str | None, predicate: Predicate | None, since: str | None) -> Watcher:
        """Register a watcher, with its initial events already queued (synchronously: no gap, no duplicate)."""
        skey = (rt.group, rt.plural)
        watcher = Watcher(skey, ns, predicate)
        if since in (None, "", "0"):
            for obj in self.list_objects(rt, ns, predicate):
                watcher.queue.put_nowait(encode_event("ADDED", obj))
        else:
            try:
                start = int(str(since))
            except ValueError as exc:
                raise bad_request(f"invalid resourceVersion: {since}") from exc
            if start < self.compacted_rv:
                status = ApiError(
                    410, "Expired", f"too old resource version: {start} ({self.compacted_rv + 1})"
                ).status()
                watcher.queue.put_nowait(encode_event("ERROR", status))
                watcher.queue.put_nowait(None)
                return watcher
            if start < self.rv:
                for event in islice(self.history, start - self.compacted_rv, None):
                    if event.skey == skey:
                        watcher.offer(event)
        self.watchers.setdefault(skey, set()).add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        self.watchers.get(watcher.skey, set()).discard(watcher)
