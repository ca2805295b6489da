"""Replay the recorded kube-apiserver transcript against the embedded API and list every difference.

``corpus/transcript.json`` (vendored from ``../shared/real-apiserver``; see ``corpus/README.md``) holds how a
real kube-apiserver v1.36.2 answered 254 probes. :func:`replay` runs every probe against a running embedded
API server, one fresh namespace per probe as the recording did, and returns a :class:`Report` of
:class:`Diff` s, which ``test_corpus.py`` holds against the explicit exception list ``corpus/exceptions.yaml``.

How a recorded request is replayed
    The recorded requests carry run-specific values taken from earlier responses (uids, resourceVersions,
    generated names, continue tokens). Each recorded response is walked alongside the double's response at
    the same step and every such value is mapped (recorded -> double); later requests are rewritten through
    the map. Object uids and resourceVersions must map one to one: a no-op write that kept its
    resourceVersion on the real server must keep it on the double too (``identity`` differences). The run
    token of the recording is reused, so namespace names are the recorded ones.

How responses are compared (``corpus/README.md``, "Comparing a double against it")
    The recorded *normalized* copy is a template: ``<ns>``, ``<run>``, ``<uid>``, ``<rv>``, ``<time>``,
    ``<gen>``, ``<continue>``, ``<age>`` and ``<server>`` match the double's values of that shape; every
    other string, number (with its JSON type), key and list length must be equal. ``managedFields`` are
    compared as sorted ``manager:operation[:subresource]`` strings, like the normalization. Exceptions to
    exact equality, each for a stated reason:

    - ``details.causes`` and the ``[...]`` list of a 422 message are compared in sorted order: the real
      server reports errors of sibling fields (and of labels) in Go map order, which varies between runs.
    - Discovery documents: the double serves a subset of the built-in resources (namespaces, configmaps,
      events, leases, customresourcedefinitions), so every group and resource it lists must equal the
      recorded entry, and the recorded entries of CRD-defined groups must all be there; CRD resources of a
      group are compared by name (the real order comes from a cache, not from the definitions).
    - Watches: the sequence of event types (a run of BOOKMARKs counts once), each event's recorded summary
      (kind, name, labels, annotations, finalizers, deletionTimestamp, generation, status; ERROR code,
      reason and message) and ``closedByServer``; triggers are compared like requests.
    - Polls: ``conditionMet``, then the last response. The double's controllers act within a second (its
      namespace controller 2 s after a namespace's deletion, :data:`REPLAY_SERVER`), so
      polls retry every 0.1 s for at most :data:`POLL_LIMIT` seconds, and recorded sleeps are capped at
      :data:`SLEEP_CAP` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHARED_DIR = ROOT.parent / "shared" / "real-apiserver"
VENDORED_DIR = HERE / "corpus"
USER_AGENT = "probe-corpus/1.0"
CRD_BASE = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"

POLL_LIMIT = 10.0  # seconds a poll retries (the double's controllers act within about a second)
POLL_EVERY = 0.1
SLEEP_CAP = 3.0  # recorded sleeps waited for the real controllers; the double's need less (REPLAY_SERVER)
TRIGGER_DELAY = 0.5  # seconds after a watch opens before its triggers run (as recorded)
CONCURRENCY = 48

JSON = dict[str, Any]


def transcript_path() -> Path:
    """The shared transcript when the repository sits next to ``../shared``, else the vendored copy."""
    shared = SHARED_DIR / "transcript.json"
    return shared if shared.exists() else VENDORED_DIR / "transcript.json"


def load_transcript(path: Path | None = None) -> JSON:
    data: JSON = json.loads((path or transcript_path()).read_text())
    return data


# -- differences ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Diff:
    """One difference: ``field`` is a dotted path such as ``status``, ``body.message``, ``events``."""

    probe: str
    step: str
    field: str
    recorded: Any
    got: Any

    def __str__(self) -> str:
        def short(value: Any) -> str:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
            return text if len(text) <= 400 else text[:400] + "..."

        return f"{self.probe} [{self.step}] {self.field}: recorded {short(self.recorded)} | got {short(self.got)}"


@dataclass
class Report:
    diffs: list[Diff] = field(default_factory=list)
    seconds: float = 0.0
    probe_seconds: dict[str, float] = field(default_factory=dict)

    def for_probe(self, probe: str) -> list[Diff]:
        return [d for d in self.diffs if d.probe == probe]


# -- templates: the normalized transcript's placeholders ------------------------------------------------------

_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_TIME = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:\d{2})"
_PLACEHOLDERS = {
    "<server>:6443": r"[^\s]+",
    "<uid>": _UUID,
    "<rv>": r"\d+",
    "<time>": _TIME,
    "<gen>": r"[a-z0-9]{5}",
    "<continue>": r"[A-Za-z0-9_=\-]+",
    "<age>": r"(?:\d+[smhdy])+|<invalid>",
}
_PLACEHOLDER_RE = re.compile("|".join(re.escape(p) for p in [*_PLACEHOLDERS, "<ns>", "<run>"]))


@lru_cache(maxsize=8192)
def _template(text: str, ns: str, run: str) -> re.Pattern[str]:
    parts: list[str] = []
    pos = 0
    for m in _PLACEHOLDER_RE.finditer(text):
        parts.append(re.escape(text[pos : m.start()]))
        token = m.group(0)
        if token == "<ns>":
            parts.append(re.escape(ns))
        elif token == "<run>":
            parts.append(re.escape(run))
        else:
            parts.append(_PLACEHOLDERS[token])
        pos = m.end()
    parts.append(re.escape(text[pos:]))
    return re.compile("".join(parts), re.DOTALL)


def matches(recorded: str, got: str, ns: str, run: str) -> bool:
    if "<" not in recorded:
        return recorded == got
    return _template(recorded, ns, run).fullmatch(got) is not None


def managers(entries: Any) -> Any:
    """``metadata.managedFields`` as the normalization reduces it: sorted ``manager:operation[:subresource]``."""
    if not isinstance(entries, list):
        return entries
    out = []
    for e in entries:
        if not isinstance(e, dict):
            return entries
        text = f"{e.get('manager', '')}:{e.get('operation', '')}"
        if e.get("subresource"):
            text += f":{e['subresource']}"
        out.append(text)
    return sorted(out)


# -- identities: recorded run-specific values and the double's --------------------------------------------------


class Ids:
    """Recorded value -> the double's value at the same place; object uids and resourceVersions are one to one."""

    def __init__(self) -> None:
        self.forward: dict[str, str] = {}
        self.strict_back: dict[str, str] = {}
        self.names: dict[str, str] = {}  # the double's generated names -> the recorded ones

    def pair_name(self, recorded: str, got: str) -> None:
        self.pair(recorded, got, False)
        self.names[got] = recorded

    def unmap(self, got: str) -> str:
        """A string of the double's with its generated names replaced by the recorded ones."""
        for name, recorded in self.names.items():
            if name in got:
                got = got.replace(name, recorded)
        return got

    def pair(self, recorded: str, got: str, strict: bool) -> str | None:
        """Record the pair; a description of the inconsistency when a strict pair contradicts an earlier one."""
        known = self.forward.get(recorded)
        if strict:
            back = self.strict_back.get(got)
            if back is not None and back != recorded:
                return f"the double reused {got} for two recorded values ({back} and {recorded})"
            if known is not None and known != got and recorded in self.strict_back.values():
                return f"recorded {recorded} was answered as both {known} and {got}"
            self.strict_back[got] = recorded
            self.forward[recorded] = got
        elif known is None:
            self.forward[recorded] = got
        return None

    def sub(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.forward.get(value, value)
        if isinstance(value, list):
            return [self.sub(v) for v in value]
        if isinstance(value, dict):
            return {k: self.sub(v) for k, v in value.items()}
        return value


def _is_list_body(body: JSON) -> bool:
    kind = body.get("kind")
    return "items" in body or (isinstance(kind, str) and (kind.endswith("List") or kind == "Table"))


def pair_ids(recorded: Any, got: Any, ids: Ids, strict: bool = True, parent: str = "") -> list[str]:
    """Walk a recorded raw body and the double's body together; map uids, resourceVersions, generated names and
    continue tokens. Returns identity inconsistencies."""
    problems: list[str] = []
    if isinstance(recorded, list) and isinstance(got, list):
        for r, g in zip(recorded, got, strict=False):
            problems += pair_ids(r, g, ids, strict, parent)
        return problems
    if not (isinstance(recorded, dict) and isinstance(got, dict)):
        return problems
    if recorded.get("kind") in ("APIGroupList", "APIGroupDiscoveryList", "APIResourceList"):
        return problems  # no run-specific values, and entries are not in the same order
    list_like = _is_list_body(recorded)
    for key, rval in recorded.items():
        gval = got.get(key)
        if key == "metadata" and isinstance(rval, dict) and isinstance(gval, dict):
            for mkey in ("uid", "resourceVersion"):
                r, g = rval.get(mkey), gval.get(mkey)
                if isinstance(r, str) and isinstance(g, str) and r:
                    problem = ids.pair(r, g, strict and not list_like)
                    if problem:
                        problems.append(f"metadata.{mkey}: {problem}")
            r, g = rval.get("name"), gval.get("name")
            if isinstance(r, str) and isinstance(g, str) and r and r != g:
                ids.pair_name(r, g)
            r, g = rval.get("continue"), gval.get("continue")
            if isinstance(r, str) and isinstance(g, str) and r and r != g:
                ids.pair(r, g, False)
            for mkey, sub in rval.items():
                if mkey not in ("uid", "resourceVersion", "name", "continue"):
                    problems += pair_ids(sub, gval.get(mkey), ids, strict, mkey)
        elif key == "uid" and isinstance(rval, str) and isinstance(gval, str):
            problem = ids.pair(rval, gval, strict)
            if problem:
                problems.append(f"uid: {problem}")
        elif key == "name" and parent == "details" and isinstance(rval, str) and isinstance(gval, str) and rval != gval:
            ids.pair_name(rval, gval)
        else:
            problems += pair_ids(rval, gval, ids, strict and not list_like, key)
    return problems


# -- comparison -------------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    probe: str
    step: str
    ns: str
    run: str
    diffs: list[Diff]
    ids: Ids | None = None

    def diff(self, path: str, recorded: Any, got: Any) -> None:
        self.diffs.append(Diff(self.probe, self.step, path, recorded, got))


_MISSING = object()


def compare(recorded: Any, got: Any, path: str, ctx: Ctx) -> None:
    """Deep comparison of a normalized recorded value (a template) with the double's value."""
    if isinstance(recorded, str):
        if not isinstance(got, str) or not matches(recorded, ctx.ids.unmap(got) if ctx.ids else got, ctx.ns, ctx.run):
            ctx.diff(path, recorded, got)
        return
    if isinstance(recorded, bool) or recorded is None:
        if got is not recorded:
            ctx.diff(path, recorded, got)
        return
    if isinstance(recorded, int | float):
        if type(got) is not type(recorded) or got != recorded:
            ctx.diff(path, recorded, got)
        return
    if isinstance(recorded, list):
        if not isinstance(got, list) or len(got) != len(recorded):
            ctx.diff(path, recorded, got)
            return
        for i, (r, g) in enumerate(zip(recorded, got, strict=True)):
            compare(r, g, f"{path}[{i}]", ctx)
        return
    if isinstance(recorded, dict):
        if not isinstance(got, dict):
            ctx.diff(path, recorded, got)
            return
        for key in recorded:
            if key not in got:
                ctx.diff(f"{path}.{key}", recorded[key], "<absent>")
        for key in got:
            if key not in recorded:
                ctx.diff(f"{path}.{key}", "<absent>", got[key])
        for key, rval in recorded.items():
            if key not in got:
                continue
            gval = got[key]
            if key == "managedFields" and path.endswith("metadata"):
                compare(rval, managers(gval), f"{path}.{key}", ctx)
            else:
                compare(rval, gval, f"{path}.{key}", ctx)
        return
    ctx.diff(path, recorded, got)


def _cause_text(cause: JSON) -> str:
    fld = cause.get("field")
    return f"{fld}: {cause.get('message', '')}" if fld else str(cause.get("message", ""))


def canonical_status(body: Any) -> Any:
    """A Status with ``details.causes``: causes sorted, and its message's ``[a, b]`` error list sorted (the real
    server lists sibling fields' errors in Go map order)."""
    if not (isinstance(body, dict) and body.get("kind") == "Status"):
        return body
    details = body.get("details")
    if not isinstance(details, dict) or not isinstance(details.get("causes"), list):
        return body
    causes = details["causes"]
    out = dict(body)
    out["details"] = dict(details, causes=sorted(causes, key=lambda c: json.dumps(c, sort_keys=True)))
    message = body.get("message")
    if isinstance(message, str):
        items: list[str] = []
        for c in causes:
            text = _cause_text(c)
            if text not in items:
                items.append(text)
        joined = "[" + ", ".join(items) + "]"
        if len(items) > 1 and message.endswith(joined):
            out["message"] = message[: -len(joined)] + "[" + ", ".join(sorted(items)) + "]"
    return out


CORE_RESOURCES = {"namespaces", "configmaps", "events", "leases", "customresourcedefinitions"}
BUILTIN_GROUPS = {"", "events.k8s.io", "coordination.k8s.io", "apiextensions.k8s.io"}


def _by_name(items: list[Any], key: str) -> dict[str, Any]:
    return {str(i.get(key)): i for i in items if isinstance(i, dict)}


def compare_resource_list(recorded: JSON, got: JSON, path: str, ctx: Ctx, crd_group: bool) -> None:
    """APIResourceList (or an aggregated discovery version): the double's resources are a subset for built-in
    groups, all of them for CRD groups; each must equal the recorded entry."""
    key = "name" if "resources" in recorded and "groupVersion" in recorded else "resource"
    rec = _by_name(recorded.get("resources") or [], key)
    gotr = _by_name(got.get("resources") or [], key)
    for name, entry in gotr.items():
        if name not in rec:
            ctx.diff(f"{path}.resources[{name}]", "<absent>", entry)
        else:
            compare(rec[name], entry, f"{path}.resources[{name}]", ctx)
    for name, entry in rec.items():
        base = name.split("/")[0]
        if name not in gotr and (crd_group or base in CORE_RESOURCES):
            ctx.diff(f"{path}.resources[{name}]", entry, "<absent>")
    rest_r = {k: v for k, v in recorded.items() if k != "resources"}
    rest_g = {k: v for k, v in got.items() if k != "resources"}
    compare(rest_r, rest_g, path, ctx)


def compare_group_list(recorded: JSON, got: JSON, path: str, ctx: Ctx, crd_groups: set[str]) -> None:
    """APIGroupList or APIGroupDiscoveryList: the double's groups, in the recorded relative order, each equal."""
    items_key = "groups" if "groups" in recorded else "items"
    rec_items = recorded.get(items_key) or []
    got_items = got.get(items_key) or []

    def gname(item: JSON) -> str:
        return str(item.get("name") if items_key == "groups" else (item.get("metadata") or {}).get("name"))

    rec_names = [gname(i) for i in rec_items]
    got_names = [gname(i) for i in got_items]
    order = [n for n in rec_names if n in got_names]
    if [n for n in got_names if n in rec_names] != order:
        ctx.diff(f"{path}.{items_key}(order)", order, got_names)
    for name in BUILTIN_GROUPS | crd_groups:
        if name and name in rec_names and name not in got_names:
            ctx.diff(f"{path}.{items_key}[{name}]", "<present>", "<absent>")
    rec_by = {gname(i): i for i in rec_items}
    for item in got_items:
        name = gname(item)
        if name not in rec_by:
            ctx.diff(f"{path}.{items_key}[{name}]", "<absent>", item)
            continue
        if items_key == "groups":
            compare(rec_by[name], item, f"{path}.{items_key}[{name}]", ctx)
            continue
        rec_item = rec_by[name]
        compare(rec_item.get("metadata"), item.get("metadata"), f"{path}.items[{name}].metadata", ctx)
        rec_versions = {v.get("version"): v for v in rec_item.get("versions") or []}
        got_versions = {v.get("version"): v for v in item.get("versions") or []}
        if list(rec_versions) != list(got_versions):
            ctx.diff(f"{path}.items[{name}].versions", list(rec_versions), list(got_versions))
        for version, gv in got_versions.items():
            if version in rec_versions:
                compare_resource_list(
                    rec_versions[version], gv, f"{path}.items[{name}].versions[{version}]", ctx, name in crd_groups
                )
    compare(
        {k: v for k, v in recorded.items() if k != items_key},
        {k: v for k, v in got.items() if k != items_key},
        path,
        ctx,
    )


def compare_openapi_root(recorded_text: str, got_text: str, path: str, ctx: Ctx) -> None:
    try:
        rec = json.loads(recorded_text)
        got = json.loads(got_text)
    except ValueError:
        ctx.diff(path, recorded_text[:200], got_text[:200])
        return
    rec_paths = set((rec.get("paths") or {}).keys())
    for key, value in (got.get("paths") or {}).items():
        if key not in rec_paths:
            ctx.diff(f"{path}.paths[{key}]", "<absent>", value)
        elif not str(value.get("serverRelativeURL", "")).startswith(f"/openapi/v3/{key}?hash="):
            ctx.diff(f"{path}.paths[{key}]", "serverRelativeURL with a hash", value)


def compare_yaml(recorded_text: str, got_text: str, raw_text: str, path: str, ctx: Ctx, ids: Ids) -> None:
    try:
        rec = yaml.safe_load(recorded_text)
        raw = yaml.safe_load(raw_text)
        got = yaml.safe_load(got_text)
    except yaml.YAMLError:
        ctx.diff(path, recorded_text[:200], got_text[:200])
        return
    if isinstance(rec, dict) and isinstance(got, dict) and isinstance(raw, dict):
        rmeta, gmeta, wmeta = rec.get("metadata") or {}, got.get("metadata") or {}, raw.get("metadata") or {}
        rv = wmeta.get("resourceVersion")
        if isinstance(rv, str) and ids.forward.get(rv) != gmeta.get("resourceVersion"):
            ctx.diff(f"{path}.metadata.resourceVersion", rv, gmeta.get("resourceVersion"))
        rmeta.pop("resourceVersion", None)
        gmeta = dict(gmeta)
        gmeta.pop("resourceVersion", None)
        if "managedFields" in rmeta:
            rmeta["managedFields"] = managers(rmeta["managedFields"])
        got = dict(got, metadata=gmeta)
    compare(rec, got, path, ctx)


def compare_body(recorded: Any, raw: Any, got_bytes: bytes, got_type: str, ctx: Ctx, ids: Ids, req_path: str) -> Any:
    """Compare a response body; returns the double's parsed body (or None)."""
    text = got_bytes.decode("utf-8", errors="replace")
    if isinstance(recorded, dict) and "_binary" in recorded:
        return None  # a protobuf body: only its status and content type are comparable
    if isinstance(recorded, dict) and "_text" in recorded:
        rec_text = str(recorded["_text"])
        if req_path.rstrip("/") == "/openapi/v3":
            compare_openapi_root(rec_text, text, "body", ctx)
        elif got_type.startswith("application/yaml"):
            compare_yaml(rec_text, text, str((raw or {}).get("_text", "")), "body", ctx, ids)
        elif not matches(rec_text, text, ctx.ns, ctx.run):
            ctx.diff("body", rec_text, text)
        return None
    try:
        got = json.loads(text) if text else None
    except ValueError:
        ctx.diff("body", recorded, text[:300])
        return None
    if isinstance(recorded, dict) and recorded.get("_truncated"):
        if not isinstance(got, dict):
            ctx.diff("body", recorded, got)
            return got
        compare(sorted(recorded.get("topLevelKeys") or []), sorted(got), "body.topLevelKeys", ctx)
        for key, value in recorded.items():
            if key in ("_truncated", "bytes", "topLevelKeys"):
                continue
            gval = got.get(key)
            if isinstance(gval, dict | list) and isinstance(value, int):
                gval = len(gval)
            compare(value, gval, f"body.{key}", ctx)
        return got
    if isinstance(recorded, dict) and isinstance(got, dict):
        kind = recorded.get("kind")
        if kind in ("APIGroupList", "APIGroupDiscoveryList"):
            crd_groups = {g for g in _crd_groups(recorded)}
            compare_group_list(recorded, got, "body", ctx, crd_groups)
            return got
        if kind == "APIResourceList":
            group = str(recorded.get("groupVersion", "")).rpartition("/")[0]
            compare_resource_list(recorded, got, "body", ctx, group not in BUILTIN_GROUPS)
            return got
    compare(canonical_status(recorded), canonical_status(got), "body", ctx)
    return got


def _crd_groups(doc: JSON) -> set[str]:
    names = [g.get("name") for g in doc.get("groups") or []] or [
        (i.get("metadata") or {}).get("name") for i in doc.get("items") or []
    ]
    return {str(n) for n in names if n and "." in str(n) and not str(n).endswith("k8s.io")}


# -- requests ---------------------------------------------------------------------------------------------------


@dataclass
class Got:
    status: int
    content_type: str
    warnings: list[str]
    body: bytes


def _content_type(method: str, req: JSON) -> str | None:
    headers = req.get("headers") or {}
    if "Content-Type" in headers:
        return str(headers["Content-Type"])
    if "body" not in req and "bodyRaw" not in req:
        return None
    return "application/merge-patch+json" if method == "PATCH" else "application/json"


def build_request(req: JSON, ids: Ids) -> tuple[str, str, dict[str, str], dict[str, str], bytes | None]:
    method = str(req["method"])
    path = "/".join(quote(str(ids.sub(seg)), safe=":@!$&'()*+,;=-._~") for seg in str(req["path"]).split("/"))
    query = {
        k: str(ids.sub(v)) if not isinstance(v, bool) else str(v).lower() for k, v in (req.get("query") or {}).items()
    }
    headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
    for k, v in (req.get("headers") or {}).items():
        headers[k] = str(v)
    data: bytes | None = None
    if "bodyRaw" in req:
        data = str(req["bodyRaw"]).encode()
    elif "body" in req:
        data = json.dumps(ids.sub(req["body"])).encode()
    ctype = _content_type(method, req)
    if ctype is not None:
        headers["Content-Type"] = ctype
    return method, path, query, headers, data


async def send(session: aiohttp.ClientSession, base: str, req: JSON, ids: Ids) -> Got:
    method, path, query, headers, data = build_request(req, ids)
    async with session.request(method, base + path, params=query, headers=headers, data=data) as resp:
        body = await resp.read()
        return Got(resp.status, resp.headers.get("Content-Type", ""), resp.headers.getall("Warning", []), body)


# -- the replay ---------------------------------------------------------------------------------------------------


@dataclass
class Probe:
    index: int
    id: str
    raw: list[JSON]
    normalized: list[JSON]
    depends_on_project_crds: bool


def probes(transcript: JSON) -> list[Probe]:
    return [
        Probe(p["index"], p["id"], p["steps"], p["normalized"]["steps"], bool(p["dependsOnProjectCRDs"]))
        for p in transcript["probes"]
    ]


def run_token(transcript: JSON) -> str:
    for p in transcript["probes"]:
        for s in p["steps"]:
            m = re.search(r"/namespaces/probe-([a-z0-9]+)-\d{3}/", str((s.get("request") or {}).get("path", "")))
            if m:
                return m.group(1)
    raise ValueError("no probe namespace in the transcript")


def global_setup_crds(transcript: JSON) -> list[JSON]:
    """The probes.corpus.test CRDs, rebuilt from the recorded create responses (spec as the server stored it)."""
    out = []
    for entry in transcript["globalSetup"]:
        body = entry["response"]["body"]
        out.append(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": body["metadata"]["name"]},
                "spec": body["spec"],
            }
        )
    return out


