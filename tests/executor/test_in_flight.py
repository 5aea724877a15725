"""Calls in flight (DESIGN.md §16): a drain keeps many calls waiting at once, none holding a
database connection or a thread that touches the database, and writes their commit points
in groups: the `submitting` marks of the calls about to start in one commit, the answers
that arrived together in another.

In-process, on the test's own connection: the calls run on the call loop (executor/engine/calls.py)
while the drain's thread, the test's, does every write. Real workers, kills and PostgreSQL's
backends are in tests/recovery/test_in_flight.py.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from io import StringIO
from pathlib import Path
from typing import Any, ClassVar
from unittest.mock import patch

import pytest
from django.core.management import call_command
from django.db.backends.signals import connection_created
from django.utils import timezone
from guardian.shortcuts import assign_perm

import executor.engine.commits as commits
import executor.engine.runtime as runtime
from executor import engine
from executor.common import dispatch
from executor.contract.tool import Invocation, ToolResult, register, unregister
from executor.ledger.records import (
    Agent,
    Attempt,
    Effect,
    HttpToolSpec,
    Idempotency,
    Phase,
    Run,
    RunStatus,
    Step,
)
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import State
from executor.services.runs import run_create
from executor.services.tools import tools_sync
from executor.tools import http as http_tools
from tests.support import tooling
from tests.support.slow_service import Running
from tests.support.tooling import (
    ScriptedTool,
    WriteTool,
    assert_within_rate,
    expire_lease,
    post_many,
    reload,
)

pytestmark = pytest.mark.django_db


class Concurrency:
    """How many calls a tool has had waiting at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0
        self.threads: set[str] = set()

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.threads.add(threading.current_thread().name)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


class SlowWrite(ScriptedTool):
    """A plain (blocking) write that takes DELAY seconds."""

    name = "test.slow_write"
    effect = Effect.WRITE
    idempotency = Idempotency.NONE
    DELAY: ClassVar[float] = 0.3
    seen: ClassVar[Concurrency] = Concurrency()

    def invoke(self, call: Invocation) -> ToolResult:
        self.seen.enter()
        try:
            time.sleep(self.DELAY)
            return super().invoke(call)
        finally:
            self.seen.leave()


class AsyncWrite(ScriptedTool):
    """A Python tool with `async def invoke`: awaited on the worker's event loop."""

    name = "test.async_write"
    effect = Effect.WRITE
    idempotency = Idempotency.KEY
    seen: ClassVar[Concurrency] = Concurrency()

    async def invoke(self, call: Invocation) -> ToolResult:  # type: ignore[override]
        self.seen.enter()
        try:
            await asyncio.sleep(0.3)
        finally:
            self.seen.leave()
        type(self).calls.append(call)
        return ToolResult(result={"n": call.input["n"]}, external_id=f"a-{call.input['n']}")


@pytest.fixture(autouse=True)
def tools(agent: Agent) -> Iterator[None]:
    SlowWrite.seen = Concurrency()
    AsyncWrite.seen = Concurrency()
    with tooling.installed(agent), dispatch.publishing(dispatch.dropping_publisher):
        for cls in (SlowWrite, AsyncWrite):
            cls.reset()
            register(cls)
        tools_sync()
        for row in ToolRow.objects.filter(name__in=[SlowWrite.name, AsyncWrite.name]):
            assign_perm("executor.use_tool", agent.user, row)
        try:
            yield
        finally:
            for cls in (SlowWrite, AsyncWrite):
                unregister(cls.name)


@pytest.fixture
def db_threads() -> Iterator[set[str]]:
    """The threads that opened a database connection meanwhile."""
    opened: set[str] = set()

    def note(**_: Any) -> None:
        opened.add(threading.current_thread().name)

    connection_created.connect(note)
    try:
        yield opened
    finally:
        connection_created.disconnect(note)


