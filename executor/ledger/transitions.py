"""The only code that changes `Step.state` (DESIGN.md §4, STYLE.md rule 2).

Every move is one conditional UPDATE on (id, state, version[, fence]) that must change
exactly one row, and the Event for it is inserted in the same transaction. The event's
hash covers its content and its predecessor's hash; the step row keeps the newest hash
(`head_hash`), so the chain needs no extra read or lock: the version check already
serializes a step's moves.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from executor.common.redaction import redact
from executor.ledger.bulk import Computed, Rows, create, insert_together, update_rows, update_sql
from executor.ledger.records import EVENT_FORMAT, Event, Step, StepCounter, comparable
from executor.ledger.states import LEASED, State, is_allowed


class TransitionError(Exception):
    """A move was refused; nothing was changed."""


class IllegalTransition(TransitionError):
    def __init__(self, source: str, target: str) -> None:
        super().__init__(f"a step cannot move from {source} to {target}")
        self.source = source
        self.target = target


class StaleStep(TransitionError):
    """The step changed since it was read (another worker, reviewer or sweeper moved it)."""

    def __init__(self, step: Step, expected_fence: int | None = None) -> None:
        detail = f"step {step.pk} is no longer {step.state} at version {step.version}"
        if expected_fence is not None:
            detail += f" with fence {expected_fence}"
        super().__init__(detail)
        self.step = step


def event_hash(content: dict[str, Any]) -> str:
    """HMAC-SHA256 of the event's canonical JSON.

    Keyed, so that someone who can write to the database but does not hold the key cannot
    forge a consistent chain after an edit (a plain hash could simply be recomputed).
    """
    canonical = _CANONICAL_WITH_STR.encode(content)
    return hmac.digest(ledger_key(), canonical.encode(), "sha256").hex()


# `json.dumps(…, sort_keys=True, separators=(",", ":")[, default=str])`, made once: dumps
# builds an encoder at every call otherwise (a third of the time of hashing an event).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
_CANONICAL_WITH_STR = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str)


def ledger_key() -> bytes:
    key: str = settings.EXECUTOR_LEDGER_KEY
    return key.encode()


def ledger_mac() -> hmac.HMAC:
    """An HMAC-SHA256 keyed like `event_hash`, to be fed a canonical JSON piece by piece."""
    return hmac.new(ledger_key(), digestmod="sha256")


# The digest of no result (JSON null), as `step_digest` would compute it.
NO_RESULT_HASH = hashlib.sha256(b"null").hexdigest()


def step_digest(
    *,
    run_id: Any,
    key: str,
    tool: str,
    input_hash: str,
    state: str,
    external_id: str,
    result: Any,
) -> str:
    """A digest of what a step is (DESIGN.md §15), which each Event's hash covers."""
    if result is None:
        result_hash = NO_RESULT_HASH  # a new step's, every one of its first events
    else:
        result_text = _CANONICAL.encode(comparable(result))
        result_hash = hashlib.sha256(result_text.encode()).hexdigest()
    snapshot = {
        "run": str(run_id),
        "key": key,
        "tool": tool,
        "input_hash": input_hash,
        "state": str(state),
        "external_id": external_id,
        "result": result_hash,
    }
    return hashlib.sha256(_CANONICAL.encode(snapshot).encode()).hexdigest()


def digest_after(step: Step, state: str, changes: dict[str, Any] | None = None) -> str:
    """The step's digest as it is once `changes` are written and it is in `state`."""
    changes = changes or {}
    return step_digest(
        run_id=step.run_id,
        key=step.key,
        tool=step.tool_id,
        input_hash=step.input_hash,
        state=state,
        external_id=changes.get("external_id", step.external_id),
        result=changes.get("result", step.result),
    )


def build_event(
    step: Step,
    *,
    seq: int,
    source: str,
    target: str,
    actor: str,
    reason: str,
    data: dict[str, Any] | None,
    at: datetime,
    changes: dict[str, Any] | None = None,
) -> Event:
    """The Event of a move of `step` to `target` writing `changes`, hashed and chained."""
    values = {
        "id": None,
        "run_id": step.run_id,
        "step_id": step.pk,
        "seq": seq,
        "from_state": source,
        "to_state": target,
        "actor": actor,
        "reason": reason,
        # Secrets never reach the audit trail (DESIGN.md §15).
        "data": redact(data) if data else {},
        "created_at": at,
        "prev_hash": step.head_hash,
        "hash": "",
        "step_digest": digest_after(step, target, changes),
        "format": EVENT_FORMAT,
    }
    # Every field by position, as a row read from the database is made: half the time of
    # keyword arguments, and a batch of posts makes three events a step.
    event = Event(*[values[name] for name in _EVENT_FIELDS])
    event.hash = event_hash(event.content())
    return event


