"""Budgets bound calls, cost and time; reaching one pauses the run and loses nothing (§10)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from executor import dispatch, engine, services, sweeper
from executor.models import Agent, Attempt, Run, RunStatus, Step
from executor.states import State
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
    run, _ = services.run_create(agent=agent, name="capped", max_calls=2)
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
    run, _ = services.run_create(agent=agent, name="capped", max_calls=1)
    for _ in range(3):
        post(agent, run, "test.pure")
    engine.drain(worker="w1", limit=10)

    tooling.run_every_automatic_path()

    assert states(run) == [State.COMPLETED, State.PENDING, State.PENDING]
    assert len(PureTool.calls) == 1


def test_max_cost_pauses_the_run_after_the_call_that_crosses_it(agent: Agent) -> None:
    run, _ = services.run_create(agent=agent, name="costly", max_cost=Decimal("2.5"))
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
    run, _ = services.run_create(agent=agent, name="timed", deadline_seconds=3600)
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
    run, _ = services.run_create(agent=agent, name="timed", deadline_seconds=3600)
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
