"""Reads for the API and the console; each answers in a fixed number of queries."""

from __future__ import annotations

import base64
import functools
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection, connections
from django.db.models import Count, Model, Q, QuerySet, Sum, TextChoices
from django.utils import timezone

from executor.common.redaction import redact
from executor.contract.tool import Tool as ToolContract
from executor.contract.tool import all_tools, find_tool
from executor.ledger.counters import run_state_counts
from executor.ledger.records import (
    Agent,
    Attempt,
    Event,
    Run,
    RunStatus,
    Step,
    StepClaim,
    Tool,
    Workspace,
    WorkspaceGroupObjectPermission,
    WorkspaceUserObjectPermission,
)
from executor.ledger.states import CONFIRMED, ENDED_WITHOUT_EFFECT, INBOX, REPORT_SECTIONS, State
from executor.policy import authorization


def runs_for_agent(*, agent: Agent) -> QuerySet[Run]:
    return Run.objects.visible_to_agent(agent)


# --- the reads of every agent request, in statements written once -------------------------
#
# Every request authenticates its agent and most read their run. Through the ORM each of
# these reads cost about 0.6 ms of building the query for 0.3 ms of database: a tenth of a
# post. They are written out here once per process instead, the rows made into models as
# the ORM makes them (its converters, `from_db`).


def agent_by_token_hash(token_hash: str) -> Agent | None:
    """The active agent of an active user whose token hashes to `token_hash`, with its
    workspace and user loaded (as `select_related` would)."""
    sql, parts = _agent_statement(connection.alias)
    with connection.cursor() as cursor:
        cursor.execute(sql, [token_hash])
        row = cursor.fetchone()
    if row is None:
        return None
    agent, workspace, user = _models_of(row, parts)
    assert isinstance(agent, Agent)
    assert isinstance(workspace, Workspace)
    agent.workspace = workspace
    agent.user = user  # type: ignore[assignment]
    return agent


def run_for_agent(*, agent: Agent, run_id: uuid.UUID) -> Run | None:
    """`runs_for_agent(agent).filter(pk=run_id).first()`, in a statement written once."""
    sql, parts = _run_statement(connection.alias)
    with connection.cursor() as cursor:
        # Prepared as the ORM would (a uuid is text on SQLite).
        pk = Run._meta.get_field("id").get_db_prep_value(run_id, connection)
        cursor.execute(sql, [pk, agent.workspace_id])
        row = cursor.fetchone()
    if row is None:
        return None
    (run,) = _models_of(row, parts)
    assert isinstance(run, Run)
    return run


@dataclass(frozen=True)
class _Part:
    """One model's columns in a row: where they are, their fields, and how to convert each
    value."""

    model: type[Model]
    start: int
    names: list[str]  # the fields' attnames, as from_db takes them
    converters: tuple[tuple[int, tuple[Any, ...], Any], ...]  # (index, converters, column)


def _models_of(row: tuple[Any, ...], parts: tuple[_Part, ...]) -> list[Model]:
    db = connections[connection.alias]
    found = []
    for part in parts:
        values = list(row[part.start : part.start + len(part.names)])
        for index, converters, column in part.converters:
            for convert in converters:
                values[index] = convert(values[index], column, db)
        found.append(part.model.from_db(db.alias, part.names, values))
    return found


def _select(alias: str, tables: list[tuple[type[Model], str]]) -> tuple[str, tuple[_Part, ...]]:
    """The select list of every concrete field of each (model, table alias), one after
    another, and where each model's columns are in a row."""
    db = connections[alias]
    columns: list[str] = []
    parts = []
    for model, table in tables:
        fields = model._meta.concrete_fields
        converters = []
        for index, f in enumerate(fields):
            column = f.get_col(model._meta.db_table)
            found = tuple(db.ops.get_db_converters(column) + column.get_db_converters(db))
            if found:
                converters.append((index, found, column))
        parts.append(_Part(model, len(columns), [f.attname for f in fields], tuple(converters)))
        columns += [f"{table}.{db.ops.quote_name(str(f.column))}" for f in fields]
    return ", ".join(columns), tuple(parts)


def _pk_column(model: type[Model]) -> str:
    pk = model._meta.pk
    assert pk is not None
    return str(pk.column)


@functools.cache
def _agent_statement(alias: str) -> tuple[str, tuple[_Part, ...]]:
    user_model = get_user_model()
    quote = connections[alias].ops.quote_name
    columns, parts = _select(alias, [(Agent, "a"), (Workspace, "w"), (user_model, "u")])
    sql = (
        f"SELECT {columns} "  # noqa: S608 - names, not input
        f"FROM {quote(Agent._meta.db_table)} a "
        f"JOIN {quote(Workspace._meta.db_table)} w ON w.{quote(_pk_column(Workspace))} "
        "= a.workspace_id "
        f"JOIN {quote(user_model._meta.db_table)} u ON u.{quote(_pk_column(user_model))} "
        "= a.user_id "
        "WHERE a.token_hash = %s AND a.is_active AND u.is_active"
    )
    return sql, parts


@functools.cache
def _run_statement(alias: str) -> tuple[str, tuple[_Part, ...]]:
    quote = connections[alias].ops.quote_name
    columns, parts = _select(alias, [(Run, "r")])
    sql = (
        f"SELECT {columns} FROM {quote(Run._meta.db_table)} r "  # noqa: S608 - names
        "WHERE r.id = %s AND r.workspace_id = %s"
    )
    return sql, parts


