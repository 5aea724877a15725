"""The executor: claim, authorize, submit, persist, verify (DESIGN.md §5, §8, §14).

A queue message only says "look at the ledger"; everything here re-reads the ledger and acts
on what it says. Work is claimed in batches: one commit takes a batch of due steps (each with
its own lease and fence), records their attempts and events, and decides each one's
authorization from facts read once for the batch. Every write a worker makes after its claim
is conditional on its fence, so a worker whose lease was taken over writes nothing to the
step and stops.

Commit points of one attempt:
  pure/read tools:         claim+authorize+submitting (batch) | call | completed (batch)
  write/destructive tools: claim+authorize (batch) | submitting | call | responded→verifying |
                           completed — each write step in a thread of the worker's pool
On PostgreSQL a write's `submitting` and `responded` commits are one statement each (CTEs,
atomic by themselves): a worker's CPU went mostly to building their ORM statements.

Why one module of about 1,000 lines: it is the single path from a claim to an outcome,
and §5's commit points must be read in order, in one place, to be checked; what is not on
that path lives elsewhere (recovery, progress, policy, dispatch, transitions).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from functools import cache, cached_property
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from executor import (
    bulk,
    calls,
    dispatch,
    faults,
    logcontext,
    policy,
    progress,
    tool_limits,
    transitions,
)
from executor.bulk import update_rows
from executor.models import (
    OPEN_PHASES,
    Approval,
    Attempt,
    Effect,
    Event,
    Idempotency,
    Phase,
    Run,
    RunStatus,
    Step,
)
from executor.redaction import Redactor
from executor.states import LEASED, State
from executor.tools.base import (
    RETRYABLE,
    FailureClass,
    Invocation,
    Tool,
    ToolError,
    ToolResult,
    find_tool,
    invoke_blocking,
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


def log_fields(step: Step, attempt: Attempt | None = None) -> dict[str, Any]:
    """What a log line about this step carries (executor/logcontext.py)."""
    workspace: Any = None
    if Step.run.is_cached(step):
        run = step.run
        workspace = run.workspace.slug if Run.workspace.is_cached(run) else run.workspace_id
    return {
        "step_id": step.pk,
        "run_id": step.run_id,
        "workspace": workspace,
        "attempt": attempt.number if attempt is not None else None,
    }


@dataclass
class Claim:
    step: Step
    attempt: Attempt
    tool: Tool
    worker: str
    # Set by the lease keeper when another worker has taken the step over.
    lost: bool = False

    @property
    def fence(self) -> int:
        return self.step.fence

    @cached_property
    def redactor(self) -> Redactor:
        """What of this call must never be stored or shown (DESIGN.md §15)."""
        return self.tool.redactor(self.step.input)


class Outcome:
    """What happened to one step when it was looked at, for logs and tests."""

    SKIPPED = "skipped"  # the step was not claimable (moved on, not due, paused run)
    FENCED_OUT = "fenced_out"


# --- the claim: a batch of due steps in one commit ----------------------------------------


LIGHT_EFFECTS = (Effect.PURE, Effect.READ)


def _locked(steps: QuerySet[Step]) -> QuerySet[Step]:
    """Locks the rows read, skipping those another worker is claiming right now.

    On SQLite (no SKIP LOCKED) the claim's transaction is IMMEDIATE: it holds the database's
    write lock from its first statement, so what it reads nobody else can claim meanwhile.
    """
    # The tool's row too: its limits (executor/tool_limits.py) come with the step.
    steps = steps.select_related("run", "run__workspace", "run__agent", "run__agent__user", "tool")
    if connection.vendor == "postgresql":
        steps = steps.select_for_update(skip_locked=True, of=("self",))
    return steps


# Oldest first; among steps due at once (a batch's), posting order: the budget's last calls go
# to the steps posted first.
DUE_ORDER = ("not_before", "position")


def _due_steps(*, light: int, writes: int, now: datetime, full: Sequence[str] = ()) -> list[Step]:
    """Up to `light` due pure/read steps and `writes` due write steps of open runs, oldest
    first, a run's steps due together in posting order, none of the tools in `full` (at
    their limit). The tool's effect comes from the Tool table (what decides is the
    registry's; this only sizes the batch)."""
    due = Step.objects.due(now).of_open_runs()
    if full:
        due = due.exclude(tool_id__in=full)
    rows: list[Step] = []
    if light > 0:
        rows += _locked(due.filter(tool__effect__in=LIGHT_EFFECTS).order_by(*DUE_ORDER))[:light]
    if writes > 0:
        rows += _locked(due.exclude(tool__effect__in=LIGHT_EFFECTS).order_by(*DUE_ORDER))[:writes]
    return rows


