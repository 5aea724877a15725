"""The commit points of an attempt (DESIGN.md §5) after its claim: `submitting`, the call,
the response stored (`responded` → `verifying`), the effect confirmed (`completed`).

Pure and read steps are past `submitting` when claimed; their answers are stored together.
Writes are marked `submitting` in groups (`submit_many`) or alone (`submit`), their answers
stored in groups (`store_answers`) or alone (`persist_response`), and completed together
(`verify_many`). Every write after the claim is conditional on the step's fence: a worker
whose lease was taken over writes nothing to the step, and its refused write is recorded on
its Attempt."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

import executor.engine.statements as statements
from executor.common import faults, logcontext
from executor.contract.tool import Tool, ToolResult, invoke_blocking
from executor.engine import progress
from executor.engine.common import (
    Claim,
    Outcome,
    call_of,
    close_attempt,
    executor_actor,
    is_light,
    lease_seconds,
    log_fields,
    pause_if_over_cost,
    record_fenced_out,
    request_evidence,
    responded_move,
    response_evidence,
)
from executor.engine.failures import handle_failure
from executor.engine.leases import lock_held, still_holds_lease
from executor.ledger import transitions
from executor.ledger.bulk import update_rows
from executor.ledger.records import OPEN_PHASES, Attempt, Phase, Run, RunStatus, Step
from executor.ledger.states import State
from executor.policy import authorization


def run_light(claims: Sequence[Claim]) -> dict[Any, str]:
    """Calls each claimed pure/read step's tool here, one after another, then persists every
    outcome in one commit. Returns the state each step ended in (or FENCED_OUT). (A drain
    with calls in flight sends its reads to the call loop instead: `InFlight`.)"""
    return persist_light(claims, [_invoke_one(c) for c in claims])


def _invoke_one(claim: Claim) -> ToolResult | BaseException:
    """The call, here and now, with the interruption points around it (DESIGN.md §5)."""
    faults.hit("before_invoke")
    try:
        answer = invoke_blocking(claim.tool, call_of(claim))
    except Exception as error:  # noqa: BLE001 - every error is classified, none escapes
        return error
    faults.hit("after_submit")
    return answer


def persist_light(
    claims: Sequence[Claim], answers: Sequence[ToolResult | BaseException]
) -> dict[Any, str]:
    """Stores the answers of claimed pure/read steps: results complete their step, errors are
    classified (§8); all in one commit, each step's write conditional on its own fence."""
    return store_answers(claims, answers, target=State.COMPLETED)


def store_answers(
    claims: Sequence[Claim], answers: Sequence[ToolResult | BaseException], *, target: State
) -> dict[Any, str]:
    """Commit 6 of §5 for many calls at once (group commit, §14 and §16): each result moves
    its step to `target` (pure and read steps: completed; writes: verifying, their response
    stored) with its attempt `responded` and its cost counted, in one commit, each step's
    write conditional on its own fence; errors are classified (§8), each in its own commit.
    A crash before the commit loses only the responses: recovery treats those steps as
    never answered (§7). Returns where each step ended (or FENCED_OUT)."""
    now = timezone.now()
    done = [(c, a) for c, a in zip(claims, answers, strict=True) if isinstance(a, ToolResult)]
    failed = [(c, a) for c, a in zip(claims, answers, strict=True) if not isinstance(a, ToolResult)]
    costs: dict[Any, Decimal] = {}
    with transaction.atomic():
        moved_ids, ends = move_fenced(
            [(c, _answered(c, a, target)) for c, a in done],
            now=now,
            write="responded",
            evidence={c.step.pk: response_evidence(c, a) for c, a in done},
        )
        responded = {
            c.attempt.pk: (c, a, c.tool.cost(a)) for c, a in done if c.step.pk in moved_ids
        }
        for c, _, cost in responded.values():
            if cost:
                costs[c.step.run_id] = costs.get(c.step.run_id, Decimal(0)) + cost
        if responded:
            update_rows(
                Attempt.objects.filter(pk__in=responded, phase__in=OPEN_PHASES),
                same={
                    "phase": Phase.RESPONDED,
                    "error_class": "",
                    "error_message": "",
                    "finished_at": now,
                },
                per_row={
                    "response_evidence": {
                        pk: response_evidence(c, a) for pk, (c, a, _) in responded.items()
                    },
                    "cost": {pk: cost for pk, (_, _, cost) in responded.items()},
                },
            )
        for run_id, cost in sorted(costs.items(), key=lambda item: str(item[0])):
            Run.objects.filter(pk=run_id).update(used_cost=F("used_cost") + cost)
        for c, error in failed:
            assert isinstance(error, BaseException)
            ends[c.step.pk] = handle_failure(c, error)
        faults.hit("before_persist")
    for run_id in costs:
        pause_if_over_cost(run_id, now=now)
    return ends


