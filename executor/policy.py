"""Authorization rechecked at every claim (DESIGN.md §9), approvals and budgets (§10)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import F, Q
from django.utils import timezone

from executor.models import Approval, Run, RunEvent, RunStatus, Step, Tool
from executor.tools.base import Tool as ToolContract


class Verdict(enum.StrEnum):
    GO = "go"
    BLOCK = "block"  # authorization or a precondition failed: a person must look
    CANCEL = "cancel"  # the run was cancelled
    PAUSE = "pause"  # the run is paused or out of budget: the step waits


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict == Verdict.GO


GO = Decision(Verdict.GO)


def approval_permission(step: Step) -> str:
    """The permission that approves this step: compensations have their own."""
    return "approve_compensation" if step.compensates_id else "approve_steps"


def approval_problem(
    step: Step, tool: ToolContract, approval: Approval | None, now: datetime
) -> str:
    """Why the live approval does not authorize this exact call, or "" when it does."""
    if approval is None:
        return "no valid approval"
    if approval.input_hash != step.input_hash or approval.tool != step.tool_id:
        return "the approval does not match this call"
    if approval.policy_version != tool.policy_version():
        return "the tool's policy changed since the approval"
    if approval.approver_id is not None:
        approver = approval.approver
        assert approver is not None
        max_age = timedelta(seconds=settings.EXECUTOR_APPROVAL_MAX_AGE)
        if approval.approved_at < now - max_age:
            return "the approval is older than EXECUTOR_APPROVAL_MAX_AGE"
        if approval.expires_at is not None and approval.expires_at <= now:
            return "the approval expired"
        permission = approval_permission(step)
        if not approver.is_active or not approver.has_perm(
            f"executor.{permission}", step.run.workspace
        ):
            return f"the approver {approver.get_username()} no longer holds {permission}"
    return ""


def live_approval(step: Step) -> Approval | None:
    return (
        Approval.objects.select_related("approver")
        .filter(step=step, consumed_at__isnull=True, revoked_at__isnull=True)
        .first()
    )


def authorize(step: Step, tool: ToolContract, *, now: datetime | None = None) -> Decision:
    """Everything that must hold before a call: the run, the agent, the approval.

    `step.run`, `step.run.agent` and its user are expected to be loaded.
    """
    now = now or timezone.now()
    run = step.run
    if run.status == RunStatus.CANCELLED:
        return Decision(Verdict.CANCEL, "the run was cancelled")
    if run.status != RunStatus.OPEN:
        return Decision(Verdict.PAUSE, run.pause_reason or f"the run is {run.status}")
    agent = run.agent
    user = agent.user
    if not agent.is_active or not user.is_active:
        return Decision(Verdict.BLOCK, f"the agent {agent.name} is deactivated")
    if not user.has_perm("executor.submit_steps", run.workspace):
        return Decision(Verdict.BLOCK, f"the agent {agent.name} no longer holds submit_steps")
    tool_row = Tool.objects.filter(name=step.tool_id, registered=True).first()
    if tool_row is None:
        return Decision(Verdict.BLOCK, f"the tool {step.tool_id} is no longer registered")
    if not user.has_perm("executor.use_tool", tool_row):
        return Decision(Verdict.BLOCK, f"the agent {agent.name} may no longer use {step.tool_id}")
    problem = approval_problem(step, tool, live_approval(step), now)
    if problem:
        return Decision(Verdict.BLOCK, problem)
    if run.deadline is not None and run.deadline <= now:
        return Decision(Verdict.PAUSE, "the run's deadline passed")
    return GO


def budget_take_call(run: Run, *, now: datetime) -> bool:
    """Counts one call against the run's budget, atomically; False when none is left.

    One conditional UPDATE, so concurrent workers can never overspend max_calls. Cost is
    known only after a call: a call may start while cost remains, and the one that crosses
    max_cost pauses the run after it (nothing is cut off mid-call).
    """
    room = Q(status=RunStatus.OPEN)
    room &= Q(max_calls__isnull=True) | Q(used_calls__lt=F("max_calls"))
    room &= Q(max_cost__isnull=True) | Q(used_cost__lt=F("max_cost"))
    room &= Q(deadline__isnull=True) | Q(deadline__gt=now)
    return (
        Run.objects.filter(room, pk=run.pk).update(used_calls=F("used_calls") + 1, updated_at=now)
        == 1
    )


def budget_exhaustion(run: Run, *, now: datetime, fresh: bool = True) -> str:
    """Why the run has no budget left ("" if it has); read anew from the ledger if `fresh`."""
    fresh_run = Run.objects.get(pk=run.pk) if fresh else run
    return _exhaustion(fresh_run, now=now)


def _exhaustion(fresh: Run, *, now: datetime) -> str:
    if fresh.status != RunStatus.OPEN:
        return fresh.pause_reason or f"the run is {fresh.status}"
    if fresh.deadline is not None and fresh.deadline <= now:
        return "the run's deadline passed"
    if fresh.max_calls is not None and fresh.used_calls >= fresh.max_calls:
        return f"max_calls reached ({fresh.used_calls} of {fresh.max_calls})"
    if fresh.max_cost is not None and fresh.used_cost >= fresh.max_cost:
        return f"max_cost reached ({fresh.used_cost} of {fresh.max_cost})"
    return ""


def run_pause(run: Run, *, reason: str, now: datetime, actor: str = "policy") -> bool:
    """Pauses an open run with its reason; False if it was not open."""
    paused = (
        Run.objects.filter(pk=run.pk, status=RunStatus.OPEN).update(
            status=RunStatus.PAUSED,
            pause_reason=reason[:500],
            version=F("version") + 1,
            updated_at=now,
        )
        == 1
    )
    if paused:
        RunEvent.objects.create(run_id=run.pk, action="paused", actor=actor, reason=reason)
    return paused
