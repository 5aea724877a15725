"""Authorization is rechecked at every claim; an old approval is never a standing grant (§9)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from guardian.shortcuts import assign_perm, remove_perm

from executor import engine
from executor.common import dispatch
from executor.contract.tool import FailureClass, ToolError, unregister
from executor.ledger.records import Agent, Approval, Phase, Run, RunStatus, Step, Workspace
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import State
from executor.services import runs
from executor.services.base import NotPermitted
from executor.services.reviews import compensation_request, deadletter_replay, step_approve
from executor.services.tools import tools_sync
from executor.worker import sweeper
from tests.support import tooling
from tests.support.tooling import (
    DestructiveTool,
    UndoTool,
    WriteTool,
    approve_as,
    attempts,
    history,
    last_event,
    make_due,
    post,
    reload,
)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def engine_env(agent: Agent) -> Iterator[None]:
    with tooling.installed(agent), dispatch.publishing(dispatch.dropping_publisher):
        yield


def assert_blocked_without_a_call(step: Step, reason: str, *, calls: int = 0) -> None:
    row = reload(step)
    assert row.state == State.BLOCKED
    assert reason in row.failure_message
    event = last_event(step)
    assert (event.from_state, event.to_state, event.actor) == (
        State.RUNNING,
        State.BLOCKED,
        "policy",
    )
    assert reason in event.reason
    refused = attempts(step)[-1]
    assert (refused.phase, refused.submitted_at) == (Phase.ABANDONED, None)
    assert len(WriteTool.calls) + len(DestructiveTool.calls) == calls


# --- the agent ------------------------------------------------------------------------------


def test_agent_that_lost_use_tool_is_blocked_before_the_call(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")
    remove_perm("executor.use_tool", agent.user, ToolRow.objects.get(name="test.write"))

    assert engine.process(step.pk, worker="w1") == State.BLOCKED

    assert_blocked_without_a_call(step, "may no longer use test.write")


def test_deactivated_agent_is_blocked_before_the_call(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")
    agent.is_active = False
    agent.save(update_fields=["is_active"])

    assert engine.process(step.pk, worker="w1") == State.BLOCKED

    assert_blocked_without_a_call(step, "is deactivated")


def test_agent_whose_user_was_deactivated_is_blocked_before_the_call(
    agent: Agent, run: Run
) -> None:
    step = post(agent, run, "test.write")
    agent.user.is_active = False
    agent.user.save(update_fields=["is_active"])

    assert engine.process(step.pk, worker="w1") == State.BLOCKED

    assert_blocked_without_a_call(step, "is deactivated")


def test_agent_that_lost_submit_steps_is_blocked_before_the_call(
    agent: Agent, run: Run, workspace: Workspace
) -> None:
    step = post(agent, run, "test.write")
    remove_perm("executor.submit_steps", agent.user, workspace)

    assert engine.process(step.pk, worker="w1") == State.BLOCKED

    assert_blocked_without_a_call(step, "no longer holds submit_steps")


def test_permission_is_rechecked_before_a_retry(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")
    WriteTool.will(FailureClass.TRANSIENT)
    assert engine.process(step.pk, worker="w1") == State.PENDING
    remove_perm("executor.use_tool", agent.user, ToolRow.objects.get(name="test.write"))
    make_due(step)

    assert engine.process(step.pk, worker="w1") == State.BLOCKED

    assert_blocked_without_a_call(step, "may no longer use test.write", calls=1)


def test_blocked_step_is_not_picked_up_again_automatically(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")
    remove_perm("executor.use_tool", agent.user, ToolRow.objects.get(name="test.write"))
    engine.process(step.pk, worker="w1")

    tooling.run_every_automatic_path()

    assert reload(step).state == State.BLOCKED
    assert WriteTool.calls == []


def test_step_of_a_tool_that_is_no_longer_registered_is_blocked(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")
    unregister("test.write")
    tools_sync()

    outcome = engine.process(step.pk, worker="w1")

    assert outcome == State.BLOCKED
    assert "no longer registered" in reload(step).failure_message


# --- reviewers' approvals -------------------------------------------------------------------


@pytest.fixture
def planned(agent: Agent, run: Run) -> Step:
    step = post(agent, run, "test.destructive")
    assert step.state == State.PLANNED
    return step


def test_destructive_step_waits_for_a_person(planned: Step) -> None:
    tooling.run_every_automatic_path()

    assert reload(planned).state == State.PLANNED
    assert DestructiveTool.calls == []


def test_valid_reviewer_approval_lets_the_step_run_once(planned: Step, reviewer: Any) -> None:
    approval = approve_as(reviewer, planned)

    assert engine.process(planned.pk, worker="w1") == State.COMPLETED

    assert len(DestructiveTool.calls) == 1
    assert Approval.objects.get(pk=approval.pk).consumed_at is not None
    assert ("", State.PLANNED, "agent:alice-bot") in history(planned)
    assert (State.PLANNED, State.APPROVED, "user:bob") in history(planned)


def test_approval_of_a_reviewer_who_lost_approve_steps_is_refused(
    planned: Step, reviewer: Any, workspace: Workspace
) -> None:
    approve_as(reviewer, planned)
    remove_perm("executor.approve_steps", reviewer, workspace)

    assert engine.process(planned.pk, worker="w1") == State.BLOCKED

    assert_blocked_without_a_call(planned, "bob no longer holds approve_steps")


def test_approval_of_a_deactivated_reviewer_is_refused(planned: Step, reviewer: Any) -> None:
    approve_as(reviewer, planned)
    reviewer.is_active = False
    reviewer.save(update_fields=["is_active"])

    assert engine.process(planned.pk, worker="w1") == State.BLOCKED

    assert_blocked_without_a_call(planned, "bob no longer holds approve_steps")


def test_approval_older_than_the_maximum_age_is_refused(
    planned: Step, reviewer: Any, settings: Any
) -> None:
    settings.EXECUTOR_APPROVAL_MAX_AGE = 3600
    approve_as(
        reviewer,
        planned,
        approved_at=timezone.now() - timedelta(hours=2),
        expires_in=timedelta(days=1),
    )

    assert engine.process(planned.pk, worker="w1") == State.BLOCKED

    assert_blocked_without_a_call(planned, "older than EXECUTOR_APPROVAL_MAX_AGE")


def test_expired_approval_is_refused(planned: Step, reviewer: Any) -> None:
    approve_as(
        reviewer,
        planned,
        approved_at=timezone.now() - timedelta(minutes=10),
        expires_in=timedelta(minutes=5),
    )

    assert engine.process(planned.pk, worker="w1") == State.BLOCKED

    assert_blocked_without_a_call(planned, "the approval expired")


def test_approval_of_another_input_is_refused(planned: Step, reviewer: Any) -> None:
    approval = approve_as(reviewer, planned)
    Approval.objects.filter(pk=approval.pk).update(input_hash="f" * 64)

    assert engine.process(planned.pk, worker="w1") == State.BLOCKED

    assert_blocked_without_a_call(planned, "does not match this call")


def test_approval_under_another_tool_policy_is_refused(planned: Step, reviewer: Any) -> None:
    approval = approve_as(reviewer, planned)
    Approval.objects.filter(pk=approval.pk).update(policy_version="an-older-policy")

    assert engine.process(planned.pk, worker="w1") == State.BLOCKED

    assert_blocked_without_a_call(planned, "policy changed since the approval")


def test_revoked_approval_is_refused(planned: Step, reviewer: Any) -> None:
    approval = approve_as(reviewer, planned)
    Approval.objects.filter(pk=approval.pk).update(revoked_at=timezone.now())

    assert engine.process(planned.pk, worker="w1") == State.BLOCKED

    assert_blocked_without_a_call(planned, "no valid approval")


def test_approval_by_someone_who_never_held_approve_steps_is_refused(
    planned: Step, workspace: Workspace
) -> None:
    stranger = get_user_model().objects.create_user("dave")

    approve_as(stranger, planned)

    assert engine.process(planned.pk, worker="w1") == State.BLOCKED
    assert_blocked_without_a_call(planned, "dave no longer holds approve_steps")


def test_compensation_approved_by_a_compensation_approver_runs(
    agent: Agent, run: Run, workspace: Workspace
) -> None:
    original = post(agent, run, "test.undoable")
    assert engine.process(original.pk, worker="w1") == State.COMPLETED
    carol = get_user_model().objects.create_user("carol")
    for permission in ("review_steps", "approve_compensation"):
        assign_perm(f"executor.{permission}", carol, workspace)
    done = reload(original)
    dave = get_user_model().objects.create_user("dave")
    assign_perm("executor.approve_compensation", dave, workspace)
    compensation = compensation_request(
        step=done, user=carol, version=done.version, reason="wrong ticket"
    )
    # Four eyes: carol asked for it, dave approves it.
    step_approve(step=compensation, user=dave, version=compensation.version, reason="undo it")

    assert engine.process(compensation.pk, worker="w1") == State.COMPLETED

    assert len(UndoTool.calls) == 1
    assert reload(original).state == State.COMPENSATED


def test_replay_of_a_dead_destructive_step_needs_a_new_approval(
    planned: Step, reviewer: Any, workspace: Workspace
) -> None:
    approve_as(reviewer, planned)
    for _ in range(DestructiveTool.retry.max_attempts):
        DestructiveTool.will(FailureClass.UNAVAILABLE)
        engine.process(planned.pk, worker="w1")
        make_due(planned)
    dead = reload(planned)
    assert dead.state == State.DEAD
    erin = get_user_model().objects.create_user("erin")
    assign_perm("executor.replay_deadletter", erin, workspace)

    with pytest.raises(NotPermitted):
        deadletter_replay(step=dead, user=erin, version=dead.version, reason="again")

    assert reload(planned).state == State.DEAD


# --- cancelled runs -------------------------------------------------------------------------


def test_cancelled_run_cancels_its_pending_step_without_a_call(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")

    runs.run_cancel(run=run, actor="agent:alice-bot", reason="changed my mind")

    assert reload(step).state == State.CANCELLED
    assert engine.process(step.pk, worker="w1") == engine.Outcome.SKIPPED
    assert WriteTool.calls == []


@pytest.mark.parametrize("lost", ["submit_steps", "active"])
def test_an_agent_may_not_cancel_without_submit_steps(
    agent: Agent, run: Run, workspace: Workspace, lost: str
) -> None:
    step = post(agent, run, "test.write")
    if lost == "submit_steps":
        remove_perm("executor.submit_steps", agent.user, workspace)
    else:
        Agent.objects.filter(pk=agent.pk).update(is_active=False)
    asking = Agent.objects.select_related("user", "workspace").get(pk=agent.pk)

    with pytest.raises(NotPermitted):
        runs.run_cancel(run=run, actor=asking, reason="not allowed")

    assert Run.objects.get(pk=run.pk).status == RunStatus.OPEN
    assert reload(step).state == State.PENDING


def test_an_agent_cancelling_is_recorded_as_that_agent(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")

    runs.run_cancel(run=run, actor=agent, reason="done here")

    assert history(step)[-1] == (State.PENDING, State.CANCELLED, f"agent:{agent.name}")


def test_claim_of_a_step_whose_run_was_cancelled_meanwhile_cancels_it(
    agent: Agent, run: Run
) -> None:
    step = post(agent, run, "test.write")
    # run_cancel found the step claimed for an instant and left it; the claim then lost.
    Run.objects.filter(pk=run.pk).update(status=RunStatus.CANCELLED)

    assert engine.process(step.pk, worker="w1") == State.CANCELLED

    assert history(step)[-1] == (State.PENDING, State.CANCELLED, "policy")
    assert WriteTool.calls == []


def test_write_claimed_before_its_run_was_cancelled_ends_cancelled_without_a_call(
    agent: Agent, run: Run
) -> None:
    step = post(agent, run, "test.write")
    claim = engine.claim_step(step.pk, worker="w1")
    assert isinstance(claim, engine.Claim)
    runs.run_cancel(run=run, actor="agent:alice-bot")

    engine.execute_claimed(claim)
    sweeper.sweep(owner="s1")

    assert WriteTool.calls == []
    assert reload(step).state == State.CANCELLED


def test_in_flight_write_of_a_cancelled_run_is_cancelled_not_retried_after_a_failure(
    agent: Agent, run: Run, settings: Any
) -> None:
    settings.EXECUTOR_REDISPATCH_AFTER = 0
    step = post(agent, run, "test.write")
    claim = engine.claim_step(step.pk, worker="w1")
    assert isinstance(claim, engine.Claim)
    WriteTool.will(FailureClass.TRANSIENT)
    # The call is under way (submitted) when the agent cancels the run.
    tooling.submit(claim)
    runs.run_cancel(run=run, actor="agent:alice-bot")

    with pytest.raises(ToolError) as failed:
        tooling.call_tool(claim)
    engine.handle_failure(claim, failed.value)
    make_due(step)
    sweeper.sweep(owner="s1")

    assert reload(step).state == State.CANCELLED
    assert len(WriteTool.calls) == 1
