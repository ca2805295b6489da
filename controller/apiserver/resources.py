"""Resource types the embedded API server serves: the built-in kinds the project uses, plus one per CRD version.

A :class:`ResourceType` carries everything discovery, routing, decoding, validation and table printing need;
CRDs are turned into resource types by :func:`from_crd` once established, whether loaded at startup or POSTed.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from typing import Any

from controller.apiserver import builtins as B
from controller.apiserver.gotypes import Struct

JSON = dict[str, Any]

BUILTIN_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
CUSTOM_VERBS = ["delete", "deletecollection", "get", "list", "patch", "create", "update", "watch"]
STATUS_VERBS = ["get", "patch", "update"]
#: The built-in API groups in the order the real server lists them (its other groups are not served here).
BUILTIN_GROUP_ORDER = ["events.k8s.io", "apiextensions.k8s.io", "coordination.k8s.io"]


def storage_version_hash(group: str, version: str, kind: str) -> str:
    """As the real server computes it: the first 8 bytes of sha256("<group>/<version>/<kind>"), base64."""
    return base64.b64encode(hashlib.sha256(f"{group}/{version}/{kind}".encode()).digest()[:8]).decode()


@dataclass
class ResourceType:
    """One served resource (group, version, plural) and what the server knows about it."""

    group: str
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    status_subresource: bool = False
    schema: JSON | None = None
    printer_columns: list[JSON] = field(default_factory=list)
    generation: bool = False  # whether metadata.generation is maintained (CRs, CRDs)
    custom: bool = False  # defined by a CRD
    struct: Struct | None = None  # the Go type of a built-in kind
    #: Where objects live; events.k8s.io/v1 Events share the core/v1 Events' storage.
    storage: tuple[str, str] | None = None
    #: A PUT without metadata.resourceVersion is allowed (ConfigMaps, Events, Namespaces), not for CRs or Leases.
    unconditional_update: bool = False
    #: A PUT to a missing object creates it (its registry strategy's ``AllowCreateOnUpdate()``): Leases and
    #: Events; not ConfigMaps, Namespaces, CRDs or custom resources, which answer 404.
    create_on_update: bool = False
    verbs: list[str] = field(default_factory=lambda: list(BUILTIN_VERBS))
    extra_subresources: list[str] = field(default_factory=list)
    storage_kind: tuple[str, str, str] | None = None  # group/version/kind hashed for storageVersionHash

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.group, self.version, self.plural)

    @property
    def storage_key(self) -> tuple[str, str]:
        return self.storage or (self.group, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        """``spans.cdc.maintainer.dev`` / ``configmaps``: how the real server names the resource in messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        """``Span.cdc.maintainer.dev`` / ``ConfigMap``: how the real server names the kind in 422 messages."""
        return f"{self.kind}.{self.group}" if self.group else self.kind

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    @property
    def is_event(self) -> bool:
        return self.storage_key == ("", "events")

    def subresources(self) -> list[str]:
        return (["status"] if self.status_subresource else []) + self.extra_subresources

    def discovery(self) -> list[JSON]:
        """The APIResource entries (the resource and its subresources) for ``/apis/<group>/<version>``."""
        main: JSON = {
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": self.verbs,
        }
        if self.short_names:
            main["shortNames"] = self.short_names
        if self.categories:
            main["categories"] = self.categories
        g, v, k = self.storage_kind or (self.group, self.version, self.kind)
        main["storageVersionHash"] = storage_version_hash(g, v, k)
        out = [main]
        for sub in sorted(self.subresources()):
            out.append(
                {
                    "name": f"{self.plural}/{sub}",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "kind": self.kind,
                    "verbs": ["update"] if sub == "finalize" else STATUS_VERBS,
                }
            )
        return out

    def aggregated(self) -> JSON:
        """The APIResourceDiscovery entry (aggregated discovery, apidiscovery.k8s.io/v2)."""
        kind = {
            "group": self.group if self.custom else "",
            "kind": self.kind,
            "version": self.version if self.custom else "",
        }
        out: JSON = {
            "resource": self.plural,
            "responseKind": kind,
            "scope": "Namespaced" if self.namespaced else "Cluster",
            "singularResource": self.singular,
            "verbs": self.verbs,
        }
        if self.short_names:
            out["shortNames"] = self.short_names
        if self.categories:
            out["categories"] = self.categories
        subs = [
            {"responseKind": kind, "subresource": sub, "verbs": ["update"] if sub == "finalize" else STATUS_VERBS}
            for sub in sorted(self.subresources())
        ]
        if subs:
            out["subresources"] = subs
        return out


CRD_KEY = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NS_KEY = ("", "v1", "namespaces")


def builtin_types() -> list[ResourceType]:
    """The non-CRD kinds the project relies on (Kopf posts core v1 Events; leader election uses Leases)."""
    return [
        ResourceType(
            "",
            "v1",
            "namespaces",
            "namespace",
            "Namespace",
            False,
            ["ns"],
            status_subresource=True,
            struct=B.NAMESPACE,
            unconditional_update=True,
            verbs=["create", "delete", "get", "list", "patch", "update", "watch"],
            extra_subresources=["finalize"],
        ),
        ResourceType(
            "",
            "v1",
            "configmaps",
            "configmap",
            "ConfigMap",
            True,
            ["cm"],
            struct=B.CONFIGMAP,
            unconditional_update=True,
        ),
        ResourceType(
            "",
            "v1",
            "secrets",
            "secret",
            "Secret",
            True,
            [],
            struct=B.SECRET,
            unconditional_update=True,
        ),
        ResourceType(
            "",
            "v1",
            "events",
            "event",
            "Event",
            True,
            ["ev"],
            struct=B.CORE_EVENT,
            unconditional_update=True,
            create_on_update=True,
        ),
        ResourceType(
            "events.k8s.io",
            "v1",
            "events",
            "event",
            "Event",
            True,
            ["ev"],
            struct=B.V1_EVENT,
            storage=("", "events"),
            unconditional_update=True,
            create_on_update=True,
            storage_kind=("", "v1", "Event"),
        ),
        ResourceType(
            "coordination.k8s.io", "v1", "leases", "lease", "Lease", True, struct=B.LEASE, create_on_update=True
        ),
        ResourceType(
            "apiextensions.k8s.io",
            "v1",
            "customresourcedefinitions",
            "customresourcedefinition",
            "CustomResourceDefinition",
            False,
            ["crd", "crds"],
            ["api-extensions"],
            True,
            generation=True,
        ),
    ]


def from_crd(crd: JSON) -> list[ResourceType]:
    """One resource type per served version of a CustomResourceDefinition (apiextensions.k8s.io/v1)."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group = str(spec.get("group", ""))
    plural = str(names.get("plural", ""))
    kind = str(names.get("kind", ""))
    if not group or not plural or not kind:
        raise ValueError("a CRD needs spec.group, spec.names.plural and spec.names.kind")
    out: list[ResourceType] = []
    for version in spec.get("versions") or []:
        if not version.get("served", True):
            continue
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        out.append(
            ResourceType(
                group=group,
                version=str(version["name"]),
                plural=plural,
                singular=str(names.get("singular") or kind.lower()),
                kind=kind,
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                short_names=list(names.get("shortNames") or []),
                categories=list(names.get("categories") or []),
                status_subresource="status" in (version.get("subresources") or {}),
                schema=schema,
                printer_columns=list(version.get("additionalPrinterColumns") or []),
                generation=True,
                custom=True,
                verbs=list(CUSTOM_VERBS),
            )
        )
    return out
