"""One log schema for every process (controller/logs.py, docs/operations.md "Logging").

Each process is started through its own ``main`` with only its work replaced (the maintainer's Kopf
operator, the capture's agent, the embedded API's server, the demo's run), so what is checked is the
logging each process really sets up. Kopf's records are made by Kopf itself: its per-object logger, and
its probe activity running the maintainer's real ``@kopf.on.probe`` handlers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kopf
import pytest
from kopf._cogs.structs import ephemera
from kopf._core.actions import lifecycles
from kopf._core.engines import activities
from kopf._core.intents import causes, registries

from controller import logs
from controller.apiserver import __main__ as apiserver_main
from controller.capture import __main__ as capture_main
from controller.demo import __main__ as demo_main
from controller.maintainer import __main__ as maintainer_main
from controller.maintainer import operator

TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Every process's setup takes over the root logger; give pytest's back afterwards."""
    root = logging.getLogger()
    probe = logging.getLogger(operator.PROBE_LOGGER)
    aio = logging.getLogger("asyncio")
    access = logging.getLogger("aiohttp.access")
    celpy = logging.getLogger("celpy")
    saved = (root.handlers[:], root.level, probe.filters[:], aio.propagate, aio.handlers[:], access.level, celpy.level)
    yield
    root.handlers[:], level, probe.filters[:], aio.propagate, aio.handlers[:], access_level, celpy_level = saved
    root.setLevel(level)
    access.setLevel(access_level)
    celpy.setLevel(celpy_level)


def emit() -> None:
    """The record every process logs in the schema test."""
    logging.getLogger("test.process").warning("probe %s", "x", extra=logs.fields(changefeed="cf1", epoch=3))


def run_maintainer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flags: list[str]) -> None:
    def run(coro: Coroutine[Any, Any, Any]) -> None:
        coro.close()  # kopf.operator(...), never started
        emit()

    monkeypatch.setattr(operator, "_state", {})
    monkeypatch.setattr(maintainer_main, "asyncio", SimpleNamespace(run=run))
    monkeypatch.setattr(maintainer_main, "prometheus_client", SimpleNamespace(disable_created_metrics=lambda: None))
    assert maintainer_main.main(["--namespace", "ns", "--identity", "m1", *flags]) == 0


def run_capture(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flags: list[str]) -> None:
    async def agent(*_: Any) -> int:
        emit()
        return 0

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    monkeypatch.setattr(capture_main, "_run", agent)
    assert capture_main.main(["--name", "c1", "--namespace", "ns", "--kubeconfig", str(kubeconfig), *flags]) == 0


class Served(Exception):
    pass


def run_apiserver(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flags: list[str]) -> None:
    def start_server(*_: Any, **__: Any) -> None:
        emit()
        raise Served

    monkeypatch.setattr(apiserver_main, "start_server", start_server)
    with pytest.raises(Served):
        apiserver_main.main(flags)


def run_demo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flags: list[str]) -> None:
    async def run(_: Any) -> int:
        emit()
        return 0

    monkeypatch.setattr(demo_main, "run", run)
    assert demo_main.main(["--log-dir", str(tmp_path / "logs"), *flags]) == 0


PROCESSES: dict[str, Callable[[pytest.MonkeyPatch, Path, list[str]], None]] = {
    "maintainer": run_maintainer,
    "capture": run_capture,
    "apiserver": run_apiserver,
    "demo": run_demo,
}


def the_line(err: str) -> str:
    (line,) = [line for line in err.splitlines() if "probe x" in line]
    return line


