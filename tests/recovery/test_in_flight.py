"""Hundreds of calls in flight in one real worker process (DESIGN.md §16), against a slow
service that counts what it saw (tests/support/slow_service.py): the worker's database
backends stay a handful, a SIGKILL with 200 calls in flight repeats nothing that is not safe
to repeat, and a kill between answers and their group's commit loses only the answers.

Two HTTP tools declared as data: `slow.keyed` (`idempotency = "header"`: the service
deduplicates on the key, so a retry is safe) and `slow.plain` (no key, no lookup: an answer
lost is a person's to decide, never a repeat).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from guardian.shortcuts import assign_perm

from executor.contract.tool import unregister
from executor.ledger.records import Agent, Attempt, HttpToolSpec, Run, Step
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import State
from executor.services.posting import StepRequest, steps_post
from executor.tools import http as http_tools
from tests.support.cluster import Cluster
from tests.support.slow_service import Running
from tests.support.tooling import assert_within_rate

pytestmark = pytest.mark.django_db(transaction=True)

TOOLS = """
[[tool]]
name = "slow.keyed"
effect = "write"
method = "POST"
url = "@URL@/effects"
idempotency = "header"
external_id = "id"
timeout = 60

[[tool]]
name = "slow.plain"
effect = "write"
method = "POST"
url = "@URL@/effects"
external_id = "id"
timeout = 60
"""

SETTLED = (State.COMPLETED, State.UNKNOWN, State.FAILED, State.DEAD)


@pytest.fixture
def service() -> Iterator[Running]:
    running = Running(latency=2.0)
    yield running
    running.stop()


@pytest.fixture
def slow_tools(
    service: Running, agent: Agent, settings: Any, tmp_path: Path
) -> Iterator[dict[str, str]]:
    """The two tools loaded and granted; the env a worker needs to reach the service."""
    yield load_slow_tools(service.port, agent, settings, tmp_path)
    for spec in HttpToolSpec.objects.all():
        unregister(spec.name)
    http_tools._mine.clear()


def load_slow_tools(port: int, agent: Agent, settings: Any, folder: Path) -> dict[str, str]:
    """Loads and grants the two tools calling 127.0.0.1:`port` (the service, or a proxy in
    front of it); returns the env a worker needs to reach it."""
    allowed = f"127.0.0.1:{port}"
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = [allowed]
    path = folder / "slow.toml"
    path.write_text(TOOLS.replace("@URL@", f"http://{allowed}"))
    call_command("load_tools", str(path), stdout=StringIO())
    for row in ToolRow.objects.filter(name__in=["slow.keyed", "slow.plain"]):
        assign_perm("executor.use_tool", agent.user, row)
    return {"EXECUTOR_HTTP_ALLOWED_HOSTS": allowed}


def post(agent: Agent, run: Run, tool: str, count: int) -> list[Step]:
    steps, created = steps_post(
        agent=agent,
        run=run,
        requests=[StepRequest(f"{tool}-{i}", tool, {"n": i}) for i in range(count)],
    )
    assert all(created)
    return steps


def posts(agent: Agent, run: Run, tool: str, times: int, each: int) -> list[Step]:
    """`times` posts of `each` steps."""
    steps: list[Step] = []
    for n in range(times):
        requests = [StepRequest(f"{tool}-{n}-{i}", tool, {"n": n, "i": i}) for i in range(each)]
        steps += steps_post(agent=agent, run=run, requests=requests)[0]
    return steps


def settled(cluster: Cluster, steps: list[Step], *, seconds: float = 120) -> list[Step]:
    ids = [s.pk for s in steps]

    def done() -> list[Step] | None:
        fresh = list(Step.objects.filter(pk__in=ids))
        return fresh if all(s.state in SETTLED for s in fresh) else None

    return cluster.wait_for(done, what=f"{len(ids)} steps to settle", seconds=seconds)


def worker_backends() -> int:
    """Client backends on the test database other than this test's own connection."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
        )
        (count,) = cursor.fetchone()
    return int(count)


@pytest.mark.postgres
def test_300_calls_in_flight_hold_a_handful_of_database_connections(
    cluster: Cluster, service: Running, slow_tools: dict[str, str], agent: Agent, run: Run
) -> None:
    steps = post(agent, run, "slow.keyed", 300)
    cluster.worker().start(EXECUTOR_MAX_IN_FLIGHT="300", **slow_tools)

    peak_backends = 0
    peak_calls = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        peak_backends = max(peak_backends, worker_backends())
        stats = service.stats()
        peak_calls = max(peak_calls, stats["in_flight"])
        if Step.objects.filter(pk__in=[s.pk for s in steps], state=State.COMPLETED).count() == 300:
            break
        time.sleep(0.05)

    assert Step.objects.filter(run=run, state=State.COMPLETED).count() == 300, cluster.diagnose()
    stats = service.stats()
    assert stats["peak_in_flight"] >= 200, stats["peak_in_flight"]
    # DESIGN.md §16: at most 2 x EXECUTOR_DB_CONNECTIONS + 2, whatever the calls in flight;
    # the engine holds its drain's connection and its lease keeper's.
    assert 0 < peak_backends <= 2 * 4 + 2, peak_backends
    assert stats["effects"] == 300
    assert set(stats["effects_by_key"].values()) == {1}