def _within_limits(rows: list[Step], *, now: datetime) -> tuple[list[Step], set[str]]:
    """`rows` less those of tools without room now (API.md "Slow tools"), counted under the
    lock of each limited tool's row so that two claims never share one room; and the tools
    whose steps were left (held back, still `pending`)."""
    limits = {
        step.tool_id: limit
        for step in rows
        if (limit := tool_limits.effective(step.tool)) is not None
    }
    if not limits:
        return rows, set()
    wanted: dict[str, int] = {}
    for step in rows:
        if step.tool_id in limits:
            wanted[step.tool_id] = wanted.get(step.tool_id, 0) + 1
    rooms = tool_limits.allot(wanted, limits, now=now)
    kept: list[Step] = []
    full: set[str] = set()
    for step in rows:
        if step.tool_id in rooms:
            if rooms[step.tool_id] <= 0:
                full.add(step.tool_id)
                continue
            rooms[step.tool_id] -= 1
        kept.append(step)
    return kept, full


@dataclass
class Batch:
    """What one claim took (`claims`) and where every step it looked at ended (`outcomes`)."""

    claims: list[Claim] = field(default_factory=list)
    outcomes: dict[Any, str] = field(default_factory=dict)
    # The tools whose due steps it left pending, at their limit (API.md "Slow tools").
    full: set[str] = field(default_factory=set)


def claim(
    *,
    worker: str,
    step_ids: Sequence[Any] | None = None,
    light: int = 0,
    writes: int = 0,
    now: datetime | None = None,
    skip_tools: Sequence[str] = (),
) -> Batch:
    """Takes the leases on a batch of due pending steps and decides their authorization, in
    one commit (DESIGN.md §5 points 2 to 4, §14).

    `step_ids` names steps to look at (a message's, a test's) whatever their age; besides
    them, up to `light` due pure/read steps and `writes` due write steps are taken. Pure and
    read steps that may go on are also past their `submitting` point (usage counted) when
    this returns; write steps are `claimed`. Steps that may not go on end blocked, cancelled,
    or pending in a paused run, each with its closed attempt, exactly as one step claimed
    alone would. Steps of `skip_tools` (found at their limit a moment ago) are not looked at.
    """
    now = now or timezone.now()
    batch = Batch()
    actor = executor_actor(worker)
    with transaction.atomic():
        rows = []
        if step_ids:
            rows = list(_locked(Step.objects.filter(pk__in=step_ids, state=State.PENDING)))
        named = {step.pk for step in rows}
        rows += [
            step
            for step in _due_steps(light=light, writes=writes, now=now, full=skip_tools)
            if step.pk not in named
        ]
        rows, batch.full = _within_limits(rows, now=now)
        taken: list[Step] = []
        for step in rows:
            if step.run.status == RunStatus.CANCELLED:
                transitions.move(
                    step, State.CANCELLED, actor="policy", reason="the run was cancelled", now=now
                )
                batch.outcomes[step.pk] = State.CANCELLED
            elif (step.not_before is not None and step.not_before > now) or (
                step.run.status != RunStatus.OPEN
            ):
                # Not due yet, or a paused run: its steps wait; a reviewer's resume wakes them.
                batch.outcomes[step.pk] = Outcome.SKIPPED
            else:
                taken.append(step)
        if not taken:
            return batch
        facts = policy.read_facts(taken)
        decisions: dict[Any, policy.Decision] = {}
        tools: dict[Any, Tool | None] = {}
        for step in taken:
            tool = tools[step.pk] = find_tool(step.tool_id)
            decisions[step.pk] = (
                policy.decide(step, tool, facts, now=now)
                if tool is not None
                else policy.Decision(
                    policy.Verdict.BLOCK, f"the tool {step.tool_id} is no longer registered"
                )
            )
        # Pure and read steps are submitted in this very commit: count their calls now, with
        # one conditional UPDATE per run; those the budget has no room for wait, paused.
        over_budget: set[Any] = set()
        by_run: dict[Any, list[Step]] = {}
        for step in taken:
            tool = tools[step.pk]
            if decisions[step.pk].ok and tool is not None and is_light(tool):
                by_run.setdefault(step.run_id, []).append(step)
        # Runs' rows in id order, as every batch takes them: two claims never wait on each
        # other's runs in a cycle.
        for _, steps in sorted(by_run.items(), key=lambda item: str(item[0])):
            granted = policy.budget_take_calls(steps[0].run, len(steps), now=now)
            over_budget.update(step.pk for step in steps[granted:])

        lease_until = now + timedelta(seconds=lease_seconds())
        transitions.move_many(
            [
                transitions.Move(
                    step,
                    State.RUNNING,
                    actor=actor,
                    reason=f"attempt {step.attempt_count + 1} claimed",
                    changes={
                        "fence": step.fence + 1,
                        "lease_owner": worker,
                        "lease_expires_at": lease_until,
                        "attempt_count": step.attempt_count + 1,
                    },
                    data={"fence": step.fence + 1, "attempt": step.attempt_count + 1},
                )
                for step in taken
            ],
            now=now,
            locked=True,
        )
        attempts: dict[Any, Attempt] = {}
        for step in taken:
            tool, decision = tools[step.pk], decisions[step.pk]
            attempt = Attempt(
                step=step,
                number=step.attempt_count,
                fence=step.fence,
                worker=worker,
                phase=Phase.CLAIMED,
                claimed_at=now,
            )
            if not decision.ok or step.pk in over_budget:
                attempt.phase = Phase.ABANDONED
                attempt.finished_at = now
                attempt.error_class = "budget" if decision.ok else decision.verdict
                attempt.error_message = decision.reason[:MAX_MESSAGE]
            elif tool is not None and is_light(tool):
                attempt.phase = Phase.SUBMITTING
                attempt.submitted_at = now
                attempt.request_evidence = request_evidence(tool, step)
            attempts[step.pk] = attempt
        Attempt.objects.bulk_create(attempts.values())

        refusals = []
        for step in taken:
            decision, tool = decisions[step.pk], tools[step.pk]
            if decision.ok and step.pk not in over_budget:
                assert tool is not None
                batch.claims.append(Claim(step, attempts[step.pk], tool, worker))
                continue
            refusals.append(_refusal(step, decision, over_budget, now=now))
        transitions.move_many(refusals, now=now, locked=True)
        for move in refusals:
            batch.outcomes[move.step.pk] = move.target
    return batch


