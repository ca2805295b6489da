"""Deleting a namespace that holds a Changefeed with spans, dispatchers and operators in flight (issue 22).

Three cases, each ending with the namespace gone (GET 404) within 60 s, on the embedded API, whose namespace
controller deletes the content and waits for finalizers as the real one does (probe
``ns-terminating-create-and-conditions`` of the recorded kube-apiserver):

(a) the maintainer and the captures run: the teardown closes the dispatchers and releases every finalizer;
(b) they were SIGKILLed first: nobody is left to honour the finalizers, and a person runs
    ``kubectl changefeed teardown --wait``, which waits until their Leases lapsed, takes them, and releases
    what they left (docs/operations.md, "Deleting a namespace");
(c) they never ran: nothing carries a finalizer, the namespace goes at once.

On a real cluster (``CFM_TEST_KUBECONFIG``) the same tests delete their own namespaces. The embedded namespace
controller takes the moment a real one does (``NAMESPACE_DELAY``, about 5 s from the namespace's DELETE to its
first pass, issue 36): the tests poll for its outcome, and the plugin's ``teardown --wait`` issued at once waits
for the Changefeed to be marked. The embedded API serves HTTPS here, as a real cluster does.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from controller.cli.__main__ import main
from controller.model.states import OpPhase
from tests.integration.harness import CHANGEFEED, Api, System, Watch, all_settled, set_hooks

EMBEDDED_TLS = True
CAPTURES = ["c0", "c1", "c2"]
GONE_WITHIN = 60.0


def boot_with_operators_in_flight(api: Api, system: System) -> Watch:
    watch = Watch(api, system)
    for c in CAPTURES:
        system.capture(c)
    watch.until(lambda s: all(s.alive(c) for c in CAPTURES), "captures registered", 30)
    api.create("changefeeds", "Changefeed", CHANGEFEED, {"scheduler": {"balanceIntervalSeconds": 0}})
    api.table(1, 4)
    api.table(2, 0)
    system.maintainer("m1")
    snap = watch.until(lambda s: len(s.spans) == 5 and all_settled(s), "initial placement", 60)
    # Destinations' creates held: every Move below stays in flight, its destination not yet started.
    set_hooks(api, system, CAPTURES, pause_create="*")
    for i, span in enumerate(sorted(snap.spans.values(), key=lambda s: s.name)[:3]):
        to = next(c for c in CAPTURES if c != span.capture)
        api.operator(f"move-{i}", "Move", [span.name], target=to)
    watch.until(
        lambda s: len([o for o in s.operators.values() if o.phase is OpPhase.RUNNING]) == 3,
        "three Moves running",
        30,
    )
    return watch


def delete_namespace(api: Api) -> None:
    api.ok("DELETE", f"/api/v1/namespaces/{api.namespace}")


def namespace_gone(api: Api, within: float = GONE_WITHIN) -> float:
    """Seconds until GET of the namespace answers 404; fails with what is left after ``within``."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        status, _ = api.req("GET", f"/api/v1/namespaces/{api.namespace}")
        if status == 404:
            return time.monotonic() - start
        time.sleep(0.2)
    _, ns = api.req("GET", f"/api/v1/namespaces/{api.namespace}")
    conditions = [(c.get("type"), c.get("message")) for c in (ns.get("status") or {}).get("conditions") or []]
    raise AssertionError(f"namespace {api.namespace} still there after {within:g}s: {conditions}")


def plugin(api: Api, *args: str) -> int:
    return main(["--kubeconfig", str(api.kubeconfig), "-n", api.namespace, *args])


def test_a_running_system_tears_down_and_the_namespace_goes(api: Api, system: System) -> None:
    boot_with_operators_in_flight(api, system)
    delete_namespace(api)
    namespace_gone(api)