_EVENT_FIELDS = tuple(f.attname for f in Event._meta.concrete_fields)


def move(
    step: Step,
    target: State,
    *,
    actor: str,
    reason: str = "",
    fence: int | None = None,
    changes: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    now: datetime | None = None,
    lease_expired_by: datetime | None = None,
) -> Step:
    """Moves `step` from the state and version it was read at to `target`.

    `lease_expired_by`, for recovery, also requires the lease to have run out by then: a
    worker's `submitting` commit extends the lease without a new version, so this is what
    keeps recovery from acting on a phase it read before that commit.

    `changes` are further fields written in the same UPDATE. `fence`, when given, must
    still match: a worker whose lease was taken over writes nothing. On success the
    in-memory `step` is updated and returned; otherwise `TransitionError` is raised and
    neither the step nor the ledger changed.
    """
    now = now or timezone.now()
    changes, event, guard = _prepare(step, target, actor, reason, fence, changes, data, now)
    if lease_expired_by is not None:
        guard["lease_expires_at__lte"] = lease_expired_by
    with transaction.atomic():
        updated = Step.objects.filter(**guard).update(
            state=target,
            version=F("version") + 1,
            head_hash=event.hash,
            updated_at=now,
            **changes,
        )
        if updated != 1:
            raise StaleStep(step, fence)
        event.save(force_insert=True)
    _moved(step, target, changes, event, now)
    return step


def _prepare(
    step: Step,
    target: State,
    actor: str,
    reason: str,
    fence: int | None,
    changes: dict[str, Any] | None,
    data: dict[str, Any] | None,
    now: datetime,
) -> tuple[dict[str, Any], Event, dict[str, Any]]:
    """A move's written fields, its Event and the guard its UPDATE is conditional on."""
    source = State(step.state)
    changes = checked_changes(step, target, changes)
    if target != source:
        changes["state_since"] = now
    event = build_event(
        step,
        seq=step.version + 1,
        source=source,
        target=target,
        actor=actor,
        reason=reason,
        data=data,
        at=now,
        changes=changes,
    )
    guard: dict[str, Any] = {"pk": step.pk, "state": source, "version": step.version}
    if fence is not None:
        guard["fence"] = fence
    return changes, event, guard


@dataclass
class PlannedMove:
    """`move` as parts of one statement (PostgreSQL), for a commit that writes more than the
    step: `sql` is the step's conditional UPDATE, answering a row when it moved; `event` is
    to be inserted in the same statement only then (`Rows(where=…)`). `done()` updates the
    in-memory step once the statement says it moved."""

    step: Step
    target: State
    changes: dict[str, Any]
    event: Event
    sql: str
    params: list[Any]

    def done(self) -> Step:
        _moved(self.step, self.target, self.changes, self.event, self.event.created_at)
        return self.step


def plan_move(
    step: Step,
    target: State,
    *,
    actor: str,
    reason: str = "",
    fence: int | None = None,
    changes: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    now: datetime,
) -> PlannedMove:
    """The parts of `move(step, target, …)` for a statement of CTEs (see PlannedMove)."""
    changes, event, guard = _prepare(step, target, actor, reason, fence, changes, data, now)
    sql, params = update_sql(
        Step,
        {"state": target, "head_hash": event.hash, "updated_at": now, **changes},
        increments={"version": 1},
        where=guard,
    )
    return PlannedMove(step, target, changes, event, sql, params)


def checked_changes(step: Step, target: State, changes: dict[str, Any] | None) -> dict[str, Any]:
    """The fields a move to `target` writes, or TransitionError when the move is not allowed."""
    source = State(step.state)
    if not is_allowed(source, target):
        raise IllegalTransition(source, target)
    changes = dict(changes or {})
    if target in LEASED:
        if not (
            changes.get("lease_owner", step.lease_owner)
            and changes.get("lease_expires_at", step.lease_expires_at)
        ):
            raise TransitionError(f"a move to {target} needs a lease owner and expiry")
    else:
        changes.setdefault("lease_owner", "")
        changes.setdefault("lease_expires_at", None)
    if target in (State.FAILED, State.DEAD) and not changes.get(
        "failure_class", step.failure_class
    ):
        raise TransitionError(f"a move to {target} needs a failure_class")
    return changes


def _moved(step: Step, target: State, changes: dict[str, Any], event: Event, now: datetime) -> None:
    """The in-memory step, as the ledger now has it."""
    for name, value in changes.items():
        setattr(step, name, value)
    step.state = target
    step.version = event.seq
    step.head_hash = event.hash
    step.updated_at = now


