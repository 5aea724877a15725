"""Reads for the API and the console; each answers in a fixed number of queries."""

from __future__ import annotations

import base64
import functools
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection, connections
from django.db.models import Count, Model, Q, QuerySet, Sum, TextChoices
from django.utils import timezone

from executor import policy
from executor.counters import run_state_counts
from executor.models import Agent, Attempt, Event, Run, RunStatus, Step, Tool, Workspace
from executor.redaction import redact
from executor.states import CONFIRMED, ENDED_WITHOUT_EFFECT, INBOX, REPORT_SECTIONS, State
from executor.tools.base import Tool as ToolContract
from executor.tools.base import all_tools, find_tool


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
    scan per state (`step_run_state`). The summary is the API's (`run_report`). With
    `reconcile`, the usage is also reconciled against the attempts and the external systems
    (which reads every attempt of the run, and asks the systems: on request only)."""
    section_of = {state: name for name, states in REPORT_SECTIONS.items() for state in states}
    report: dict[str, Any] = {name: [] for name in REPORT_SECTIONS}
    for step in _first_steps_by_state(run, [s for s in State if counts.get(s.value)]):
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


def _first_steps_by_state(run: Run, states: list[State]) -> list[Step]:
    """The run's first REPORT_ENTRIES_SHOWN steps in each of `states`: one statement, a
    UNION ALL of one bounded range scan of (run, state, position) per state."""
    if not states:
        return []
    parts: list[str] = []
    params: list[Any] = []
    for state in states:
        query = (
            Step.objects.filter(run_id=run.pk, state=state)
            .only(*REPORT_FIELDS)
            .order_by("position")[:REPORT_ENTRIES_SHOWN]
        )
        sql, part_params = query.query.sql_with_params()
        parts.append(f"SELECT * FROM ({sql}) AS s{len(parts)}")  # noqa: S608 - the ORM's SQL
        params += list(part_params)
    return list(Step.objects.raw(" UNION ALL ".join(parts), params))


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
    """A keyset position (time, id): opaque in URLs, so `+` in an ISO offset survives."""

    at: datetime
    pk: str

    def encode(self) -> str:
        raw = f"{self.at.isoformat()}|{self.pk}".encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Cursor | None:
        """The cursor, or None for anything that is not one (the first page, then)."""
        if not text:
            return None
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
            at_text, pk_text = raw.split("|", 1)
            at = datetime.fromisoformat(at_text)
            pk = str(uuid.UUID(pk_text))
        except (ValueError, UnicodeDecodeError):
            return None
        if at.tzinfo is None:
            return None
        return cls(at=at, pk=pk)


@dataclass(frozen=True)
class InboxFilter:
    workspace_ids: tuple[int, ...]
    workspace_id: int | None = None
    tool: str = ""
    kind: str = ""
    older_than: timedelta | None = None

    def narrowing(self, now: datetime) -> Q:
        """Everything but the kind and the visibility, as one condition."""
        condition = Q()
        if self.workspace_id is not None:
            condition &= Q(run__workspace_id=self.workspace_id)
        if self.tool:
            condition &= Q(tool_id=self.tool)
        if self.older_than is not None:
            condition &= Q(state_since__lt=now - self.older_than)
        return condition


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
    *, inbox: InboxFilter, after: Cursor | None = None, size: int = 25, now: datetime | None = None
) -> tuple[list[Step], Cursor | None]:
    """One page of waiting steps, longest waiting first, and the cursor of the next page.

    Keyset on (state_since, id), so a page costs the same wherever it is and a reviewer's
    place holds while new steps arrive.
    """
    now = now or timezone.now()
    steps = _inbox_visible(inbox.workspace_ids).filter(inbox.narrowing(now))
    if inbox.kind:
        steps = steps.filter(INBOX_KIND_Q[inbox.kind])
    if after is not None:
        steps = steps.filter(
            Q(state_since__gt=after.at) | Q(state_since=after.at, pk__gt=uuid.UUID(after.pk))
        )
    rows = list(
        steps.select_related("run", "run__workspace")
        .defer("input", "result", "run__pause_reason")
        .order_by("state_since", "pk")[: size + 1]
    )
    if len(rows) <= size:
        return rows, None
    last = rows[size - 1]
    return rows[:size], Cursor(at=last.state_since, pk=str(last.pk))


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
    facts = policy.Facts(
        grants=policy.grants(
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
    facts = policy.workspace_facts(workspace_id, [name])
    return _info(tool, facts, workspace_id, None)


def _info(
    tool: ToolContract, facts: policy.Facts, workspace_id: int, user_id: int | None
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

    @property
    def kind(self) -> str:
        return "event" if self.event is not None else "attempt"


def step_timeline(*, step: Step) -> list[TimelineEntry]:
    """The step's Events and Attempts merged by time, in two queries.

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

    return sorted(entries, key=order)


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
    counts from the counters (executor/counters.py), never their steps."""
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