def request_evidence(tool: Tool, step: Step) -> dict[str, Any]:
    return {"tool": tool.name, "input": tool.redacted(step.input), **tool.request_details()}


def _refusal(
    step: Step, decision: policy.Decision, over_budget: set[Any], *, now: datetime
) -> transitions.Move:
    """The move that ends a claimed attempt which may not go on; nothing was sent."""
    if step.pk in over_budget:
        reason = policy.budget_exhaustion(step.run, now=now) or "no budget left"
        policy.run_pause(step.run, reason=reason, now=now)
        return transitions.Move(step, State.PENDING, actor="policy", reason=f"run paused: {reason}")
    if decision.verdict == policy.Verdict.CANCEL:
        return transitions.Move(step, State.CANCELLED, actor="policy", reason=decision.reason)
    if decision.verdict == policy.Verdict.PAUSE:
        policy.run_pause(step.run, reason=decision.reason, now=now)
        return transitions.Move(step, State.PENDING, actor="policy", reason=decision.reason)
    return transitions.Move(
        step,
        State.BLOCKED,
        actor="policy",
        reason=decision.reason,
        changes={"failure_message": decision.reason},
    )


def claim_step(step_id: Any, *, worker: str) -> Claim | str:
    """Claims one step (a batch of one): its Claim, or the state/outcome it stopped at."""
    batch = claim(worker=worker, step_ids=[step_id])
    if batch.claims:
        return batch.claims[0]
    return batch.outcomes.get(step_id, Outcome.SKIPPED)


def process(step_id: Any, *, worker: str | None = None) -> str:
    """Advances one step as far as it goes. Returns the state it ended in, or an Outcome."""
    worker = worker or worker_name()
    claimed = claim_step(step_id, worker=worker)
    if not isinstance(claimed, Claim):
        return claimed
    with LeaseKeeper([claimed]):
        if is_light(claimed.tool):
            return run_light([claimed])[claimed.step.pk]
        return execute_claimed(claimed)


