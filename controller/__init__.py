"""changefeed-maintainer: a crash-safe Kubernetes maintainer for TiCDC-style changefeeds.

Layers (enforced by import-linter, see pyproject.toml):

- ``controller.model``: plain data, no I/O.
- ``controller.engine``: pure decisions over a snapshot of the world.
- ``controller.kube`` / ``controller.capture``: the code that talks to the API.
- ``controller.maintainer`` / ``controller.cli`` / ``controller.sim``: wiring and drivers.
"""
