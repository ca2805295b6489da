"""The data plane: what a real dispatcher replicates from and to, and how a sink is checked against its source.

:mod:`.etcd` is the connection to the etcd source, :mod:`.schema` the PostgreSQL sink's layout and its only-if-newer
writes, :mod:`.horizon` the tombstone collection, :mod:`.verify` the row-by-row comparison behind ``kubectl
changefeed verify``, :mod:`.diagnosis` what a failure of either side means for a person; :mod:`.servers` starts a
real etcd and a real PostgreSQL on loopback for the tests and the demo (always stopped) and :mod:`.writer` writes
to the source. The runtime that replicates a span over them is :mod:`controller.capture.dataplane`. The client
libraries and why they were chosen: docs/architecture.md, "Data plane: the servers and clients".
"""
