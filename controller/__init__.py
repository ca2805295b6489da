"""changefeed-maintainer: a crash-safe Kubernetes maintainer for TiCDC-style changefeeds.

Layers (enforced by import-linter, see pyproject.toml):

- ``controller.model``: plain data, no I/O.
- ``controller.engine``: pure decisions over a snapshot of the world.
- ``controller.kube``: the API client (every request of ours goes through ``controller.kube.client``) and what the
  maintainer builds on it: informer, executor, leader election.
- ``controller.capture``: the capture agent (its own informer; it calls the client itself).
- ``controller.maintainer`` / ``controller.cli`` / ``controller.sim``: wiring and drivers (the runner and the
  plugin call the client too; the simulator has an API of its own).
- ``controller.demo``: the whole system in one command.

No module imports another that imports it, directly or not (``tests/test_purity.py``).
"""
