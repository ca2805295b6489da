"""The controllers a real control plane runs next to the API server: garbage collector, namespace controller,
and the CRD establishing and cleanup controllers.

They are driven by the store's commits (:attr:`Store.listeners`), each reaction scheduled on the server's event
loop a moment later (``delay``), as the real controllers act asynchronously; they write through the store like any
client (manager ``kube-controller-manager``), so watchers see their writes. The real ones take from one second
(background collection) to half a minute (namespace removal); these act within a fraction of a second, which
only makes the tests faster, except the namespace controller's first pass over a Terminating namespace: it comes
``namespace_delay`` seconds after the namespace's deletion (default :data:`NAMESPACE_DELAY`, as a real v1.36
cluster took: its Leases deleted and its Changefeed marked about 5 s after the DELETE), so that a client that
expects its objects to be marked at once fails here as it would there.

- Garbage collector: a dependent all of whose ``ownerReferences`` point to objects that no longer exist (or to
  another incarnation: the uid is compared) is deleted; dangling references beside a live owner are removed.
  An owner deleted with ``propagationPolicy: Foreground`` (finalizer ``foregroundDeletion``) has its dependents
  deleted and disappears once none with ``blockOwnerDeletion: true`` remains; with ``Orphan`` (finalizer
  ``orphan``) its dependents lose their reference to it, then it disappears.
- Namespace controller: a Terminating namespace has its content deleted (``namespace_delay`` after its deletion,
  then again at every change of what is left); while some remains (held by
  finalizers) its status reports the ``NamespaceContentRemaining`` and ``NamespaceFinalizersRemaining``
  conditions; once empty, its ``kubernetes`` finalizer is removed and it is gone.
- CRDs: a created CRD gets its names accepted and the ``Established`` condition (only then are its resources
  served); a deleted one has all its custom resources deleted first.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

from controller.apiserver import meta
from controller.apiserver.crd import established, established_status
from controller.apiserver.errors import ApiError
from controller.apiserver.resources import CRD_KEY, NS_KEY, ResourceType
from controller.apiserver.store import CONTROLLER_MANAGER, CRD_CLEANUP, NS_FINALIZER, Event, Store, WriteOptions, now

JSON = dict[str, Any]
Key = tuple[tuple[str, str], str, str]  # (storage key, namespace, name)
log = logging.getLogger(__name__)

#: Seconds between a namespace's deletion and the namespace controller's first pass over it (deleting its
#: content, or removing the finalizer of an empty one): about what a real v1.36 cluster takes.
NAMESPACE_DELAY = 5.0


class Controllers:
    def __init__(
        self,
        store: Store,
        loop: asyncio.AbstractEventLoop,
        delay: float = 0.05,
        namespace_delay: float = NAMESPACE_DELAY,
    ) -> None:
        self.store = store
        self.loop = loop
        self.delay = delay
        self.namespace_delay = namespace_delay
        #: Terminating namespaces: the loop time from which the namespace controller acts on each.
        self._namespace_ready: dict[str, float] = {}
        self.uids: dict[str, Key] = {}
        self.dependents: dict[str, set[Key]] = {}
        self.refs: dict[Key, set[str]] = {}
        self._pending: set[tuple[str, Any]] = set()
        self._terminating_crds: dict[tuple[str, str], Key] = {}  # (group, plural) -> the CRD being deleted
        for skey, objs in store.objects.items():
            for (ns, name), obj in objs.items():
                self._index((skey, ns, name), obj)
        store.listeners.append(self.on_event)
        for (_, name), obj in store.objects.get(("apiextensions.k8s.io", "customresourcedefinitions"), {}).items():
            if not established(obj):
                self.schedule("establish", ("", name))

    # -- indexes -----------------------------------------------------------------------------------------------

    def _index(self, key: Key, obj: JSON) -> None:
        m = obj["metadata"]
        self.uids[m["uid"]] = key
        owners = {str(r.get("uid")) for r in m.get("ownerReferences") or [] if r.get("uid")}
        before = self.refs.get(key, set())
        if owners == before:
            return
        for uid in before - owners:
            self.dependents.get(uid, set()).discard(key)
        for uid in owners - before:
            self.dependents.setdefault(uid, set()).add(key)
        if owners:
            self.refs[key] = owners
        else:
            self.refs.pop(key, None)

    def _unindex(self, key: Key, obj: JSON) -> None:
        uid = obj["metadata"].get("uid")
        if self.uids.get(uid) == key:
            del self.uids[uid]
        for owner in self.refs.pop(key, set()):
            self.dependents.get(owner, set()).discard(key)

    def _lookup(self, key: Key) -> JSON | None:
        skey, ns, name = key
        return self.store.objects.get(skey, {}).get((ns, name))

    def _type(self, skey: tuple[str, str]) -> ResourceType | None:
        return self.store.types_by_storage().get(skey)

    # -- events ------------------------------------------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        m = event.obj["metadata"]
        key: Key = (event.skey, m.get("namespace", ""), m["name"])
        if event.type == "DELETED":
            uid = m.get("uid", "")
            self._unindex(key, event.obj)
            for dep in list(self.dependents.get(uid, ())):
                self.schedule("gc", dep)
            for owner in (r.get("uid") for r in m.get("ownerReferences") or []):
                owner_key = self.uids.get(str(owner))
                if owner_key is not None:
                    self.schedule("foreground", owner_key)
        else:
            self._index(key, event.obj)
            if m.get("ownerReferences"):
                self.schedule("gc", key)
            if m.get("deletionTimestamp"):
                finalizers = m.get("finalizers") or []
                if meta.FOREGROUND in finalizers:
                    self.schedule("foreground", key)
                if meta.ORPHAN in finalizers:
                    self.schedule("orphan", key)
                if event.skey == ("apiextensions.k8s.io", "customresourcedefinitions") and CRD_CLEANUP in finalizers:
                    spec = event.obj.get("spec") or {}
                    served = (str(spec.get("group", "")), str((spec.get("names") or {}).get("plural", "")))
                    self._terminating_crds[served] = key
                    self.schedule("crd-cleanup", key)
            for owner in (r.get("uid") for r in m.get("ownerReferences") or []):
                owner_key = self.uids.get(str(owner))
                if owner_key is not None:
                    self.schedule("foreground", owner_key)
            crd = event.skey == ("apiextensions.k8s.io", "customresourcedefinitions")
            if crd and not established(event.obj) and not m.get("deletionTimestamp"):
                self.schedule("establish", ("", m["name"]))
        crd_key = self._terminating_crds.get(event.skey)
        if crd_key is not None:
            self.schedule("crd-cleanup", crd_key)  # one of its objects changed or went: look again
        if event.skey == ("", "namespaces"):
            if event.type == "DELETED":
                self._namespace_ready.pop(m["name"], None)
            elif m.get("deletionTimestamp"):
                self._schedule_namespace(m["name"])
        elif m.get("namespace"):
            namespace = self.store.objects[("", "namespaces")].get(("", m["namespace"]))
            if namespace is not None and namespace["metadata"].get("deletionTimestamp"):
                self._schedule_namespace(m["namespace"])

    def schedule(self, what: str, arg: Any, delay: float | None = None) -> None:
        item = (what, arg)
        if item in self._pending:
            return
        self._pending.add(item)
        self.loop.call_later(self.delay if delay is None else max(self.delay, delay), self._run, item)

    def _schedule_namespace(self, name: str) -> None:
        """A pass over Terminating namespace ``name``: not before ``namespace_delay`` after its deletion was seen."""
        ready = self._namespace_ready.setdefault(name, self.loop.time() + self.namespace_delay)
        self.schedule("namespace", name, ready - self.loop.time())

    def _run(self, item: tuple[str, Any]) -> None:
        self._pending.discard(item)
        what, arg = item
        try:
            getattr(self, "_" + what.replace("-", "_"))(arg)
        except ApiError as exc:
            if exc.code in (404, 409):
                if exc.code == 409:
                    self.schedule(what, arg)  # raced with another write: look again (a namespace is ready by now)
                return
            log.warning("controller %s %s: %s", what, arg, exc.message)

    # -- garbage collector ----------------------------------------------------------------------------------------

    def _owner_state(self, dependent: Key, ref: JSON) -> str:
        """``solid``, ``dangling`` or ``waiting`` (the owner is being deleted in the foreground)."""
        owner_key = self.uids.get(str(ref.get("uid")))
        if owner_key is None:
            return "dangling"
        if owner_key[1] not in ("", dependent[1]):
            return "dangling"  # owners are in the dependent's namespace or cluster-scoped
        owner = self._lookup(owner_key)
        if owner is None or owner["metadata"]["uid"] != ref.get("uid"):
            return "dangling"
        om = owner["metadata"]
        if om.get("deletionTimestamp") and meta.FOREGROUND in (om.get("finalizers") or []):
            return "waiting"
        return "solid"

    def _gc(self, key: Key) -> None:
        obj = self._lookup(key)
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            return
        refs = obj["metadata"].get("ownerReferences") or []
        if not refs:
            return
        states = [self._owner_state(key, r) for r in refs]
        rt = self._type(key[0])
        if rt is None:
            return
        if "solid" in states:
            keep = [r for r, s in zip(refs, states, strict=True) if s == "solid"]
            if len(keep) != len(refs):
                new = dict(obj)
                new["metadata"] = dict(obj["metadata"], ownerReferences=keep)
                self.store.controller_update(rt, obj, new, None)
            return
        self.store.delete(rt, key[1], key[2], {"propagationPolicy": "Background"}, WriteOptions(CONTROLLER_MANAGER))

    def _foreground(self, key: Key) -> None:
        owner = self._lookup(key)
        if owner is None:
            return
        om = owner["metadata"]
        if not om.get("deletionTimestamp") or meta.FOREGROUND not in (om.get("finalizers") or []):
            return
        uid = om["uid"]
        blocking = False
        for dep in list(self.dependents.get(uid, ())):
            obj = self._lookup(dep)
            rt = self._type(dep[0])
            if obj is None or rt is None:
                continue
            if not obj["metadata"].get("deletionTimestamp"):
                gone = self.store.delete(
                    rt, dep[1], dep[2], {"propagationPolicy": "Background"}, WriteOptions(CONTROLLER_MANAGER)
                )[1]
                if gone:
                    continue
                obj = self._lookup(dep) or obj
            if any(
                r.get("uid") == uid and r.get("blockOwnerDeletion")
                for r in obj["metadata"].get("ownerReferences") or []
            ):
                blocking = True
        if blocking:
            return
        rt = self._type(key[0])
        if rt is None:
            return
        new = dict(owner)
        new["metadata"] = dict(om, finalizers=[f for f in om.get("finalizers") or [] if f != meta.FOREGROUND])
        self.store.controller_update(rt, owner, new, None)

    def _orphan(self, key: Key) -> None:
        owner = self._lookup(key)
        if owner is None:
            return
        om = owner["metadata"]
        if not om.get("deletionTimestamp") or meta.ORPHAN not in (om.get("finalizers") or []):
            return
        uid = om["uid"]
        for dep in list(self.dependents.get(uid, ())):
            obj = self._lookup(dep)
            rt = self._type(dep[0])
            if obj is None or rt is None:
                continue
            keep = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("uid") != uid]
            new = dict(obj)
            new_meta = dict(obj["metadata"])
            if keep:
                new_meta["ownerReferences"] = keep
            else:
                new_meta.pop("ownerReferences", None)
            new["metadata"] = new_meta
            self.store.controller_update(rt, obj, new, None)
        rt = self._type(key[0])
        owner = self._lookup(key)
        if rt is None or owner is None:
            return
        new = dict(owner)
        new["metadata"] = dict(
            owner["metadata"], finalizers=[f for f in owner["metadata"].get("finalizers") or [] if f != meta.ORPHAN]
        )
        self.store.controller_update(rt, owner, new, None)

    # -- namespaces ---------------------------------------------------------------------------------------------

    def _namespace(self, name: str) -> None:
        ns_type = self.store.types[NS_KEY]
        namespace = self.store.objects[("", "namespaces")].get(("", name))
        if namespace is None or not namespace["metadata"].get("deletionTimestamp"):
            return
        remaining: Counter[str] = Counter()
        finalizers: Counter[str] = Counter()
        for skey, rt in self.store.types_by_storage().items():
            if not rt.namespaced:
                continue
            for (ns, obj_name), obj in list(self.store.objects.get(skey, {}).items()):
                if ns != name:
                    continue
                if not obj["metadata"].get("deletionTimestamp"):
                    gone = self.store.delete(
                        rt, ns, obj_name, {"propagationPolicy": "Background"}, WriteOptions(CONTROLLER_MANAGER)
                    )[1]
                    if gone:
                        continue
                    obj = self.store.objects[skey].get((ns, obj_name)) or obj
                remaining[rt.group_resource] += 1
                for f in obj["metadata"].get("finalizers") or []:
                    finalizers[f] += 1
        namespace = self.store.objects[("", "namespaces")].get(("", name))
        if namespace is None:
            return
        if remaining:
            conditions = _conditions(namespace, remaining, finalizers)
            if conditions != (namespace.get("status") or {}).get("conditions"):
                new = dict(namespace, status=dict(namespace.get("status") or {}, conditions=conditions))
                self.store.controller_update(ns_type, namespace, new, "status")
            return
        spec = namespace.get("spec") or {}
        if NS_FINALIZER in (spec.get("finalizers") or []):
            new = dict(namespace, spec=dict(spec, finalizers=[f for f in spec["finalizers"] if f != NS_FINALIZER]))
            self.store.controller_update(ns_type, namespace, new, "finalize")

    # -- CRDs -----------------------------------------------------------------------------------------------------

    def _establish(self, key: tuple[str, str]) -> None:
        crd_type = self.store.types[CRD_KEY]
        obj = self.store.objects[("apiextensions.k8s.io", "customresourcedefinitions")].get(("", key[1]))
        if obj is None or established(obj) or obj["metadata"].get("deletionTimestamp"):
            return
        new = dict(obj, status=established_status(obj, now()))
        self.store.controller_update(crd_type, obj, new, "status", manager="kube-apiserver")

    def _crd_cleanup(self, key: Key) -> None:
        crd_type = self.store.types[CRD_KEY]
        obj = self._lookup(key)
        if obj is None:
            return
        spec = obj.get("spec") or {}
        group, plural = str(spec.get("group", "")), str((spec.get("names") or {}).get("plural", ""))
        if not obj["metadata"].get("deletionTimestamp"):
            return
        rt = next((t for t in self.store.types.values() if t.group == group and t.plural == plural), None)
        left = 0
        if rt is not None:
            for (ns, name), cr in list(self.store.objects.get((group, plural), {}).items()):
                if (
                    not cr["metadata"].get("deletionTimestamp")
                    and self.store.delete(rt, ns, name, {}, WriteOptions(CONTROLLER_MANAGER))[1]
                ):
                    continue
                left += 1
        if left:
            return
        obj = self._lookup(key)
        if obj is None:
            return
        new = dict(obj)
        new["metadata"] = dict(
            obj["metadata"], finalizers=[f for f in obj["metadata"].get("finalizers") or [] if f != CRD_CLEANUP]
        )
        self._terminating_crds.pop((group, plural), None)
        self.store.controller_update(crd_type, obj, new, None, manager="kube-apiserver")


def _conditions(namespace: JSON, remaining: Counter[str], finalizers: Counter[str]) -> list[JSON]:
    stamp = now()
    previous = {c.get("type"): c for c in (namespace.get("status") or {}).get("conditions") or []}

    def cond(kind: str, status: str, reason: str, message: str) -> JSON:
        old = previous.get(kind)
        since = old["lastTransitionTime"] if old and old.get("status") == status else stamp
        return {"type": kind, "status": status, "lastTransitionTime": since, "reason": reason, "message": message}

    out = [
        cond(
            "NamespaceDeletionDiscoveryFailure", "False", "ResourcesDiscovered", "All resources successfully discovered"
        ),
        cond(
            "NamespaceDeletionGroupVersionParsingFailure",
            "False",
            "ParsedGroupVersions",
            "All legacy kube types successfully parsed",
        ),
        cond(
            "NamespaceDeletionContentFailure",
            "False",
            "ContentDeleted",
            "All content successfully deleted, may be waiting on finalization",
        ),
    ]
    if remaining:
        text = ", ".join(f"{r} has {n} resource instances" for r, n in sorted(remaining.items()))
        out.append(
            cond("NamespaceContentRemaining", "True", "SomeResourcesRemain", f"Some resources are remaining: {text}")
        )
    else:
        out.append(cond("NamespaceContentRemaining", "False", "ContentRemoved", "All content successfully removed"))
    if finalizers:
        text = ", ".join(f"{f} in {n} resource instances" for f, n in sorted(finalizers.items()))
        out.append(
            cond(
                "NamespaceFinalizersRemaining",
                "True",
                "SomeFinalizersRemain",
                f"Some content in the namespace has finalizers remaining: {text}",
            )
        )
    else:
        out.append(
            cond(
                "NamespaceFinalizersRemaining",
                "False",
                "ContentHasNoFinalizers",
                "All content-preserving finalizers finished",
            )
        )
    return out
