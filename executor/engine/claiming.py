"""The claim: a batch of due steps in one commit (DESIGN.md §5 points 2 to 4, §14).

One statement takes up to N due `pending` rows (`FOR UPDATE SKIP LOCKED` on PostgreSQL; on
SQLite the claim's IMMEDIATE transaction holds the write lock), moves them to `running` with
their fences and leases, inserts their Attempts and Events in bulk, and decides each one's
authorization from facts read once for the batch. Tools at their limit (API.md "Slow tools",
executor/policy/tool_limits.py) keep their steps `pending`."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import F, QuerySet, Window
from django.db.models.functions import RowNumber
from django.utils import timezone

from executor.contract.tool import FailureClass, Tool, find_tool
from executor.engine.common import (
    MAX_MESSAGE,
    Claim,
    Outcome,
    executor_actor,
    is_light,
    lease_seconds,
    request_evidence,
)
from executor.ledger import bulk, transitions
from executor.ledger.records import TAKES_WORK, Attempt, Effect, Phase, Run, RunStatus, Step
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import State
from executor.policy import authorization, tool_limits

LIGHT_EFFECTS = (Effect.PURE, Effect.READ)


def _locked(steps: QuerySet[Step]) -> QuerySet[Step]:
    """Locks the rows read, skipping those another worker is claiming right now.

    On SQLite (no SKIP LOCKED) the claim's transaction is IMMEDIATE: it holds the database's
    write lock from its first statement, so what it reads nobody else can claim meanwhile.
    """
    steps = _with_facts(steps)
    if connection.vendor == "postgresql":
        steps = steps.select_for_update(skip_locked=True, of=("self",))
    return steps


def _with_facts(steps: QuerySet[Step]) -> QuerySet[Step]:
    """The steps with what authorizing them reads (run, workspace, agent and its user) and
    their tool's row: its limits (executor/policy/tool_limits.py) come with the step."""
    return steps.select_related("run", "run__workspace", "run__agent", "run__agent__user", "tool")


# Within a run: oldest first; among its steps due at once (a batch's), posting order: the
# budget's last calls go to the steps posted first.
DUE_ORDER = ("not_before", "position")


def _due_steps(*, light: int, writes: int, now: datetime, full: Sequence[str] = ()) -> list[Step]:
    """Up to `light` due pure/read steps and `writes` due write steps of open runs, none of
    the tools in `full` (at their limit), taken fairly across runs: each run's first due step
    (oldest first, then in posting order), then each run's second, and so on — a run with
    10,000 steps due does not make another run's steps wait behind them all. The tool's
    effect comes from the Tool table (what decides is the registry's; this only sizes the
    batch)."""
    rows: list[Step] = []
    if light > 0:
        rows += _fairly(light=True, limit=light, now=now, full=full)
    if writes > 0:
        rows += _fairly(light=False, limit=writes, now=now, full=full)
    return rows


# How many due steps the PostgreSQL claim ranks: the limit times this, shared among the runs
# found with due work (each run's first `ceil(limit * 4 / runs)`), so that claims made at
# the same moment by a few workers, each skipping the rows the others hold, still find rows
# of their own in a run that has the only due work; and a hundred runs with a backlog each
# cost a few index entries each, not their backlogs.
CANDIDATES_PER_LIMIT = 4


def _fairly(*, light: bool, limit: int, now: datetime, full: Sequence[str]) -> list[Step]:
    """Up to `limit` due steps of pure/read tools (`light`) or of the others, locked
    (PostgreSQL), round-robin across their runs.

    One statement ranks due steps within their run (ROW_NUMBER over the run, in DUE_ORDER)
    and takes them by rank, skipping (PostgreSQL) rows another claim holds, so two workers'
    claims take different steps; a second reads the rows taken with what authorizing them
    needs. On PostgreSQL it ranks only the first few due steps of a bounded number of runs
    with due work, found in the `step_due_in_run` index (`_fair_sql`), so a claim costs what
    it takes, not the backlog nor the number of runs; on SQLite (the embedded default, one
    worker) every due step.

    The outer check that the row is still as ranked (`s.version = ranked.version` on
    PostgreSQL, `s.state = 'pending'` on SQLite) is not redundant: under READ COMMITTED, a
    row another claim committed (to `running`, a new version) after this statement's
    snapshot is locked anyway and re-checked against the outer query's conditions only (the
    ranked subquery is not re-evaluated), so without it the row would be taken twice.
    """
    if connection.vendor == "postgresql":
        sql, params = fair_statement(light=light, limit=limit, now=now, full=full)
    else:
        sql, params = _fair_sql_everywhere(light=light, limit=limit, now=now, full=full)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        ids = [row[0] for row in cursor.fetchall()]
    if not ids:
        return []
    # Locked already (PostgreSQL) or under the claim's write lock (SQLite).
    found = {step.pk: step for step in _sharing_facts(ids)}
    return [found[pk] for pk in _as_pks(ids) if pk in found]