@pytest.mark.parametrize("process", PROCESSES)
def test_every_process_logs_json_lines_of_the_one_schema_by_default(
    process: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    PROCESSES[process](monkeypatch, tmp_path, [])
    line = json.loads(the_line(capsys.readouterr().err))
    assert list(line) == ["ts", "level", "logger", "msg", "changefeed", "epoch"], line
    assert TS.match(line.pop("ts")), line
    assert line == {"level": "warning", "logger": "test.process", "msg": "probe x", "changefeed": "cf1", "epoch": 3}


@pytest.mark.parametrize("process", PROCESSES)
def test_every_process_logs_the_same_fields_as_text_with_log_format_plain(
    process: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    PROCESSES[process](monkeypatch, tmp_path, ["--log-format", "plain"])
    ts, rest = the_line(capsys.readouterr().err).split(" ", 1)
    assert TS.match(ts), ts
    assert rest == "WARNING test.process: probe x changefeed=cf1 epoch=3"


@pytest.mark.parametrize("process", PROCESSES)
def test_every_process_takes_log_level(
    process: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    PROCESSES[process](monkeypatch, tmp_path, ["--log-level", "error"])
    assert "probe x" not in capsys.readouterr().err  # a warning, below ERROR


@pytest.mark.parametrize("process", ["apiserver", "demo"])
def test_the_embedded_api_keeps_the_code_celpy_transpiles_out_of_the_log(
    process: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    PROCESSES[process](monkeypatch, tmp_path, [])
    assert not logging.getLogger("celpy.CompiledRunner").isEnabledFor(logging.INFO)  # it logs every rule at info


def test_the_maintainer_and_the_capture_offer_the_same_log_flags_and_defaults() -> None:
    maintainer = maintainer_main.parse(["--namespace", "ns"])
    capture = capture_main.parse_args(["--name", "c1", "--namespace", "ns"])
    assert (maintainer.log_format, maintainer.log_level) == (capture.log_format, capture.log_level) == ("json", "INFO")
    assert maintainer_main.parse(["--log-format", "plain"]).log_format == "plain"
    assert capture_main.parse_args(["--name", "c", "--namespace", "n", "--log-format", "plain"]).log_format == "plain"
    assert maintainer_main.parse(["--verbose"]).log_level == "DEBUG"  # the old flag still works


def records(err: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in err.splitlines() if line.strip()]


def test_a_kopf_object_record_is_rendered_in_the_schema_with_its_object(capsys: pytest.CaptureFixture[str]) -> None:
    operator.setup_logging("INFO", "json")
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False  # no k8s Event for it
    body: kopf.RawBody = {
        "apiVersion": "cdc.maintainer.dev/v1alpha1",
        "kind": "Changefeed",
        "metadata": {"name": "cf1", "namespace": "ns", "uid": "u-1"},
    }
    kopf.ObjectLogger(body=kopf.Body(body), settings=settings).info("Handler 'x' succeeded.")
    (line,) = records(capsys.readouterr().err)
    assert TS.match(line.pop("ts")), line
    assert line == {
        "level": "info",
        "logger": "kopf.objects",
        "msg": "Handler 'x' succeeded.",
        "object": {
            "apiVersion": "cdc.maintainer.dev/v1alpha1",
            "kind": "Changefeed",
            "name": "cf1",
            "uid": "u-1",
            "namespace": "ns",
        },
    }


def test_an_exception_gives_error_and_stacktrace(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup("INFO", "json")
    log = logging.getLogger("test.process")
    try:
        raise KeyError("k")
    except KeyError:
        log.exception("failed")
        log.exception("failed", extra=logs.fields(error="what the call site says"))
    first, second = records(capsys.readouterr().err)
    assert first["error"] == "KeyError: 'k'"
    assert first["stacktrace"].startswith("Traceback (most recent call last):")
    assert first["stacktrace"].endswith("KeyError: 'k'")
    assert second["error"] == "what the call site says"
    assert second["stacktrace"] == first["stacktrace"]


def test_a_field_never_replaces_a_key_of_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    logs.setup("INFO", "json")
    logging.getLogger("test.process").info("real", extra=logs.fields(msg="fake", level="fake", capture="c1"))
    (line,) = records(capsys.readouterr().err)
    assert (line["msg"], line["level"], line["capture"]) == ("real", "info", "c1")


# -- Kopf's probe activity: what the liveness endpoint runs, with the maintainer's real probe handlers ----


def probe(monkeypatch: pytest.MonkeyPatch, healthy: tuple[bool, str]) -> dict[Any, Any]:
    """One run of Kopf's probe activity, as its liveness endpoint does (kopf/_core/engines/probing.py)."""
    maintainer = SimpleNamespace(healthy=lambda: healthy, leading={"cf1"})
    monkeypatch.setitem(operator._state, "maintainer", maintainer)
    registry = registries.get_default_registry()
    assert {h.id for h in registry._activities.get_handlers(activity=causes.Activity.PROBE)} == {"watches", "leading"}
    return asyncio.run(
        activities.run_activity(
            lifecycle=lifecycles.all_at_once,
            registry=registry,
            settings=kopf.OperatorSettings(),
            activity=causes.Activity.PROBE,
            indices={},
            memo=ephemera.AnyMemo(kopf.Memo()),
        )
    )


def test_probe_successes_are_not_logged_at_info(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    operator.setup_logging("INFO", "json")
    assert probe(monkeypatch, (True, "ok")) == {"watches": "ok", "leading": ["cf1"]}
    assert records(capsys.readouterr().err) == []  # an idle maintainer's probes: nothing at info


def test_probe_successes_are_logged_at_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    operator.setup_logging("DEBUG", "json")
    probe(monkeypatch, (True, "ok"))
    succeeded = {
        (r["level"], r["logger"], r["msg"]) for r in records(capsys.readouterr().err) if "succeeded" in r["msg"]
    }
    assert succeeded == {
        ("debug", operator.PROBE_LOGGER, "Activity 'watches' succeeded."),
        ("debug", operator.PROBE_LOGGER, "Activity 'leading' succeeded."),
    }


def test_a_failing_probe_is_still_logged_as_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    operator.setup_logging("INFO", "json")
    with pytest.raises(activities.ActivityError):
        probe(monkeypatch, (False, "watch task watch-spans ended"))
    lines = records(capsys.readouterr().err)
    assert [(r["level"], r["logger"], r["msg"]) for r in lines] == [
        ("error", operator.PROBE_LOGGER, "Activity 'watches' failed permanently: watch task watch-spans ended")
    ]


# -- help texts --------------------------------------------------------------------------------------


def help_of(parse: Callable[[list[str]], Any], flag: str, capsys: pytest.CaptureFixture[str]) -> str:
    """The help of one option, on one line."""
    with pytest.raises(SystemExit):
        parse(["--help"])
    entries = re.split(r"\n(?=  -)", capsys.readouterr().out)
    (entry,) = [e for e in entries if e.strip().startswith(f"{flag} ")]
    return " ".join(entry.split())


def test_the_capture_renew_deadline_help_says_it_pauses(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(capture_main.parse_args, "--renew-deadline", capsys)
    assert "pause" in text, text
    assert "resume" in text, text
    assert "stop everything" not in text, text
    # It exits 3 only when a renewal finds the Lease deleted or taken, not at the deadline.
    assert "exits 3 only when a renewal finds its Lease deleted or taken" in text, text


def test_no_help_of_the_capture_says_a_late_renewal_fences_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        capture_main.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "fence" not in text, text
    assert "not renewable" not in (capture_main.__doc__ or "")