class Replayer:
    def __init__(self, base: str, transcript: JSON, session: aiohttp.ClientSession) -> None:
        self.base = base
        self.transcript = transcript
        self.session = session
        self.run = run_token(transcript)
        self.report = Report()

    # setup ------------------------------------------------------------------------------------------------

    async def setup(self, project_crds: list[JSON]) -> None:
        ctx = Ctx("globalSetup", "crd", "", self.run, self.report.diffs)
        for crd in project_crds:
            headers = {"User-Agent": "helm/v3", "Content-Type": "application/json", "Accept": "application/json"}
            async with self.session.post(self.base + CRD_BASE, data=json.dumps(crd), headers=headers) as resp:
                if resp.status != 201:
                    ctx.diff("project CRD " + crd["metadata"]["name"], 201, f"{resp.status} {await resp.text()}")
        norm = {g["crd"]: g["response"] for g in self.transcript["globalSetup"]}
        for crd in global_setup_crds(self.transcript):
            name = crd["metadata"]["name"]
            got = await send(self.session, self.base, {"method": "POST", "path": CRD_BASE, "body": crd}, Ids())
            step = Ctx("globalSetup", name, "", self.run, self.report.diffs)
            self._compare_response(norm[name], None, got, step, Ids(), CRD_BASE)
        names = [c["metadata"]["name"] for c in project_crds] + [
            c["metadata"]["name"] for c in global_setup_crds(self.transcript)
        ]
        deadline = time.monotonic() + 30
        for name in names:
            while True:
                async with self.session.get(f"{self.base}{CRD_BASE}/{name}") as resp:
                    crd = await resp.json() if resp.status == 200 else {}
                conditions = (crd.get("status") or {}).get("conditions") or []
                if any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions):
                    break
                if time.monotonic() > deadline:
                    ctx.diff(f"CRD {name} established", True, False)
                    break
                await asyncio.sleep(0.05)

    # probes -----------------------------------------------------------------------------------------------

    def namespace(self, probe: Probe) -> str:
        return f"probe-{self.run}-{probe.index:03d}"

    async def run_probe(self, probe: Probe) -> None:
        start = time.monotonic()
        ns = self.namespace(probe)
        body = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": ns, "labels": {"probe-corpus": "true", "probe-run": self.run}},
        }
        headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT}
        async with self.session.post(self.base + "/api/v1/namespaces", data=json.dumps(body), headers=headers) as resp:
            if resp.status != 201:
                self.report.diffs.append(Diff(probe.id, "namespace", "status", 201, resp.status))
                return
        ids = Ids()
        for raw, norm in zip(probe.raw, probe.normalized, strict=True):
            ctx = Ctx(probe.id, str(raw.get("label")), ns, self.run, self.report.diffs)
            try:
                if "sleep" in raw:
                    await asyncio.sleep(min(float(raw["sleep"]), SLEEP_CAP))
                elif "watchSeconds" in raw:
                    await self._watch(raw, norm, ctx, ids)
                elif "poll" in raw:
                    await self._poll(raw, norm, ctx, ids)
                else:
                    got = await send(self.session, self.base, raw["request"], ids)
                    self._compare_response(norm["response"], raw["response"], got, ctx, ids, raw["request"]["path"])
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                ctx.diff("transport", "a response", repr(exc))
        self.report.probe_seconds[probe.id] = time.monotonic() - start

    def _compare_response(self, norm: JSON, raw: JSON | None, got: Got, ctx: Ctx, ids: Ids, path: str) -> None:
        if norm.get("status") != got.status:
            ctx.diff("status", norm.get("status"), got.status)
        if str(norm.get("contentType", "")) != got.content_type:
            ctx.diff("contentType", norm.get("contentType"), got.content_type)
        rec_warnings = norm.get("warnings") or []
        if len(rec_warnings) != len(got.warnings) or not all(
            matches(r, g, ctx.ns, ctx.run) for r, g in zip(rec_warnings, got.warnings, strict=False)
        ):
            ctx.diff("warnings", rec_warnings, got.warnings)
        rec_body = norm.get("body")
        ctx.ids = ids
        try:
            parsed = json.loads(got.body) if got.content_type.startswith("application/json") and got.body else None
        except ValueError:
            parsed = None
        if raw is not None and parsed is not None:
            for problem in pair_ids(raw.get("body"), parsed, ids):
                ctx.diff("identity", "one to one", problem)
        parsed = compare_body(rec_body, (raw or {}).get("body"), got.body, got.content_type, ctx, ids, path)
        is_status = isinstance(rec_body, dict) and isinstance(parsed, dict) and rec_body.get("kind") == "Status"
        if is_status and rec_body.get("reason") != parsed.get("reason"):  # a body diff too; named for the exceptions
            ctx.diff("reason", rec_body.get("reason"), parsed.get("reason"))

    async def _poll(self, raw: JSON, norm: JSON, ctx: Ctx, ids: Ids) -> None:
        until = int(raw["poll"]["untilStatus"])
        deadline = time.monotonic() + POLL_LIMIT
        while True:
            got = await send(self.session, self.base, raw["request"], ids)
            if got.status == until or time.monotonic() > deadline:
                break
            await asyncio.sleep(POLL_EVERY)
        met = got.status == until
        if bool(norm["poll"]["conditionMet"]) != met:
            ctx.diff("poll.conditionMet", norm["poll"]["conditionMet"], met)
        self._compare_response(norm["response"], raw["response"], got, ctx, ids, raw["request"]["path"])

    async def _watch(self, raw: JSON, norm: JSON, ctx: Ctx, ids: Ids) -> None:
        window = float(raw["watchSeconds"])
        method, path, query, headers, data = build_request(raw["request"], ids)
        rec = norm["response"]
        events: list[JSON] = []
        closed = False
        start = time.monotonic()
        async with self.session.request(method, self.base + path, params=query, headers=headers, data=data) as resp:
            if resp.status != 200 or "events" not in rec:
                got = Got(
                    resp.status,
                    resp.headers.get("Content-Type", ""),
                    resp.headers.getall("Warning", []),
                    await resp.read(),
                )
                self._compare_response(rec, raw["response"], got, ctx, ids, path)
                return
            if resp.headers.get("Content-Type", "") != rec.get("contentType"):
                ctx.diff("contentType", rec.get("contentType"), resp.headers.get("Content-Type", ""))

            async def read() -> None:
                nonlocal closed
                async for line in resp.content:
                    if line.strip():
                        events.append(json.loads(line))
                closed = True

            reader = asyncio.create_task(read())
            triggers = rec.get("triggers") or []
            if triggers:
                await asyncio.sleep(TRIGGER_DELAY)
            for traw, tnorm in zip(raw["response"].get("triggers") or [], triggers, strict=True):
                tctx = Ctx(ctx.probe, f"{ctx.step}/{traw['label']}", ctx.ns, ctx.run, ctx.diffs)
                got = await send(self.session, self.base, traw["request"], ids)
                self._compare_response(tnorm["response"], traw["response"], got, tctx, ids, traw["request"]["path"])
                await asyncio.sleep(0.05)
            left = window - (time.monotonic() - start)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(reader), timeout=max(0.0, left))
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await reader
        if bool(rec.get("closedByServer")) != closed:
            ctx.diff("closedByServer", rec.get("closedByServer"), closed)
        self._compare_events(rec.get("events") or [], events, ctx)

    def _compare_events(self, recorded: list[JSON], got: list[JSON], ctx: Ctx) -> None:
        rec = _collapse(recorded)
        summaries = _collapse([_summary(e) for e in got])
        if [e.get("type") for e in rec] != [e.get("type") for e in summaries]:
            ctx.diff("events", [e.get("type") for e in rec], [e.get("type") for e in summaries])
            return
        for i, (r, g) in enumerate(zip(rec, summaries, strict=True)):
            compare(r, g, f"events[{i}]", ctx)