def steps_for_agent(*, agent: Agent) -> QuerySet[Step]:
    return Step.objects.visible_to_agent(agent)


def run_counts(*, run: Run) -> dict[str, int]:
    """The run's steps per state, from the counters (one query, whatever the run's size)."""
    return run_state_counts([run.pk]).get(run.pk, {})


def run_elapsed_seconds(*, run: Run) -> float:
    return round((timezone.now() - run.created_at).total_seconds(), 3)


def run_usage(*, run: Run) -> dict[str, Any]:
    return {
        "calls": run.used_calls,
        "cost": float(run.used_cost),
        "elapsed_seconds": run_elapsed_seconds(run=run),
    }


def run_budget(*, run: Run) -> dict[str, Any]:
    return {
        "max_calls": run.max_calls,
        "max_cost": float(run.max_cost) if run.max_cost is not None else None,
        "deadline": run.deadline,
    }


def run_attempt_usage(*, run: Run) -> dict[str, Any]:
    """Calls and cost as the attempts table counts them (a submission is a call)."""
    totals = Attempt.objects.filter(step__run=run, submitted_at__isnull=False).aggregate(
        calls=Count("id"), cost=Sum("cost")
    )
    return {"calls": totals["calls"], "cost": float(totals["cost"] or Decimal(0))}


def step_evidence(step: Step) -> dict[str, Any]:
    evidence: dict[str, Any] = {}
    if step.external_id:
        evidence["external_id"] = step.external_id
    if step.failure_class:
        evidence["failure"] = {"class": step.failure_class, "message": step.failure_message}
    if step.attempt_count:
        evidence["attempts"] = step.attempt_count
    return evidence


def run_report(*, run: Run, external: bool = False) -> dict[str, Any]:
    """What a person reads after a run: each step in its section, usage, one summary line.

    Usage is reconciled: the run's counters against its attempts, and with `external`,
    each tool's confirmed effects against the count its external system keeps.
    """
    section_of = {state: name for name, states in REPORT_SECTIONS.items() for state in states}
    report: dict[str, Any] = {name: [] for name in REPORT_SECTIONS}
    steps = (
        Step.objects.filter(run=run)
        .only(
            "id",
            "key",
            "tool",
            "state",
            "external_id",
            "failure_class",
            "failure_message",
            "attempt_count",
            "position",
            "operation_id",
        )
        .order_by("position")
    )
    for step in steps:
        report[section_of[State(step.state)]].append(
            {
                "step_id": str(step.pk),
                "key": step.key,
                "tool": step.tool_id,
                "state": step.state,
                "external_id": step.external_id,
                "evidence": step_evidence(step),
            }
        )
    usage = run_usage(run=run)
    usage["attempts"] = run_attempt_usage(run=run)
    usage["reconciled"] = {
        "calls": usage["calls"] == usage["attempts"]["calls"],
        "cost": abs(usage["cost"] - usage["attempts"]["cost"]) < 1e-9,
    }
    if external:
        usage["external"] = external_usage(list(steps))
    report["usage"] = usage
    report["summary"] = report_summary(report)
    return report


# What the console's run page lists of each report section; the rest it counts.
REPORT_ENTRIES_SHOWN = 50
REPORT_FIELDS = (
    "id",
    "key",
    "tool",
    "state",
    "external_id",
    "failure_class",
    "failure_message",
    "attempt_count",
    "position",
    "operation_id",
    "run_id",
)


def run_report_shown(
    *, run: Run, counts: dict[str, int], reconcile: bool = False
) -> dict[str, Any]:
    """The run report as the console's run page shows it, in a cost that does not grow with
    the run: each section's count (from `counts`, the counters) and its first
    REPORT_ENTRIES_SHOWN entries in posting order, read in one statement of one index range
    scan per state (`step_run_incomplete`; the completed ones, which it leaves out, from
    `step_unique_position`, as many rows as come before the 50th completed one: a run's
    steps are claimed in posting order, so those it has not finished are few and behind its
    completed ones). The summary is the API's (`run_report`). With
    `reconcile`, the usage is also reconciled against the attempts and the external systems
    (which reads every attempt of the run, and asks the systems: on request only)."""
    section_of = {state: name for name, states in REPORT_SECTIONS.items() for state in states}
    report: dict[str, Any] = {name: [] for name in REPORT_SECTIONS}
    for step in _first_steps_by_state(run, counts):
        report[section_of[State(step.state)]].append(
            {
                "step_id": str(step.pk),
                "key": step.key,
                "tool": step.tool_id,
                "state": step.state,
                "external_id": step.external_id,
                "evidence": step_evidence(step),
                "position": step.position,
            }
        )
    report["counts"] = {
        name: sum(counts.get(state.value, 0) for state in states)
        for name, states in REPORT_SECTIONS.items()
    }
    for name in REPORT_SECTIONS:
        report[name].sort(key=lambda entry: entry["position"])
    summary = _summary(report["counts"], report["uncertain"])
    for name in REPORT_SECTIONS:
        del report[name][REPORT_ENTRIES_SHOWN:]
    usage = run_usage(run=run)
    if reconcile:
        usage["attempts"] = run_attempt_usage(run=run)
        usage["reconciled"] = {
            "calls": usage["calls"] == usage["attempts"]["calls"],
            "cost": abs(usage["cost"] - usage["attempts"]["cost"]) < 1e-9,
        }
        usage["external"] = external_usage(
            list(Step.objects.filter(run=run).only(*REPORT_FIELDS).order_by("position"))
        )
    report["usage"] = usage
    report["summary"] = summary
    return report