def _answered(claim: Claim, result: ToolResult, target: State) -> transitions.Move:
    """The move that stores a call's result: to completed (pure, read) or verifying (write)."""
    if target == State.VERIFYING:
        return transitions.Move(
            claim.step, target, fence=claim.fence, **responded_move(claim, result)
        )
    return transitions.Move(
        claim.step,
        target,
        actor=executor_actor(claim.worker),
        reason="completed",
        fence=claim.fence,
        changes={
            "external_id": result.external_id[:200],
            "result": claim.redactor(result.result),
        },
        data={"external_id": result.external_id} if result.external_id else None,
    )


def mark_submitting(step: Step, attempt: Attempt, tool: Tool, *, now: datetime) -> bool:
    """The point after which the tool may be called: usage counted, attempt `submitting`.

    Must run inside a transaction. False (and nothing written) when the budget is spent.
    """
    if not authorization.budget_take_call(step.run, now=now):
        return False
    Attempt.objects.filter(pk=attempt.pk, phase=Phase.CLAIMED).update(
        phase=Phase.SUBMITTING, submitted_at=now, request_evidence=request_evidence(tool, step)
    )
    attempt.phase = Phase.SUBMITTING
    attempt.submitted_at = now
    return True


def stop_before_submit(step: Step, attempt: Attempt, *, now: datetime) -> str:
    """The run had no room for this call: it was cancelled, or its budget is spent."""
    run = Run.objects.get(pk=step.run_id)
    if run.status == RunStatus.CANCELLED:
        close_attempt(attempt, Phase.ABANDONED, error_class="cancel", message="run cancelled")
        transitions.move(step, State.CANCELLED, actor="policy", reason="the run was cancelled")
        return State.CANCELLED
    reason = authorization.budget_exhaustion(step.run, now=now) or "no budget left"
    close_attempt(attempt, Phase.ABANDONED, error_class="budget", message=reason)
    authorization.run_pause(step.run, reason=reason, now=now)
    transitions.move(step, State.PENDING, actor="policy", reason=f"run paused: {reason}", now=now)
    return State.PENDING


def execute_claimed(claim: Claim, *, verify: bool = True) -> str:
    """The rest of a claimed write step's attempt: submitting, the call, its outcome.

    `verify=False` stops at `verifying` (its response stored) for the caller to complete it
    with others (`verify_many`): the write pool does."""
    with logcontext.bound(**log_fields(claim.step, claim.attempt)):
        return _execute_claimed(claim, verify=verify)


def _execute_claimed(claim: Claim, *, verify: bool) -> str:
    if is_light(claim.tool):
        return run_light([claim])[claim.step.pk]
    stopped = submit(claim, now=timezone.now())
    if stopped is not None:
        return stopped
    answer = _invoke_one(claim)
    if isinstance(answer, ToolResult):
        return persist_response(claim, answer, verify=verify)
    return handle_failure(claim, answer)


# How often a write's `submitting` statement is tried when the run had no room for its call
# but has some when read again (resumed or extended meanwhile), as budget_take_calls does.
SUBMIT_TRIES = 5


def submit(claim: Claim, *, now: datetime) -> str | None:
    """Commit point 4 of a write (DESIGN.md §5): the lease still held, the call counted, the
    attempt `submitting`. None when the tool may now be called; otherwise where the step
    ended: FENCED_OUT (nothing written), or back to `pending` with the run paused (no
    budget), or `cancelled` (the run was)."""
    step, attempt, tool = claim.step, claim.attempt, claim.tool
    if connection.vendor != "postgresql":
        with transaction.atomic():
            if not still_holds_lease(claim, now=now):
                return record_fenced_out(attempt, "submitting")
            if not mark_submitting(step, attempt, tool, now=now):
                return stop_before_submit(step, attempt, now=now)
        return None
    for _ in range(SUBMIT_TRIES):
        held, counted = statements.submit_in_one_statement(claim, now=now)
        if not held:
            return record_fenced_out(attempt, "submitting")
        if counted:
            return None
        if authorization.budget_exhaustion(step.run, now=now):
            break
    with transaction.atomic():
        return stop_before_submit(step, attempt, now=now)


def submit_many(claims: Sequence[Claim], *, now: datetime) -> tuple[list[Claim], dict[Any, str]]:
    """Commit point 4 for many writes at once (DESIGN.md §16): the leases still held are
    extended, each run's calls counted by one conditional UPDATE, and the attempts marked
    `submitting` with their request evidence, in one commit. Returns (the claims whose tool
    may now be called, where each of the others ended: FENCED_OUT, or `pending` in a paused
    run, or `cancelled`)."""
    if not claims:
        return [], {}
    ends: dict[Any, str] = {}
    with transaction.atomic():
        held = lock_held(claims)
        Step.objects.filter(pk__in=held).update(
            lease_expires_at=now + timedelta(seconds=lease_seconds())
        )
        by_run: dict[Any, list[Claim]] = {}
        for c in claims:
            if c.step.pk in held:
                by_run.setdefault(c.step.run_id, []).append(c)
        ready: list[Claim] = []
        refused: list[Claim] = []
        # Runs' rows in id order, as every batch takes them (`claim`).
        for _, waiting in sorted(by_run.items(), key=lambda item: str(item[0])):
            granted = authorization.budget_take_calls(waiting[0].step.run, len(waiting), now=now)
            ready += waiting[:granted]
            refused += waiting[granted:]
        if ready:
            update_rows(
                Attempt.objects.filter(pk__in=[c.attempt.pk for c in ready], phase=Phase.CLAIMED),
                same={"phase": Phase.SUBMITTING, "submitted_at": now},
                per_row={
                    "request_evidence": {
                        c.attempt.pk: request_evidence(c.tool, c.step) for c in ready
                    }
                },
            )
        for c in ready:
            c.attempt.phase = Phase.SUBMITTING
            c.attempt.submitted_at = now
        for c in refused:
            with logcontext.bound(**log_fields(c.step, c.attempt)):
                ends[c.step.pk] = stop_before_submit(c.step, c.attempt, now=now)
    for c in claims:
        if c.step.pk not in held:
            with logcontext.bound(**log_fields(c.step, c.attempt)):
                ends[c.step.pk] = record_fenced_out(c.attempt, "submitting")
    return ready, ends


