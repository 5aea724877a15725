"""Failure classes, retries, backoff, attempts and deadlines (DESIGN.md §8)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor import engine
from executor.common import dispatch
from executor.contract.tool import FailureClass, Lookup, LookupOutcome, RetryPolicy, ToolError
from executor.ledger.records import Agent, Phase, Run, Step
from executor.ledger.states import State
from executor.services.reviews import deadletter_replay
from tests.support import tooling
from tests.support.tooling import (
    DAY,
    KeyedTool,
    LookupTool,
    PureTool,
    ReadTool,
    ShortDeadlineTool,
    WriteTool,
    attempts,
    last_event,
    make_due,
    post,
    reload,
    run_every_automatic_path,
)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def engine_env(agent: Agent) -> Iterator[None]:
    with tooling.installed(agent), dispatch.publishing(dispatch.dropping_publisher):
        yield


RETRYABLE = [FailureClass.TRANSIENT, FailureClass.UNAVAILABLE, FailureClass.RATE_LIMITED]
NOT_RETRIED = [
    FailureClass.INVALID_INPUT,
    FailureClass.PERMISSION_DENIED,
    FailureClass.POLICY_DENIED,
    FailureClass.CONFLICT,
]
SAFE_TO_REPEAT = {"test.keyed": KeyedTool, "test.pure": PureTool, "test.read": ReadTool}


# --- where each failure class goes ------------------------------------------------------------


@pytest.mark.parametrize("failure", RETRYABLE)
def test_retryable_failure_is_retried_after_a_backoff_until_the_tool_recovers(
    agent: Agent, run: Run, failure: FailureClass
) -> None:
    step = post(agent, run, "test.write")
    WriteTool.will(failure)

    assert engine.process(step.pk, worker="w1") == State.PENDING

    row = reload(step)
    [failed] = attempts(step)
    assert failed.phase == Phase.ERRORED
    assert failed.error_class == failure
    assert failed.finished_at is not None
    assert row.not_before is not None
    assert row.not_before > failed.finished_at
    assert row.failure_class == ""  # pending again: no failure stands
    assert last_event(step).data["failure_class"] == failure
    # Not due yet: a message now finds nothing to do.
    assert engine.process(step.pk, worker="w1") == engine.Outcome.SKIPPED
    assert len(WriteTool.calls) == 1

    make_due(step)
    assert engine.process(step.pk, worker="w1") == State.COMPLETED
    assert len(WriteTool.calls) == 2
    assert [a.phase for a in attempts(step)] == [Phase.ERRORED, Phase.RESPONDED]


@pytest.mark.parametrize("failure", NOT_RETRIED)
def test_refused_call_fails_and_is_never_called_again(
    agent: Agent, run: Run, failure: FailureClass
) -> None:
    step = post(agent, run, "test.write")
    WriteTool.will(failure)

    assert engine.process(step.pk, worker="w1") == State.FAILED

    row = reload(step)
    assert row.failure_class == failure
    assert f"scripted {failure}" in row.failure_message
    make_due(step)
    run_every_automatic_path()
    assert reload(step).state == State.FAILED
    assert len(WriteTool.calls) == 1


def test_ambiguous_outcome_of_a_non_idempotent_write_is_unknown_and_never_retried(
    agent: Agent, run: Run
) -> None:
    step = post(agent, run, "test.write")
    WriteTool.will(FailureClass.AMBIGUOUS)

    assert engine.process(step.pk, worker="w1") == State.UNKNOWN

    row = reload(step)
    assert (row.failure_class, row.not_before) == (FailureClass.AMBIGUOUS, None)
    run_every_automatic_path()
    run_every_automatic_path()
    assert reload(step).state == State.UNKNOWN
    assert len(WriteTool.calls) == 1


def test_unclassified_error_is_treated_as_ambiguous(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")
    WriteTool.will(RuntimeError("connection reset after the request was written"))

    assert engine.process(step.pk, worker="w1") == State.UNKNOWN

    assert reload(step).failure_class == FailureClass.AMBIGUOUS
    run_every_automatic_path()
    assert len(WriteTool.calls) == 1


def test_ambiguous_outcome_of_a_write_with_lookup_is_reconciled_not_resent(
    agent: Agent, run: Run
) -> None:
    step = post(agent, run, "test.lookup")
    LookupTool.will(FailureClass.AMBIGUOUS)

    assert engine.process(step.pk, worker="w1") == State.UNKNOWN
    assert reload(step).not_before is not None  # due for its lookup at once

    LookupTool.answer = Lookup(LookupOutcome.FOUND, external_id="T-9")
    run_every_automatic_path()

    row = reload(step)
    assert (row.state, row.external_id) == (State.COMPLETED, "T-9")
    assert len(LookupTool.calls) == 1


@pytest.mark.parametrize("tool", sorted(SAFE_TO_REPEAT))
def test_ambiguous_outcome_of_a_keyed_pure_or_read_tool_is_retried(
    agent: Agent, run: Run, tool: str
) -> None:
    step = post(agent, run, tool)
    scripted = SAFE_TO_REPEAT[tool]
    scripted.will(FailureClass.AMBIGUOUS)

    assert engine.process(step.pk, worker="w1") == State.PENDING

    make_due(step)
    assert engine.process(step.pk, worker="w1") == State.COMPLETED
    first, second = scripted.calls
    assert first.operation_id == second.operation_id == str(step.operation_id)


def test_destructive_unsafe_goes_to_unknown_and_is_not_retried(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")
    WriteTool.will(FailureClass.DESTRUCTIVE_UNSAFE)

    assert engine.process(step.pk, worker="w1") == State.UNKNOWN

    assert reload(step).failure_class == FailureClass.DESTRUCTIVE_UNSAFE
    run_every_automatic_path()
    assert len(WriteTool.calls) == 1


# --- backoff -------------------------------------------------------------------------------


policies = st.builds(
    lambda initial, coefficient, extra: RetryPolicy(
        initial_interval=initial,
        backoff_coefficient=coefficient,
        max_interval=initial + extra,
        max_attempts=10,
        deadline=3600,
    ),
    initial=st.floats(min_value=0.001, max_value=100),
    coefficient=st.floats(min_value=1, max_value=10),
    extra=st.floats(min_value=0, max_value=1000),
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=policies, failures=st.integers(min_value=1, max_value=60), seed=st.integers())
def test_backoff_stays_within_the_full_jitter_window(
    policy: RetryPolicy, failures: int, seed: int
) -> None:
    tool = SimpleNamespace(retry=policy)
    ceiling = min(
        policy.max_interval, policy.initial_interval * policy.backoff_coefficient ** (failures - 1)
    )

    delay = engine.backoff_seconds(tool, failures, random.Random(seed))  # type: ignore[arg-type]

    assert 0 <= delay <= ceiling


def test_backoff_spreads_over_the_whole_window() -> None:
    tool = SimpleNamespace(retry=RetryPolicy(initial_interval=1, max_interval=8))
    rng = random.Random(7)

    samples = [engine.backoff_seconds(tool, 3, rng) for _ in range(500)]  # type: ignore[arg-type]

    # Full jitter: anywhere in [0, 4], not bunched at the ceiling.
    assert max(samples) <= 4
    assert min(samples) < 1
    assert max(samples) > 3


def test_backoff_of_a_long_retry_series_is_capped_not_an_error() -> None:
    tool = SimpleNamespace(retry=RetryPolicy(max_interval=60, max_attempts=5000))

    delay = engine.backoff_seconds(tool, 1100, random.Random(1))  # type: ignore[arg-type]

    assert 0 <= delay <= 60


def test_rate_limited_retry_waits_at_least_the_retry_after_window(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")
    window = 7 * DAY  # longer than anything the tool's own backoff could pick
    assert window > WriteTool.retry.max_interval
    WriteTool.will(ToolError(FailureClass.RATE_LIMITED, "slow down", retry_after=window))

    assert engine.process(step.pk, worker="w1") == State.PENDING

    row = reload(step)
    [limited] = attempts(step)
    assert limited.finished_at is not None
    assert row.not_before is not None
    assert row.not_before >= limited.finished_at + timedelta(seconds=window)


# --- attempts and deadlines run out ---------------------------------------------------------


def fail_until_settled(step: Step, failure: FailureClass, *, limit: int = 20) -> list[str]:
    """Runs the step, failing every call, each retry made due by hand; returns the outcomes."""
    outcomes = []
    for _ in range(limit):
        WriteTool.will(failure)
        outcome = engine.process(step.pk, worker="w1")
        outcomes.append(outcome)
        if outcome != State.PENDING:
            return outcomes
        make_due(step)
    raise AssertionError(f"still retrying after {limit} attempts: {outcomes}")


def test_exhausted_attempts_make_the_step_dead_with_class_and_count(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")

    outcomes = fail_until_settled(step, FailureClass.UNAVAILABLE)

    assert outcomes == [State.PENDING, State.PENDING, State.DEAD]
    row = reload(step)
    assert row.failure_class == FailureClass.UNAVAILABLE
    assert len(WriteTool.calls) == WriteTool.retry.max_attempts == 3
    event = last_event(step)
    assert (event.from_state, event.to_state) == (State.RUNNING, State.DEAD)
    assert event.data["attempts"] == 3
    assert event.data["evidence_attempt"] == attempts(step)[-1].pk
    assert "unavailable" in event.reason
    assert "max_attempts 3" in event.reason
    WriteTool.script.clear()
    run_every_automatic_path()
    assert reload(step).state == State.DEAD
    assert len(WriteTool.calls) == 3


def test_passed_retry_deadline_makes_the_step_dead_with_attempts_left(
    agent: Agent, run: Run
) -> None:
    step = post(agent, run, "test.short_deadline")
    Step.objects.filter(pk=step.pk).update(first_scheduled_at=timezone.now() - timedelta(hours=1))
    ShortDeadlineTool.will(FailureClass.TRANSIENT)

    assert engine.process(step.pk, worker="w1") == State.DEAD

    assert reload(step).failure_class == FailureClass.TRANSIENT
    event = last_event(step)
    assert event.data["attempts"] == 1 < ShortDeadlineTool.retry.max_attempts
    assert "deadline" in event.reason
    assert len(ShortDeadlineTool.calls) == 1


def test_retry_deadline_counts_from_first_scheduling_across_attempts(
    agent: Agent, run: Run
) -> None:
    step = post(agent, run, "test.short_deadline")
    first_scheduled = reload(step).first_scheduled_at
    ShortDeadlineTool.will(FailureClass.TRANSIENT, FailureClass.TRANSIENT)

    assert engine.process(step.pk, worker="w1") == State.PENDING
    # A retry does not restart the clock.
    assert reload(step).first_scheduled_at == first_scheduled

    # The operation has now been going on for longer than the deadline (120 s).
    Step.objects.filter(pk=step.pk).update(
        first_scheduled_at=timezone.now() - timedelta(seconds=121)
    )
    make_due(step)
    assert engine.process(step.pk, worker="w1") == State.DEAD

    assert last_event(step).data["attempts"] == 2
    assert len(ShortDeadlineTool.calls) == 2


def test_replayed_dead_letter_gets_a_fresh_series_of_attempts(
    agent: Agent, run: Run, reviewer: Any
) -> None:
    step = post(agent, run, "test.write")
    fail_until_settled(step, FailureClass.UNAVAILABLE)
    dead = reload(step)
    deadletter_replay(step=dead, user=reviewer, version=dead.version, reason="the desk is back")
    WriteTool.will(FailureClass.UNAVAILABLE)

    assert engine.process(step.pk, worker="w1") == State.PENDING

    make_due(step)
    assert engine.process(step.pk, worker="w1") == State.COMPLETED
    assert len(WriteTool.calls) == 5
