"""Field ownership (``metadata.managedFields``) and server-side apply, kept proportionate.

Every write records which manager set which fields, in the real format (``FieldsV1`` tries such as
``{"f:spec": {".": {}, "f:size": {}}}``): a create or an update gives its manager the fields it set or changed
and takes them away from the other managers; a removed field belongs to nobody. Server-side apply
(``application/apply-patch+yaml``) merges the applied configuration into the object, removes the fields its
manager applied before and no longer applies (unless another manager owns them), and refuses, with 409 and
one ``FieldManagerConflict`` cause per field, to change a field another manager owns, unless ``force=true``.

Simplifications, none of which a client of this project can observe: every list is atomic (the real server
merges ``set`` and ``map`` lists item by item), and a write's ownership is computed from a diff of the stored
objects, which is cheap because unchanged subtrees are shared between versions (an identity check skips them).
The store keeps each entry's ``fieldsV1`` trie beside the object rather than in it: the entries an object shows
have manager, operation, apiVersion, time (and subresource) but no ``fieldsV1``, which would double the size of
every object a list or a watch encodes, for something no client of this project reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from controller.apiserver.errors import ApiError
from controller.apiserver.gojson import quote

JSON = dict[str, Any]
Trie = dict[str, Any]

_META_FIELDS = ("labels", "annotations", "finalizers", "ownerReferences")
_SKIP = ("apiVersion", "kind", "metadata")


def project(obj: JSON, status: bool | None) -> JSON:
    """The part of an object field ownership covers: ``status`` only (status subresource, ``status=True``),
    everything but ``status`` (``False``, main resource of a kind with a status subresource), or all (``None``)."""
    if status:
        return {"status": obj["status"]} if "status" in obj else {}
    out: JSON = {k: v for k, v in obj.items() if k not in _SKIP and not (status is False and k == "status")}
    meta = obj.get("metadata") or {}
    picked = {k: meta[k] for k in _META_FIELDS if k in meta}
    if picked:
        out["metadata"] = picked
    return out


def fields_of(value: Any) -> Trie:
    if isinstance(value, dict):
        out: Trie = {".": {}}
        for k, v in value.items():
            out["f:" + k] = fields_of(v)
        return out
    return {}


def owned(part: JSON) -> Trie:
    """The fields of a projection: no ``.`` for the object itself or its metadata, as the real tries."""
    out: Trie = {}
    for k, v in part.items():
        if k == "metadata":
            out["f:metadata"] = {"f:" + mk: fields_of(mv) for mk, mv in v.items()}
        else:
            out["f:" + k] = fields_of(v)
    return out


def _diff(old: JSON, new: JSON) -> tuple[Trie, Trie]:
    changed: Trie = {}
    removed: Trie = {}
    for k, v in new.items():
        key = "f:" + k
        if k not in old:
            changed[key] = fields_of(v)
            continue
        ov = old[k]
        if ov is v:
            continue
        if isinstance(v, dict) and isinstance(ov, dict):
            c, r = _diff(ov, v)
            if c:
                changed[key] = c
            if r:
                removed[key] = r
        elif ov != v:
            changed[key] = fields_of(v)
            if isinstance(ov, dict):
                removed[key] = fields_of(ov)
    for k, ov in old.items():
        if k not in new:
            removed["f:" + k] = fields_of(ov)
    return changed, removed


def diff(old: JSON, new: JSON) -> tuple[Trie, Trie]:
    """(fields set or changed by going from projection ``old`` to ``new``, fields removed)."""
    changed, removed = _diff(
        {k: v for k, v in old.items() if k != "metadata"}, {k: v for k, v in new.items() if k != "metadata"}
    )
    om, nm = old.get("metadata") or {}, new.get("metadata") or {}
    if om or nm:
        c, r = _diff(om, nm)
        if c:
            changed["f:metadata"] = c
        if r:
            removed["f:metadata"] = r
    return changed, removed


def union(a: Trie, b: Trie) -> Trie:
    out = dict(a)
    for k, v in b.items():
        if k in out and out[k] and v:
            out[k] = union(out[k], v)
        elif k not in out or not out[k]:
            out[k] = v
    return out


def subtract(a: Trie, b: Trie) -> Trie:
    """``a`` without the fields of ``b`` (a leaf of ``b`` takes the whole field)."""
    out: Trie = {}
    for k, v in a.items():
        if k not in b:
            out[k] = v
        elif b[k] and v:
            rest = subtract(v, b[k])
            if rest:
                out[k] = rest
    return out


def leaves(trie: Trie, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for k, v in trie.items():
        if k == ".":
            continue
        path = (*prefix, k[2:])
        if v and set(v) != {"."}:
            yield from leaves(v, path)
        else:
            yield path


def owns(trie: Trie, path: tuple[str, ...]) -> bool:
    node: Any = trie
    for part in path:
        if not isinstance(node, dict) or "f:" + part not in node:
            return False
        node = node["f:" + part]
        if not node:
            return True  # owned as a whole
    return True


def entry_key(e: JSON) -> tuple[str, str, str]:
    return str(e.get("manager", "")), str(e.get("operation", "")), str(e.get("subresource", ""))


def record(
    entries: list[JSON] | None,
    manager: str,
    operation: str,
    subresource: str,
    api_version: str,
    changed: Trie,
    removed: Trie,
    now: str,
) -> list[JSON]:
    """Entries after a write by ``manager`` that set ``changed`` and removed ``removed``."""
    out: list[JSON] = []
    mine = (manager, operation, subresource)
    found = False
    for e in entries or []:
        fields = e.get("fieldsV1") or {}
        if entry_key(e) == mine:
            found = True
            new_fields = subtract(union(fields, changed), removed)
            if new_fields != fields:
                e = dict(e, fieldsV1=new_fields, time=now, apiVersion=api_version)
            if new_fields:
                out.append(e)
            continue
        new_fields = subtract(subtract(fields, changed), removed) if (changed or removed) else fields
        if new_fields is not fields and new_fields != fields:
            e = dict(e, fieldsV1=new_fields)
        if new_fields:
            out.append(e)
    if not found:
        fields = subtract(changed, removed)
        if fields:
            entry: JSON = {
                "manager": manager,
                "operation": operation,
                "apiVersion": api_version,
                "time": now,
                "fieldsType": "FieldsV1",
                "fieldsV1": fields,
            }
            if subresource:
                entry["subresource"] = subresource
            out.append(entry)
    return out


def record_kept(
    shown: list[JSON],
    tries: dict[Any, Trie],
    manager: str,
    operation: str,
    subresource: str,
    api_version: str,
    changed: Trie,
    removed: Trie,
    now: str,
) -> tuple[list[JSON], dict[Any, Trie]]:
    """:func:`record` on entries as the store keeps them (shown without fieldsV1, the tries beside them by
    :func:`entry_key`), without building the full entries: the update path of every write."""
    out: list[JSON] = []
    out_tries: dict[Any, Trie] = {}
    mine = (manager, operation, subresource)
    found = False
    for e in shown:
        key = entry_key(e)
        fields = tries.get(key, {})
        if key == mine:
            found = True
            new_fields = subtract(union(fields, changed), removed)
            if new_fields != fields:
                e = dict(e, time=now, apiVersion=api_version)
        else:
            new_fields = subtract(subtract(fields, changed), removed) if (changed or removed) else fields
        if new_fields:
            out.append(e)
            out_tries[key] = new_fields
    if not found:
        fields = subtract(changed, removed)
        if fields:
            entry: JSON = {"manager": manager, "operation": operation, "apiVersion": api_version, "time": now}
            if subresource:
                entry["subresource"] = subresource
            out.append(entry)
            out_tries[mine] = fields
    return out, out_tries


def _describe(e: JSON) -> str:
    text = quote(str(e.get("manager", "")))
    if e.get("subresource"):
        text += f" with subresource {quote(str(e['subresource']))}"
    if e.get("operation") == "Update":
        text += f" using {e.get('apiVersion', '')}"
        if e.get("time"):
            text += f" at {e['time']}"
    return text


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(obj, dict) or part not in obj:
            return _MISSING
        obj = obj[part]
    return obj


def _delete(obj: JSON, path: tuple[str, ...]) -> None:
    node: Any = obj
    for part in path[:-1]:
        if not isinstance(node, dict) or part not in node:
            return
        node = node[part]
    if isinstance(node, dict):
        node.pop(path[-1], None)


_MISSING = object()


def merge(base: Any, config: Any) -> Any:
    """Apply's merge: maps merge key by key, everything else (lists included) is replaced."""
    if isinstance(base, dict) and isinstance(config, dict):
        out = dict(base)
        for k, v in config.items():
            out[k] = merge(base.get(k), v) if k in base else v
        return out
    return config