def cancel_if_run_cancelled(step_id: Any, *, actor: str) -> str:
    """A pending step of a cancelled run is cancelled (the sweeper's backstop)."""
    step = Step.objects.select_related("run").filter(pk=step_id).first()
    if step is None or step.state != State.PENDING or step.run.status != RunStatus.CANCELLED:
        return Outcome.SKIPPED
    try:
        transitions.move(step, State.CANCELLED, actor=actor, reason="the run was cancelled")
    except transitions.TransitionError:
        return Outcome.SKIPPED
    return State.CANCELLED


# --- pure and read tools: called at once, their outcomes persisted together ----------------


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


def call_of(claim: Claim) -> Invocation:
    return invocation(claim.step, claim.fence, claim.attempt.number)


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
    ends: dict[Any, str] = {}
    now = timezone.now()
    done = [(c, a) for c, a in zip(claims, answers, strict=True) if isinstance(a, ToolResult)]
    failed = [(c, a) for c, a in zip(claims, answers, strict=True) if not isinstance(a, ToolResult)]
    costs: dict[Any, Decimal] = {}
    with transaction.atomic():
        moved, stale = transitions.move_many([_answered(c, a, target) for c, a in done], now=now)
        moved_ids = {m.step.pk for m in moved}
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
        if target == State.COMPLETED:
            progress.steps_completed([m.step for m in moved], now=now)
        for c, _ in done:
            ends[c.step.pk] = target if c.step.pk in moved_ids else Outcome.FENCED_OUT
        for m in stale:
            c, a = next((c, a) for c, a in done if c.step.pk == m.step.pk)
            with logcontext.bound(**log_fields(c.step, c.attempt)):
                record_fenced_out(c.attempt, "responded", **response_evidence(c, a))
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
        return transitions.Move(claim.step, target, fence=claim.fence, **_responded(claim, result))
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


def response_evidence(claim: Claim, result: ToolResult) -> dict[str, Any]:
    """What the tool answered, as evidence: redacted before it is written."""
    evidence: dict[str, Any] = claim.redactor(
        {"external_id": result.external_id, **result.evidence}
    )
    return evidence


# --- write tools: one call per step, each outcome committed as it comes -------------------


def mark_submitting(step: Step, attempt: Attempt, tool: Tool, *, now: datetime) -> bool:
    """The point after which the tool may be called: usage counted, attempt `submitting`.

    Must run inside a transaction. False (and nothing written) when the budget is spent.
    """
    if not policy.budget_take_call(step.run, now=now):
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
    reason = policy.budget_exhaustion(step.run, now=now) or "no budget left"
    close_attempt(attempt, Phase.ABANDONED, error_class="budget", message=reason)
    policy.run_pause(step.run, reason=reason, now=now)
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
        held, counted = _submit_in_one_statement(claim, now=now)
        if not held:
            return record_fenced_out(attempt, "submitting")
        if counted:
            return None
        if policy.budget_exhaustion(step.run, now=now):
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
        held = _lock_held(claims)
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
            granted = policy.budget_take_calls(waiting[0].step.run, len(waiting), now=now)
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


def _lock_held(claims: Sequence[Claim]) -> set[Any]:
    """Locks (in id order, as every batch does) the rows of the claims whose lease their
    worker still holds, and returns their steps' ids. Inside a transaction."""
    held = Q()
    for c in claims:
        held |= Q(pk=c.step.pk, fence=c.fence)
    return set(
        Step.objects.select_for_update(no_key=True)
        .filter(held, state__in=LEASED)
        .order_by("pk")
        .values_list("pk", flat=True)
    )


@cache
def _submit_sql() -> str:
    """`still_holds_lease` and `mark_submitting` as one statement (`_submit_in_one_statement`)."""
    step, run, attempt = Step._meta, Run._meta, Attempt._meta
    return (
        f"WITH lease AS (UPDATE {step.db_table} SET lease_expires_at = %(expires)s"  # noqa: S608 - names, not input
        " WHERE id = %(step)s AND state = ANY(%(leased)s) AND fence = %(fence)s RETURNING run_id),"
        f" budget AS (UPDATE {run.db_table} SET used_calls = used_calls + 1, updated_at = %(now)s"
        f" WHERE id = (SELECT run_id FROM lease) AND {policy.ONE_CALL_ROOM_SQL} RETURNING id),"
        f" submitting AS (UPDATE {attempt.db_table} SET phase = %(submitting)s,"
        " submitted_at = %(now)s, request_evidence = %(evidence)s"
        " WHERE id = %(attempt)s AND phase = %(claimed)s AND EXISTS (SELECT FROM budget))"
        " SELECT EXISTS (SELECT FROM lease), EXISTS (SELECT FROM budget)"
    )