def persist_response(claim: Claim, result: ToolResult, *, verify: bool = True) -> str:
    """Stores a write's response (commit 6), then confirms the effect (commit 7) unless the
    caller does that itself (`verify=False`: the step is left `verifying`)."""
    step, attempt, tool = claim.step, claim.attempt, claim.tool
    if is_light(tool):
        return persist_light([claim], [result])[step.pk]
    actor = executor_actor(claim.worker)
    now = timezone.now()
    cost = tool.cost(result)
    evidence = response_evidence(claim, result)
    if connection.vendor == "postgresql":
        if not statements.respond_in_one_statement(
            claim, result, evidence, cost, actor=actor, now=now
        ):
            return record_fenced_out(attempt, "responded", **evidence)
    else:
        try:
            with transaction.atomic():
                transitions.move(
                    step,
                    State.VERIFYING,
                    fence=claim.fence,
                    now=now,
                    **responded_move(claim, result),
                )
                close_attempt(attempt, Phase.RESPONDED, response=evidence, cost=cost, now=now)
                if cost:
                    Run.objects.filter(pk=step.run_id).update(used_cost=F("used_cost") + cost)
                faults.hit("before_persist")
        except transitions.StaleStep:
            return record_fenced_out(attempt, "responded", **evidence)
    if cost:
        pause_if_over_cost(step.run_id, now=now)
    if not verify:
        return step.state
    return verify_step(step, actor=actor, fence=claim.fence, attempt=attempt)


def verify_many(claims: Sequence[Claim]) -> dict[Any, str]:
    """verifying → completed for write steps whose responses are stored (commit 7 of §5),
    all in one commit, each conditional on its own fence; returns where each ended.

    Their responses were committed before (commit 6, in groups or alone); their
    completions are shared, as a batch's claim is. A crash in between leaves them
    `verifying` with their response stored, which recovery completes (§7)."""
    if not claims:
        return {}
    now = timezone.now()
    with transaction.atomic():
        _, ends = move_fenced(
            [
                (
                    c,
                    transitions.Move(
                        c.step,
                        State.COMPLETED,
                        actor=executor_actor(c.worker),
                        reason="effect confirmed",
                        fence=c.fence,
                    ),
                )
                for c in claims
            ],
            now=now,
            write="completed",
        )
    return ends


def move_fenced(
    moves: Sequence[tuple[Claim, transitions.Move]],
    *,
    now: datetime,
    write: str,
    evidence: dict[Any, dict[str, Any]] | None = None,
) -> tuple[set[Any], dict[Any, str]]:
    """Moves many claims' steps at once, each conditional on its own fence, counting the
    completions among them; a move its fence refused is recorded on its attempt (`write`,
    with the step's `evidence`). Inside a transaction. Returns (the steps moved, where each
    step ended: its move's target, or FENCED_OUT)."""
    moved, stale = transitions.move_many([move for _, move in moves], now=now)
    completed = [m.step for m in moved if m.target == State.COMPLETED]
    if completed:
        progress.steps_completed(completed, now=now)
    ends: dict[Any, str] = {m.step.pk: m.target for m in moved}
    by_step = {c.step.pk: c for c, _ in moves}
    for m in stale:
        c = by_step[m.step.pk]
        with logcontext.bound(**log_fields(c.step, c.attempt)):
            ends[c.step.pk] = record_fenced_out(
                c.attempt, write, **(evidence or {}).get(c.step.pk, {})
            )
    return {m.step.pk for m in moved}, ends


def verify_step(
    step: Step, *, actor: str, fence: int | None, attempt: Attempt | None = None
) -> str:
    """verifying → completed: the stored response is the tool's confirmation of its effect."""
    now = timezone.now()
    try:
        with transaction.atomic():
            transitions.move(
                step, State.COMPLETED, actor=actor, reason="effect confirmed", fence=fence, now=now
            )
            progress.step_completed(step, now=now)
    except transitions.StaleStep:
        if attempt is not None:
            return record_fenced_out(attempt, "completed")
        return Outcome.FENCED_OUT
    return step.state
