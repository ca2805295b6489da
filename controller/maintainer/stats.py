"""What a maintainer process counts as it works (``Maintainer.stats``), read by its metrics: a module of its own so
that the metrics (``controller.maintainer.metrics``) need not import the runner that builds them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stats:
    decisions: int = 0
    writes: int = 0
    failed_chains: int = 0
    #: A changefeed's loop hit an unexpected error (an engine bug, a malformed object...): it gave up
    #: its Lease, backed off and competes again.
    loop_crashes: int = 0
    #: Full audits made (decisions over every record, every ``audit_interval``), and those that decided
    #: otherwise than the incremental decision would have from the same snapshot (an index bug: the audit
    #: made up for it; never more than 0 in a healthy system).
    audits: int = 0
    audit_disagreements: int = 0
    bootstrap_seconds: dict[str, float] = field(default_factory=dict)
    epochs: dict[str, int] = field(default_factory=dict)
    #: Changefeeds this replica handed over to balance the replicas (engine/shards.py).
    handoffs: int = 0
    #: Turns of the supervisor's loop (on changes, at most 20 a second; at rest every SUPERVISE_IDLE).
    supervisor_turns: int = 0
