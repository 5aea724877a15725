"""The database itself refuses rows that break the ledger's rules (STYLE.md code rule 3).

Each write goes around the services on purpose, so only the constraint stands in its way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from executor.ledger import guards
from executor.ledger.records import (
    OPEN_PHASES,
    Agent,
    Approval,
    Attempt,
    Event,
    Phase,
    Run,
    RunStatus,
    Step,
)
from executor.ledger.states import State
from tests.support.factories import WORKER, new_step, step_in

pytestmark = pytest.mark.django_db


@contextmanager
def violates(constraint: str, *, sqlite_says: str | None = None) -> Iterator[None]:
    """Expects the block to fail on `constraint`, and to leave no partial write behind.

    PostgreSQL names every constraint in its message; SQLite names CHECK constraints but
    reports a UNIQUE one by its columns, given as `sqlite_says`.
    """
    with pytest.raises(IntegrityError) as caught, transaction.atomic():
        yield
    expected = sqlite_says if connection.vendor == "sqlite" and sqlite_says else constraint
    assert expected in str(caught.value)


def update_step(step: Step, **fields: Any) -> None:
    Step.objects.filter(pk=step.pk).update(**fields)


def lease(**extra: Any) -> dict[str, Any]:
    return {"lease_owner": WORKER, "lease_expires_at": timezone.now(), **extra}


# --- steps --------------------------------------------------------------------------------


def test_a_second_step_with_the_same_key_in_a_run_is_refused(run: Run) -> None:
    first = new_step(run, key="create-ticket")

    with violates("step_unique_key", sqlite_says="executor_step.run_id, executor_step.key"):
        Step.objects.create(
            run=run,
            position=first.position + 1,
            key="create-ticket",
            tool_id="echo",
            input={},
            input_hash="0" * 64,
        )

    assert Step.objects.filter(run=run).count() == 1


def test_the_same_step_key_in_another_run_is_accepted(run: Run, agent: Agent) -> None:
    other_run = Run.objects.create(workspace=run.workspace, agent=agent, name="other")
    new_step(run, key="create-ticket")
    new_step(other_run, key="create-ticket")
    assert Step.objects.filter(key="create-ticket").count() == 2


def test_two_steps_at_one_position_in_a_run_are_refused(run: Run) -> None:
    first = new_step(run)
    second = new_step(run)
    with violates(
        "step_unique_position", sqlite_says="executor_step.run_id, executor_step.position"
    ):
        update_step(second, position=first.position)


def test_a_state_outside_the_choices_is_refused(run: Run) -> None:
    step = new_step(run)
    with violates("step_state_valid"):
        update_step(step, state="done")
    assert Step.objects.get(pk=step.pk).state == State.PLANNED


def test_version_zero_is_refused(run: Run) -> None:
    step = new_step(run)
    with violates("step_version_positive"):
        update_step(step, version=0)


@pytest.mark.parametrize(
    "fields",
    [
        {"lease_owner": "", "lease_expires_at": None},
        {"lease_owner": WORKER, "lease_expires_at": None},
        {"lease_owner": "", "lease_expires_at": timezone.now()},
    ],
    ids=["no-lease", "no-expiry", "no-owner"],
)
@pytest.mark.parametrize("state", [State.RUNNING, State.VERIFYING])
def test_a_leased_state_without_a_whole_lease_is_refused(
    run: Run, state: State, fields: dict[str, Any]
) -> None:
    step = new_step(run)
    with violates("step_lease_iff_leased_state"):
        update_step(step, state=state, fence=1, **fields)


@pytest.mark.parametrize(
    "fields",
    [lease(), {"lease_owner": WORKER}, {"lease_expires_at": timezone.now()}],
    ids=["whole-lease", "owner-only", "expiry-only"],
)
@pytest.mark.parametrize(
    "state", [State.PLANNED, State.PENDING, State.COMPLETED, State.UNKNOWN, State.CANCELLED]
)
def test_a_lease_outside_running_and_verifying_is_refused(
    run: Run, state: State, fields: dict[str, Any]
) -> None:
    step = new_step(run)
    with violates("step_lease_iff_leased_state"):
        update_step(step, state=state, **fields)


def test_running_without_a_fence_is_refused(run: Run) -> None:
    step = new_step(run)
    with violates("step_running_is_fenced"):
        update_step(step, state=State.RUNNING, fence=0, **lease())


def test_running_with_a_lease_and_a_fence_is_accepted(run: Run) -> None:
    step = new_step(run)
    update_step(step, state=State.RUNNING, fence=1, **lease())
    assert Step.objects.get(pk=step.pk).state == State.RUNNING


@pytest.mark.parametrize("state", [State.FAILED, State.DEAD])
def test_failed_or_dead_without_a_failure_class_is_refused(run: Run, state: State) -> None:
    step = new_step(run)
    with violates("step_failure_has_class"):
        update_step(step, state=state, failure_class="")
    update_step(step, state=state, failure_class="permanent")
    assert Step.objects.get(pk=step.pk).state == state


def test_a_step_that_compensates_itself_is_refused(run: Run) -> None:
    step = new_step(run)
    with violates("step_not_self_compensating"):
        update_step(step, compensates_id=step.pk)


# --- attempts -----------------------------------------------------------------------------


def attempt(step: Step, number: int, **fields: Any) -> Attempt:
    fields.setdefault("fence", number)
    return Attempt.objects.create(step=step, number=number, worker=WORKER, **fields)


def test_a_second_open_attempt_on_a_step_is_refused(run: Run) -> None:
    step = step_in(run, State.RUNNING)
    attempt(step, 1, phase=Phase.CLAIMED)

    with violates("attempt_one_open_per_step"):
        attempt(step, 2, phase=Phase.SUBMITTING, submitted_at=timezone.now())

    assert Attempt.objects.filter(step=step).count() == 1


def test_a_closed_attempt_is_not_reopened_beside_an_open_one(run: Run) -> None:
    # The rule is a trigger (executor/ledger/guards.py): it also looks at an update that
    # opens an attempt again, or moves an open one onto a step that has one.
    step, other = step_in(run, State.RUNNING), step_in(run, State.RUNNING)
    closed = attempt(step, 1, phase=Phase.ERRORED)
    attempt(step, 2, phase=Phase.CLAIMED)
    elsewhere = attempt(other, 1, phase=Phase.CLAIMED)

    with violates("attempt_one_open_per_step"):
        Attempt.objects.filter(pk=closed.pk).update(phase=Phase.CLAIMED)
    with violates("attempt_one_open_per_step"):
        Attempt.objects.filter(pk=elsewhere.pk).update(step=step, number=3, fence=3)

    assert Attempt.objects.get(pk=closed.pk).phase == Phase.ERRORED
    assert Attempt.objects.get(pk=elsewhere.pk).step_id == other.pk
    # Submitting and closing the open one are not its business.
    Attempt.objects.filter(step=step, number=2).update(
        phase=Phase.SUBMITTING, submitted_at=timezone.now()
    )
    Attempt.objects.filter(step=step, number=2).update(phase=Phase.RESPONDED)
    Attempt.objects.filter(pk=closed.pk).update(phase=Phase.CLAIMED)  # none open now
    assert Attempt.objects.filter(step=step, phase__in=OPEN_PHASES).count() == 1


def test_the_guard_opens_exactly_the_open_phases() -> None:
    assert "(" + ", ".join(f"'{phase}'" for phase in OPEN_PHASES) + ")" == guards.OPEN


@pytest.mark.postgres
def test_closing_an_attempt_is_a_hot_update(run: Run) -> None:
    # No index reads an attempt's phase, so its close leaves every index alone (issue 25:
    # the partial unique index on open attempts made each close write three index entries).
    step = step_in(run, State.RUNNING)
    opened = attempt(step, 1, phase=Phase.SUBMITTING, submitted_at=timezone.now())

    def updates() -> tuple[int, int]:
        # This transaction's own counts (the test's, with whatever ran in it before).
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables"
                " WHERE relname = 'executor_attempt'"
            )
            return cursor.fetchone()

    before = updates()
    Attempt.objects.filter(pk=opened.pk).update(
        phase=Phase.RESPONDED, response_evidence={"external_id": "T-1"}
    )
    after = updates()

    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)


def test_closed_attempts_do_not_count_against_the_open_one(run: Run) -> None:
    step = step_in(run, State.RUNNING)
    attempt(step, 1, phase=Phase.ERRORED)
    attempt(step, 2, phase=Phase.ABANDONED)
    attempt(step, 3, phase=Phase.CLAIMED)
    assert Attempt.objects.filter(step=step).count() == 3


def test_two_attempts_with_one_number_are_refused(run: Run) -> None:
    step = step_in(run, State.RUNNING)
    attempt(step, 1, phase=Phase.ERRORED)
    with violates(
        "attempt_unique_number", sqlite_says="executor_attempt.step_id, executor_attempt.number"
    ):
        attempt(step, 1, fence=2, phase=Phase.ABANDONED)


def test_two_attempts_with_one_fence_are_refused(run: Run) -> None:
    step = step_in(run, State.RUNNING)
    attempt(step, 1, phase=Phase.ERRORED)
    with violates("attempt_unique_fence"):
        attempt(step, 2, fence=1, phase=Phase.ABANDONED)
    second = attempt(step, 2, fence=2, phase=Phase.ABANDONED)
    with violates("attempt_unique_fence"):  # a trigger, not an index: an update is looked at
        Attempt.objects.filter(pk=second.pk).update(fence=1)
    assert list(Attempt.objects.filter(step=step).values_list("fence", flat=True)) == [1, 2]


def test_an_attempt_phase_outside_the_choices_is_refused(run: Run) -> None:
    step = step_in(run, State.RUNNING)
    with violates("attempt_phase_valid"):
        attempt(step, 1, phase="lost")


@pytest.mark.parametrize("phase", [Phase.SUBMITTING, Phase.RESPONDED])
def test_a_submitted_attempt_without_its_submission_time_is_refused(run: Run, phase: Phase) -> None:
    step = step_in(run, State.RUNNING)
    with violates("attempt_submitted_has_time"):
        attempt(step, 1, phase=phase, submitted_at=None)


# --- events -------------------------------------------------------------------------------


def test_a_second_event_for_one_version_is_refused(run: Run) -> None:
    step = new_step(run)
    first = Event.objects.get(step_id=step.pk, seq=1)

    with violates("event_unique_seq", sqlite_says="executor_event.step_id, executor_event.seq"):
        Event.objects.create(
            run=run,
            step_id=step.pk,
            seq=1,
            to_state=State.APPROVED,
            actor="intruder",
            created_at=timezone.now(),
            prev_hash=first.hash,
            hash="f" * 64,
        )

    assert Event.objects.filter(step_id=step.pk).count() == 1


# --- runs and agents ----------------------------------------------------------------------


def test_a_second_run_with_the_same_key_for_one_agent_is_refused(run: Run, agent: Agent) -> None:
    Run.objects.create(workspace=run.workspace, agent=agent, name="first", key="nightly")

    with violates("run_unique_key", sqlite_says="executor_run.agent_id, executor_run.key"):
        Run.objects.create(workspace=run.workspace, agent=agent, name="second", key="nightly")

    assert Run.objects.filter(agent=agent, key="nightly").count() == 1


def test_runs_without_a_key_and_other_agents_keys_do_not_clash(
    agent: Agent, other_agent_auth: Any
) -> None:
    other = other_agent_auth.agent
    Run.objects.create(workspace=agent.workspace, agent=agent, name="a", key=None)
    Run.objects.create(workspace=agent.workspace, agent=agent, name="b", key=None)
    Run.objects.create(workspace=agent.workspace, agent=agent, name="c", key="nightly")
    Run.objects.create(workspace=other.workspace, agent=other, name="d", key="nightly")
    assert Run.objects.filter(key="nightly").count() == 2
    assert Run.objects.filter(agent=agent, key__isnull=True).count() == 2


@pytest.mark.parametrize("status", [RunStatus.OPEN, RunStatus.CANCELLED])
def test_a_pause_reason_on_a_run_that_is_not_paused_is_refused(run: Run, status: RunStatus) -> None:
    with violates("run_pause_reason_only_when_paused"):
        Run.objects.filter(pk=run.pk).update(status=status, pause_reason="budget spent")
    Run.objects.filter(pk=run.pk).update(status=RunStatus.PAUSED, pause_reason="budget spent")
    assert Run.objects.get(pk=run.pk).pause_reason == "budget spent"


def test_a_run_status_outside_the_choices_is_refused(run: Run) -> None:
    with violates("run_status_valid"):
        Run.objects.filter(pk=run.pk).update(status="finished")


def test_a_negative_used_cost_is_refused(run: Run) -> None:
    with violates("run_used_cost_positive"):
        Run.objects.filter(pk=run.pk).update(used_cost=Decimal("-0.0001"))


def test_two_agents_with_one_name_in_a_workspace_are_refused(agent: Agent) -> None:
    user = get_user_model().objects.create_user(username="impostor")
    with violates(
        "agent_unique_name", sqlite_says="executor_agent.workspace_id, executor_agent.name"
    ):
        Agent.objects.create(
            workspace=agent.workspace, name=agent.name, user=user, token_hash="e" * 64
        )


# --- approvals ----------------------------------------------------------------------------


def approval(step: Step, **fields: Any) -> Approval:
    return Approval.objects.create(
        step=step,
        input_hash=step.input_hash,
        tool=step.tool_id,
        policy_version="v1",
        approved_at=timezone.now(),
        **fields,
    )


def test_a_second_live_approval_for_one_step_is_refused(run: Run) -> None:
    step = new_step(run)
    approval(step, consumed_at=timezone.now())
    approval(step, revoked_at=timezone.now())
    approval(step)

    with violates("approval_one_live_per_step", sqlite_says="executor_approval.step_id"):
        approval(step)

    assert Approval.objects.filter(step=step).count() == 3


def test_a_persons_approval_without_an_expiry_is_refused(run: Run, reviewer: Any) -> None:
    step = new_step(run)
    with violates("approval_by_person_expires"):
        approval(step, approver=reviewer, expires_at=None)
    approval(step, approver=reviewer, expires_at=timezone.now() + timedelta(hours=1))
    assert Approval.objects.filter(step=step, approver=reviewer).count() == 1
