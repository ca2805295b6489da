"""The embedded API server of ``tests.kube`` (``server``), for the tests of how the processes wire their tuning in."""

from tests.kube.conftest import server

__all__ = ["server"]