def _sharing_facts(ids: list[Any]) -> list[Step]:
    """The pending steps of `ids` with what `_with_facts` reads, each run (with its
    workspace, agent and user) and each tool's row read once and shared by its steps: a
    batch is mostly one run's steps of one tool, and building the same five related rows for
    each of its steps was much of a claim's CPU."""
    steps = list(Step.objects.filter(pk__in=ids, state=State.PENDING))
    runs = Run.objects.select_related("workspace", "agent", "agent__user").in_bulk(
        {step.run_id for step in steps}
    )
    tools = ToolRow.objects.in_bulk({step.tool_id for step in steps}, field_name="name")
    for step in steps:
        step.run = runs[step.run_id]
        if step.tool_id in tools:
            step.tool = tools[step.tool_id]
    return steps


def fair_statement(
    *, light: bool, limit: int, now: datetime, full: Sequence[str] = ()
) -> tuple[str, list[Any]]:
    """PostgreSQL's fair claim (`_fair_sql`) and its parameters, starting at a random run."""
    start = uuid.uuid4()
    runs = min(limit * CANDIDATES_PER_LIMIT, MAX_RUNS_LOOKED_AT)
    params: list[Any] = [
        # The runs with due work: from `start` on, then from the first up to `start`.
        State.PENDING,
        start,
        now,
        State.PENDING,
        now,
        runs,
        State.PENDING,
        start,
        now,
        State.PENDING,
        start,
        now,
        runs,
        # How many due steps of each run to rank: the candidates shared among the runs found.
        limit * CANDIDATES_PER_LIMIT,
        # Each open one's first due steps of the kind wanted.
        State.PENDING,
        now,
        list(LIGHT_EFFECTS),
        list(full),
        RunStatus.OPEN,
        RunStatus.CLOSED,
        limit,
    ]
    return _fair_sql(light), params


# How many runs with due work one PostgreSQL claim looks at, at most.
MAX_RUNS_LOOKED_AT = 256

# One probe of the `step_due_in_run` index: the first run after a run id with a due step.
# An index scan bounded by LIMIT 1, whatever the statistics say: it reads the index in
# run order and stops at the first due entry (passing, and marking dead for the next scan,
# the entries of steps claimed since the last vacuum, which a bitmap scan would not).
_NEXT_RUN = (
    "SELECT c.run_id FROM {step} c WHERE c.state = %s AND c.run_id {after} {previous}"
    " AND (c.not_before IS NULL OR c.not_before <= %s) ORDER BY c.run_id LIMIT 1"
)