# The completed steps are read from (run, position) a window of positions at a time, so that
# no statement reads more than this many rows of the run whatever the planner's statistics.
COMPLETED_WINDOW = 500


def _first_steps_by_state(run: Run, counts: dict[str, int]) -> list[Step]:
    """The run's first REPORT_ENTRIES_SHOWN steps in each state it has steps in (`counts`,
    from its counters): one statement, a UNION ALL of one bounded range scan per state.
    `step_run_incomplete` holds every state but completed; the completed ones are looked for
    in the run's first COMPLETED_WINDOW positions (`step_unique_position`), and in the next
    windows, a statement each, only while fewer are found than are to be shown (the run's
    positions are 1..its number of steps)."""
    states = [state for state in State if counts.get(state.value)]
    if not states:
        return []
    parts: list[str] = []
    params: list[Any] = []
    for state in states:
        query = _steps_in(run, state)
        if state == State.COMPLETED:
            query = query.filter(position__lte=COMPLETED_WINDOW)
        sql, part_params = query[:REPORT_ENTRIES_SHOWN].query.sql_with_params()
        parts.append(f"SELECT * FROM ({sql}) AS s{len(parts)}")  # noqa: S608 - the ORM's SQL
        params += list(part_params)
    found = list(Step.objects.raw(" UNION ALL ".join(parts), params))
    shown = min(REPORT_ENTRIES_SHOWN, counts.get(State.COMPLETED.value, 0))
    completed = sum(1 for step in found if step.state == State.COMPLETED)
    after, total = COMPLETED_WINDOW, sum(counts.values())
    while completed < shown and after < total:
        more = list(
            _steps_in(run, State.COMPLETED).filter(
                position__gt=after, position__lte=after + COMPLETED_WINDOW
            )[: shown - completed]
        )
        found += more
        completed += len(more)
        after += COMPLETED_WINDOW
    return found


def _steps_in(run: Run, state: State) -> QuerySet[Step]:
    return Step.objects.filter(run_id=run.pk, state=state).only(*REPORT_FIELDS).order_by("position")


def _summary(counts: dict[str, int], uncertain: list[dict[str, Any]]) -> str:
    """`report_summary`'s line from the sections' counts."""
    parts = [f"{counts[name]} {name}" for name in REPORT_SECTIONS if counts[name]]
    if not parts:
        return "No steps yet."
    line = ", ".join(parts)
    unknown = [e for e in uncertain if e["state"] == State.UNKNOWN]
    if unknown:
        keys = ", ".join(f"`{e['key']}`" for e in unknown[:3])
        line += f"; may or may not have happened: {keys}; a reviewer has it"
    return line + "."


def run_steps_page(
    *, run: Run, total: int, after: int = 0, size: int = 100
) -> tuple[list[Step], int | None]:
    """A page of the run's steps in posting order, after position `after`, and the next
    page's `after` (None on the last). `total` is how many steps the run has (its counters).

    A run's positions are 1..n with no gap (its StepCounter hands them out; `verify_ledger`
    holds it), so a page is the position range (after, after + size]: whatever plan the
    statistics of the moment suggest, it meets `size` rows at most.
    """
    rows = list(
        Step.objects.filter(run_id=run.pk, position__gt=after, position__lte=after + size)
        .defer("input", "result", "depends_on")
        .order_by("position")
    )
    return rows, (after + size if after + size < total else None)


def external_usage(steps: list[Step]) -> dict[str, Any]:
    """Per tool: effects the ledger confirms, and the count the external system keeps.

    It agrees when every confirmed step has its one effect there, no operation has more
    than one, and only `unknown` steps may account for the rest.
    """
    by_tool: dict[str, list[Step]] = {}
    for step in steps:
        by_tool.setdefault(step.tool_id, []).append(step)
    answer: dict[str, Any] = {}
    for name, tool_steps in sorted(by_tool.items()):
        tool = find_tool(name)
        if tool is None:
            continue
        counted = tool.effects_counted([str(s.operation_id) for s in tool_steps])
        if counted is None:
            continue
        confirmed = [s for s in tool_steps if s.state in CONFIRMED]
        unknown = [s for s in tool_steps if s.state == State.UNKNOWN]
        total = sum(counted.values())
        duplicates = sorted(s.key for s in tool_steps if counted[str(s.operation_id)] > 1)
        missing = sorted(s.key for s in confirmed if counted[str(s.operation_id)] == 0)
        answer[name] = {
            "confirmed_in_ledger": len(confirmed),
            "unknown_in_ledger": len(unknown),
            "counted_by_system": total,
            "duplicates": duplicates,
            "confirmed_but_not_found": missing,
            "agrees": not duplicates
            and not missing
            and len(confirmed) <= total <= len(confirmed) + len(unknown),
        }
    return answer


