"""The executor: claim, authorize, submit, persist, verify, recover (DESIGN.md §5, §7, §8).

A queue message only says "look at step X"; everything here re-reads the ledger and acts
on what it says. Every write a worker makes after its claim is conditional on its fence,
so a worker whose lease was taken over writes nothing to the step and stops.

Commit points of one attempt:
  write/destructive tools: claim+authorize | submitting | call | responded→verifying | completed
  pure/read tools:         claim+authorize+submitting | call | responded→completed
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from executor import faults, policy, transitions
from executor.models import (
    OPEN_PHASES,
    Approval,
    Attempt,
    Effect,
    Idempotency,
    Phase,
    Run,
    RunStatus,
    Step,
)
from executor.states import State
from executor.tools.base import (
    RETRYABLE,
    FailureClass,
    Invocation,
    LookupOutcome,
    Tool,
    ToolError,
    ToolResult,
    get_tool,
)

logger = logging.getLogger(__name__)

MAX_MESSAGE = 2000


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def lease_seconds() -> int:
    return settings.EXECUTOR_LEASE_SECONDS


def executor_actor(worker: str) -> str:
    return f"executor:{worker}"


def is_light(tool: Tool) -> bool:
    """Pure and read tools are safe to repeat and have nothing to verify."""
    return tool.effect in (Effect.PURE, Effect.READ)


def safe_to_repeat(tool: Tool) -> bool:
    """May a submission that might have happened be sent again? (DESIGN.md §7)"""
    return is_light(tool) or tool.idempotency == Idempotency.KEY


def invocation(step: Step, fence: int, attempt: int) -> Invocation:
    return Invocation(
        step_id=str(step.pk),
        operation_id=str(step.operation_id),
        input=step.input,
        fence=fence,
        attempt=attempt,
        idempotency_key=str(step.operation_id),
    )


@dataclass
class Claim:
    step: Step
    attempt: Attempt
    tool: Tool
    worker: str

    @property
    def fence(self) -> int:
        return self.step.fence


class Outcome:
    """What happened to one message, for logs and tests."""

    SKIPPED = "skipped"  # the step was not claimable (moved on, not due, paused run)
    FENCED_OUT = "fenced_out"


def load_step(step_id: Any) -> Step | None:
    return (
        Step.objects.select_related("run", "run__agent", "run__agent__user", "run__workspace")
        .filter(pk=step_id)
        .first()
    )


# --- the attempt ------------------------------------------------------------------------


def process(step_id: Any, *, worker: str | None = None) -> str:
    """Advances one step as far as it goes. Returns the state it ended in, or an Outcome."""
    worker = worker or worker_name()
    claim = claim_step(step_id, worker=worker)
    if not isinstance(claim, Claim):
        return claim
    return execute_claimed(claim)


def claim_step(step_id: Any, *, worker: str) -> Claim | str:
    """Takes the lease on a due pending step and rechecks its authorization, in one commit.

    Returns a Claim to go on with, or the state/outcome it stopped at.
    """
    step = load_step(step_id)
    now = timezone.now()
    if step is None or step.state != State.PENDING:
        return Outcome.SKIPPED
    run = step.run
    if run.status == RunStatus.CANCELLED:
        return cancel_pending(step, actor="policy")
    if step.not_before is not None and step.not_before > now:
        return Outcome.SKIPPED
    if run.status != RunStatus.OPEN:
        # A paused run's steps wait, still pending; a reviewer's resume dispatches them.
        return Outcome.SKIPPED
    tool = find_tool(step.tool_id)
    number = step.attempt_count + 1
    fence = step.fence + 1
    actor = executor_actor(worker)
    try:
        with transaction.atomic():
            transitions.move(
                step,
                State.RUNNING,
                actor=actor,
                reason=f"attempt {number} claimed",
                changes={
                    "fence": fence,
                    "lease_owner": worker,
                    "lease_expires_at": now + timedelta(seconds=lease_seconds()),
                    "attempt_count": number,
                },
                data={"fence": fence, "attempt": number},
                now=now,
            )
            attempt = Attempt.objects.create(
                step=step, number=number, fence=fence, worker=worker, phase=Phase.CLAIMED
            )
            decision = (
                policy.authorize(step, tool, now=now)
                if tool is not None
                else policy.Decision(
                    policy.Verdict.BLOCK, f"the tool {step.tool_id} is no longer registered"
                )
            )
            if not decision.ok or tool is None:
                end = refuse_claimed(step, attempt, decision, actor=actor, now=now)
                return end
            if is_light(tool) and not mark_submitting(step, attempt, tool, now=now):
                return stop_before_submit(step, attempt, actor=actor, now=now)
    except transitions.StaleStep:
        # Another worker or the sweeper moved it first; the duplicate message ends here.
        return Outcome.SKIPPED
    return Claim(step=step, attempt=attempt, tool=tool, worker=worker)


def cancel_pending(step: Step, *, actor: str) -> str:
    try:
        transitions.move(step, State.CANCELLED, actor=actor, reason="the run was cancelled")
    except transitions.TransitionError:
        return Outcome.SKIPPED
    return State.CANCELLED


def cancel_if_run_cancelled(step_id: Any, *, actor: str) -> str:
    """A pending step of a cancelled run is cancelled (the sweeper's backstop)."""
    step = load_step(step_id)
    if step is None or step.state != State.PENDING or step.run.status != RunStatus.CANCELLED:
        return Outcome.SKIPPED
    return cancel_pending(step, actor=actor)


def refuse_claimed(
    step: Step, attempt: Attempt, decision: policy.Decision, *, actor: str, now: datetime
) -> str:
    """Ends a claimed attempt that may not go on; nothing was sent."""
    close_attempt(attempt, Phase.ABANDONED, error_class=decision.verdict, message=decision.reason)
    if decision.verdict == policy.Verdict.CANCEL:
        transitions.move(step, State.CANCELLED, actor="policy", reason=decision.reason, now=now)
    elif decision.verdict == policy.Verdict.PAUSE:
        policy.run_pause(step.run, reason=decision.reason, now=now)
        transitions.move(step, State.PENDING, actor="policy", reason=decision.reason, now=now)
    else:
        transitions.move(
            step,
            State.BLOCKED,
            actor="policy",
            reason=decision.reason,
            changes={"failure_message": decision.reason},
            now=now,
        )
    return step.state


def stop_before_submit(step: Step, attempt: Attempt, *, actor: str, now: datetime) -> str:
    """The run had no room for this call: it was cancelled, or its budget is spent."""
    run = Run.objects.get(pk=step.run_id)
    if run.status == RunStatus.CANCELLED:
        close_attempt(attempt, Phase.ABANDONED, error_class="cancel", message="run cancelled")
        transitions.move(step, State.CANCELLED, actor="policy", reason="the run was cancelled")
        return State.CANCELLED
    return pause_claimed(step, attempt, actor=actor, now=now)


def pause_claimed(step: Step, attempt: Attempt, *, actor: str, now: datetime) -> str:
    reason = policy.budget_exhaustion(step.run, now=now) or "no budget left"
    close_attempt(attempt, Phase.ABANDONED, error_class="budget", message=reason)
    policy.run_pause(step.run, reason=reason, now=now)
    transitions.move(step, State.PENDING, actor="policy", reason=f"run paused: {reason}", now=now)
    return State.PENDING


def mark_submitting(step: Step, attempt: Attempt, tool: Tool, *, now: datetime) -> bool:
    """The point after which the tool may be called: usage counted, attempt `submitting`.

    Must run inside a transaction. False (and nothing written) when the budget is spent.
    """
    if not policy.budget_take_call(step.run, now=now):
        return False
    Attempt.objects.filter(pk=attempt.pk, phase=Phase.CLAIMED).update(
        phase=Phase.SUBMITTING,
        submitted_at=now,
        request_evidence={"tool": tool.name, "input": tool.redacted(step.input)},
    )
    attempt.phase = Phase.SUBMITTING
    attempt.submitted_at = now
    return True


def execute_claimed(claim: Claim) -> str:
    step, attempt, tool = claim.step, claim.attempt, claim.tool
    actor = executor_actor(claim.worker)
    if not is_light(tool):
        now = timezone.now()
        with transaction.atomic():
            if not still_holds_lease(claim, now=now):
                return record_fenced_out(attempt, "submitting")
            if not mark_submitting(step, attempt, tool, now=now):
                return stop_before_submit(step, attempt, actor=actor, now=now)
    faults.hit("before_invoke")
    call = invocation(step, claim.fence, attempt.number)
    with Heartbeat(claim):
        try:
            result = tool.invoke(call)
        except Exception as error:  # noqa: BLE001 - every error is classified, none escapes
            return handle_failure(claim, error)
    faults.hit("after_submit")
    return persist_response(claim, result)


def still_holds_lease(claim: Claim, *, now: datetime) -> bool:
    """Extends the lease if this worker still holds it (a fenced write)."""
    return (
        Step.objects.filter(
            pk=claim.step.pk, state__in=(State.RUNNING, State.VERIFYING), fence=claim.fence
        ).update(lease_expires_at=now + timedelta(seconds=lease_seconds()))
        == 1
    )


def record_fenced_out(attempt: Attempt, write: str, **evidence: Any) -> str:
    """Notes on the attempt that its worker's write was refused by the fence."""
    fields: dict[str, Any] = {"fenced_out_at": timezone.now(), "fenced_out_write": write}
    if evidence:
        fields["response_evidence"] = evidence
    Attempt.objects.filter(pk=attempt.pk).update(**fields)
    logger.warning("attempt %s was fenced out at %s", attempt.pk, write)
    return Outcome.FENCED_OUT


def close_attempt(
    attempt: Attempt,
    phase: Phase,
    *,
    error_class: str = "",
    message: str = "",
    response: dict[str, Any] | None = None,
    cost: Decimal | None = None,
    now: datetime | None = None,
) -> None:
    fields: dict[str, Any] = {
        "phase": phase,
        "error_class": error_class,
        "error_message": message[:MAX_MESSAGE],
        "finished_at": now or timezone.now(),
    }
    if response is not None:
        fields["response_evidence"] = response
    if cost is not None:
        fields["cost"] = cost
    Attempt.objects.filter(pk=attempt.pk, phase__in=OPEN_PHASES).update(**fields)


def persist_response(claim: Claim, result: ToolResult) -> str:
    """Stores the response (commit 6), then confirms the effect (commit 7)."""
    step, attempt, tool = claim.step, claim.attempt, claim.tool
    actor = executor_actor(claim.worker)
    now = timezone.now()
    cost = tool.cost(result)
    evidence = {"external_id": result.external_id, **result.evidence}
    target = State.COMPLETED if is_light(tool) else State.VERIFYING
    try:
        with transaction.atomic():
            transitions.move(
                step,
                target,
                actor=actor,
                reason="response stored" if target == State.VERIFYING else "completed",
                fence=claim.fence,
                changes={"external_id": result.external_id[:200], "result": result.result},
                data={"external_id": result.external_id} if result.external_id else None,
                now=now,
            )
            close_attempt(attempt, Phase.RESPONDED, response=evidence, cost=cost, now=now)
            if cost:
                Run.objects.filter(pk=step.run_id).update(used_cost=F("used_cost") + cost)
            if target == State.COMPLETED:
                completed(step, now=now)
            faults.hit("before_persist")
    except transitions.StaleStep:
        return record_fenced_out(attempt, "responded", **evidence)
    if cost:
        pause_if_over_cost(step.run, now=now)
    if target == State.VERIFYING:
        return verify(step, actor=actor, fence=claim.fence, attempt=attempt)
    return step.state


def verify(step: Step, *, actor: str, fence: int | None, attempt: Attempt | None = None) -> str:
    """verifying → completed: the stored response is the tool's confirmation of its effect."""
    now = timezone.now()
    try:
        with transaction.atomic():
            transitions.move(
                step, State.COMPLETED, actor=actor, reason="effect confirmed", fence=fence, now=now
            )
            completed(step, now=now)
    except transitions.StaleStep:
        if attempt is not None:
            return record_fenced_out(attempt, "completed")
        return Outcome.FENCED_OUT
    return step.state


def completed(step: Step, *, now: datetime) -> None:
    """What a completion implies, in the completing transaction (see services)."""
    from executor import services

    services.step_completed_effects(step=step, now=now)


def pause_if_over_cost(run: Run, *, now: datetime) -> None:
    fresh = Run.objects.get(pk=run.pk)
    if fresh.max_cost is not None and fresh.used_cost >= fresh.max_cost:
        policy.run_pause(
            fresh, reason=f"max_cost reached ({fresh.used_cost} of {fresh.max_cost})", now=now
        )


# --- failures and retries (DESIGN.md §8) ------------------------------------------------


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
    step, attempt, tool = claim.step, claim.attempt, claim.tool
    actor = executor_actor(claim.worker)
    failure = tool.classify(error)
    message = f"{type(error).__name__}: {error}"[:MAX_MESSAGE]
    retry_after = error.retry_after if isinstance(error, ToolError) else None
    evidence = dict(error.evidence) if isinstance(error, ToolError) else {}
    now = timezone.now()

    if failure == FailureClass.AMBIGUOUS and safe_to_repeat(tool):
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
    except transitions.StaleStep:
        return record_fenced_out(attempt, f"failure:{failure}")
    if step.state in (State.FAILED, State.DEAD):
        # This execution is over; a replay is a new one and needs an approval of its own.
        Approval.objects.filter(step=step, consumed_at__isnull=True).update(consumed_at=now)
    elif step.state == State.PENDING:
        dispatch(step.pk, eta=step.not_before)
    elif step.state == State.UNKNOWN and tool.has_lookup():
        dispatch_reconcile(step.pk)
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


# --- the heartbeat ----------------------------------------------------------------------


class Heartbeat:
    """Extends the lease while a long call runs; stops when the call returns."""

    def __init__(self, claim: Claim) -> None:
        self.claim = claim
        self.stop = threading.Event()
        self.lost = False
        self.thread = threading.Thread(target=self.beat, daemon=True, name="stepward-heartbeat")

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def beat(self) -> None:
        interval = max(0.5, lease_seconds() / 3)
        try:
            while not self.stop.wait(interval):
                if not still_holds_lease(self.claim, now=timezone.now()):
                    self.lost = True
                    logger.warning("lease lost on step %s", self.claim.step.pk)
                    return
        finally:
            connection.close()


# --- recovery (DESIGN.md §7) ------------------------------------------------------------


def find_tool(name: str) -> Tool | None:
    """The registered tool, or None where this process does not know it."""
    try:
        return get_tool(name)
    except LookupError:
        return None


def recover_expired(step_id: Any, *, actor: str = "sweeper") -> str:
    """Acts on a step whose lease expired, by the table of DESIGN.md §7.

    Every move here also requires the lease to be expired still (`lease_expired_by`): a
    worker that commits its `submitting` point after we read the attempt has extended its
    lease in that same commit, so our decision, made on an older phase, is refused.
    """
    step = load_step(step_id)
    now = timezone.now()
    if step is None or step.state not in (State.RUNNING, State.VERIFYING):
        return Outcome.SKIPPED
    if step.lease_expires_at is None or step.lease_expires_at > now:
        return Outcome.SKIPPED
    # A tool this process does not know is treated as the least safe kind: no repeat, no
    # lookup. Its step goes to a person rather than being guessed about.
    tool = find_tool(step.tool_id)
    repeatable = tool is not None and safe_to_repeat(tool)
    has_lookup = tool is not None and tool.has_lookup()
    attempt = Attempt.objects.filter(step=step, fence=step.fence).first()
    phase = attempt.phase if attempt else None
    why = f"lease of {step.lease_owner} expired"

    def to(target: State, reason: str, **changes: Any) -> None:
        transitions.move(
            step,
            target,
            actor=actor,
            reason=reason,
            changes=changes,
            now=now,
            lease_expired_by=now,
        )

    def abandon(message: str) -> None:
        if attempt is not None:
            close_attempt(
                attempt, Phase.ABANDONED, error_class="lease_expired", message=message, now=now
            )

    try:
        with transaction.atomic():
            if step.state == State.VERIFYING or phase == Phase.RESPONDED:
                # The response is stored: never submit again, finish the confirmation.
                to(State.COMPLETED, f"{why}; the response was stored, effect confirmed")
                completed(step, now=now)
            elif phase != Phase.SUBMITTING:
                to(State.PENDING, f"{why}; nothing was sent", not_before=now)
                abandon(why)
            elif repeatable:
                to(
                    State.PENDING,
                    f"{why} after submission; {step.tool_id} is safe to repeat",
                    not_before=now,
                )
                abandon(f"{why} after submission")
            else:
                to(
                    State.UNKNOWN,
                    f"{why} after submission; the effect may have happened",
                    failure_class=FailureClass.AMBIGUOUS,
                    failure_message="the worker stopped after submitting",
                    not_before=now if has_lookup else None,
                )
                abandon(f"{why} after submission")
    except transitions.StaleStep:
        return Outcome.SKIPPED
    if step.state == State.PENDING:
        dispatch(step.pk)
    elif step.state == State.UNKNOWN and has_lookup:
        return reconcile(step.pk, actor=actor)
    return step.state


def lookups_since_unknown(step: Step) -> int:
    """How many lookups could not tell since the step last became unknown."""
    recent = step.events.order_by("-seq").values_list("from_state", "to_state")
    count = 0
    for source, target in recent[: RECONCILE_TRIES + 1]:
        if not (source == State.UNKNOWN and target == State.UNKNOWN):
            break
        count += 1
    return count


RECONCILE_TRIES = 5
RECONCILE_INTERVAL = 30


def noted(reason: str, note: str) -> str:
    return f"{reason}: {note}" if note else reason


def reconcile(step_id: Any, *, actor: str = "sweeper", note: str = "") -> str:
    """Asks the tool whether an `unknown` step's operation happened (DESIGN.md §7).

    found → verifying → completed; not_found from an authoritative lookup → pending with
    the same operation_id; cannot_tell → stays unknown, tried again a few times, then left
    to a person.
    """
    step = load_step(step_id)
    if step is None or step.state != State.UNKNOWN:
        return Outcome.SKIPPED
    tool = find_tool(step.tool_id)
    if tool is None or not tool.has_lookup():
        # Nothing this process can ask: stop scheduling lookups; a person has it.
        Step.objects.filter(pk=step.pk, version=step.version).update(not_before=None)
        return Outcome.SKIPPED
    try:
        # One fence above the last attempt's: a tool that checks fences then refuses a
        # slow request of that attempt arriving after our "not found" (DESIGN.md §7).
        found = tool.lookup(invocation(step, step.fence + 1, step.attempt_count))
    except Exception as error:  # noqa: BLE001 - a failed lookup tells nothing
        logger.warning("lookup of %s failed: %s", step.pk, error)
        from executor.tools.base import Lookup

        found = Lookup(LookupOutcome.CANNOT_TELL, evidence={"error": str(error)[:500]})
    now = timezone.now()
    try:
        with transaction.atomic():
            if found.outcome == LookupOutcome.FOUND:
                transitions.move(
                    step,
                    State.VERIFYING,
                    actor=actor,
                    reason=noted("lookup found the operation", note),
                    changes={
                        "external_id": found.external_id[:200],
                        "result": found.result,
                        "lease_owner": actor,
                        "lease_expires_at": now + timedelta(seconds=lease_seconds()),
                        "not_before": None,
                    },
                    data={"lookup": found.outcome, **found.evidence},
                    now=now,
                )
                transitions.move(
                    step,
                    State.COMPLETED,
                    actor=actor,
                    reason=noted("effect confirmed by lookup", note),
                    now=now,
                )
                completed(step, now=now)
            elif found.outcome == LookupOutcome.NOT_FOUND and tool.lookup_authoritative:
                transitions.move(
                    step,
                    State.PENDING,
                    actor=actor,
                    reason=noted(
                        "the authoritative lookup found no effect: run again, same operation", note
                    ),
                    changes={"not_before": now, "failure_class": "", "failure_message": ""},
                    data={"lookup": found.outcome, **found.evidence},
                    now=now,
                )
            else:
                tries = lookups_since_unknown(step) + 1
                give_up = tries >= RECONCILE_TRIES
                transitions.move(
                    step,
                    State.UNKNOWN,
                    actor=actor,
                    reason=noted(
                        f"lookup could not tell ({tries} of {RECONCILE_TRIES}); "
                        + ("a reviewer has it" if give_up else "will ask again"),
                        note,
                    ),
                    changes={
                        "not_before": None
                        if give_up
                        else now + timedelta(seconds=RECONCILE_INTERVAL * tries)
                    },
                    data={"lookup": found.outcome, **found.evidence},
                    now=now,
                )
    except transitions.StaleStep:
        return Outcome.SKIPPED
    if step.state == State.PENDING:
        dispatch(step.pk)
    return step.state


# --- dispatch ---------------------------------------------------------------------------


def dispatch(step_id: Any, *, eta: datetime | None = None) -> None:
    """Sends "look at step X" after the current transaction commits. Only a hint."""
    from executor import tasks

    tasks.send_execute(step_id, eta=eta)


def dispatch_reconcile(step_id: Any) -> None:
    from executor import tasks

    tasks.send_reconcile(step_id)


# --- draining: a woken worker claims further due work -------------------------------------


def due_now(now: datetime) -> Q:
    return Q(not_before__isnull=True) | Q(not_before__lte=now)


def next_due_step_id(*, exclude: set[Any]) -> Any | None:
    """The oldest due pending step of an open run, skipping rows other workers have locked.

    On PostgreSQL `SKIP LOCKED` keeps concurrent drainers off each other's rows; on SQLite
    (no SKIP LOCKED, one writer at a time) the claim's version check settles any race.
    """
    now = timezone.now()
    qs = (
        Step.objects.filter(due_now(now), state=State.PENDING, run__status="open")
        .exclude(pk__in=exclude)
        .order_by("not_before")
        .values_list("pk", flat=True)
    )
    if connection.vendor == "postgresql":
        qs = qs.select_for_update(skip_locked=True, of=("self",))
    return qs.first()


def drain(*, worker: str, limit: int) -> int:
    """Claims and processes up to `limit` further due steps; returns how many it claimed."""
    done = 0
    seen: set[Any] = set()
    while done < limit:
        with transaction.atomic():
            step_id = next_due_step_id(exclude=seen)
            if step_id is None:
                return done
            seen.add(step_id)
            claim = claim_step(step_id, worker=worker)
        if isinstance(claim, Claim):
            execute_claimed(claim)
            done += 1
    return done
