"""The capture's Lease keeper (controller/capture/lease_keeper.py, on the one Lease protocol of
controller/kube/lease.py): its writes carry the uid of the Lease it holds (issue 36): a Lease PUT to a missing name
creates it on a real kube-apiserver, so a renewal without the uid re-created a Lease deleted by hand and the
capture never fenced. With the uid the renewal is refused (409); the agent then reads the Lease, and a Lease that
is gone (404) or is another object of that name (another uid) is not its own: LeaseLost, it fences."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest

from controller.capture.lease_keeper import LeaseKeeper, Standing
from controller.kube.client import ApiError, Client
from controller.kube.lease import LeaseLost
from controller.model.progress import Progress

JSON = dict[str, Any]


def lease(agent: LeaseKeeper, uid: str, rv: str, *, holder: str = "c0", acquire: str | None = None) -> JSON:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "capture-c0", "namespace": "ns", "uid": uid, "resourceVersion": rv},
        "spec": {"holderIdentity": holder, "acquireTime": agent.acquire_time if acquire is None else acquire},
    }


class FakeLeases:
    """Answers the agent's Lease requests from scripted answers; records every body written."""

    def __init__(self) -> None:
        self.puts: list[JSON] = []
        self.posts: list[JSON] = []
        self.put_answers: list[JSON | ApiError] = []
        self.post_answers: list[JSON | ApiError] = []
        self.get_answers: list[JSON | ApiError] = []

    @staticmethod
    def _next(answers: list[JSON | ApiError]) -> JSON:
        answer = answers.pop(0)
        if isinstance(answer, ApiError):
            raise answer
        return answer

    async def replace(self, res: Any, ns: str, name: str, body: JSON) -> JSON:
        self.puts.append(body)
        return self._next(self.put_answers)

    async def create(self, res: Any, ns: str, body: JSON) -> JSON:
        self.posts.append(body)
        return self._next(self.post_answers)

    async def get(self, res: Any, ns: str, name: str) -> JSON:
        return self._next(self.get_answers)


class NoDispatchers:
    """The part that runs the dispatchers (``lease_keeper.Dispatchers``): these tests never pause nor resume."""

    def pause_all(self, reason: str) -> None: ...

    async def resume_plan(self, pause: float) -> None: ...

    def resume(self, plan: Any) -> None: ...

    async def report_dropped(self, plan: Any) -> None: ...


def with_agent(check: Callable[[LeaseKeeper, FakeLeases], Awaitable[None]]) -> None:
    async def main() -> None:
        fake = FakeLeases()
        keeper = LeaseKeeper(
            cast(Client, fake),
            "ns",
            "c0",
            duration=10,
            renew_interval=2.0,
            renew_deadline=7.0,
            tick=0.2,
            standing=Standing(),
            dispatchers=NoDispatchers(),
            report=lambda: Progress(incarnation="i", at=0.0, entries=()),
            fence=lambda reason: None,
        )
        await check(keeper, fake)

    asyncio.run(main())


NOT_FOUND = ApiError(404, "NotFound", 'leases.coordination.k8s.io "capture-c0" not found')
CONFLICT = ApiError(409, "Conflict", "Precondition failed: UID in precondition: u1, UID in object meta: ")


def test_the_renewal_carries_the_uid_and_version_of_the_lease_as_last_answered() -> None:
    async def check(agent: LeaseKeeper, fake: FakeLeases) -> None:
        fake.post_answers = [lease(agent, "u1", "10")]
        await agent.acquire()
        assert "uid" not in fake.posts[0]["metadata"]  # a create carries none
        fake.put_answers = [lease(agent, "u1", "11"), lease(agent, "u1", "12")]
        await agent.renew_once()
        await agent.renew_once()
        assert [(b["metadata"]["uid"], b["metadata"]["resourceVersion"]) for b in fake.puts] == [
            ("u1", "10"),
            ("u1", "11"),
        ]

    with_agent(check)


def test_taking_over_an_existing_lease_carries_the_uid_it_read() -> None:
    async def check(agent: LeaseKeeper, fake: FakeLeases) -> None:
        fake.post_answers = [ApiError(409, "AlreadyExists", "exists")]
        fake.get_answers = [lease(agent, "u7", "3", holder="", acquire="2020-01-02T03:04:05.000000Z")]
        fake.put_answers = [lease(agent, "u7", "4")]
        await agent.acquire()
        assert fake.puts[0]["metadata"]["uid"] == "u7"
        assert fake.puts[0]["metadata"]["resourceVersion"] == "3"
        assert agent.lease is not None
        assert (agent.lease["metadata"]["uid"], agent.lease["metadata"]["resourceVersion"]) == ("u7", "4")

    with_agent(check)


def test_a_deleted_lease_refuses_the_renewal_and_is_lost() -> None:
    """The real answer to a renewal (uid carried) of a deleted Lease is 409; the GET that follows finds nothing."""

    async def check(agent: LeaseKeeper, fake: FakeLeases) -> None:
        agent.lease = lease(agent, "u1", "10")
        fake.put_answers = [CONFLICT]
        fake.get_answers = [NOT_FOUND]
        with pytest.raises(LeaseLost, match="deleted"):
            await agent.renew_once()
        fake.put_answers = [NOT_FOUND]  # (a server that answers 404 to it: the same)
        with pytest.raises(LeaseLost, match="deleted"):
            await agent.renew_once()

    with_agent(check)


def test_a_lease_created_again_under_the_same_holder_is_not_ours() -> None:
    """Deleted, then created again (another uid) even with this process's holder and acquireTime: lost."""

    async def check(agent: LeaseKeeper, fake: FakeLeases) -> None:
        agent.lease = lease(agent, "u1", "10")
        fake.put_answers = [CONFLICT]
        fake.get_answers = [lease(agent, "u2", "20")]
        with pytest.raises(LeaseLost, match="created again"):
            await agent.renew_once()

    with_agent(check)


def test_its_own_write_whose_answer_was_lost_is_adopted() -> None:
    """A 409 whose Lease is the same object (uid) still carrying this process's acquireTime: its own write."""

    async def check(agent: LeaseKeeper, fake: FakeLeases) -> None:
        agent.lease = lease(agent, "u1", "10")
        fake.put_answers = [CONFLICT, lease(agent, "u1", "12")]
        fake.get_answers = [lease(agent, "u1", "11")]
        await agent.renew_once()
        assert [(b["metadata"]["uid"], b["metadata"]["resourceVersion"]) for b in fake.puts] == [
            ("u1", "10"),
            ("u1", "11"),
        ]
        assert agent.lease is not None
        assert agent.lease["metadata"]["resourceVersion"] == "12"

    with_agent(check)


def test_the_release_carries_the_uid() -> None:
    async def check(agent: LeaseKeeper, fake: FakeLeases) -> None:
        agent.lease = lease(agent, "u1", "10")
        fake.put_answers = [lease(agent, "u1", "11")]
        await agent.release()
        assert fake.puts[0]["metadata"]["uid"] == "u1"
        assert fake.puts[0]["spec"]["holderIdentity"] == ""

    with_agent(check)