@dataclass
class Move:
    """One step's move in a batch (`move_many`); the fields are those of `move`."""

    step: Step
    target: State
    actor: str
    reason: str = ""
    changes: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] | None = None
    # The worker's fence, which must still match; None for moves that are not a worker's.
    fence: int | None = None


def move_many(
    moves: Sequence[Move], *, now: datetime, locked: bool = False
) -> tuple[list[Move], list[Move]]:
    """Moves many steps at once: one UPDATE and one INSERT of their Events (DESIGN.md §14).

    Each move is conditional exactly as `move` is: on its step's state and version, and on
    its fence when given. Unless the caller already holds the rows' locks (`locked`, as a
    claim does), the rows are locked and read first, so that each move that no longer
    applies is told apart. Returns (moved, stale); a stale move changed nothing. At most
    one move per step. Must run inside a transaction.
    """
    if not moves:
        return [], []
    prepared = [(m, checked_changes(m.step, m.target, m.changes)) for m in moves]
    fresh: list[tuple[Move, dict[str, Any]]]
    stale: list[tuple[Move, dict[str, Any]]] = []
    if locked:
        fresh = prepared
    else:
        # The steps' rows only (the model's order would join, and lock, their runs: a run's
        # row that every worker's commit checks its foreign keys against), in one order for
        # every caller (the lease keeper's too), so that two batches never wait on each
        # other's rows in a cycle; and not against those checks (no key changes here).
        current = {
            pk: (state, version, fence)
            for pk, state, version, fence in Step.objects.select_for_update(no_key=True)
            .filter(pk__in=[m.step.pk for m in moves])
            .order_by("pk")
            .values_list("pk", "state", "version", "fence")
        }
        fresh = []
        for m, changes in prepared:
            row = current.get(m.step.pk)
            still = row is not None and row[:2] == (m.step.state, m.step.version)
            if still and m.fence is not None:
                still = row is not None and row[2] == m.fence
            (fresh if still else stale).append((m, changes))
    for m, changes in fresh:
        if m.target != m.step.state:
            changes["state_since"] = now
    events = {
        m.step.pk: build_event(
            m.step,
            seq=m.step.version + 1,
            source=m.step.state,
            target=m.target,
            actor=m.actor,
            reason=m.reason,
            data=m.data,
            at=now,
            changes=changes,
        )
        for m, changes in fresh
    }
    if fresh:
        # One UPDATE per set of changed fields (a batch has one or two): a field a move
        # does not change is not written, so no other writer's value is overwritten.
        groups: dict[frozenset[str], list[tuple[Move, dict[str, Any]]]] = {}
        for m, changes in fresh:
            groups.setdefault(frozenset(changes), []).append((m, changes))
        for names, group in groups.items():
            pks = [m.step.pk for m, _ in group]
            per_row: dict[str, dict[Any, Any]] = {
                "state": {m.step.pk: m.target for m, _ in group},
                "head_hash": {m.step.pk: events[m.step.pk].hash for m, _ in group},
            }
            for name in names:
                per_row[name] = {m.step.pk: changes[name] for m, changes in group}
            updated = update_rows(
                Step.objects.filter(pk__in=pks),
                same={"version": F("version") + 1, "updated_at": now},
                per_row=per_row,
            )
            if updated != len(group):
                raise TransitionError(f"{len(group)} steps were locked but {updated} moved")
        create(Event, list(events.values()))
        for m, changes in fresh:
            _moved(m.step, m.target, changes, events[m.step.pk], now)
    return [m for m, _ in fresh], [m for m, _ in stale]


@dataclass
class Posted:
    """A state a new step passes through as it is recorded (`insert_many`)."""

    target: State
    actor: str
    reason: str = ""
    data: dict[str, Any] | None = None