def report_summary(report: dict[str, Any]) -> str:
    parts = [f"{len(report[name])} {name}" for name in REPORT_SECTIONS if report[name]]
    if not parts:
        return "No steps yet."
    line = ", ".join(parts)
    unknown = [e for e in report["uncertain"] if e["state"] == State.UNKNOWN]
    if unknown:
        keys = ", ".join(f"`{e['key']}`" for e in unknown[:3])
        line += f"; may or may not have happened: {keys}; a reviewer has it"
    return line + "."


# --- the reviewers' console (DESIGN.md §12) ------------------------------------------------
#
# Each read takes the ids of the workspaces the reviewer may see, so the permission is
# decided once per request by the caller and every query stays a single statement.


class InboxKind(TextChoices):
    UNKNOWN = "unknown", "Unknown outcome"
    APPROVAL = "approval", "Awaiting approval"
    COMPENSATION = "compensation", "Compensation requests"
    DEAD = "dead", "Dead letters"
    BLOCKED = "blocked", "Blocked"
    FAILED_COMPENSATION = "failed_compensation", "Failed compensations"


# A compensation that failed while the effect it should undo still stands: a person must
# know (replay it, or request another).
FAILED_COMPENSATION = Q(
    state=State.FAILED, compensates__isnull=False, compensates__state=State.COMPLETED
)
INBOX_KIND_Q: dict[str, Q] = {
    InboxKind.UNKNOWN: Q(state=State.UNKNOWN),
    InboxKind.APPROVAL: Q(state=State.PLANNED, compensates__isnull=True),
    InboxKind.COMPENSATION: Q(state=State.PLANNED, compensates__isnull=False),
    InboxKind.DEAD: Q(state=State.DEAD),
    InboxKind.BLOCKED: Q(state=State.BLOCKED),
    InboxKind.FAILED_COMPENSATION: FAILED_COMPENSATION,
}


def inbox_kind_of(step: Step) -> str:
    if step.state == State.PLANNED:
        return InboxKind.COMPENSATION if step.compensates_id else InboxKind.APPROVAL
    if step.state == State.FAILED:
        return InboxKind.FAILED_COMPENSATION
    return str(step.state)


@dataclass(frozen=True)
class Cursor:
    """A keyset position (time, id[, the sort's own value]): opaque in URLs, so `+` in an
    ISO offset survives. `pk` is a step's UUID, or an event's number."""

    at: datetime
    pk: str
    value: str | None = None

    def encode(self) -> str:
        text = f"{self.at.isoformat()}|{self.pk}"
        if self.value is not None:
            text += f"|{self.value}"
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Cursor | None:
        """The cursor, or None for anything that is not one (the first page, then)."""
        if not text:
            return None
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
            at_text, pk_text, *rest = raw.split("|", 2)
            at = datetime.fromisoformat(at_text)
            pk = pk_text if pk_text.isdigit() else str(uuid.UUID(pk_text))
        except (ValueError, UnicodeDecodeError):
            return None
        if at.tzinfo is None:
            return None
        return cls(at=at, pk=pk, value=rest[0] if rest else None)


def _keyset(order: list[str], values: list[Any], *, forward: bool) -> Q:
    """Rows after `values` in `order` (fields, "-" for descending), or before them when not
    `forward`: (a, b, c) > (x, y, z) spelled as the ORM can, field by field."""
    condition = Q()
    equal = Q()
    for name, value in zip(order, values, strict=True):
        field = name.lstrip("-")
        greater = (not name.startswith("-")) == forward
        condition |= equal & Q(**{f"{field}__{'gt' if greater else 'lt'}": value})
        equal &= Q(**{field: value})
    return condition


def _reversed_order(order: list[str]) -> list[str]:
    return [name[1:] if name.startswith("-") else f"-{name}" for name in order]


@dataclass(frozen=True)
class Page[T]:
    """One page of a keyset-paged list and the cursors either side of it."""

    rows: list[T]
    next: Cursor | None
    previous: Cursor | None


def _keyset_page[T: Model](
    rows: QuerySet[T],
    *,
    order: list[str],
    cursor_of: Any,
    values_of: Any,
    after: Cursor | None,
    before: Cursor | None,
    size: int,
) -> Page[T]:
    """A page after `after` (or before `before`) of `rows` in `order`, in size + 1 rows read."""
    if before is not None:
        found = list(
            rows.filter(_keyset(order, values_of(before), forward=False)).order_by(
                *_reversed_order(order)
            )[: size + 1]
        )
        more_before = len(found) > size
        found = list(reversed(found[:size]))
        if not found:
            return Page([], None, None)
        return Page(found, cursor_of(found[-1]), cursor_of(found[0]) if more_before else None)
    if after is not None:
        rows = rows.filter(_keyset(order, values_of(after), forward=True))
    found = list(rows.order_by(*order)[: size + 1])
    more_after = len(found) > size
    found = found[:size]
    return Page(
        found,
        cursor_of(found[-1]) if more_after else None,
        cursor_of(found[0]) if after is not None and found else None,
    )