def _collapse(events: list[JSON]) -> list[JSON]:
    out: list[JSON] = []
    for e in events:
        if e.get("type") == "BOOKMARK" and out and out[-1].get("type") == "BOOKMARK":
            continue
        out.append(e)
    return out


def _summary(event: JSON) -> JSON:
    """A watch event as the recording summarized it."""
    obj = event.get("object") or {}
    if event.get("type") == "ERROR":
        return {
            "type": "ERROR",
            "status": {k: obj[k] for k in ("code", "kind", "message", "reason", "status") if k in obj},
        }
    meta = obj.get("metadata") or {}
    out: JSON = {"kind": obj.get("kind"), "name": meta.get("name"), "resourceVersion": meta.get("resourceVersion")}
    for key in ("labels", "annotations", "finalizers", "deletionTimestamp", "generation"):
        if key in meta:
            out[key] = meta[key]
    if "status" in obj:
        out["status"] = obj["status"]
    return {"type": event.get("type"), "object": out}


def iter_crd_files(crd_dir: Path) -> Iterator[JSON]:
    for path in sorted(crd_dir.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                yield doc


async def replay(base: str, transcript: JSON, project_crds: list[JSON], only: set[str] | None = None) -> Report:
    """Replay every probe (or those in ``only``) concurrently against the API at ``base``."""
    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=CONCURRENCY * 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False) as session:
        replayer = Replayer(base, transcript, session)
        await replayer.setup(project_crds)
        sem = asyncio.Semaphore(CONCURRENCY)
        selected = [p for p in probes(transcript) if only is None or p.id in only]

        async def one(probe: Probe) -> None:
            async with sem:
                await replayer.run_probe(probe)

        # The slow probes first, so they overlap with the rest.
        selected.sort(key=lambda p: -_expected_seconds(p))
        await asyncio.gather(*(one(p) for p in selected))
    replayer.report.seconds = time.monotonic() - start
    return replayer.report


