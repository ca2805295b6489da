"""PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902), and strategic merge patch.

Strategic merge patch is applied as a merge patch (true for custom resources on the real server, which
refuses it there with 415; we accept it because kubectl apply uses it for built-in kinds such as CRDs):
its ``$``-directives are dropped, except ``$deleteFromPrimitiveList`` and ``$patch: delete``.
"""

from __future__ import annotations

import copy
from typing import Any

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"


class PatchError(ValueError):
    """An unusable patch (the server answers 422 or 400)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, without mutating ``target`` (unchanged subtrees are shared, never copied)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result: dict[str, Any] = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Merge patch semantics plus the two directives kubectl relies on; other directives are ignored."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "delete":
        return None
    result: dict[str, Any] = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            if isinstance(result.get(name), list) and isinstance(value, list):
                result[name] = [x for x in result[name] if x not in value]
            continue
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        else:
            merged = strategic_merge_patch(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer: {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        if isinstance(doc, dict):
            if part not in doc:
                raise PatchError(f"path not found: {part!r}")
            doc = doc[part]
        elif isinstance(doc, list):
            try:
                doc = doc[int(part)]
            except (ValueError, IndexError) as exc:
                raise PatchError(f"invalid array index: {part!r}") from exc
        else:
            raise PatchError(f"cannot traverse into {part!r}")
    return doc


def _add(doc: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    parent = _walk(doc, parts[:-1])
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        else:
            try:
                index = int(last)
            except ValueError as exc:
                raise PatchError(f"invalid array index: {last!r}") from exc
            if not 0 <= index <= len(parent):
                raise PatchError(f"array index out of range: {index}")
            parent.insert(index, value)
    else:
        raise PatchError("cannot add to a scalar")
    return doc


def _remove(doc: Any, parts: list[str]) -> Any:
    if not parts:
        raise PatchError("cannot remove the whole document")
    parent = _walk(doc, parts[:-1])
    last = parts[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"unable to remove nonexistent key: {last}")
        return parent.pop(last)
    if isinstance(parent, list):
        try:
            return parent.pop(int(last))
        except (ValueError, IndexError) as exc:
            raise PatchError(f"invalid array index: {last!r}") from exc
    raise PatchError("cannot remove from a scalar")


def json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902 on a deep copy of ``target``."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"invalid operation: {op!r}")
        parts = _pointer(str(op["path"]))
        kind = op["op"]
        if kind == "add":
            doc = _add(doc, parts, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            _remove(doc, parts)
        elif kind == "replace":
            _walk(doc, parts)
            if not parts:
                doc = copy.deepcopy(op.get("value"))
            else:
                _remove(doc, parts)
                doc = _add(doc, parts, copy.deepcopy(op.get("value")))
        elif kind in ("move", "copy"):
            source = _pointer(str(op.get("from", "")))
            value = _remove(doc, source) if kind == "move" else copy.deepcopy(_walk(doc, source))
            doc = _add(doc, parts, value)
        elif kind == "test":
            if _walk(doc, parts) != op.get("value"):
                raise PatchError(f"testing value {op['path']} failed")
        else:
            raise PatchError(f"unknown operation: {kind!r}")
    return doc
