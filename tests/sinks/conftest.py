"""The sink servers of tests/dataplane/conftest.py, shared here: each sink-generic test runs once per sink kind."""

from tests.dataplane.conftest import mariadb, postgres, sink_server, start_sink, table_id

__all__ = ["mariadb", "postgres", "sink_server", "start_sink", "table_id"]
