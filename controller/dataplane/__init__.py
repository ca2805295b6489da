"""The data plane: what a real dispatcher replicates from and to (issue 38).

So far only :mod:`.servers`: a real etcd (the source) and a real PostgreSQL (the sink), each started on
loopback in a temporary directory for the tests and the demo, and always stopped. The client libraries and
why they were chosen: docs/architecture.md, "Data plane: the servers and clients".
"""
