"""The embedded API server of ``tests.kube`` (``server``), for the tests of the maintainer's runner against it."""

from tests.kube.conftest import server

__all__ = ["server"]