def insert_many(
    histories: Sequence[tuple[Step, Sequence[Posted]]],
    *,
    now: datetime,
    also: Sequence[Rows] = (),
) -> None:
    """Inserts new steps, each with one Event for the states it passed through as it was
    recorded (posted, approved by policy, pending), and `also` (rows that belong to them,
    such as the policy's approvals), numbering the steps in their runs' posting order.

    The history must start from nothing and follow allowed moves, as if each had been
    `move`d there; the step is inserted in its last state, at version 1. Its Event goes from
    nothing to that state in one move, as it happened (one transaction, one instant): it is
    the first move's actor's, its reason joins the moves' reasons, its data merges theirs and
    names the states passed `through` (a third of a step's events, and their bytes, before).
    On PostgreSQL all of it is one statement (atomic by itself, in a transaction or not);
    elsewhere one statement a table, which must run inside a transaction.
    """
    events: list[Event] = []
    for step, history in histories:
        step.head_hash = ""
        source = ""
        data: dict[str, Any] = {}
        for posted in history:
            if source and not is_allowed(source, posted.target):
                raise IllegalTransition(source, posted.target)
            data.update(posted.data or {})
            source = posted.target
        if len(history) > 1:
            data["through"] = [posted.target.value for posted in history[:-1]]
        event = build_event(
            step,
            seq=1,
            source="",
            target=history[-1].target,
            actor=history[0].actor,
            reason="; ".join(posted.reason for posted in history if posted.reason),
            data=data or None,
            at=now,
        )
        events.append(event)
        step.head_hash = event.hash
        step.state = State(source)
        step.version = 1
        step.created_at = step.updated_at = step.state_since = now
    by_run: dict[Any, list[Step]] = {}
    for step, _ in histories:
        by_run.setdefault(step.run_id, []).append(step)
    others = [Rows(Event, events), *also]
    if connection.vendor == "postgresql":
        _insert_in_one_statement(by_run, others)
        return
    for run_id, run_steps in by_run.items():
        first = take_positions(run_id, len(run_steps))
        for offset, step in enumerate(run_steps):
            step.position = first + offset
    Step.objects.bulk_create([step for step, _ in histories])
    for group in others:
        group.model._default_manager.bulk_create(group.objs)


def for_insert_many() -> contextlib.AbstractContextManager[Any]:
    """The transaction `insert_many` (and whatever is sent on its commit) needs: none on
    PostgreSQL outside a transaction, where it is one statement, atomic by itself (a BEGIN
    and a COMMIT fewer: two round trips of a single post); a savepoint inside one, so that a
    refused insert (a concurrent post of the same key) leaves the outer transaction usable;
    a transaction elsewhere."""
    if connection.vendor == "postgresql" and not connection.in_atomic_block:
        return contextlib.nullcontext()
    return transaction.atomic()


def _insert_in_one_statement(by_run: dict[Any, list[Step]], others: Sequence[Rows]) -> None:
    """`insert_many` on PostgreSQL: each run's counter moves (`take_positions`), the steps take
    their positions from it, and the other rows go in, in one statement."""
    ctes: list[tuple[str, str, list[Any]]] = []
    places: dict[Any, tuple[int, int]] = {}  # step id → (its run's number, offset in the run)
    for number, (run_id, run_steps) in enumerate(by_run.items()):
        ctes.append((f"c{number}", *_positions_sql(run_id, len(run_steps))))
        for offset, step in enumerate(run_steps):
            places[step.pk] = (number, offset)
    # The run's first position (its counter's CTE, by the run's number) plus the offset.
    firsts = " ".join(
        f"WHEN {number} THEN (SELECT first_position FROM c{number})"  # noqa: S608 - ours
        for number in range(len(by_run))
    )
    position = Computed(
        f"CASE {{0}} {firsts} END + {{1}}", ("integer", "integer"), lambda s: places[s.pk]
    )
    steps = [step for run_steps in by_run.values() for step in run_steps]
    found = insert_together([Rows(Step, steps, {"position": position}), *others], ctes=ctes)
    for number, run_steps in enumerate(by_run.values()):
        (first,) = found[f"c{number}"]
        for offset, step in enumerate(run_steps):
            step.position = first + offset


def _positions_sql(run_id: Any, count: int) -> tuple[str, list[Any]]:
    """The statement that reserves `count` consecutive positions in the run's posting order
    and returns the first.

    It creates the run's counter (from its highest position, for steps numbered before the
    counter existed) or increments it. Concurrent posts to one run wait on this row only,
    from here to their commit; nothing else locks it.
    """
    table = StepCounter._meta.db_table
    steps = Step._meta.db_table
    run = StepCounter._meta.pk.get_db_prep_value(run_id, connection)
    sql = (
        f"INSERT INTO {table} (run_id, last_position) "  # noqa: S608 - names, not input
        f"VALUES (%s, (SELECT COALESCE(MAX(position), 0) FROM {steps} WHERE run_id = %s) + %s) "
        f"ON CONFLICT (run_id) DO UPDATE SET last_position = {table}.last_position + %s "
        "RETURNING last_position - %s + 1 AS first_position"
    )
    return sql, [run, run, count, count, count]


def take_positions(run_id: Any, count: int) -> int:
    """Reserves `count` consecutive positions in the run's posting order; returns the first
    (`_positions_sql`, as a statement of its own)."""
    sql, params = _positions_sql(run_id, count)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        (first,) = cursor.fetchone()
    return int(first)


def insert(step: Step, *, actor: str, reason: str = "", now: datetime | None = None) -> Step:
    """Inserts a new step with its first Event (version 1, from nothing to its state)."""
    with transaction.atomic():
        insert_many([(step, [Posted(State(step.state), actor, reason)])], now=now or timezone.now())
    return step