@functools.cache
def _fair_sql(light: bool) -> str:
    """PostgreSQL's fair claim, in a cost that does not grow with the ledger or its runs.

    First the runs with due work, found by walking the `step_due_in_run` index from run to
    run (a recursive CTE of index probes, each bounded by LIMIT 1), starting at a random run
    id and wrapping around, at most `runs` on each side of it: not a loop over every open
    run, and every run with due work comes first for some claims. Then, for each of those that is
    open, its first due steps of the kind wanted (an index range scan each, LATERAL, in the
    due index's order, as many as the candidates shared among the runs found: a LIMIT the
    planner cannot know, so it reads the index in order rather than a bitmap of the run's
    whole backlog), ranked within the run; the first `limit` by rank locked, skipping those
    another claim holds.
    """
    step, run, tool = Step._meta.db_table, Run._meta.db_table, ToolRow._meta.db_table
    kind = "= ANY(%s::text[])" if light else "<> ALL(%s::text[])"
    first_after = _NEXT_RUN.format(step=step, after=">=", previous="%s")
    next_after = _NEXT_RUN.format(step=step, after=">", previous="d.run_id")
    first_before = _NEXT_RUN.format(step=step, after="<", previous="%s")
    next_before = (
        f"SELECT c.run_id FROM {step} c WHERE c.state = %s AND c.run_id > d.run_id"  # noqa: S608
        " AND c.run_id < %s AND (c.not_before IS NULL OR c.not_before <= %s)"
        " ORDER BY c.run_id LIMIT 1"
    )
    return (
        "WITH RECURSIVE after_start (run_id, n) AS ("  # noqa: S608 - names, not input
        f" (SELECT ({first_after}), 1)"
        f" UNION ALL SELECT ({next_after}), d.n + 1 FROM after_start d"
        " WHERE d.run_id IS NOT NULL AND d.n < %s"
        "), before_start (run_id, n) AS ("
        f" (SELECT ({first_before}), 1)"
        f" UNION ALL SELECT ({next_before}), d.n + 1 FROM before_start d"
        " WHERE d.run_id IS NOT NULL AND d.n < %s"
        "), due_runs AS ("
        " SELECT run_id FROM after_start WHERE run_id IS NOT NULL"
        " UNION ALL SELECT run_id FROM before_start WHERE run_id IS NOT NULL"
        "), per_run (k) AS ("
        " SELECT CEIL(%s::numeric / GREATEST(count(*), 1))::integer FROM due_runs"
        ")"
        f" SELECT s.id FROM {step} s JOIN ("
        " SELECT d.id, d.version, d.not_before, d.position, ROW_NUMBER() OVER"
        " (PARTITION BY d.run_id ORDER BY d.not_before, d.position) AS rank"
        " FROM due_runs CROSS JOIN LATERAL ("
        f" SELECT c.id, c.run_id, c.version, c.not_before, c.position FROM {step} c"
        " WHERE c.run_id = due_runs.run_id AND c.state = %s"
        " AND (c.not_before IS NULL OR c.not_before <= %s)"
        f" AND c.tool IN (SELECT name FROM {tool} WHERE effect {kind})"
        " AND c.tool <> ALL(%s::text[])"
        " ORDER BY c.not_before, c.position LIMIT (SELECT k FROM per_run)) d"
        # The run's status by its key: one lookup per run found, never a read of every
        # open run to join them.
        f" WHERE (SELECT r.status FROM {run} r WHERE r.id = due_runs.run_id) IN (%s, %s)"
        # By its key too: the version, not the state, says the row is still as ranked
        # (an index on state would offer the planner a scan of every pending entry).
        " ) ranked ON ranked.id = s.id AND s.version = ranked.version"
        " ORDER BY ranked.rank, ranked.not_before, ranked.position"
        " LIMIT %s FOR UPDATE OF s SKIP LOCKED"
    )


def _fair_sql_everywhere(
    *, light: bool, limit: int, now: datetime, full: Sequence[str]
) -> tuple[str, list[Any]]:
    """The fair claim where there is no LATERAL or SKIP LOCKED (SQLite): every due step of
    open runs ranked within its run (the claim's IMMEDIATE transaction holds the write lock)."""
    due = Step.objects.due(now).of_open_runs()
    if full:
        due = due.exclude(tool_id__in=full)
    due = (
        due.filter(tool__effect__in=LIGHT_EFFECTS)
        if light
        else due.exclude(tool__effect__in=LIGHT_EFFECTS)
    )
    ranked = (
        due.annotate(
            rank=Window(RowNumber(), partition_by=F("run_id"), order_by=[F(f) for f in DUE_ORDER])
        )
        .values("id", "rank", *DUE_ORDER)
        .order_by()
    )
    inner, params = ranked.query.sql_with_params()
    sql = (
        f"SELECT s.id FROM {Step._meta.db_table} s JOIN ({inner}) ranked ON ranked.id = s.id"  # noqa: S608 - names, not input
        " WHERE s.state = %s"
        " ORDER BY ranked.rank, ranked.not_before, ranked.position"
        " LIMIT %s"
    )
    return sql, [*params, State.PENDING, limit]


def _as_pks(ids: list[Any]) -> list[Any]:
    """The database's ids as the model's primary keys (SQLite gives UUIDs as text)."""
    field = Step._meta.pk
    assert field is not None
    return [field.to_python(value) for value in ids]