@dataclass(frozen=True)
class InboxFilter:
    workspace_ids: tuple[int, ...]
    workspace_id: int | None = None
    tool: str = ""
    kind: str = ""
    older_than: timedelta | None = None
    # Free text: a key, an operation or step id, an external id, a tool, summary words.
    search: str = ""

    def narrowing(self, now: datetime) -> Q:
        """Everything but the kind and the visibility, as one condition."""
        condition = Q()
        if self.workspace_id is not None:
            condition &= Q(run__workspace_id=self.workspace_id)
        if self.tool:
            condition &= Q(tool_id=self.tool)
        if self.older_than is not None:
            condition &= Q(state_since__lt=now - self.older_than)
        if self.search:
            condition &= inbox_search(self.search)
        return condition


# Hex digits and dashes, long enough to be the start of an id someone copied.
_ID_PART = re.compile(r"[0-9a-fA-F-]{8,36}")


def inbox_search(text: str) -> Q:
    """Steps whose key, external id, tool or summary holds `text`; a whole UUID also finds
    the step of that id or operation id, and a piece of one its operation id."""
    text = text.strip()
    try:
        exact = uuid.UUID(text)
    except ValueError:
        exact = None
    if exact is not None:
        return Q(pk=exact) | Q(operation_id=exact)
    condition = (
        Q(key__icontains=text)
        | Q(external_id__icontains=text)
        | Q(tool__name__icontains=text)
        | Q(input_summary__icontains=text)
    )
    if _ID_PART.fullmatch(text):
        condition |= Q(operation_id__icontains=text)
    return condition


class InboxSort(TextChoices):
    OLDEST = "oldest", "Longest waiting first"
    NEWEST = "newest", "Newest first"
    TOOL = "tool", "Tool, then longest waiting"
    KEY = "key", "Step key"


# Each sort's keyset: a leading field of its own (or none), then waiting since, then id.
INBOX_ORDER: dict[str, list[str]] = {
    InboxSort.OLDEST: ["state_since", "pk"],
    InboxSort.NEWEST: ["-state_since", "-pk"],
    InboxSort.TOOL: ["tool_id", "state_since", "pk"],
    InboxSort.KEY: ["key", "state_since", "pk"],
}


def _inbox_visible(workspace_ids: tuple[int, ...]) -> QuerySet[Step]:
    return Step.objects.in_workspaces(workspace_ids).filter(
        Q(state__in=INBOX) | FAILED_COMPENSATION
    )


def inbox_counts(*, inbox: InboxFilter, now: datetime | None = None) -> dict[str, dict[str, int]]:
    """Steps waiting per kind, in one query: `all` that the reviewer may see, `shown`
    under the filter's workspace, tool and age (every kind, so each tab has its number)."""
    now = now or timezone.now()
    narrowing = inbox.narrowing(now)
    aggregates: dict[str, Any] = {}
    for kind, condition in INBOX_KIND_Q.items():
        aggregates[f"all_{kind}"] = Count("pk", filter=condition)
        aggregates[f"shown_{kind}"] = Count(
            "pk", filter=condition & narrowing if narrowing else condition
        )
    row = _inbox_visible(inbox.workspace_ids).aggregate(**aggregates)
    return {
        scope: {kind: row[f"{scope}_{kind}"] or 0 for kind in INBOX_KIND_Q}
        for scope in ("all", "shown")
    }


def inbox_page(
    *,
    inbox: InboxFilter,
    after: Cursor | None = None,
    before: Cursor | None = None,
    size: int = 25,
    sort: str = InboxSort.OLDEST,
    now: datetime | None = None,
) -> Page[Step]:
    """One page of waiting steps in the `sort` order (longest waiting first by default),
    with the cursors of the pages after and before it, and each step's claim.

    Keyset on (the sort's field, state_since, id), so a page costs the same wherever it is
    and a reviewer's place holds while new steps arrive.
    """
    now = now or timezone.now()
    order = INBOX_ORDER.get(sort, INBOX_ORDER[InboxSort.OLDEST])
    lead = order[0].lstrip("-") if len(order) == 3 else None
    steps = _inbox_visible(inbox.workspace_ids).filter(inbox.narrowing(now))
    if inbox.kind:
        steps = steps.filter(INBOX_KIND_Q[inbox.kind])

    def cursor_of(step: Step) -> Cursor:
        value = str(getattr(step, lead)) if lead else None
        return Cursor(at=step.state_since, pk=str(step.pk), value=value)

    def values_of(cursor: Cursor) -> list[Any]:
        values: list[Any] = [cursor.at, uuid.UUID(cursor.pk)]
        return [cursor.value or "", *values] if lead else values

    return _keyset_page(
        steps.select_related("run", "run__workspace", "claim", "claim__user").defer(
            "input", "result", "run__pause_reason"
        ),
        order=order,
        cursor_of=cursor_of,
        values_of=values_of,
        after=after if after is not None and not after.pk.isdigit() else None,
        before=before if before is not None and not before.pk.isdigit() else None,
        size=size,
    )


def paused_runs(
    *, workspace_ids: tuple[int, ...], workspace_id: int | None = None, limit: int = 10
) -> list[Run]:
    runs = Run.objects.in_workspaces(workspace_ids).filter(status=RunStatus.PAUSED)
    if workspace_id is not None:
        runs = runs.filter(workspace_id=workspace_id)
    return list(runs.select_related("workspace", "agent").order_by("updated_at", "pk")[:limit])