def test_a_worker_killed_with_200_calls_in_flight_repeats_nothing_unsafe(
    cluster: Cluster, service: Running, slow_tools: dict[str, str], agent: Agent, run: Run
) -> None:
    keyed = post(agent, run, "slow.keyed", 100)
    plain = post(agent, run, "slow.plain", 100)
    worker = cluster.worker().start(**slow_tools)
    cluster.wait_for(
        lambda: service.stats()["in_flight"] >= 200 or None,
        what="200 calls in flight at the service",
    )
    worker.kill()
    cluster.sweeper().start()
    worker.start(**slow_tools)

    keyed_done = settled(cluster, keyed)
    plain_done = settled(cluster, plain)
    time.sleep(3)  # the calls the kill cut off end at the service
    stats = service.stats()
    requests = stats["requests_by_operation"]

    # A keyed call is safe to repeat: every one completed, one effect each, though the calls
    # the kill cut off were sent twice (the same key both times).
    assert {s.state for s in keyed_done} == {State.COMPLETED}, cluster.diagnose()
    assert {stats["effects_by_key"][str(s.operation_id)] for s in keyed_done} == {1}
    # A plain write is not: each was sent once, and as every one was in flight when the
    # worker died (its answer lost), each is a person's to decide, never sent again.
    assert {requests[str(s.operation_id)] for s in plain_done} == {1}
    assert {s.state for s in plain_done} == {State.UNKNOWN}, cluster.diagnose()
    # The service's own count: one effect per step, 200 in all.
    assert stats["effects"] == 200


def test_a_kill_between_answers_and_their_group_commit_loses_only_the_answers(
    cluster: Cluster, service: Running, slow_tools: dict[str, str], agent: Agent, run: Run
) -> None:
    keyed = post(agent, run, "slow.keyed", 40)
    plain = post(agent, run, "slow.plain", 40)
    worker = cluster.worker().start(faults="before_persist:1", **slow_tools)
    assert worker.wait_dead(seconds=60) == 137  # at its first group of answers
    cluster.sweeper().start()
    worker.start(**slow_tools)

    keyed_done = settled(cluster, keyed)
    plain_done = settled(cluster, plain)
    time.sleep(3)  # the killed worker's calls end at the service
    stats = service.stats()
    requests = stats["requests_by_operation"]

    assert {s.state for s in keyed_done} == {State.COMPLETED}, cluster.diagnose()
    assert {stats["effects_by_key"][str(s.operation_id)] for s in keyed_done} == {1}
    assert {requests[str(s.operation_id)] for s in plain_done} == {1}
    # Every plain call was answered or in flight when the group's commit died: its answer
    # was never stored, so a person decides.
    assert {s.state for s in plain_done} == {State.UNKNOWN}


LIMITED_TOOLS = """
[[tool]]
name = "slow.limited"
effect = "write"
method = "POST"
url = "@SLOW@/effects"
idempotency = "header"
max_in_flight = 5

[[tool]]
name = "slow.rated"
effect = "write"
method = "POST"
url = "@FAST@/effects"
idempotency = "header"
rate = "10/s"
"""


def test_a_tools_limits_hold_across_two_worker_processes(
    cluster: Cluster,
    service: Running,
    agent: Agent,
    run: Run,
    tmp_path: Path,
    settings: Any,
) -> None:
    fast = Running(latency=0.05)
    try:
        hosts = [f"127.0.0.1:{service.port}", f"127.0.0.1:{fast.port}"]
        settings.EXECUTOR_HTTP_ALLOWED_HOSTS = hosts
        path = tmp_path / "limited.toml"
        path.write_text(LIMITED_TOOLS.replace("@SLOW@", service.url).replace("@FAST@", fast.url))
        call_command("load_tools", str(path), stdout=StringIO())
        for row in ToolRow.objects.filter(name__in=["slow.limited", "slow.rated"]):
            assign_perm("executor.use_tool", agent.user, row)
        # Three calls in flight per worker: five at once takes both of them.
        for name in ("w1", "w2"):
            cluster.worker(name).start(
                EXECUTOR_HTTP_ALLOWED_HOSTS=",".join(hosts), EXECUTOR_MAX_IN_FLIGHT="3"
            )

        # max_in_flight 5: the service never saw more than 5 of its calls at once, and saw 5,
        # which one worker alone (3 at most) cannot send.
        # Six posts: six messages (one per batch a worker claims), so both workers wake.
        limited = settled(cluster, posts(agent, run, "slow.limited", 6, 5), seconds=180)
        stats = service.stats()
        assert {s.state for s in limited} == {State.COMPLETED}, cluster.diagnose()
        assert stats["peak_in_flight"] == 5, stats["peak_in_flight"]
        assert set(stats["effects_by_key"].values()) == {1}
        workers = set(Attempt.objects.filter(step__in=limited).values_list("worker", flat=True))
        assert len(workers) == 2, workers

        # rate 10/s across both: in any stretch of the service's arrivals, at most 10 + 10 x
        # its length in seconds (+2: each call leaves a few milliseconds after its claim
        # commits, and a group of them may leave a little later than the next). Unlimited,
        # the 40 would arrive within a fraction of a second.
        rated = settled(cluster, posts(agent, run, "slow.rated", 4, 10), seconds=180)
        assert {s.state for s in rated} == {State.COMPLETED}, cluster.diagnose()
        arrivals = sorted(fast.stats()["arrivals"])
        assert len(arrivals) == 40
        assert_within_rate(arrivals, 10, 1, slack=2)
    finally:
        fast.stop()