def _within_limits(
    rows: list[Step], *, now: datetime, limited: int | None = None
) -> tuple[list[Step], set[str], datetime]:
    """`rows` less those of tools without room now (API.md "Slow tools"), counted under the
    lock of each limited tool's row so that two claims never share one room; the tools
    whose steps were left (held back, still `pending`); and the time to claim them at (the
    rates' clock, read under those locks: later than `now` when the claim waited for them,
    and a claim's attempts must not look older than the tokens they took). Of the steps of
    limited tools, at most `limited` are kept (what the claiming worker can send at once): a
    step claimed to wait in a worker would take a room, or a rate's token, that another
    could use now."""
    limits = {
        step.tool_id: limit
        for step in rows
        if (limit := tool_limits.effective(step.tool)) is not None
    }
    if not limits:
        return rows, set(), now
    if limited is not None:
        capped: list[Step] = []
        for step in rows:
            if step.tool_id in limits:
                if limited <= 0:
                    continue  # left pending: a claim with room takes it
                limited -= 1
            capped.append(step)
        rows = capped
    wanted: dict[str, int] = {}
    for step in rows:
        if step.tool_id in limits:
            wanted[step.tool_id] = wanted.get(step.tool_id, 0) + 1
    rooms, counted_at = tool_limits.allot(wanted, limits, now=now)
    kept: list[Step] = []
    full: set[str] = set()
    for step in rows:
        if step.tool_id in rooms:
            if rooms[step.tool_id] <= 0:
                full.add(step.tool_id)
                continue
            rooms[step.tool_id] -= 1
        kept.append(step)
    return kept, full, counted_at


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
    limited: int | None = None,
) -> Batch:
    """Takes the leases on a batch of due pending steps and decides their authorization, in
    one commit (DESIGN.md §5 points 2 to 4, §14).

    `step_ids` names steps to look at (a message's, a test's) whatever their age; besides
    them, up to `light` due pure/read steps and `writes` due write steps are taken. Pure and
    read steps that may go on are also past their `submitting` point (usage counted) when
    this returns; write steps are `claimed`. Steps that may not go on end blocked, cancelled,
    or pending in a paused run, each with its closed attempt, exactly as one step claimed
    alone would. Steps of `skip_tools` (found at their limit a moment ago) are not looked at;
    of the steps of tools with limits, at most `limited` are taken (None: no such cap).
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
        rows, batch.full, now = _within_limits(rows, now=now, limited=limited)
        taken: list[Step] = []
        for step in rows:
            if step.run.status == RunStatus.CANCELLED:
                transitions.move(
                    step, State.CANCELLED, actor="policy", reason="the run was cancelled", now=now
                )
                batch.outcomes[step.pk] = State.CANCELLED
            elif (step.not_before is not None and step.not_before > now) or (
                step.run.status not in TAKES_WORK
            ):
                # Not due yet, or a paused run: its steps wait; a reviewer's resume wakes them.
                batch.outcomes[step.pk] = Outcome.SKIPPED
            else:
                taken.append(step)
        if not taken:
            return batch
        facts = authorization.read_facts(taken)
        decisions: dict[Any, authorization.Decision] = {}
        tools: dict[Any, Tool | None] = {}
        for step in taken:
            tool = tools[step.pk] = find_tool(step.tool_id)
            decisions[step.pk] = (
                authorization.decide(step, tool, facts, now=now)
                if tool is not None
                else authorization.Decision(
                    authorization.Verdict.BLOCK, f"the tool {step.tool_id} is no longer registered"
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
            granted = authorization.budget_take_calls(steps[0].run, len(steps), now=now)
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
        bulk.create(Attempt, list(attempts.values()))

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


def _refusal(
    step: Step, decision: authorization.Decision, over_budget: set[Any], *, now: datetime
) -> transitions.Move:
    """The move that ends a claimed attempt which may not go on; nothing was sent."""
    if step.pk in over_budget:
        reason = authorization.budget_exhaustion(step.run, now=now) or "no budget left"
        authorization.run_pause(step.run, reason=reason, now=now)
        return transitions.Move(step, State.PENDING, actor="policy", reason=f"run paused: {reason}")
    if decision.verdict == authorization.Verdict.CANCEL:
        return transitions.Move(step, State.CANCELLED, actor="policy", reason=decision.reason)
    if decision.verdict == authorization.Verdict.REFUSE:
        return transitions.Move(
            step,
            State.FAILED,
            actor="policy",
            reason=f"refused by an approval rule: {decision.reason}",
            changes={
                "not_before": None,
                "failure_class": FailureClass.POLICY_DENIED,
                "failure_message": decision.reason,
            },
        )
    if decision.verdict == authorization.Verdict.PAUSE:
        authorization.run_pause(step.run, reason=decision.reason, now=now)
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