@contextmanager
def delayed(cls: type[SlowWrite], seconds: float) -> Iterator[None]:
    """The slow tool's calls take `seconds` meanwhile."""
    before = cls.DELAY
    cls.DELAY = seconds
    try:
        yield
    finally:
        cls.DELAY = before


def test_plain_writes_wait_together_on_threads_that_never_touch_the_database(
    agent: Agent, run: Run, settings: Any, db_threads: set[str]
) -> None:
    settings.EXECUTOR_MAX_IN_FLIGHT = 40
    steps = post_many(agent, run, SlowWrite.name, 40)

    assert engine.drain(worker="w1") == 40

    assert {reload(s).state for s in steps} == {State.COMPLETED}
    assert len(SlowWrite.calls) == 40
    assert SlowWrite.seen.peak == 40  # every call was waiting at once
    assert all(name.startswith("stepward-call") for name in SlowWrite.seen.threads)
    assert not [name for name in db_threads if name.startswith("stepward-call")], db_threads
    # The 40 `submitting` marks were one commit (one `now`), before any call was made.
    attempts = Attempt.objects.filter(step__in=steps)
    assert attempts.values("submitted_at").distinct().count() == 1
    assert set(attempts.values_list("phase", flat=True)) == {Phase.RESPONDED}


def test_async_tools_are_awaited_on_the_event_loop(agent: Agent, run: Run, settings: Any) -> None:
    settings.EXECUTOR_MAX_IN_FLIGHT = 100
    steps = post_many(agent, run, AsyncWrite.name, 100)

    assert engine.drain(worker="w1") == 100

    assert {reload(s).state for s in steps} == {State.COMPLETED}
    assert AsyncWrite.seen.peak == 100
    assert AsyncWrite.seen.threads == {"stepward-calls"}  # the loop's own thread
    assert sorted(reload(s).external_id for s in steps) == sorted(f"a-{i}" for i in range(100))


def test_no_more_calls_than_the_limit_are_in_flight(agent: Agent, run: Run, settings: Any) -> None:
    settings.EXECUTOR_MAX_IN_FLIGHT = 7
    with delayed(SlowWrite, 0.1):
        steps = post_many(agent, run, SlowWrite.name, 30)
        assert engine.drain(worker="w1") == 30

    assert {reload(s).state for s in steps} == {State.COMPLETED}
    assert SlowWrite.seen.peak == 7
    assert len(SlowWrite.calls) == 30


def test_calls_beyond_the_runs_budget_are_never_made(agent: Agent, settings: Any) -> None:
    settings.EXECUTOR_MAX_IN_FLIGHT = 20
    run, _ = run_create(agent=agent, name="capped", max_calls=5)
    steps = post_many(agent, run, SlowWrite.name, 12)

    engine.drain(worker="w1")

    fresh = Run.objects.get(pk=run.pk)
    assert (fresh.status, fresh.used_calls) == (RunStatus.PAUSED, 5)
    assert len(SlowWrite.calls) == 5
    states = sorted(reload(s).state for s in steps)
    assert states == sorted([State.COMPLETED] * 5 + [State.PENDING] * 7)


def test_a_write_whose_lease_was_taken_over_before_its_submitting_mark_is_not_called(
    agent: Agent, run: Run
) -> None:
    steps = post_many(agent, run, WriteTool.name, 3)
    claims = engine.claim(worker="A", writes=10).claims
    taken = steps[1]
    expire_lease(taken)
    Step.objects.filter(pk=taken.pk).update(fence=taken.fence + 5)  # another worker's now

    ready, stopped = engine.submit_many(claims, now=timezone.now())

    assert [c.step.pk for c in ready] == [steps[0].pk, steps[2].pk]
    assert stopped == {taken.pk: engine.Outcome.FENCED_OUT}
    assert Attempt.objects.get(step=taken, worker="A").fenced_out_write == "submitting"
    assert set(
        Attempt.objects.filter(step__in=[steps[0], steps[2]]).values_list("phase", flat=True)
    ) == {Phase.SUBMITTING}


