"""The sinks a changefeed can write to, each a package behind one interface (``controller.sinks.api``):
``postgres`` (PostgreSQL 13 or later) and ``mysql`` (MySQL 8.0, MariaDB 10.11 or later, TiDB)."""
