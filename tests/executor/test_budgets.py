"""Budgets bound calls, cost and time; reaching one pauses the run and loses nothing (§10)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from guardian.shortcuts import assign_perm

import executor.engine.statements as statements
from executor import engine
from executor.common import dispatch
from executor.contract.tool import Effect, Idempotency, Invocation, ToolResult, register, unregister
from executor.engine import recovery
from executor.ledger.records import Agent, Attempt, Run, RunStatus, Step
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import State
from executor.policy import authorization
from executor.services.runs import run_cancel, run_create
from executor.services.tools import tools_sync
from executor.worker import sweeper
from tests.support import tooling
from tests.support.tooling import CostlyTool, PureTool, WriteTool, post, reload

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def engine_env(agent: Agent) -> Iterator[None]:
    with tooling.installed(agent), dispatch.publishing(dispatch.dropping_publisher):
        yield


def states(run: Run) -> list[str]:
    return list(Step.objects.filter(run=run).order_by("position").values_list("state", flat=True))


def submitted_attempts(run: Run) -> int:
    return Attempt.objects.filter(step__run=run, submitted_at__isnull=False).count()


@pytest.mark.parametrize(("tool", "scripted"), [("test.pure", PureTool), ("test.write", WriteTool)])
def test_max_calls_pauses_the_run_and_leaves_the_rest_pending(
    agent: Agent, tool: str, scripted: type[tooling.ScriptedTool]
) -> None:
    run, _ = run_create(agent=agent, name="capped", max_calls=2)
    steps = [post(agent, run, tool) for _ in range(5)]

    outcomes = [engine.process(step.pk, worker="w1") for step in steps]

    assert outcomes[:3] == [State.COMPLETED, State.COMPLETED, State.PENDING]
    assert states(run) == [State.COMPLETED] * 2 + [State.PENDING] * 3
    fresh = Run.objects.get(pk=run.pk)
    assert fresh.status == RunStatus.PAUSED
    assert "max_calls" in fresh.pause_reason
    assert fresh.used_calls == submitted_attempts(run) == len(scripted.calls) == 2
    third = reload(steps[2])
    assert (third.failure_class, third.failure_message) == ("", "")


def test_steps_of_a_paused_run_wait_for_every_automatic_path(agent: Agent) -> None:
    run, _ = run_create(agent=agent, name="capped", max_calls=1)
    for _ in range(3):
        post(agent, run, "test.pure")
    engine.drain(worker="w1", limit=10)

    tooling.run_every_automatic_path()

    assert states(run) == [State.COMPLETED, State.PENDING, State.PENDING]
    assert len(PureTool.calls) == 1


def test_max_cost_pauses_the_run_after_the_call_that_crosses_it(agent: Agent) -> None:
    run, _ = run_create(agent=agent, name="costly", max_cost=Decimal("2.5"))
    steps = [post(agent, run, "test.costly") for _ in range(5)]

    for step in steps:
        engine.process(step.pk, worker="w1")

    # 1 and 2 leave room; the third starts with 0.5 left and is not cut off mid-call.
    assert states(run) == [State.COMPLETED] * 3 + [State.PENDING] * 2
    fresh = Run.objects.get(pk=run.pk)
    assert fresh.status == RunStatus.PAUSED
    assert "max_cost" in fresh.pause_reason
    assert fresh.used_cost == Decimal(3)
    assert len(CostlyTool.calls) == 3
    costs = Attempt.objects.filter(step__run=run).values_list("cost", flat=True)
    assert sum(costs) == Decimal(3)


def test_passed_run_deadline_is_paused_by_the_sweeper_and_steps_stay_pending(
    agent: Agent,
) -> None:
    run, _ = run_create(agent=agent, name="timed", deadline_seconds=3600)
    steps = [post(agent, run, "test.write") for _ in range(2)]
    Run.objects.filter(pk=run.pk).update(deadline=timezone.now() - timedelta(seconds=1))

    report = sweeper.sweep(owner="s1")

    assert report is not None
    assert report.runs_paused == 1
    fresh = Run.objects.get(pk=run.pk)
    assert (fresh.status, fresh.pause_reason) == (RunStatus.PAUSED, "the run's deadline passed")
    for step in steps:
        assert engine.process(step.pk, worker="w1") == engine.Outcome.SKIPPED
    assert states(run) == [State.PENDING, State.PENDING]
    assert WriteTool.calls == []


def test_passed_run_deadline_is_caught_at_the_claim_before_any_sweep(agent: Agent) -> None:
    run, _ = run_create(agent=agent, name="timed", deadline_seconds=3600)
    step = post(agent, run, "test.pure")
    Run.objects.filter(pk=run.pk).update(deadline=timezone.now() - timedelta(seconds=1))

    assert engine.process(step.pk, worker="w1") == State.PENDING

    fresh = Run.objects.get(pk=run.pk)
    assert (fresh.status, fresh.pause_reason) == (RunStatus.PAUSED, "the run's deadline passed")
    assert (fresh.used_calls, submitted_attempts(run)) == (0, 0)
    assert PureTool.calls == []


def test_run_without_budget_limits_counts_usage_only(agent: Agent, run: Run) -> None:
    for _ in range(3):
        post(agent, run, "test.costly")

    engine.drain(worker="w1", limit=10)

    fresh = Run.objects.get(pk=run.pk)
    assert (fresh.status, fresh.used_calls, fresh.used_cost) == (RunStatus.OPEN, 3, Decimal(3))


@pytest.mark.parametrize("spent", ["max_calls", "cancelled"])
def test_a_write_whose_run_ran_out_after_its_claim_is_never_called(
    agent: Agent, spent: str
) -> None:
    # The claim found room; by the `submitting` commit there is none: nothing is sent, the
    # step waits (or is cancelled), and the call is not counted.
    run, _ = run_create(agent=agent, name="raced", max_calls=5)
    step = post(agent, run, "test.write")
    claim = engine.claim_step(step.pk, worker="w1")
    assert isinstance(claim, engine.Claim)
    if spent == "max_calls":
        Run.objects.filter(pk=run.pk).update(used_calls=5)
    else:
        run_cancel(run=run, actor="test", reason="no longer needed")

    outcome = engine.execute_claimed(claim)

    fresh = Run.objects.get(pk=run.pk)
    attempt = Attempt.objects.get(pk=claim.attempt.pk)
    assert WriteTool.calls == []
    assert attempt.submitted_at is None
    if spent == "max_calls":
        assert outcome == reload(step).state == State.PENDING
        assert (fresh.status, fresh.used_calls) == (RunStatus.PAUSED, 5)
        assert (attempt.phase, attempt.error_class) == ("abandoned", "budget")
    else:
        assert outcome == reload(step).state == State.CANCELLED
        assert (fresh.used_calls, attempt.phase, attempt.error_class) == (0, "abandoned", "cancel")


@pytest.mark.django_db(transaction=True)
def test_the_submitting_commit_counts_the_call_and_extends_the_lease(agent: Agent) -> None:
    run, _ = run_create(agent=agent, name="counted", max_calls=5)
    step = post(agent, run, "test.write")
    claim = engine.claim_step(step.pk, worker="w1")
    assert isinstance(claim, engine.Claim)
    leased_until = reload(step).lease_expires_at
    seen: list[tuple[str, int, bool]] = []

    def observe(call: Invocation) -> ToolResult:
        # What the ledger says while the tool runs: the call is counted before it is made.
        attempt = Attempt.objects.get(pk=claim.attempt.pk)
        fresh = Run.objects.get(pk=run.pk)
        seen.append((attempt.phase, fresh.used_calls, reload(step).lease_expires_at > leased_until))
        # Committed, not merely written: no transaction is open while the tool runs.
        assert not connection.in_atomic_block
        return ToolResult(result={}, external_id="seen")

    WriteTool.will(observe)
    assert engine.execute_claimed(claim) == State.COMPLETED

    assert seen == [("submitting", 1, True)]
    assert Attempt.objects.get(pk=claim.attempt.pk).request_evidence != {}


def test_the_one_call_room_sql_answers_as_the_budget_check_does(agent: Agent) -> None:
    # The `submitting` statement on PostgreSQL takes a call where `call_room(1)` has room.
    run, _ = run_create(agent=agent, name="room")
    now = timezone.now()
    table = Run._meta.db_table
    room = authorization.ONE_CALL_ROOM_SQL
    sql = f"SELECT EXISTS (SELECT 1 FROM {table} WHERE id = %(run)s AND {room})"
    checked = 0
    for status in RunStatus:
        for max_calls, used_calls in ((None, 7), (3, 2), (3, 3), (3, 4)):
            for max_cost, used_cost in ((None, "9"), ("2.5", "2.4999"), ("2.5", "2.5"), ("1", "3")):
                for deadline in (None, now + timedelta(seconds=1), now, now - timedelta(seconds=1)):
                    Run.objects.filter(pk=run.pk).update(
                        status=status,
                        max_calls=max_calls,
                        used_calls=used_calls,
                        max_cost=None if max_cost is None else Decimal(max_cost),
                        used_cost=Decimal(used_cost),
                        deadline=deadline,
                    )
                    expected = Run.objects.filter(
                        authorization.call_room(1, now=now), pk=run.pk
                    ).exists()
                    with connection.cursor() as cursor:
                        cursor.execute(
                            sql,
                            {
                                "run": Run._meta.pk.get_db_prep_value(run.pk, connection),
                                "open": str(RunStatus.OPEN),
                                "closed": str(RunStatus.CLOSED),
                                "now": now,
                            },
                        )
                        (answer,) = cursor.fetchone()
                    assert bool(answer) == expected, (
                        status,
                        max_calls,
                        used_calls,
                        max_cost,
                        used_cost,
                        deadline,
                    )
                    checked += expected
    # Room only when open or closed (a closed run takes work), with calls (2 of 4 cases),
    # cost (2 of 4) and time (2 of 4) left.
    assert checked == 2 * 2 * 2 * 2


class CostlyWriteTool(tooling.ScriptedTool):
    """A keyed write whose calls cost 1.5: its cost is counted where its response is stored."""

    name = "test.costly_write"
    effect = Effect.WRITE
    idempotency = Idempotency.KEY

    def cost(self, result: ToolResult) -> Decimal:
        return Decimal("1.5")


@pytest.fixture
def costly_write(agent: Agent) -> Iterator[type[CostlyWriteTool]]:
    CostlyWriteTool.reset()
    register(CostlyWriteTool)
    try:
        tools_sync()
        assign_perm("executor.use_tool", agent.user, ToolRow.objects.get(name=CostlyWriteTool.name))
        yield CostlyWriteTool
    finally:
        unregister(CostlyWriteTool.name)


def test_a_writes_cost_is_counted_with_its_response_and_pauses_the_run_after_it(
    agent: Agent, costly_write: type[CostlyWriteTool]
) -> None:
    run, _ = run_create(agent=agent, name="costly writes", max_cost=Decimal("2.5"))
    steps = [post(agent, run, costly_write.name) for _ in range(3)]

    for step in steps:
        engine.process(step.pk, worker="w1")

    # The first leaves 1 of 2.5; the second starts within budget and crosses it.
    assert states(run) == [State.COMPLETED, State.COMPLETED, State.PENDING]
    fresh = Run.objects.get(pk=run.pk)
    assert (fresh.status, fresh.used_cost, fresh.used_calls) == (RunStatus.PAUSED, Decimal(3), 2)
    assert sorted(Attempt.objects.filter(step__run=run).values_list("cost", flat=True)) == [
        Decimal("1.5"),
        Decimal("1.5"),
    ]


def test_a_fenced_out_writes_cost_is_not_counted(
    agent: Agent, costly_write: type[CostlyWriteTool]
) -> None:
    run, _ = run_create(agent=agent, name="costly writes", max_cost=Decimal(10))
    step = post(agent, run, costly_write.name)
    claim_a = engine.claim_step(step.pk, worker="A")
    assert isinstance(claim_a, engine.Claim)
    tooling.submit(claim_a)
    late_answer = tooling.call_tool(claim_a)
    tooling.expire_lease(step)
    assert recovery.recover_expired(step.pk, actor="sweeper") == State.PENDING
    assert isinstance(engine.claim_step(step.pk, worker="B"), engine.Claim)

    assert engine.persist_response(claim_a, late_answer) == engine.Outcome.FENCED_OUT

    assert Run.objects.get(pk=run.pk).used_cost == Decimal(0)
    refused = Attempt.objects.get(pk=claim_a.attempt.pk)
    assert (refused.cost, refused.fenced_out_write) == (Decimal(0), "responded")
    assert reload(step).state == State.RUNNING


@pytest.mark.postgres
def test_a_run_given_room_after_its_submitting_statement_found_none_takes_the_call(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The statement finds the run spent; by the time the engine reads the run again, it was
    # extended (a reviewer, or the agent): the call is taken, the run is not paused.
    run, _ = run_create(agent=agent, name="extended meanwhile", max_calls=1)
    step = post(agent, run, "test.write")
    claim = engine.claim_step(step.pk, worker="w1")
    assert isinstance(claim, engine.Claim)
    statement = statements.submit_in_one_statement
    answers: list[tuple[bool, bool]] = []

    def extended_meanwhile(claim: engine.Claim, *, now: Any) -> tuple[bool, bool]:
        if not answers:
            Run.objects.filter(pk=run.pk).update(used_calls=1)
        answer = statement(claim, now=now)
        if not answers:
            Run.objects.filter(pk=run.pk).update(max_calls=2)
        answers.append(answer)
        return answer

    monkeypatch.setattr(statements, "submit_in_one_statement", extended_meanwhile)

    assert engine.execute_claimed(claim) == State.COMPLETED
    assert answers == [(True, False), (True, True)]
    fresh = Run.objects.get(pk=run.pk)
    assert (fresh.status, fresh.used_calls) == (RunStatus.OPEN, 2)
    assert len(WriteTool.calls) == 1
