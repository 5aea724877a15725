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

import itertools
import logging
import os
import random
import select
import socket
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from functools import cache, cached_property
from typing import Any

import psycopg
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, close_old_connections, connection, connections, transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from executor import bulk, dispatch, faults, logcontext, policy, progress, transitions
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
    steps = steps.select_related("run", "run__workspace", "run__agent", "run__agent__user")
    if connection.vendor == "postgresql":
        steps = steps.select_for_update(skip_locked=True, of=("self",))
    return steps


# Oldest first; among steps due at once (a batch's), posting order: the budget's last calls go
# to the steps posted first.
DUE_ORDER = ("not_before", "position")


def _due_steps(*, light: int, writes: int, now: datetime) -> list[Step]:
    """Up to `light` due pure/read steps and `writes` due write steps of open runs, oldest
    first, a run's steps due together in posting order. The tool's effect comes from the Tool
    table (what decides is the registry's; this only sizes the batch)."""
    due = Step.objects.due(now).of_open_runs()
    rows: list[Step] = []
    if light > 0:
        rows += _locked(due.filter(tool__effect__in=LIGHT_EFFECTS).order_by(*DUE_ORDER))[:light]
    if writes > 0:
        rows += _locked(due.exclude(tool__effect__in=LIGHT_EFFECTS).order_by(*DUE_ORDER))[:writes]
    return rows


@dataclass
class Batch:
    """What one claim took (`claims`) and where every step it looked at ended (`outcomes`)."""

    claims: list[Claim] = field(default_factory=list)
    outcomes: dict[Any, str] = field(default_factory=dict)


def claim(
    *,
    worker: str,
    step_ids: Sequence[Any] | None = None,
    light: int = 0,
    writes: int = 0,
    now: datetime | None = None,
) -> Batch:
    """Takes the leases on a batch of due pending steps and decides their authorization, in
    one commit (DESIGN.md §5 points 2 to 4, §14).

    `step_ids` names steps to look at (a message's, a test's) whatever their age; besides
    them, up to `light` due pure/read steps and `writes` due write steps are taken. Pure and
    read steps that may go on are also past their `submitting` point (usage counted) when
    this returns; write steps are `claimed`. Steps that may not go on end blocked, cancelled,
    or pending in a paused run, each with its closed attempt, exactly as one step claimed
    alone would.
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
            step for step in _due_steps(light=light, writes=writes, now=now) if step.pk not in named
        ]
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
    """Calls each claimed pure/read step's tool, then persists every outcome in one commit.

    Returns the state each step ended in (or FENCED_OUT). Read tools (which wait on the
    network) are called concurrently; pure ones in this thread.
    """
    answers = _invoke_all(claims)
    return persist_light(claims, answers)


def _invoke_one(claim: Claim) -> ToolResult | BaseException:
    """The call, with the interruption points around it (DESIGN.md §5)."""
    faults.hit("before_invoke")
    try:
        answer = claim.tool.invoke(invocation(claim.step, claim.fence, claim.attempt.number))
    except Exception as error:  # noqa: BLE001 - every error is classified, none escapes
        return error
    faults.hit("after_submit")
    return answer


def _invoke_all(claims: Sequence[Claim]) -> list[ToolResult | BaseException]:
    reads = [c for c in claims if c.tool.effect == Effect.READ]
    futures: dict[int, Future[ToolResult | BaseException]] = {}
    if len(reads) > 1 and settings.EXECUTOR_WRITE_POOL > 0:
        pool = _read_pool()
        futures = {id(c): pool.submit(_invoke_one, c) for c in reads}
    return [futures[id(c)].result() if id(c) in futures else _invoke_one(c) for c in claims]


def persist_light(
    claims: Sequence[Claim], answers: Sequence[ToolResult | BaseException]
) -> dict[Any, str]:
    """Stores the answers of claimed pure/read steps: results complete their step, errors are
    classified (§8); all in one commit, each step's write conditional on its own fence."""
    ends: dict[Any, str] = {}
    now = timezone.now()
    done = [(c, a) for c, a in zip(claims, answers, strict=True) if isinstance(a, ToolResult)]
    failed = [(c, a) for c, a in zip(claims, answers, strict=True) if not isinstance(a, ToolResult)]
    costs: dict[Any, Decimal] = {}
    with transaction.atomic():
        moved, stale = transitions.move_many(
            [
                transitions.Move(
                    c.step,
                    State.COMPLETED,
                    actor=executor_actor(c.worker),
                    reason="completed",
                    fence=c.fence,
                    changes={"external_id": a.external_id[:200], "result": c.redactor(a.result)},
                    data={"external_id": a.external_id} if a.external_id else None,
                )
                for c, a in done
            ],
            now=now,
        )
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
        progress.steps_completed([m.step for m in moved], now=now)
        for c, _ in done:
            ends[c.step.pk] = State.COMPLETED if c.step.pk in moved_ids else Outcome.FENCED_OUT
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
                    **_responded(claim, result, actor),
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