def test_a_maintainer_that_lost_its_lease_to_the_namespace_releases_the_rest(api: Api, system: System) -> None:
    """(a') The chart's case: the namespace controller deletes the Leases with everything else, so the
    maintainer's term ends (its Lease cannot be created again) and no capture can renew: nobody could finish
    the teardown. Here the captures died first (their dispatchers need the maintainer to release them); the
    maintainer, finding its namespace terminating, releases our finalizers (controller/kube/namespace.py),
    and on SIGTERM it exits cleanly."""
    boot_with_operators_in_flight(api, system)
    for c in CAPTURES:
        system.signal(c)
    # The maintainer frozen while the namespace controller deletes the Leases and marks the rest: when it runs
    # again its term is over by its own clock (no renewal for longer than the renew deadline), as a pod whose
    # Lease was deleted finds, and it is stopped at once, as the pod is.
    m1 = system.procs["m1"].popen.pid
    os.killpg(m1, signal.SIGSTOP)
    delete_namespace(api)
    deadline = time.monotonic() + 30
    while api.get("leases", f"cfm-{CHANGEFEED}") is not None:  # the namespace controller's moment (about 5 s)
        assert time.monotonic() < deadline, "the namespace controller did not delete the maintainer's Lease"
        time.sleep(0.2)
    os.killpg(m1, signal.SIGCONT)
    assert system.signal("m1", signal.SIGTERM, wait=40) == 0, system.tails()
    namespace_gone(api, within=10)
    # Released by the stop, or in part by the janitor first (it runs as soon as the process resumes and releases
    # what is being deleted already; the stop releases the rest): one or two lines, never none.
    assert 1 <= system.gone["m1"].count("is being deleted: released") <= 2, system.tails()


def test_a_killed_system_is_released_by_the_plugin(
    api: Api, system: System, capsys: pytest.CaptureFixture[str]
) -> None:
    """(b) SIGKILLed, then the namespace deleted: it stays Terminating until a person runs the plugin, which
    may be at once (the documented way out): ``teardown --wait`` waits for the namespace controller to mark the
    Changefeed (a few seconds later; issue 36: it exited 2, "no Changefeed is being deleted"), then finishes."""
    watch = boot_with_operators_in_flight(api, system)
    assert any(d.finalizers for d in watch.poll().dispatchers.values())
    system.stop_all()  # SIGKILL: nobody honours a finalizer from here on
    delete_namespace(api)
    capsys.readouterr()
    assert plugin(api, "teardown", "--wait", "--timeout", "60") == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert f"changefeed {CHANGEFEED} released" in out, out
    namespace_gone(api)


def test_teardown_wait_refuses_outside_a_namespace_being_deleted(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    """Without a namespace being deleted, nobody will mark the Changefeed: ``--wait`` refuses at once (exit 2)."""
    api.create("changefeeds", "Changefeed", CHANGEFEED, {})
    capsys.readouterr()
    assert plugin(api, "teardown", "--wait", "--timeout", "60") == 2
    assert "no Changefeed is being deleted" in capsys.readouterr().err


def test_after_helm_uninstall_the_plugin_proves_nothing_runs_first(
    api: Api, system: System, capsys: pytest.CaptureFixture[str]
) -> None:
    """The maintainer and captures gone (killed, or uninstalled) and the Changefeed deleted by a person:
    the plugin refuses while their Leases are current, then takes the lapsed Leases and releases."""
    boot_with_operators_in_flight(api, system)
    system.stop_all()
    capsys.readouterr()
    assert plugin(api, "teardown", "-c", CHANGEFEED) == 2, "a Changefeed not being deleted is refused"
    assert "is not being deleted" in capsys.readouterr().err
    api.ok("DELETE", api.path("changefeeds", CHANGEFEED))
    assert plugin(api, "teardown") == 1, "refused at once: the Leases of the killed processes are current"
    assert "is alive (Lease" in capsys.readouterr().err
    assert plugin(api, "teardown", "--wait", "--timeout", "30") == 0
    out = capsys.readouterr().out
    assert "lease capture-c0 taken from c0" in out
    assert f"lease cfm-{CHANGEFEED} taken from m1" in out
    assert f"changefeed {CHANGEFEED} released" in out
    assert api.get("changefeeds", CHANGEFEED) is None
    for t in api.list("tables"):
        assert t["status"]["state"] == "Detached"
        assert not t["metadata"].get("finalizers")
        assert set(t["status"]["spans"].values()) == {0}
    delete_namespace(api)
    namespace_gone(api)


def test_a_namespace_whose_system_never_ran_goes_at_once(api: Api) -> None:
    api.create("changefeeds", "Changefeed", CHANGEFEED, {})
    api.table(1, 2)
    api.operator("move-0", "Move", ["s-nonexistent"], target="c0")
    delete_namespace(api)
    namespace_gone(api)