def paused_run_counts(
    *, workspace_ids: tuple[int, ...], workspace_id: int | None = None
) -> dict[str, int]:
    """Paused runs the reviewer may see (`all`) and under the workspace filter (`shown`)."""
    shown = (
        Count("pk") if workspace_id is None else Count("pk", filter=Q(workspace_id=workspace_id))
    )
    row = (
        Run.objects.in_workspaces(workspace_ids)
        .filter(status=RunStatus.PAUSED)
        .aggregate(all=Count("pk"), shown=shown)
    )
    return {"all": row["all"] or 0, "shown": row["shown"] or 0}


@dataclass(frozen=True)
class ToolInfo:
    """What the API, the console and admin show of a tool, as one workspace sees it."""

    name: str
    description: str
    effect: str
    idempotency: str
    has_lookup: bool
    lookup_authoritative: bool
    compensation: str
    # The approval rule in force in the workspace (its own policy, or the declaration's)
    # and whether a call with no particular input needs a person under it.
    approval_rule: str
    needs_approval: bool
    policy_version: str
    retry: dict[str, Any]
    input_schema: dict[str, Any]
    registered: bool = True
    usable: bool = False
    # Where its calls go, when that is another system's tool (an MCP upstream's name, its
    # own name for the tool, how it is reached): what a reviewer approves a call to.
    goes_to: dict[str, Any] = field(default_factory=dict)


def tool_infos(*, workspace_id: int, user_id: int | None = None) -> list[ToolInfo]:
    """Every registered tool as the workspace sees it, and whether `user_id` (an agent's
    user) may use it: one query."""
    tools = all_tools()
    facts = authorization.Facts(
        grants=authorization.grants(
            users=[user_id] if user_id is not None else [],
            workspaces=[workspace_id],
            tools=[tool.name for tool in tools],
        )
    )
    return [_info(tool, facts, workspace_id, user_id) for tool in tools]


def tool_info(*, name: str, workspace_id: int) -> ToolInfo:
    """One tool as the workspace sees it; one no longer registered from its Tool row."""
    tool = find_tool(name)
    if tool is None:
        row = Tool.objects.get(name=name)
        return ToolInfo(
            name=row.name,
            description="",
            effect=row.effect,
            idempotency=row.idempotency,
            has_lookup=row.has_lookup,
            lookup_authoritative=False,
            compensation=row.compensation,
            approval_rule=row.requires_approval,
            needs_approval=True,
            policy_version=row.policy_version,
            retry={},
            input_schema={},
            registered=False,
        )
    facts = authorization.workspace_facts(workspace_id, [name])
    return _info(tool, facts, workspace_id, None)


def _info(
    tool: ToolContract, facts: authorization.Facts, workspace_id: int, user_id: int | None
) -> ToolInfo:
    own = facts.approval_policy(workspace_id, tool)
    return ToolInfo(
        name=tool.name,
        description=tool.description,
        effect=str(tool.effect),
        idempotency=str(tool.idempotency),
        has_lookup=tool.has_lookup(),
        lookup_authoritative=tool.lookup_authoritative,
        compensation=tool.compensation,
        approval_rule=str(own.rule if own else tool.requires_approval),
        needs_approval=facts.needs_person(workspace_id, tool, None),
        policy_version=facts.approval_version(workspace_id, tool),
        retry=tool.retry.as_dict(),
        input_schema=tool.input_schema,
        usable=user_id is not None
        and facts.registered(tool.name)
        and facts.holds(user_id, "use_tool", tool=tool.name),
        goes_to=tool.request_details(),
    )


@dataclass(frozen=True)
class ApprovalToGive:
    """What a reviewer approving a planned step approves: this exact call, under this policy
    version, for this long (DESIGN.md §3 "Approval")."""

    tool: str
    input: Any
    input_hash: str
    policy_version: str
    expires_at: datetime


def approval_to_give(*, step: Step, tool: ToolInfo, now: datetime | None = None) -> ApprovalToGive:
    now = now or timezone.now()
    found = find_tool(step.tool_id)
    fields = found.redact if found else frozenset()
    return ApprovalToGive(
        tool=step.tool_id,
        input=redact(step.input, fields=fields),
        input_hash=step.input_hash,
        policy_version=tool.policy_version,
        expires_at=now + timedelta(seconds=settings.EXECUTOR_APPROVAL_MAX_AGE),
    )


def tool_names() -> list[str]:
    return list(Tool.objects.order_by("name").values_list("name", flat=True))


def steps_visible(*, step_ids: list[str], workspace_ids: tuple[int, ...]) -> dict[str, Step]:
    """The steps among `step_ids` that the reviewer may see, by id."""
    steps = Step.objects.in_workspaces(workspace_ids).filter(pk__in=step_ids)
    return {str(step.pk): step for step in steps.select_related("run", "run__workspace")}


@dataclass(frozen=True)
class TimelineEntry:
    at: datetime
    event: Event | None = None
    attempt: Attempt | None = None
    # A run of failed attempts of one kind, with the engine's moves between them.
    group: list[TimelineEntry] | None = None

    @property
    def kind(self) -> str:
        if self.group is not None:
            return "group"
        return "event" if self.event is not None else "attempt"

    @property
    def attempts(self) -> list[Attempt]:
        return [e.attempt for e in self.group or () if e.attempt is not None]

    @property
    def first_number(self) -> int:
        return self.attempts[0].number

    @property
    def last_number(self) -> int:
        return self.attempts[-1].number

    @property
    def error(self) -> tuple[str, str]:
        """The group's error class, and the message of its last attempt."""
        last = self.attempts[-1]
        return last.error_class, last.error_message

    @property
    def last_at(self) -> datetime:
        assert self.group
        return self.group[-1].at