def test_answers_that_arrive_together_are_committed_together(
    agent: Agent, run: Run, settings: Any
) -> None:
    # Ten writes answered at once: their responses are stored in one commit and their
    # completions in one more, not two commits each.
    settings.EXECUTOR_MAX_IN_FLIGHT = 10
    steps = post_many(agent, run, SlowWrite.name, 10)
    with pytest.MonkeyPatch.context() as patch:
        groups: list[int] = []
        real = commits.store_answers

        def store(claims: Any, answers: Any, *, target: State) -> dict[Any, str]:
            groups.append(len(claims))
            return real(claims, answers, target=target)

        patch.setattr(commits, "store_answers", store)
        # All ten answer at the same moment (the tool sleeps, then they wait here).
        gate = threading.Barrier(10)
        SlowWrite.will(*[lambda call: (gate.wait(30), ToolResult(result={}))[1]] * 10)
        assert engine.drain(worker="w1") == 10

    assert {reload(s).state for s in steps} == {State.COMPLETED}
    assert sum(groups) == 10
    assert len(groups) < 10  # grouped (how many groups depends on when each arrived)


# --- HTTP tools on the async client, against a slow service ---------------------------------


@pytest.fixture(scope="module")
def slow_service() -> Iterator[Running]:
    service = Running(latency=0.5)
    yield service
    service.stop()


@pytest.fixture
def slow_tool(slow_service: Running, agent: Agent, settings: Any, tmp_path: Path) -> Iterator[str]:
    slow_service.reset()
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{slow_service.port}"]
    path = tmp_path / "slow.toml"
    path.write_text(
        "[[tool]]\n"
        'name = "slow.create"\n'
        'effect = "write"\n'
        'method = "POST"\n'
        f'url = "{slow_service.url}/effects"\n'
        'idempotency = "header"\n'
        'external_id = "id"\n'
    )
    call_command("load_tools", str(path), stdout=StringIO())
    assign_perm("executor.use_tool", agent.user, ToolRow.objects.get(name="slow.create"))
    yield "slow.create"
    for spec in HttpToolSpec.objects.all():
        unregister(spec.name)
    http_tools._mine.clear()


def test_http_tools_wait_on_the_async_client_each_key_sent_once(
    agent: Agent, run: Run, settings: Any, slow_service: Running, slow_tool: str
) -> None:
    settings.EXECUTOR_MAX_IN_FLIGHT = 60
    steps = post_many(agent, run, slow_tool, 60)

    assert engine.drain(worker="w1") == 60

    assert {reload(s).state for s in steps} == {State.COMPLETED}
    stats = slow_service.stats()
    assert stats["peak_in_flight"] == 60
    assert stats["requests"] == stats["effects"] == 60
    assert set(stats["effects_by_key"].values()) == {1}
    assert {str(s.operation_id) for s in steps} == set(stats["effects_by_key"])
    assert len({reload(s).external_id for s in steps}) == 60


def test_the_drains_connection_is_the_only_one_its_calls_use(
    agent: Agent, run: Run, settings: Any, slow_tool: str, db_threads: set[str]
) -> None:
    settings.EXECUTOR_MAX_IN_FLIGHT = 30
    post_many(agent, run, slow_tool, 30)

    assert engine.drain(worker="w1") == 30

    # Only the lease keeper opens a connection of its own; no call does.
    assert db_threads <= {"stepward-leases"}, db_threads


# --- per-tool limits (API.md "Slow tools") ---------------------------------------------------


class LimitedWrite(SlowWrite):
    """A slow write whose API takes 3 calls at a time."""

    name = "test.limited_write"
    max_in_flight = 3
    seen: ClassVar[Concurrency] = Concurrency()


class RatedRead(ScriptedTool):
    name = "test.rated_read"
    effect = Effect.READ
    idempotency = Idempotency.NONE
    rate = "5/s"