def _responded(claim: Claim, result: ToolResult, actor: str) -> dict[str, Any]:
    """The move to `verifying` that stores a write's response: what it writes and says."""
    return {
        "actor": actor,
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
        step, State.VERIFYING, fence=claim.fence, now=now, **_responded(claim, result, actor)
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
    held = Q()
    for c in claims:
        held |= Q(pk=c.step.pk, fence=c.fence)
    until = now + timedelta(seconds=lease_seconds())
    with transaction.atomic():
        # Locked first, in the order every batch locks steps (transitions.move_many): an
        # UPDATE locks its rows in whatever order its plan meets them, and met the drain's
        # completion of the same steps the other way round (a deadlock, then leases lost).
        ours = set(
            Step.objects.select_for_update(no_key=True)
            .filter(held, state__in=LEASED)
            .order_by("pk")
            .values_list("pk", flat=True)
        )
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


# --- the worker pool and the drain --------------------------------------------------------

# The process's thread pools, by name (made on first use, after a worker process forks).
_pools: dict[str, ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()


def _threads(name: str) -> ThreadPoolExecutor:
    with _pool_lock:
        if name not in _pools:
            _pools[name] = ThreadPoolExecutor(
                max_workers=max(1, settings.EXECUTOR_WRITE_POOL),
                thread_name_prefix=f"stepward-{name}",
            )
        return _pools[name]


def _call_pool() -> ThreadPoolExecutor:
    """The process's threads for write steps; each thread keeps its own database connection."""
    return _threads("call")


def _read_pool() -> ThreadPoolExecutor:
    """The process's threads for a batch's read calls, apart from the write pool, whose
    queue holds the writes' backlog: a batch's reads never wait behind it. They only call
    the tool; the batch's outcomes are persisted by the thread that claimed them."""
    return _threads("read")


def refresh_connection() -> None:
    """Django's rules for a connection at the start of a request (too old for CONN_MAX_AGE,
    left in error or outside autocommit: closed, the next query opens a new one), with the
    health check CONN_HEALTH_CHECKS asks for made by looking at the socket instead of by a
    query: a `SELECT 1` is a round trip and, for PostgreSQL, a transaction of its own.

    A connection that sat idle has nothing to read unless the server ended it meanwhile (a
    restart, `idle_session_timeout`, `pg_terminate_backend`): then its last words, or the
    end of the stream, are waiting. Such a connection is closed here, before a step uses it.
    A connection lost without a word (a network gone silent) is found by neither check in
    time; the step it fails waits for its lease to run out (DESIGN.md §7), as after a crash.
    """
    close_old_connections()
    db = connections[DEFAULT_DB_ALIAS]
    if db.vendor != "postgresql" or db.connection is None:
        return
    if not db.settings_dict.get("CONN_HEALTH_CHECKS"):
        return
    if db.connection.closed or _has_news(db.connection):
        db.close()
    else:
        # Django's flag for "checked this request" (not in its type stubs): no SELECT 1.
        db.health_check_done = True  # type: ignore[attr-defined]


def _has_news(pg: Any) -> bool:
    """Whether anything (or the end of the stream) waits to be read on an idle psycopg
    connection's socket: no round trip, no wait."""
    try:
        poller = select.poll()  # not select.select: it refuses descriptors from 1024 on
        poller.register(pg.pgconn.socket, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except (OSError, ValueError, psycopg.Error):
        return True


# Which drain each pool thread last worked for (`_execute_in_thread`).
_thread_drain = threading.local()


def _execute_in_thread(claim: Claim, context: dict[str, Any], drain: int) -> str:
    # A drain is to a pool thread what a request is to a web thread: its connection is
    # checked (and replaced if stale or broken) once at the start, not before every step.
    # After an error it is checked again before the next step.
    if getattr(_thread_drain, "number", None) != drain:
        refresh_connection()
        _thread_drain.number = drain
    with logcontext.bound(**context):
        try:
            return execute_claimed(claim, verify=False)
        except Exception:  # its lease runs out and recovery takes it from there (§7)
            logger.exception(
                "step %s: the attempt stopped on an error",
                claim.step.pk,
                extra=log_fields(claim.step, claim.attempt),
            )
            _thread_drain.number = None
            return Outcome.SKIPPED


_drains = itertools.count(1)


class WritePool:
    """Runs claimed write steps on the process's threads, `size` calls at once, with a
    backlog of at most BACKLOG times as many (in the calling thread, one by one, when `size`
    is 0).

    Writes are claimed for it BACKLOG pools' worth at a time, never one by one as each call
    returns: a claim is a commit, and the backlog's leases are kept like the running ones.
    Each call's thread commits its response; the calls that ended by the time the drain
    looks are completed together (`verify_many`), for the same reason. A claimed step that
    waits in the backlog has sent nothing: if the worker dies, it is retried once its lease
    runs out (DESIGN.md §7).
    """

    # Desk drain, create_keyed, -c 2, 8 threads: 100-108 steps/s with a backlog of one pool,
    # 117-123 with two (claims and completions half as often), 117 with three.
    BACKLOG = 2

    def __init__(self, size: int, keeper: LeaseKeeper, ends: dict[Any, str]) -> None:
        self.size = size
        self.keeper = keeper
        # Where each step it ran ended, as each call's thread returns.
        self.ends = ends
        self._running: dict[Future[str], Claim] = {}
        self._number = next(_drains)

    def room(self, wanted: int) -> int:
        """How many write steps to claim now."""
        if self.size == 0:
            return wanted
        self._reap()
        if len(self._running) > self.size:
            return 0
        return min(wanted, (1 + self.BACKLOG) * self.size - len(self._running))

    def submit(self, claims: Sequence[Claim]) -> None:
        for c in claims:
            if self.size == 0:
                self.ends[c.step.pk] = execute_claimed(c)
                self.keeper.release([c])
            else:
                # The pool's threads log with the context of the task that claimed the step.
                future = _call_pool().submit(
                    _execute_in_thread, c, logcontext.current(), self._number
                )
                self._running[future] = c

    def busy(self) -> bool:
        self._reap()
        return bool(self._running)

    def wait_for_room(self) -> None:
        """Waits for a call to end, and on until a claim would take writes again; then takes
        in every call that ended, so that their completions share one commit and the next
        claim takes pools' worth, not a step or two at a time."""
        pending = [f for f in self._running if not f.done()]
        if len(pending) == len(self._running):
            wait(pending, return_when=FIRST_COMPLETED)
            pending = [f for f in pending if not f.done()]
        while len(pending) > self.size:
            wait(pending, return_when=FIRST_COMPLETED)
            pending = [f for f in pending if not f.done()]
        self._reap()

    def join(self) -> None:
        wait(self._running)
        self._reap()

    def _reap(self) -> None:
        """Takes in the calls that ended; completes those that stored a response together."""
        ended = [(self._running.pop(f), f.result()) for f in [f for f in self._running if f.done()]]
        responded = [claim for claim, end in ended if end == State.VERIFYING]
        self.ends.update((claim.step.pk, end) for claim, end in ended)
        self.ends.update(verify_many(responded))
        self.keeper.release([claim for claim, _ in ended])


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
    with LeaseKeeper() as keeper:
        pool = WritePool(settings.EXECUTOR_WRITE_POOL, keeper, drained.ends)
        try:
            while named or drained.claimed < limit:
                room = min(size, limit - drained.claimed)
                writes = pool.room(room)
                batch = claim(worker=worker, step_ids=named, light=room, writes=writes)
                named = []
                drained.ends.update(batch.outcomes)
                if batch.claims:
                    drained.claimed += len(batch.claims)
                    keeper.hold(batch.claims)
                    pool.submit([c for c in batch.claims if not is_light(c.tool)])
                    light = [c for c in batch.claims if is_light(c.tool)]
                    if light:
                        drained.ends.update(run_light(light))
                        keeper.release(light)
                elif batch.outcomes and drained.claimed < limit:
                    continue  # only refusals: look again
                elif pool.busy():
                    pool.wait_for_room()
                elif writes == 0 < room:
                    continue  # the pool was full when this claim looked: look for writes now
                else:
                    break
        finally:
            pool.join()
    return drained
