"""How a sink is checked against its source: :mod:`.verify`, the row-by-row comparison behind ``kubectl changefeed
verify`` (etcd at a revision against any sink's snapshot). The source is :mod:`controller.sources`, the sinks
:mod:`controller.sinks`, the runtime that replicates a span between them :mod:`controller.capture.dataplane`; the
servers and the writer the tests, the benches and the demo start are :mod:`controller.demo.servers` and
:mod:`controller.demo.writer`. The client libraries and why they were chosen: docs/architecture.md, "Data plane:
the servers and clients" and "Sinks: the seam".
"""