def _copy_dicts(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy_dicts(v) for k, v in value.items()}
    return value


def apply(
    live: JSON,
    config: JSON,
    entries: list[JSON] | None,
    manager: str,
    subresource: str,
    status: bool | None,
    force: bool,
    api_version: str,
    now: str,
) -> tuple[JSON, list[JSON]]:
    """Server-side apply of ``config`` by ``manager`` onto ``live`` (``{}`` for a create): the merged object and
    the new entries; :class:`ApiError` 409 on conflicts."""
    cfg = project(config, status)
    applied = owned(cfg)
    live_part = project(live, status) if live else {}
    conflicts: list[tuple[JSON, tuple[str, ...]]] = []
    mine = (manager, "Apply", subresource)
    for path in leaves(applied):
        have = _get(live_part, path)
        if have is _MISSING or have == _get(cfg, path):
            continue
        for e in entries or []:
            if entry_key(e) != mine and owns(e.get("fieldsV1") or {}, path):
                conflicts.append((e, path))
    if conflicts and not force:
        raise conflict_error(conflicts)
    merged = _copy_dicts(live) if live else {}
    previous = next((e.get("fieldsV1") or {} for e in entries or [] if entry_key(e) == mine), {})
    applied_leaves = set(leaves(applied))
    for path in leaves(previous):
        if path in applied_leaves or any(
            entry_key(e) != mine and owns(e.get("fieldsV1") or {}, path) for e in entries or []
        ):
            continue
        _delete(merged, path)
    for key, value in cfg.items():
        if key == "metadata":
            meta = merged.setdefault("metadata", {})
            for mk, mv in value.items():
                meta[mk] = merge(meta.get(mk), mv) if mk in meta else mv
        else:
            merged[key] = merge(merged.get(key), value) if key in merged else value
    out: list[JSON] = []
    taken: Trie = {}
    for _, path in conflicts:
        node = taken
        for part in path[:-1]:
            node = node.setdefault("f:" + part, {})
        node["f:" + path[-1]] = {}
    found = False
    for e in entries or []:
        if entry_key(e) == mine:
            found = True
            e = dict(e, fieldsV1=applied, time=now, apiVersion=api_version)
            out.append(e)
            continue
        fields = e.get("fieldsV1") or {}
        if taken:
            fields = subtract(fields, taken)
            e = dict(e, fieldsV1=fields)
        if fields:
            out.append(e)
    if not found:
        entry: JSON = {
            "manager": manager,
            "operation": "Apply",
            "apiVersion": api_version,
            "time": now,
            "fieldsType": "FieldsV1",
            "fieldsV1": applied,
        }
        if subresource:
            entry["subresource"] = subresource
        out.append(entry)
    return merged, out


def conflict_error(conflicts: list[tuple[JSON, tuple[str, ...]]]) -> ApiError:
    causes = [
        {"reason": "FieldManagerConflict", "message": f"conflict with {_describe(e)}", "field": "." + ".".join(p)}
        for e, p in conflicts
    ]
    if len(conflicts) == 1:
        e, p = conflicts[0]
        message = f"Apply failed with 1 conflict: conflict with {_describe(e)}: .{'.'.join(p)}"
    else:
        by: dict[str, list[str]] = {}
        for e, p in conflicts:
            by.setdefault(json.dumps(entry_key(e)), []).append("." + ".".join(p))
        lines: list[str] = []
        described = {json.dumps(entry_key(e)): _describe(e) for e, _ in conflicts}
        for key in sorted(by):
            lines.append(f"conflicts with {described[key]}:")
            lines += [f"- {p}" for p in by[key]]
        message = f"Apply failed with {len(conflicts)} conflicts: " + "\n".join(lines)
    return ApiError(409, "Conflict", message, {"causes": causes})