@pytest.fixture
def limited(agent: Agent) -> Iterator[None]:
    LimitedWrite.seen = Concurrency()
    for cls in (LimitedWrite, RatedRead):
        cls.reset()
        register(cls)
    tools_sync()
    for row in ToolRow.objects.filter(name__in=[LimitedWrite.name, RatedRead.name]):
        assign_perm("executor.use_tool", agent.user, row)
    yield
    for cls in (LimitedWrite, RatedRead):
        unregister(cls.name)


def test_the_declared_limits_are_mirrored_into_the_tools_row(limited: None) -> None:
    row = ToolRow.objects.get(name=LimitedWrite.name)
    assert (row.max_in_flight, row.rate) == (3, "")
    assert ToolRow.objects.get(name=RatedRead.name).rate == "5/s"


def test_a_tool_at_its_limit_leaves_its_steps_pending(
    agent: Agent, run: Run, limited: None
) -> None:
    steps = post_many(agent, run, LimitedWrite.name, 5)

    batch = engine.claim(worker="A", writes=10)

    assert len(batch.claims) == 3
    assert batch.full == {LimitedWrite.name}
    left = [reload(s) for s in steps if s.pk not in {c.step.pk for c in batch.claims}]
    assert [(s.state, s.attempt_count) for s in left] == [(State.PENDING, 0)] * 2
    # While the three are leased, another claim takes none of the tool's steps.
    assert engine.claim(worker="B", writes=10).claims == []


def test_a_worker_claims_a_limited_tools_steps_only_as_far_as_it_can_send_them(
    agent: Agent, run: Run, limited: None
) -> None:
    # Worker A can send 2 calls now (its room ahead is for tools without limits): it takes
    # 2 of the tool's 3 rooms, and B, with room, takes the third at once.
    post_many(agent, run, LimitedWrite.name, 5)

    first = engine.claim(worker="A", writes=10, limited=2)
    second = engine.claim(worker="B", writes=10, limited=8)

    assert (len(first.claims), len(second.claims)) == (2, 1)
    assert first.full == set()  # A left the rest for room it does not have, not the tool's
    assert second.full == {LimitedWrite.name}


def test_a_drain_with_few_calls_of_room_claims_no_limited_steps_to_wait_in_it(
    agent: Agent, run: Run, settings: Any, limited: None
) -> None:
    settings.EXECUTOR_MAX_IN_FLIGHT = 1
    seen: list[int] = []
    original = engine.claim

    def counting(**kwargs: Any) -> Any:
        batch = original(**kwargs)
        seen.append(sum(c.step.tool_id == LimitedWrite.name for c in batch.claims))
        return batch

    with delayed(LimitedWrite, 0.05), patch.object(runtime, "claim", counting):
        steps = post_many(agent, run, LimitedWrite.name, 4)
        assert engine.drain(worker="w1") == 4

    assert {reload(s).state for s in steps} == {State.COMPLETED}
    # One call in flight at a time, and never more claimed than that: nothing waited in the
    # drain holding one of the tool's three rooms.
    assert max(seen) == 1


def test_max_in_flight_holds_while_a_drain_has_room_for_more(
    agent: Agent, run: Run, settings: Any, limited: None
) -> None:
    settings.EXECUTOR_MAX_IN_FLIGHT = 50
    with delayed(LimitedWrite, 0.1):
        steps = post_many(agent, run, LimitedWrite.name, 12)
        assert engine.drain(worker="w1") == 12

    assert {reload(s).state for s in steps} == {State.COMPLETED}
    assert LimitedWrite.seen.peak == 3


def test_an_admins_override_wins_over_the_declaration(
    agent: Agent, run: Run, settings: Any, limited: None
) -> None:
    settings.EXECUTOR_MAX_IN_FLIGHT = 50
    ToolRow.objects.filter(name=LimitedWrite.name).update(max_in_flight_override=1)
    with delayed(LimitedWrite, 0.05):
        post_many(agent, run, LimitedWrite.name, 6)
        assert engine.drain(worker="w1") == 6

    assert LimitedWrite.seen.peak == 1