# Fewer failed attempts in a row than this stay as they are.
GROUP_FROM = 2


def step_timeline(*, step: Step) -> list[TimelineEntry]:
    """The step's Events and Attempts merged by time, in two queries, with repeated failed
    attempts of one kind folded into one entry ("attempts 2 to 5 failed: transient …").

    An attempt sits at its claim; the claim's event (pending → running) is written in the
    same transaction, so at equal times the event comes first.
    """
    entries = [TimelineEntry(at=e.created_at, event=e) for e in step.events.order_by("seq")]
    entries += [TimelineEntry(at=a.claimed_at, attempt=a) for a in step.attempts.all()]

    def order(entry: TimelineEntry) -> tuple[datetime, int, int]:
        if entry.event is not None:
            return (entry.at, 0, entry.event.seq)
        assert entry.attempt is not None
        return (entry.at, 1, entry.attempt.number)

    return group_retries(sorted(entries, key=order))


def _failed_kind(entry: TimelineEntry) -> str | None:
    attempt = entry.attempt
    if attempt is not None and attempt.phase == "errored" and attempt.error_class:
        return attempt.error_class
    return None


def _retry_move(entry: TimelineEntry) -> bool:
    """An engine's move of a retry: taken (pending → running) or put back (→ pending)."""
    event = entry.event
    return (
        event is not None
        and not event.actor.startswith("user:")
        and (event.from_state, event.to_state)
        in (("pending", "running"), ("running", "pending"), ("approved", "pending"))
    )


def group_retries(entries: list[TimelineEntry]) -> list[TimelineEntry]:
    """Folds each run of failed attempts with the same error class (and the engine's retry
    moves among them) into one group entry; everything else stays where it was."""
    answer: list[TimelineEntry] = []
    run: list[TimelineEntry] = []
    kind: str | None = None

    def flush() -> None:
        # The moves after the group's last attempt belong to what follows it.
        last = max((i for i, e in enumerate(run) if e.attempt is not None), default=-1)
        body, rest = run[: last + 1], run[last + 1 :]
        failed = [e for e in body if e.attempt is not None]
        if len(failed) >= GROUP_FROM:
            # The move that took the first attempt stays outside: it is when retrying began.
            answer.append(TimelineEntry(at=body[0].at, group=body))
        else:
            answer.extend(body)
        answer.extend(rest)
        run.clear()

    for entry in entries:
        failed = _failed_kind(entry)
        if failed is not None and (kind is None or failed == kind):
            kind = failed
            run.append(entry)
        elif failed is None and kind is not None and _retry_move(entry):
            run.append(entry)
        else:
            if run:
                flush()
            kind = failed
            if failed is not None:
                run.append(entry)
            else:
                answer.append(entry)
    if run:
        flush()
    return answer


# --- the desk: claims and the decisions page ----------------------------------------------


def step_claim_held(*, step: Step, now: datetime | None = None) -> StepClaim | None:
    """The step's claim while it holds, else None."""
    now = now or timezone.now()
    return StepClaim.objects.select_related("user").filter(step=step, expires_at__gt=now).first()


class DecisionKind(TextChoices):
    APPROVED = "approved", "Approved"
    REJECTED = "rejected", "Rejected"
    RESOLVED = "resolved", "Resolved an unknown outcome"
    REPLAYED = "replayed", "Replayed"
    RESUMED = "resumed", "Resumed"
    COMPENSATION = "compensation", "Requested a compensation"
    OTHER = "other", "Other"


DECISION_KIND_Q: dict[str, Q] = {
    DecisionKind.APPROVED: Q(to_state=State.APPROVED),
    DecisionKind.REJECTED: Q(to_state=State.REJECTED),
    DecisionKind.RESOLVED: Q(from_state=State.UNKNOWN),
    DecisionKind.REPLAYED: Q(from_state__in=(State.DEAD, State.FAILED), to_state=State.PENDING),
    DecisionKind.RESUMED: Q(from_state=State.BLOCKED, to_state=State.PENDING),
    DecisionKind.COMPENSATION: Q(from_state=""),
}
DECISION_KIND_Q[DecisionKind.OTHER] = ~functools.reduce(
    lambda a, b: a | b, DECISION_KIND_Q.values()
)
# A person's moves: the partial index `event_by_person` holds exactly these.
BY_PERSON = Q(actor__startswith="user:")


def decision_kind_of(event: Event) -> str:
    if event.to_state == State.APPROVED:
        return DecisionKind.APPROVED
    if event.to_state == State.REJECTED:
        return DecisionKind.REJECTED
    if event.from_state == State.UNKNOWN:
        return DecisionKind.RESOLVED
    if event.from_state in (State.DEAD, State.FAILED) and event.to_state == State.PENDING:
        return DecisionKind.REPLAYED
    if event.from_state == State.BLOCKED and event.to_state == State.PENDING:
        return DecisionKind.RESUMED
    if not event.from_state:
        return DecisionKind.COMPENSATION
    return DecisionKind.OTHER


