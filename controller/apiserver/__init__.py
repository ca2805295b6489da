"""An embedded Kubernetes API server for tests, the demo and kubectl: see :func:`start_server`.

It implements what this project relies on from kube-apiserver (CRDs with structural schemas, pruning,
defaulting, CEL, the status subresource, finalizers, resourceVersion conflicts, watches with bookmarks and
410 Gone, selectors, discovery and Table output) in memory, so Kopf, the capture agents and kubectl can run
against it without a cluster.
"""

from controller.apiserver.errors import ApiError
from controller.apiserver.server import ApiServerHandle, start_server
from controller.apiserver.store import Store

__all__ = ["ApiError", "ApiServerHandle", "Store", "start_server"]
