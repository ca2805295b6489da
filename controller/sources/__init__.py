"""The sources a changefeed reads, behind ``controller.sources.api``: etcd (``controller.sources.etcd``)."""