def test_a_rate_is_a_bucket_of_its_calls_refilled_at_the_rate(
    agent: Agent, run: Run, settings: Any, limited: None
) -> None:
    settings.EXECUTOR_MAX_IN_FLIGHT = 50
    steps = post_many(agent, run, RatedRead.name, 12)

    assert engine.drain(worker="w1") == 12

    assert {reload(s).state for s in steps} == {State.COMPLETED}
    times = sorted(Attempt.objects.filter(step__in=steps).values_list("claimed_at", flat=True))
    assert len(times) == 12
    # "5/s": at most 5 at once, then one more each 0.2 s — in any stretch of the drain, at
    # most 5 + 5 x its length in seconds (an attempt is claimed at the bucket's own clock).
    assert_within_rate(times, 5, 1)


def test_steps_of_a_tool_at_its_limit_do_not_hide_other_tools_steps(
    agent: Agent, run: Run, settings: Any, limited: None
) -> None:
    settings.EXECUTOR_MAX_IN_FLIGHT = 50
    settings.EXECUTOR_BATCH_SIZE = 10
    limited_steps = post_many(agent, run, LimitedWrite.name, 20)  # the oldest due
    others = post_many(agent, run, AsyncWrite.name, 5)

    assert engine.drain(worker="w1") == 25

    def claimed(step: Step) -> Any:
        return Attempt.objects.get(step=step).claimed_at

    # The others were claimed while the limited tool's first three calls were in flight,
    # not after its twenty.
    fourth = sorted(claimed(s) for s in limited_steps)[3]
    assert max(claimed(s) for s in others) < fourth


def test_a_tool_table_with_a_bad_limit_is_refused_naming_the_field(settings: Any) -> None:
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = ["127.0.0.1:9"]
    table = {"name": "x.create", "effect": "write", "url": "http://127.0.0.1:9/x"}

    assert http_tools.spec_errors(table) == []
    rate = "'fast' is not a rate like 20/s, 600/m or 1000/h (at least 1)"
    assert http_tools.spec_errors({**table, "rate": "fast", "max_in_flight": 0}) == [
        "tool x.create: field 'max_in_flight': must be a whole number of calls, at least 1",
        f"tool x.create: field 'rate': {rate}",
    ]


# --- fair claiming across runs ------------------------------------------------------------------


def test_a_run_with_many_steps_due_does_not_make_another_runs_steps_wait(
    agent: Agent, settings: Any
) -> None:
    big, _ = run_create(agent=agent, name="ten thousand, say")
    small, _ = run_create(agent=agent, name="a few")
    post_many(agent, big, SlowWrite.name, 300)  # due first
    later = post_many(agent, small, SlowWrite.name, 5)

    batch = engine.claim(worker="A", writes=10)

    # Round-robin by run: each run's first due step, then each one's second, and so on.
    taken = [c.step.run_id for c in batch.claims]
    assert sorted(taken, key=str) == sorted([big.pk] * 5 + [small.pk] * 5, key=str)
    assert {c.step.pk for c in batch.claims} >= {s.pk for s in later}
    # Within a run, posting order still.
    positions = [c.step.position for c in batch.claims if c.step.run_id == big.pk]
    assert positions == [1, 2, 3, 4, 5]


def test_a_worker_process_collects_its_garbage_less_often() -> None:
    # Celery sends worker_init in the worker's parent and worker_process_init in each
    # prefork child: both freeze what start-up made and raise the first generation's
    # threshold (executor/worker/tasks.py, DESIGN.md §16).
    from celery.signals import worker_init, worker_process_init

    from executor.worker import tasks

    for signal in (worker_init, worker_process_init):
        assert tasks.quieter_garbage_collector in signal._live_receivers(None)
    before = gc.get_threshold()
    try:
        tasks.quieter_garbage_collector()
        assert gc.get_threshold() == tasks.GC_THRESHOLD != before
        assert gc.get_freeze_count() > 0
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
