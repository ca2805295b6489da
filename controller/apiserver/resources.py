"""Resource types the embedded API server serves: the built-in kinds the project uses, plus one per CRD.

A :class:`ResourceType` carries everything discovery, routing, validation and table printing need; CRDs are
turned into resource types by :func:`from_crd`, whether loaded from files at startup or POSTed later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

JSON = dict[str, Any]

ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
STATUS_VERBS = ["get", "patch", "update"]


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

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.group, self.version, self.plural)

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

    def discovery(self) -> list[JSON]:
        """The APIResource entries (the resource and its status subresource) for ``/apis/<group>/<version>``."""
        main: JSON = {
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": ALL_VERBS,
        }
        if self.short_names:
            main["shortNames"] = self.short_names
        if self.categories:
            main["categories"] = self.categories
        out = [main]
        if self.status_subresource:
            out.append(
                {
                    "name": f"{self.plural}/status",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "kind": self.kind,
                    "verbs": STATUS_VERBS,
                }
            )
        return out


def builtin_types() -> list[ResourceType]:
    """The non-CRD kinds the project relies on (Kopf posts core v1 Events; leader election uses Leases)."""
    return [
        ResourceType("", "v1", "namespaces", "namespace", "Namespace", False, ["ns"], [], True),
        ResourceType("", "v1", "configmaps", "configmap", "ConfigMap", True, ["cm"], ["all"]),
        ResourceType("", "v1", "events", "event", "Event", True, ["ev"]),
        ResourceType("events.k8s.io", "v1", "events", "event", "Event", True, ["ev"]),
        ResourceType("coordination.k8s.io", "v1", "leases", "lease", "Lease", True),
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
            )
        )
    return out