def _submit_in_one_statement(claim: Claim, *, now: datetime) -> tuple[bool, bool]:
    """The `submitting` commit on PostgreSQL: the lease extended if this worker still holds
    it, one call taken from the run's budget, the attempt `submitting`, in one statement (one
    round trip, atomic by itself, the run's row locked only while it runs). Returns (the
    lease was held, the call was counted); nothing but the lease is written unless both.
    """
    step, attempt = claim.step, claim.attempt
    evidence = Attempt._meta.get_field("request_evidence").get_db_prep_save(
        request_evidence(claim.tool, step), connection
    )
    params = {
        "expires": now + timedelta(seconds=lease_seconds()),
        "step": step.pk,
        "leased": [str(state) for state in LEASED],
        "fence": claim.fence,
        "now": now,
        "open": str(RunStatus.OPEN),
        "submitting": str(Phase.SUBMITTING),
        "evidence": evidence,
        "attempt": attempt.pk,
        "claimed": str(Phase.CLAIMED),
    }
    with connection.cursor() as cursor:
        cursor.execute(_submit_sql(), params)
        held, counted = cursor.fetchone()
    if held and counted:
        attempt.phase = Phase.SUBMITTING
        attempt.submitted_at = now
    return bool(held), bool(counted)


def still_holds_lease(claim: Claim, *, now: datetime) -> bool:
    """Extends the lease if this worker still holds it (a fenced write)."""
    return (
        Step.objects.filter(pk=claim.step.pk, state__in=LEASED, fence=claim.fence).update(
            lease_expires_at=now + timedelta(seconds=lease_seconds())
        )
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
    fields = closing_fields(
        phase, error_class=error_class, message=message, response=response, cost=cost, now=now
    )
    Attempt.objects.filter(pk=attempt.pk, phase__in=OPEN_PHASES).update(**fields)


def closing_fields(
    phase: Phase,
    *,
    error_class: str = "",
    message: str = "",
    response: dict[str, Any] | None = None,
    cost: Decimal | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """What closing an attempt in `phase` writes (`close_attempt`, the responded statement)."""
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
    return fields


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
        if not _respond_in_one_statement(claim, result, evidence, cost, actor=actor, now=now):
            return record_fenced_out(attempt, "responded", **evidence)
    else:
        try:
            with transaction.atomic():
                transitions.move(
                    step,
                    State.VERIFYING,
                    fence=claim.fence,
                    now=now,
                    **_responded(claim, result),
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


def _responded(claim: Claim, result: ToolResult) -> dict[str, Any]:
    """The move to `verifying` that stores a write's response: what it writes and says."""
    return {
        "actor": executor_actor(claim.worker),
        "reason": "response stored",
        "changes": {
            "external_id": result.external_id[:200],
            "result": claim.redactor(result.result),
        },
        "data": {"external_id": result.external_id} if result.external_id else None,
    }


def _respond_in_one_statement(
    claim: Claim,
    result: ToolResult,
    evidence: dict[str, Any],
    cost: Decimal | None,
    *,
    actor: str,
    now: datetime,
) -> bool:
    """Commit 6 on PostgreSQL: the step to `verifying` with its response (if this worker's
    fence still holds), its Event, the attempt `responded` and the run's cost, in one
    statement. False, and nothing written, when the fence no longer holds."""
    step, attempt = claim.step, claim.attempt
    moved = transitions.plan_move(
        step, State.VERIFYING, fence=claim.fence, now=now, **_responded(claim, result)
    )
    if_moved = "EXISTS (SELECT FROM moved)"
    closed = closing_fields(Phase.RESPONDED, response=evidence, cost=cost, now=now)
    ctes = [
        ("moved", moved.sql, moved.params),
        (
            "closed",
            *bulk.update_sql(
                Attempt,
                closed,
                where={"pk": attempt.pk},
                condition=f"phase = ANY(%s) AND {if_moved}",
                condition_params=[[str(phase) for phase in OPEN_PHASES]],
            ),
        ),
    ]
    if cost:
        ctes.append(
            (
                "costed",
                *bulk.update_sql(
                    Run,
                    {},
                    where={"pk": step.run_id},
                    increments={"used_cost": cost},
                    condition=if_moved,
                ),
            )
        )
    # Nothing is written until the statement runs: a crash here loses only the response.
    faults.hit("before_persist")
    found = bulk.insert_together([bulk.Rows(Event, [moved.event], where=if_moved)], ctes=ctes)
    if not found["moved"]:
        return False
    moved.done()
    return True


def verify_many(claims: Sequence[Claim]) -> dict[Any, str]:
    """verifying → completed for write steps whose responses are stored (commit 7 of §5),
    all in one commit, each conditional on its own fence; returns where each ended.

    The write pool's calls each commit their response as it comes (commit 6); their
    completions are shared, as a batch's claim is. A crash in between leaves them
    `verifying` with their response stored, which recovery completes (§7)."""
    if not claims:
        return {}
    now = timezone.now()
    with transaction.atomic():
        moved, stale = transitions.move_many(
            [
                transitions.Move(
                    c.step,
                    State.COMPLETED,
                    actor=executor_actor(c.worker),
                    reason="effect confirmed",
                    fence=c.fence,
                )
                for c in claims
            ],
            now=now,
        )
        progress.steps_completed([m.step for m in moved], now=now)
    ends: dict[Any, str] = {m.step.pk: State.COMPLETED for m in moved}
    by_step = {c.step.pk: c for c in claims}
    for m in stale:
        c = by_step[m.step.pk]
        with logcontext.bound(**log_fields(c.step, c.attempt)):
            ends[c.step.pk] = record_fenced_out(c.attempt, "completed")
    return ends


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


def pause_if_over_cost(run_id: Any, *, now: datetime) -> None:
    fresh = Run.objects.get(pk=run_id)
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


# --- leases: one heartbeat for every claim a worker holds ----------------------------------


def extend_leases(claims: Sequence[Claim], *, now: datetime) -> list[Claim]:
    """Extends the leases of `claims` still held (their rows locked in id order, then one
    UPDATE, in one transaction); returns those lost to another worker (the step claimed
    again, under another fence). A claim whose step has simply moved on (completed, or taken
    by recovery) is neither extended nor lost: its drain releases it."""
    if not claims:
        return []
    until = now + timedelta(seconds=lease_seconds())
    with transaction.atomic():
        # Locked first, in the order every batch locks steps (transitions.move_many): an
        # UPDATE locks its rows in whatever order its plan meets them, and met the drain's
        # completion of the same steps the other way round (a deadlock, then leases lost).
        ours = _lock_held(claims)
        Step.objects.filter(pk__in=ours).update(lease_expires_at=until)
    if len(ours) == len(claims):
        return []
    fences = dict(
        Step.objects.filter(pk__in=[c.step.pk for c in claims if c.step.pk not in ours])
        .order_by()
        .values_list("pk", "fence")
    )
    return [c for c in claims if c.step.pk in fences and fences[c.step.pk] != c.fence]


class LeaseKeeper:
    """Extends the leases of the claims a worker holds while it works on them.

    One thread and one transaction every third of the lease for all of them, however many; a
    claim whose lease another worker took over is marked `lost` (its fenced writes will be
    refused anyway) and dropped.
    """

    def __init__(self, claims: Sequence[Claim] = ()) -> None:
        self._held: dict[Any, Claim] = {c.step.pk: c for c in claims}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="stepward-leases")

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def hold(self, claims: Sequence[Claim]) -> None:
        with self._lock:
            self._held.update((c.step.pk, c) for c in claims)

    def release(self, claims: Sequence[Claim]) -> None:
        with self._lock:
            for c in claims:
                self._held.pop(c.step.pk, None)

    def _beat(self) -> None:
        interval = max(0.5, lease_seconds() / 3)
        try:
            while not self._stop.wait(interval):
                with self._lock:
                    held = list(self._held.values())
                for lost in extend_leases(held, now=timezone.now()):
                    lost.lost = True
                    logger.warning(
                        "lease lost on step %s",
                        lost.step.pk,
                        extra=log_fields(lost.step, lost.attempt),
                    )
                    self.release([lost])
        except Exception:  # the leases then run out, and recovery takes over
            logger.exception("the lease keeper stopped")
        finally:
            connection.close()


# --- calls in flight and the drain (DESIGN.md §16) ---------------------------------------


class InFlight:
    """The calls a drain has in flight: up to `limit` at once, on the process's call loop
    (executor/calls.py), none holding a database connection. Everything they need written
    this (the drain's) thread writes, in groups: the `submitting` marks of the writes about
    to start in one commit (`submit_many`), the answers that arrived by the time it looks in
    one commit (`store_answers`), the writes' completions in one more (`verify_many`); the
    lease keeper renews every lease in flight in one statement.

    Claims wait in `waiting` (claimed, nothing sent: a crash leaves them for recovery to
    retry, §7) until there is room. With `limit` 0 every call is made in this thread, one at
    a time, as it is claimed (in-process tests: their uncommitted rows are this thread's).
    """

    def __init__(self, limit: int, keeper: LeaseKeeper, ends: dict[Any, str]) -> None:
        self.limit = limit
        self.keeper = keeper
        # Where each step it ran ended, as its group is committed.
        self.ends = ends
        self._waiting: list[Claim] = []
        self._running: dict[Future[calls.Answer], Claim] = {}

    def room(self, wanted: int) -> int:
        """How many write steps to claim now."""
        if self.limit == 0:
            return wanted
        return max(0, min(wanted, self.limit - len(self._running) - len(self._waiting)))

    def add(self, claims: Sequence[Claim]) -> None:
        """Takes claimed steps whose call is not made in the claiming thread (writes, reads)."""
        if self.limit == 0:
            for c in claims:
                self.ends[c.step.pk] = execute_claimed(c)
                self.keeper.release([c])
            return
        self._waiting += claims
        self._start()

    def busy(self) -> bool:
        return bool(self._running or self._waiting)

    def collect(self, *, wait_seconds: float = 0) -> None:
        """Commits the answers that have arrived, waiting up to `wait_seconds` for the first
        one if none has; then starts what waits, room allowing."""
        if self._running and wait_seconds > 0:
            wait(self._running, timeout=wait_seconds, return_when=FIRST_COMPLETED)
        arrived = [(self._running.pop(f), f.result()) for f in list(self._running) if f.done()]
        if arrived:
            self._store(arrived)
        self._start()

    def join(self) -> None:
        """Waits for every call in flight and commits its answer."""
        while self.busy():
            self.collect(wait_seconds=1)

    def _start(self) -> None:
        room = self.limit - len(self._running)
        if room <= 0 or not self._waiting:
            return
        starting, self._waiting = self._waiting[:room], self._waiting[room:]
        reads = [c for c in starting if is_light(c.tool)]  # `submitting` since their claim
        writes, stopped = submit_many(
            [c for c in starting if not is_light(c.tool)], now=timezone.now()
        )
        self.ends.update(stopped)
        self.keeper.release([c for c in starting if c.step.pk in stopped])
        loop = calls.call_loop()
        for c in reads + writes:
            context = {**logcontext.current(), **log_fields(c.step, c.attempt)}
            self._running[loop.start(c.tool, call_of(c), context)] = c

    def _store(self, arrived: list[tuple[Claim, calls.Answer]]) -> None:
        reads = [(c, a) for c, a in arrived if is_light(c.tool)]
        writes = [(c, a) for c, a in arrived if not is_light(c.tool)]
        try:
            if reads:
                self.ends.update(store_answers(*zip(*reads, strict=True), target=State.COMPLETED))
            if writes:
                ends = store_answers(*zip(*writes, strict=True), target=State.VERIFYING)
                self.ends.update(ends)
                self.ends.update(
                    verify_many([c for c, _ in writes if ends[c.step.pk] == State.VERIFYING])
                )
        except Exception:  # their leases run out, and recovery takes them from there (§7)
            logger.exception("%d answers could not be committed", len(arrived))
            for c, _ in arrived:
                self.ends.setdefault(c.step.pk, Outcome.SKIPPED)
        finally:
            self.keeper.release([c for c, _ in arrived])


def drain(*, worker: str, limit: int | None = None) -> int:
    """Claims and runs due steps in batches until nothing is due (or `limit` were claimed).

    Returns how many it claimed. Pure and read steps run here, batch by batch; write steps
    go to the pool, and a batch claims no more of them than the pool has room for.
    """
    return _drain(worker=worker, limit=limit).claimed


def wake(step_id: Any, *, worker: str, limit: int | None = None) -> str:
    """What a message does: looks at the named step in the first batch, then drains due
    work until none is left (or `limit` more steps were claimed). Returns what happened to
    the named step: the state it ended in, or an Outcome."""
    try:
        hint = uuid.UUID(str(step_id))
    except ValueError:  # not a step id at all: nothing to look at but the due work
        _drain(worker=worker, limit=limit)
        return Outcome.SKIPPED
    return _drain(worker=worker, limit=limit, hint=hint).ends.get(hint, Outcome.SKIPPED)


@dataclass
class Drained:
    claimed: int = 0
    # Where each step looked at ended (a state, or an Outcome).
    ends: dict[Any, str] = field(default_factory=dict)


def _drain(*, worker: str, limit: int | None, hint: Any = None) -> Drained:
    limit = settings.EXECUTOR_DRAIN_LIMIT if limit is None else limit
    size = settings.EXECUTOR_BATCH_SIZE
    drained = Drained()
    named = [hint] if hint is not None else []
    held = HeldBack()
    with LeaseKeeper() as keeper:
        flight = InFlight(settings.EXECUTOR_MAX_IN_FLIGHT, keeper, drained.ends)
        try:
            while named or drained.claimed < limit:
                room = min(size, limit - drained.claimed)
                writes = flight.room(room)
                skipped = held.skipped()
                batch = claim(
                    worker=worker, step_ids=named, light=room, writes=writes, skip_tools=skipped
                )
                held.found_full(batch.full)
                held_back = bool(batch.full or skipped)
                named = []
                drained.ends.update(batch.outcomes)
                if batch.claims:
                    held.reset()
                    drained.claimed += len(batch.claims)
                    keeper.hold(batch.claims)
                    # Pure steps wait on nothing: they run here, at once. With no calls in
                    # flight (limit 0), reads do too.
                    here = [c for c in batch.claims if _called_here(c.tool, flight)]
                    flight.add([c for c in batch.claims if not _called_here(c.tool, flight)])
                    if here:
                        drained.ends.update(run_light(here))
                        keeper.release(here)
                    flight.collect()
                elif batch.outcomes and drained.claimed < limit:
                    continue  # only refusals: look again
                elif flight.busy():
                    # Nothing due that there is room for: commit answers as they come, and
                    # look for new work at least every LOOK_SECONDS (more often while a
                    # tool's limit holds steps back: its room comes back with time too).
                    flight.collect(wait_seconds=HELD_SECONDS if held_back else LOOK_SECONDS)
                elif writes == 0 < room:
                    continue  # no room when this claim looked: look for writes now
                elif held_back and held.wait():
                    continue  # only steps a tool's limit holds back: look again soon
                else:
                    break
        finally:
            flight.join()
    return drained


# How long a drain with calls in flight and nothing due waits for an answer before it looks
# for new work again; and as often while a tool's limit holds steps back.
LOOK_SECONDS = 0.5
HELD_SECONDS = 0.05


class HeldBack:
    """What a drain knows of the tools at their limit (API.md "Slow tools").

    A tool found without room is skipped by the drain's claims for SKIP_SECONDS, so that its
    due steps, oldest first, do not fill every batch and hide other tools' steps; then it is
    looked at again. A drain with nothing to do but such steps looks again after a wait that
    doubles (from HELD_SECONDS to 1 s), for at most HOLD_SECONDS in all; then it ends, and
    the sweeper's redispatch of due steps (EXECUTOR_REDISPATCH_AFTER) wakes a worker for
    them later: a tool limited to a few calls an hour holds no worker.
    """

    HOLD_SECONDS = 5.0
    SKIP_SECONDS = 0.2

    def __init__(self) -> None:
        self.reset()
        self._full: dict[str, float] = {}

    def found_full(self, tools: set[str]) -> None:
        until = time.monotonic() + self.SKIP_SECONDS
        self._full.update((tool, until) for tool in tools)

    def skipped(self) -> list[str]:
        now = time.monotonic()
        self._full = {tool: until for tool, until in self._full.items() if until > now}
        return sorted(self._full)

    def reset(self) -> None:
        self.pause = HELD_SECONDS
        self.since: float | None = None

    def wait(self) -> bool:
        """Waits before the next look; False (no wait) once HOLD_SECONDS have passed."""
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        if now - self.since >= self.HOLD_SECONDS:
            return False
        time.sleep(self.pause)
        self.pause = min(1.0, self.pause * 2)
        return True


def _called_here(tool: Tool, flight: InFlight) -> bool:
    return tool.effect == Effect.PURE or (is_light(tool) and flight.limit == 0)
