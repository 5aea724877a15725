"""The engine in batches (DESIGN.md §14): the commit points of §5 kept per step, a fixed cost
per batch, authorization and budgets decided step by step from facts read once, fences
checked row by row, and concurrent drainers never sharing a step."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from guardian.shortcuts import assign_perm, remove_perm

from executor import engine
from executor.common import dispatch
from executor.contract.tool import Invocation, ToolResult
from executor.engine import recovery
from executor.ledger.records import Agent, Attempt, Phase, Run, RunStatus, Workspace
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import State
from executor.services.accounts import agent_create
from executor.services.runs import run_create
from tests.support import tooling
from tests.support.tooling import PureTool, ReadTool, WriteTool, expire_lease, post_many, reload

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def engine_env(agent: Agent) -> Iterator[None]:
    with tooling.installed(agent), dispatch.publishing(dispatch.dropping_publisher):
        yield


# A statement of data-modifying CTEs (`WITH … AS (UPDATE …)`) writes too.
WRITES_IN_CTE = re.compile(r"\b(INSERT|UPDATE|DELETE)\b")


@contextmanager
def commits() -> Iterator[list[str]]:
    """Counts this connection's write transactions: the commits of atomic blocks, and each
    write statement run outside one (autocommit)."""
    seen: list[str] = []
    real_commit = connection.commit

    def commit() -> None:
        seen.append("commit")
        real_commit()

    def autocommitted(execute: Any, sql: str, *args: Any) -> Any:
        text = sql.lstrip().upper()
        writes = text.startswith(("INSERT", "UPDATE", "DELETE")) or (
            text.startswith("WITH") and WRITES_IN_CTE.search(text) is not None
        )
        if not connection.in_atomic_block and writes:
            seen.append(sql)
        return execute(sql, *args)

    connection.commit = commit  # type: ignore[method-assign]
    try:
        with connection.execute_wrapper(autocommitted):
            yield seen
    finally:
        del connection.commit


# --- the commit points, per step and per batch ------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_pure_step_takes_two_commits(agent: Agent, run: Run) -> None:
    [step] = post_many(agent, run, "test.pure", 1)

    with commits() as seen:
        assert engine.process(step.pk, worker="w1") == State.COMPLETED

    assert len(seen) == 2  # claim + authorize + submitting; completed


@pytest.mark.django_db(transaction=True)
def test_a_write_step_takes_four_commits(agent: Agent, run: Run) -> None:
    [step] = post_many(agent, run, "test.write", 1)

    with commits() as seen:
        assert engine.process(step.pk, worker="w1") == State.COMPLETED

    assert len(seen) == 4  # claim + authorize; submitting; responded; completed


@pytest.mark.django_db(transaction=True)
def test_a_batch_of_pure_steps_takes_two_commits_in_all(agent: Agent, run: Run) -> None:
    steps = post_many(agent, run, "test.pure", 40)

    with commits() as seen:
        assert engine.drain(worker="w1") == 40

    # The batch's claim, its outcomes, and the look that found nothing more due.
    assert len(seen) == 3
    assert {reload(s).state for s in steps} == {State.COMPLETED}
    assert len(PureTool.calls) == 40


def test_a_batch_costs_the_same_statements_whatever_its_size(agent: Agent) -> None:
    def statements_to_drain(count: int) -> int:
        run, _ = run_create(agent=agent, name=f"{count} steps")
        post_many(agent, run, "test.pure", count)
        with CaptureQueriesContext(connection) as queries:
            assert engine.drain(worker="w1") == count
        return len(queries.captured_queries)

    assert statements_to_drain(3) == statements_to_drain(90)


def test_batches_are_as_large_as_the_setting(agent: Agent, run: Run, settings: Any) -> None:
    settings.EXECUTOR_BATCH_SIZE = 10
    steps = post_many(agent, run, "test.pure", 25)

    assert engine.drain(worker="w1") == 25

    claim_times = {reload(s).events.get(to_state=State.RUNNING).created_at for s in steps}
    assert len(claim_times) == 3  # 10 + 10 + 5


def test_pure_steps_of_a_batch_are_submitted_in_the_claim_commit(agent: Agent, run: Run) -> None:
    steps = post_many(agent, run, "test.pure", 3)

    batch = engine.claim(worker="w1", light=10)

    # Due at the same moment: in no particular order.
    assert {c.step.pk for c in batch.claims} == {s.pk for s in steps}
    for c in batch.claims:
        attempt = Attempt.objects.get(pk=c.attempt.pk)
        assert (attempt.phase, attempt.fence) == (Phase.SUBMITTING, 1)
        assert attempt.request_evidence == {"tool": "test.pure", "input": c.step.input}
    assert Run.objects.get(pk=run.pk).used_calls == 3
    assert PureTool.calls == []


def test_write_steps_of_a_batch_wait_claimed_until_their_own_submission(
    agent: Agent, run: Run
) -> None:
    post_many(agent, run, "test.write", 2)

    batch = engine.claim(worker="w1", writes=10)

    assert {Attempt.objects.get(pk=c.attempt.pk).phase for c in batch.claims} == {Phase.CLAIMED}
    assert Run.objects.get(pk=run.pk).used_calls == 0


def test_a_claim_takes_no_more_writes_than_asked(agent: Agent, run: Run) -> None:
    post_many(agent, run, "test.write", 5)
    post_many(agent, run, "test.pure", 5)

    batch = engine.claim(worker="w1", light=10, writes=2)

    tools = sorted(c.step.tool_id for c in batch.claims)
    assert tools == ["test.pure"] * 5 + ["test.write"] * 2


# --- decided step by step ------------------------------------------------------------------


def test_authorization_is_decided_for_each_step_of_a_batch(
    agent: Agent, run: Run, workspace: Workspace
) -> None:
    other, _ = agent_create(workspace=workspace, name="other-bot")
    for row in ToolRow.objects.filter(name__startswith="test."):
        assign_perm("executor.use_tool", other.user, row)
    other_run, _ = run_create(agent=other, name="other")
    mine = post_many(agent, run, "test.pure", 3)
    theirs = post_many(other, other_run, "test.pure", 3)
    remove_perm("executor.use_tool", other.user, ToolRow.objects.get(name="test.pure"))

    assert engine.drain(worker="w1") == 3

    assert {reload(s).state for s in mine} == {State.COMPLETED}
    for step in theirs:
        blocked = reload(step)
        assert blocked.state == State.BLOCKED
        assert "may no longer use test.pure" in blocked.failure_message
        [attempt] = blocked.attempts.all()
        assert (attempt.phase, attempt.submitted_at) == (Phase.ABANDONED, None)
    assert len(PureTool.calls) == 3


def test_a_batch_takes_only_the_calls_its_run_has_budget_for(agent: Agent) -> None:
    run, _ = run_create(agent=agent, name="capped", max_calls=3)
    steps = post_many(agent, run, "test.pure", 5)

    engine.drain(worker="w1")

    assert [reload(s).state for s in steps] == [State.COMPLETED] * 3 + [State.PENDING] * 2
    fresh = Run.objects.get(pk=run.pk)
    assert (fresh.status, fresh.used_calls) == (RunStatus.PAUSED, 3)
    assert "max_calls" in fresh.pause_reason
    assert len(PureTool.calls) == 3
    released = Attempt.objects.filter(step__in=steps[3:])
    assert {(a.phase, a.error_class) for a in released} == {(Phase.ABANDONED, "budget")}


def test_a_fenced_out_step_of_a_batch_writes_nothing_while_the_others_complete(
    agent: Agent, run: Run
) -> None:
    steps = post_many(agent, run, "test.pure", 3)
    batch = engine.claim(worker="A", light=10)
    taken = steps[1]
    expire_lease(taken)
    assert recovery.recover_expired(taken.pk) == State.PENDING
    [b_claim] = engine.claim(worker="B", step_ids=[taken.pk]).claims

    ends = engine.run_light(batch.claims)

    assert ends == {
        steps[0].pk: State.COMPLETED,
        taken.pk: engine.Outcome.FENCED_OUT,
        steps[2].pk: State.COMPLETED,
    }
    row = reload(taken)
    assert (row.state, row.lease_owner, row.result) == (State.RUNNING, "B", None)
    refused = Attempt.objects.get(step=taken, worker="A")
    assert refused.fenced_out_write == "responded"
    assert engine.run_light([b_claim]) == {taken.pk: State.COMPLETED}


def test_extend_leases_renews_the_held_and_names_the_lost(agent: Agent, run: Run) -> None:
    first, second = post_many(agent, run, "test.write", 2)
    claims = engine.claim(worker="A", writes=10).claims
    expire_lease(second)
    recovery.recover_expired(second.pk)
    engine.claim(worker="B", step_ids=[second.pk])
    lease_b = reload(second).lease_expires_at

    lost = engine.extend_leases(claims, now=reload(first).lease_expires_at)

    assert [c.step.pk for c in lost] == [second.pk]
    assert reload(first).lease_expires_at > claims[0].step.lease_expires_at
    assert reload(second).lease_expires_at == lease_b


# --- threads and concurrent drainers ------------------------------------------------------------


def drain_in_thread(
    worker: str, counts: dict[str, int], start: threading.Barrier
) -> threading.Thread:
    def run() -> None:
        try:
            # Connected first, so neither drainer starts a connection behind the other.
            connection.ensure_connection()
            start.wait(timeout=30)
            counts[worker] = engine.drain(worker=worker)
        finally:
            connection.close()

    return threading.Thread(target=run, name=worker)


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_drainers_never_claim_one_step_both(
    agent: Agent, run: Run, settings: Any
) -> None:
    settings.EXECUTOR_BATCH_SIZE = 20
    steps = post_many(agent, run, "test.pure", 200)
    counts: dict[str, int] = {}
    start = threading.Barrier(2)
    threads = [drain_in_thread(name, counts, start) for name in ("A", "B")]

    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert sum(counts.values()) == 200
    assert {reload(s).state for s in steps} == {State.COMPLETED}
    assert Attempt.objects.filter(step__run=run).count() == 200
    called = [call.step_id for call in PureTool.calls]
    assert len(called) == len(set(called)) == 200
    if connection.vendor == "postgresql":
        # SKIP LOCKED lets both work side by side rather than one after the other.
        assert min(counts.values()) > 0


@pytest.mark.django_db(transaction=True)
def test_write_steps_run_in_the_pool_each_called_once(
    agent: Agent, run: Run, settings: Any
) -> None:
    settings.EXECUTOR_MAX_IN_FLIGHT = 3
    steps = post_many(agent, run, "test.write", 12)

    assert engine.drain(worker="w1") == 12

    assert {reload(s).state for s in steps} == {State.COMPLETED}
    assert sorted(call.step_id for call in WriteTool.calls) == sorted(str(s.pk) for s in steps)
    threads = {a.worker for a in Attempt.objects.filter(step__in=steps)}
    assert threads == {"w1"}


@pytest.mark.django_db(transaction=True)
def test_write_steps_that_stored_their_responses_complete_together(agent: Agent, run: Run) -> None:
    steps = post_many(agent, run, "test.write", 3)
    batch = engine.claim(worker="A", writes=10)
    for c in batch.claims:  # what the pool's threads do: each response committed as it comes
        assert engine.execute_claimed(c, verify=False) == State.VERIFYING
    taken = steps[1]
    expire_lease(taken)
    assert recovery.recover_expired(taken.pk) == State.COMPLETED  # a response stored: §7

    with commits() as seen:
        ends = engine.verify_many(batch.claims)

    assert ends == {
        steps[0].pk: State.COMPLETED,
        taken.pk: engine.Outcome.FENCED_OUT,
        steps[2].pk: State.COMPLETED,
    }
    assert len(seen) == 1  # both completions and the fenced-out note in one commit
    assert {reload(s).state for s in steps} == {State.COMPLETED}
    assert Attempt.objects.get(step=taken, worker="A").fenced_out_write == "completed"
    assert len(WriteTool.calls) == 3


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_keeper_and_the_completions_lock_a_workers_steps_in_one_order(
    agent: Agent, run: Run
) -> None:
    # The lease keeper (its own thread and connection) and the drain's shared completion
    # lock the same steps: each in its own order, they deadlocked (seen with two workers on
    # the desk), PostgreSQL killed one, and its steps waited for their leases to run out.
    # Every statement that waits for several steps' rows takes them in the same (id) order,
    # and only the steps' rows: not their run's, which every commit's foreign keys check.
    post_many(agent, run, "test.write", 4)
    batch = engine.claim(worker="A", writes=10)
    for c in batch.claims:
        assert engine.execute_claimed(c, verify=False) == State.VERIFYING

    with CaptureQueriesContext(connection) as queries:
        assert engine.extend_leases(batch.claims, now=timezone.now()) == []
        ends = engine.verify_many(batch.claims)

    assert set(ends.values()) == {State.COMPLETED}
    locking = [q["sql"] for q in queries.captured_queries if "FOR " in q["sql"]]
    assert len(locking) == 2, locking
    for sql in locking:
        # The steps' rows only, ordered by their id (the ORM's statement orders by the first
        # column selected; lock_held's own names it).
        assert sql.startswith(('SELECT "executor_step"."id"', "SELECT id FROM executor_step ")), sql
        assert sql.endswith(
            ("ORDER BY 1 ASC FOR NO KEY UPDATE", "ORDER BY id FOR NO KEY UPDATE")
        ), sql
        assert "executor_run" not in sql, sql


def test_a_claim_whose_step_completed_is_neither_extended_nor_lost(agent: Agent, run: Run) -> None:
    # The keeper's beat can meet a step the drain has just completed (before the drain lets
    # go of it): that step is over, not taken by another worker, and says nothing.
    first, _ = post_many(agent, run, "test.write", 2)
    claims = engine.claim(worker="A", writes=10).claims
    for c in claims:
        assert engine.execute_claimed(c) == State.COMPLETED
    completed_at = reload(first).lease_expires_at

    assert engine.extend_leases(claims, now=timezone.now()) == []
    assert reload(first).lease_expires_at == completed_at


def test_a_claim_counts_its_runs_budgets_in_run_id_order(agent: Agent) -> None:
    # Two claims that each take calls of the same runs update the runs' rows in one order,
    # so they never wait on each other in a cycle.
    runs = [run_create(agent=agent, name=f"run {i}")[0] for i in range(4)]
    for run in reversed(runs):
        post_many(agent, run, "test.pure", 2)

    with CaptureQueriesContext(connection) as queries:
        engine.claim(worker="A", light=100)

    updated = [
        run.pk.hex
        for q in queries.captured_queries
        if q["sql"].startswith('UPDATE "executor_run"')
        for run in runs
        if run.pk.hex in q["sql"].replace("-", "")
    ]
    assert sorted(updated) == sorted(run.pk.hex for run in runs)
    assert updated == sorted(updated)


@pytest.mark.django_db(transaction=True)
def test_a_batchs_reads_are_called_in_flight_off_the_drains_thread(
    agent: Agent, run: Run, settings: Any
) -> None:
    settings.EXECUTOR_MAX_IN_FLIGHT = 3
    steps = post_many(agent, run, "test.read", 6)
    threads: list[str] = []

    def read(call: Invocation) -> ToolResult:
        threads.append(threading.current_thread().name)
        return ToolResult(result={"read": call.input})

    ReadTool.will(*[read] * 6)

    assert engine.drain(worker="w1") == 6

    assert {reload(s).state for s in steps} == {State.COMPLETED}
    assert len(ReadTool.calls) == 6
    # A plain tool's calls run on the call loop's threads, which never touch the database.
    assert len(threads) == 6
    assert all(name.startswith("stepward-call") for name in threads), threads