def _expected_seconds(probe: Probe) -> float:
    total = 0.0
    for s in probe.raw:
        total += float(s.get("watchSeconds", 0)) + min(float(s.get("sleep", 0)), SLEEP_CAP)
        if "poll" in s:
            total += 1.0
    return total


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.apiserver.replay [probe-id...]``: replay against a fresh embedded API, print differences."""
    import argparse

    from controller.apiserver import start_server

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("probes", nargs="*", help="probe ids (default: all)")
    parser.add_argument("--transcript", type=Path, default=None)
    args = parser.parse_args(argv)
    transcript = load_transcript(args.transcript)
    handle = start_server(None, **REPLAY_SERVER)
    try:
        report = asyncio.run(
            replay(handle.url, transcript, list(iter_crd_files(ROOT / "crds")), set(args.probes) or None)
        )
    finally:
        handle.stop()
    for d in report.diffs:
        print(d)
    slow = sorted(report.probe_seconds.items(), key=lambda kv: -kv[1])[:5]
    probes_hit = len({d.probe for d in report.diffs})
    print(f"{len(report.diffs)} differences in {probes_hit} probes; {report.seconds:.1f}s; slowest {slow}")
    return 0


#: How the replay starts the double: real-server timing (bookmarks every minute).
#: The namespace controller's first pass 2 s after a namespace's deletion (a real one: about 5 s; the default,
#: ``NAMESPACE_DELAY``): as recorded, it has not acted yet at the probe's second DELETE (1 s after the first)
#: and has at its GET after the next sleep (8 s recorded, capped at SLEEP_CAP: 4 s after the first DELETE).
REPLAY_SERVER: JSON = {"bookmark_interval": 60.0, "namespace_delay": 2.0}

if __name__ == "__main__":
    raise SystemExit(main())