@dataclass(frozen=True)
class DecisionFilter:
    workspace_ids: tuple[int, ...]
    person: str = ""
    tool: str = ""
    kind: str = ""
    # Times, not dates: the caller turns a day into its bounds (and refuses what is not one).
    since: datetime | None = None
    until: datetime | None = None

    def events(self) -> QuerySet[Event]:
        events = Event.objects.filter(BY_PERSON, run__workspace_id__in=self.workspace_ids)
        if self.person:
            events = events.filter(actor=f"user:{self.person}")
        if self.tool:
            events = events.filter(step__tool_id=self.tool)
        if self.kind in DECISION_KIND_Q:
            events = events.filter(DECISION_KIND_Q[self.kind])
        if self.since is not None:
            events = events.filter(created_at__gte=self.since)
        if self.until is not None:
            events = events.filter(created_at__lt=self.until)
        return events


DECISION_ORDER = ["-created_at", "-id"]


def _decision_rows(decisions: DecisionFilter) -> QuerySet[Event]:
    return (
        decisions.events()
        .select_related("step", "run", "run__workspace")
        .only(
            "id",
            "seq",
            "from_state",
            "to_state",
            "actor",
            "reason",
            "data",
            "created_at",
            "step__id",
            "step__key",
            "step__tool_id",
            "step__run_id",
            "run__id",
            "run__name",
            "run__workspace__slug",
        )
    )


def _decision_cursor(event: Event) -> Cursor:
    return Cursor(at=event.created_at, pk=str(event.pk))


def _decision_values(cursor: Cursor) -> list[Any]:
    return [cursor.at, int(cursor.pk)] if cursor.pk.isdigit() else [cursor.at, -1]


def decisions_page(
    *,
    decisions: DecisionFilter,
    after: Cursor | None = None,
    before: Cursor | None = None,
    size: int = 50,
) -> Page[Event]:
    """People's decisions, newest first: who moved which step, from what to what, and why."""
    return _keyset_page(
        _decision_rows(decisions),
        order=DECISION_ORDER,
        cursor_of=_decision_cursor,
        values_of=_decision_values,
        after=after if after is not None and after.pk.isdigit() else None,
        before=before if before is not None and before.pk.isdigit() else None,
        size=size,
    )


def decisions_count(*, decisions: DecisionFilter) -> int:
    return decisions.events().count()


def decisions_chunks(*, decisions: DecisionFilter, chunk: int = 1000) -> Iterator[list[Event]]:
    """Every decision under the filter, newest first, `chunk` rows a query (keyset): what a
    CSV export streams without holding the whole list."""
    after: Cursor | None = None
    while True:
        page = decisions_page(decisions=decisions, after=after, size=chunk)
        if page.rows:
            yield page.rows
        if page.next is None:
            return
        after = page.next


def decision_people(*, workspace_ids: tuple[int, ...]) -> list[str]:
    """Who may review in these workspaces, by name (the filter's choices): one query."""
    holders = WorkspaceUserObjectPermission.objects.filter(
        content_object_id__in=workspace_ids, permission__codename="review_steps"
    ).values("user_id")
    groups = WorkspaceGroupObjectPermission.objects.filter(
        content_object_id__in=workspace_ids, permission__codename="review_steps"
    ).values("group_id")
    users = get_user_model().objects.filter(Q(pk__in=holders) | Q(groups__in=groups))
    return list(users.distinct().order_by("username").values_list("username", flat=True))


def runs_page(
    *,
    workspace_ids: tuple[int, ...],
    workspace_id: int | None = None,
    status: str = "",
    after: Cursor | None = None,
    size: int = 25,
) -> tuple[list[Run], Cursor | None]:
    """Newest runs first with their step counts, and the next page's cursor: two queries,
    the page of runs (an index range scan in (created_at, id) order, keyset) and their
    counts from the counters (executor/ledger/counters.py), never their steps."""
    runs = Run.objects.in_workspaces(workspace_ids)
    if workspace_id is not None:
        runs = runs.filter(workspace_id=workspace_id)
    if status:
        runs = runs.filter(status=status)
    if after is not None:
        runs = runs.filter(
            Q(created_at__lt=after.at) | Q(created_at=after.at, pk__lt=uuid.UUID(after.pk))
        )
    rows: list[Run] = list(
        runs.select_related("workspace", "agent").order_by("-created_at", "-pk")[: size + 1]
    )
    next_cursor = None
    if len(rows) > size:
        rows = rows[:size]
        next_cursor = Cursor(at=rows[-1].created_at, pk=str(rows[-1].pk))
    counts = run_state_counts([run.pk for run in rows]) if rows else {}
    for run in rows:
        of_run = counts.get(run.pk, {})
        run.steps_total = sum(of_run.values())  # type: ignore[attr-defined]
        run.steps_done = sum(of_run.get(s, 0) for s in CONFIRMED)  # type: ignore[attr-defined]
        run.steps_waiting = sum(of_run.get(s, 0) for s in INBOX)  # type: ignore[attr-defined]
        run.steps_failed = sum(  # type: ignore[attr-defined]
            of_run.get(s, 0) for s in ENDED_WITHOUT_EFFECT
        )
    return rows, next_cursor


def step_move_after(*, step: Step, version: int) -> Event | None:
    """The move that left `version`: who acted first on what a reviewer saw."""
    return Event.objects.filter(step_id=step.pk, seq=version + 1).first()
