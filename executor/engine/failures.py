"""Failures and retries (DESIGN.md §8): each error classified, retried with bounded,
jittered backoff under a deadline where that is safe, `unknown` where nobody can know
whether the effect happened, failed where retrying cannot help."""

from __future__ import annotations

import random
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

import executor.engine.common as common
from executor.common import dispatch, logcontext
from executor.contract.tool import RETRYABLE, FailureClass, Tool, ToolError
from executor.engine.common import (
    MAX_MESSAGE,
    Claim,
    close_attempt,
    executor_actor,
    log_fields,
    record_fenced_out,
)
from executor.ledger import transitions
from executor.ledger.records import Approval, Attempt, Phase, Run, RunStatus, Step
from executor.ledger.states import State


def backoff_seconds(tool: Tool, failures: int, rng: random.Random | None = None) -> float:
    """Exponential backoff with full jitter, capped by max_interval. `failures` >= 1."""
    retry = tool.retry
    try:
        grown = retry.initial_interval * retry.backoff_coefficient ** (failures - 1)
    except OverflowError:  # a long series: the cap applies long before
        grown = retry.max_interval
    ceiling = min(retry.max_interval, grown)
    return (rng or random).uniform(0, ceiling)


def handle_failure(claim: Claim, error: BaseException) -> str:
    with logcontext.bound(**log_fields(claim.step, claim.attempt)):
        return _handle_failure(claim, error)


def _handle_failure(claim: Claim, error: BaseException) -> str:
    step, attempt, tool = claim.step, claim.attempt, claim.tool
    actor = executor_actor(claim.worker)
    failure = tool.classify(error)
    message = claim.redactor.text(f"{type(error).__name__}: {error}")[:MAX_MESSAGE]
    retry_after = error.retry_after if isinstance(error, ToolError) else None
    evidence = claim.redactor(dict(error.evidence)) if isinstance(error, ToolError) else {}
    now = timezone.now()

    if failure == FailureClass.AMBIGUOUS and common.safe_to_repeat(tool):
        # The call may have happened, but repeating it is harmless (§7).
        failure_retryable = True
    else:
        failure_retryable = failure in RETRYABLE
    try:
        with transaction.atomic():
            close_attempt(
                attempt,
                Phase.ERRORED,
                error_class=failure,
                message=message,
                response=evidence or None,
                now=now,
            )
            if failure_retryable and run_cancelled(step):
                # Nothing happened (a retryable class says so) and the run is cancelled:
                # the retry would never be wanted.
                transitions.move(
                    step,
                    State.CANCELLED,
                    actor="policy",
                    reason=f"{failure}; the run was cancelled meanwhile",
                    fence=claim.fence,
                    now=now,
                )
            elif failure_retryable:
                schedule_retry(claim, failure, message, retry_after, actor=actor, now=now)
            elif failure in (FailureClass.AMBIGUOUS, FailureClass.DESTRUCTIVE_UNSAFE):
                transitions.move(
                    step,
                    State.UNKNOWN,
                    actor=actor,
                    reason=f"{failure}: the effect may or may not have happened",
                    fence=claim.fence,
                    changes={
                        "failure_class": failure,
                        "failure_message": message,
                        # The sweeper reconciles through the lookup at once, if there is one.
                        "not_before": now if tool.has_lookup() else None,
                    },
                    now=now,
                )
            else:
                transitions.move(
                    step,
                    State.FAILED,
                    actor=actor,
                    reason=f"{failure}: not retried",
                    fence=claim.fence,
                    changes={"failure_class": failure, "failure_message": message},
                    now=now,
                )
            if step.state in (State.FAILED, State.DEAD):
                # This execution is over; a replay is a new one and needs its own approval.
                Approval.objects.filter(step=step, consumed_at__isnull=True).update(consumed_at=now)
            elif step.state == State.PENDING:
                dispatch.execute(step.pk, eta=step.not_before)
            elif step.state == State.UNKNOWN and tool.has_lookup():
                dispatch.reconcile(step.pk)
    except transitions.StaleStep:
        return record_fenced_out(attempt, f"failure:{failure}")
    return step.state


def run_cancelled(step: Step) -> bool:
    return Run.objects.filter(pk=step.run_id, status=RunStatus.CANCELLED).exists()


def schedule_retry(
    claim: Claim,
    failure: FailureClass,
    message: str,
    retry_after: float | None,
    *,
    actor: str,
    now: datetime,
) -> None:
    """running → pending with a backoff, or → dead when attempts or the deadline run out."""
    step, tool = claim.step, claim.tool
    # This operation's series only: a replay starts a new one (it resets first_scheduled_at).
    failures = Attempt.objects.filter(
        step=step,
        phase=Phase.ERRORED,
        claimed_at__gte=step.first_scheduled_at or step.created_at,
    ).count()
    delay = backoff_seconds(tool, failures)
    if failure == FailureClass.RATE_LIMITED and retry_after is not None:
        delay = max(delay, retry_after)
    first = step.first_scheduled_at or step.created_at
    deadline = first + timedelta(seconds=tool.retry.deadline)
    next_at = now + timedelta(seconds=delay)
    exhausted = ""
    if failures >= tool.retry.max_attempts:
        exhausted = f"{failures} attempts failed (max_attempts {tool.retry.max_attempts})"
    elif next_at >= deadline:
        exhausted = f"the retry deadline ({tool.retry.deadline:g}s from first scheduling) passed"
    if exhausted:
        transitions.move(
            step,
            State.DEAD,
            actor=actor,
            reason=f"{failure}: {exhausted}",
            fence=claim.fence,
            changes={"failure_class": failure, "failure_message": message, "not_before": None},
            data={"attempts": failures, "evidence_attempt": claim.attempt.pk},
            now=now,
        )
        return
    transitions.move(
        step,
        State.PENDING,
        actor=actor,
        reason=f"{failure}: retry {failures + 1} in {delay:.2f}s",
        fence=claim.fence,
        changes={"not_before": next_at, "failure_class": "", "failure_message": ""},
        data={"failure_class": failure, "delay": round(delay, 3)},
        now=now,
    )
