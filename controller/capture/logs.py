"""The capture's name for :mod:`controller.logs`, the log schema every process of the project shares.

The formatter, the flags and the setup live in ``controller.logs``, outside the import layers, so that the
maintainer, the embedded API and ``controller.kube`` (a layer below the capture) may use them too; this
module only keeps ``from controller.capture.logs import fields`` working for the capture's call sites.
"""

from __future__ import annotations

from controller.logs import JsonFormatter, PlainFormatter, fields, setup

__all__ = ["JsonFormatter", "PlainFormatter", "fields", "setup"]
