"""Kopf wiring: the process lifecycle and the liveness probe come from Kopf; logging is the project's.

Kopf runs no resource handlers here on purpose. The maintainer's multi-step state lives only in our
own status fields; Kopf's progress storage (annotations written in a separate request from status,
so a kill between the two loses the status) is never used, and Kopf adds no finalizers (a daemon per
Changefeed would, keeping the object undeletable whenever the operator is down). The watches are our
informer's (see ``controller.kube.informer`` for why), and the liveness probe reports progress
(``Informer.healthy``): a watch task that ended, or no request answered by the API for ``--liveness-window``
seconds, makes the pod restart instead of leaving a zombie operator; a quiet watch does not (a real API server
promises no BOOKMARKs).

The readiness endpoint (``--readiness``, :mod:`controller.kube.probes`) answers 200 once every kind is
listed and every Changefeed's Lease is being competed for, so ``helm install --wait`` means working.

The Prometheus endpoint (``--metrics-port``, see ``controller.maintainer.metrics``) is an aiohttp server in
the running event loop, as the readiness endpoint is, on a port other than Kopf's liveness endpoint; it is
started before the maintainer (a port that cannot be bound stops the process at once) and stopped at cleanup.

Logging (:func:`setup_logging`): every record, Kopf's included, goes through the schema of
``controller.logs``, the one the capture agent writes too; ``kopf.configure`` (Kopf's own formats) is not
used. Kopf runs the probe handlers below for the requests to the liveness endpoint (at most every 10 s)
and logs each success at info (``Activity 'watches' succeeded.``), which made an idle maintainer log two
lines per kubelet probe for ever: those successes are logged at debug instead; a failing probe still logs
its error.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from controller import logs
from controller.kube.client import Client, Config
from controller.kube.probes import ProbeServer
from controller.maintainer.metrics import MetricsServer
from controller.maintainer.runner import Maintainer, Settings

log = logging.getLogger("controller.maintainer")
_state: dict[str, Any] = {}
#: The logger of Kopf's probe activity (kopf/_core/engines/activities.py, ``kopf.activities.<activity>``):
#: the liveness endpoint runs every ``@kopf.on.probe`` handler through it, at most every 10 s.
PROBE_LOGGER = "kopf.activities.probe"


class ProbeSuccessesAtDebug(logging.Filter):
    """On Kopf's probe logger: ``Activity '<probe>' succeeded.`` becomes a debug record, dropped unless the
    logger is enabled for debug. Anything else (``... failed permanently: <why>`` at error) passes as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and record.getMessage().endswith(" succeeded."):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def setup_logging(level: str = "INFO", log_format: str = "json") -> None:
    """The maintainer's logging: ``controller.logs`` for every record (Kopf's too), probe successes at debug."""
    logs.setup(level, log_format)
    probe = logging.getLogger(PROBE_LOGGER)
    if not any(isinstance(f, ProbeSuccessesAtDebug) for f in probe.filters):
        probe.addFilter(ProbeSuccessesAtDebug())
    # As kopf.configure did (the maintainer called it before): asyncio's own logger, the event loop's
    # low-level messages, stays out unless at debug.
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.propagate = logging.getLogger().isEnabledFor(logging.DEBUG)
    if not asyncio_log.propagate:
        asyncio_log.handlers[:] = [logging.NullHandler()]
    # One access line per request to the liveness endpoint: not worth a line.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def configure(settings: Settings, kubeconfig: str | None, context: str | None, readiness: str = "") -> None:
    _state["settings"] = settings
    _state["kubeconfig"] = kubeconfig
    _state["context"] = context
    _state["readiness"] = readiness


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """Kopf connects exactly where our own client does (the same kubeconfig, context or service account)."""
    config = Config.load(_state.get("kubeconfig"), _state.get("context"))
    token = config.token.split(" ", 1)[1] if " " in config.token else config.token
    return kopf.ConnectionInfo(
        server=config.url,
        scheme="Bearer" if token else None,
        token=token or None,
        ca_path=config.ca_file or None,
        certificate_path=config.cert_file or None,
        private_key_path=config.key_file or None,
        insecure=not config.verify,
    )


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.enabled = False  # our Events come from the engine's decisions only
    settings.peering.standalone = True
    # No cluster-wide scanning: Kopf would list namespaces and watch CRDs across the cluster, which the
    # chart's namespaced RBAC forbids (403 on every retry, forever, in the log). Kopf runs no resource
    # handlers here, so it has nothing to discover; our informer watches our namespace.
    settings.scanning.disabled = True
    config = Config.load(_state.get("kubeconfig"), _state.get("context"))
    client = Client(config)
    maintainer = Maintainer(client, _state["settings"])
    _state["client"] = client
    s = maintainer.settings
    if s.metrics_port:
        server = MetricsServer(maintainer.metrics.registry, s.metrics_address, s.metrics_port)
        try:
            await server.start()
        except OSError as exc:
            await client.close()
            _state.pop("client", None)
            why = f"cannot serve metrics on {s.metrics_address}:{s.metrics_port}: {exc}"
            _state["fatal"] = why  # for __main__: one line and exit status 1 instead of Kopf's tracebacks
            raise kopf.PermanentError(why) from exc
        _state["metrics"] = server
    if _state.get("readiness"):
        probe = ProbeServer(_state["readiness"], maintainer.ready)
        try:
            await probe.start()
        except OSError as exc:
            await client.close()
            _state.pop("client", None)
            why = f"cannot serve readiness on {_state['readiness']}: {exc}"
            _state["fatal"] = why
            raise kopf.PermanentError(why) from exc
        _state["readiness_server"] = probe
    _state["maintainer"] = maintainer
    await maintainer.start()
    log.info(
        "maintainer %s started in namespace %s",
        s.identity,
        s.namespace,
        extra=logs.fields(identity=s.identity, namespace=s.namespace),
    )


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    maintainer: Maintainer | None = _state.get("maintainer")
    if maintainer is not None:
        await maintainer.stop()  # releases the Leases it holds, so a successor takes over at once
    client: Client | None = _state.get("client")
    if client is not None:
        await client.close()
    server: MetricsServer | None = _state.get("metrics")
    if server is not None:
        await server.stop()
    probe: ProbeServer | None = _state.get("readiness_server")
    if probe is not None:
        await probe.stop()


@kopf.on.probe(id="watches")
def watches(**_: Any) -> str:
    maintainer: Maintainer | None = _state.get("maintainer")
    if maintainer is None:
        return "starting"
    ok, why = maintainer.healthy()
    if not ok:
        raise kopf.PermanentError(why)
    return why


@kopf.on.probe(id="leading")
def leading(**_: Any) -> list[str]:
    maintainer: Maintainer | None = _state.get("maintainer")
    return sorted(maintainer.leading) if maintainer is not None else []


def fatal() -> str:
    """Why startup failed for good ("" if it did not)."""
    return str(_state.get("fatal", ""))


def pod_namespace() -> str:
    return os.environ.get("POD_NAMESPACE", "default")
