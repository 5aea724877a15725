"""Test helpers: steps built in any state through the real transitions, and a chain check."""

from __future__ import annotations

import uuid
from collections import deque
from datetime import timedelta
from typing import Any

from django.db import connection
from django.utils import timezone

from executor.ledger import transitions
from executor.ledger.records import Event, Run, Step, Tool, call_hash
from executor.ledger.states import ALLOWED, LEASED, State
from executor.services.tools import tools_sync

TOOL = "echo"
WORKER = "executor:test-worker"


def path_from_planned(target: State) -> list[State]:
    """The shortest list of allowed moves from planned to `target` (empty for planned)."""
    previous: dict[State, State | None] = {State.PLANNED: None}
    queue = deque([State.PLANNED])
    while queue:
        state = queue.popleft()
        for nxt in sorted(ALLOWED[state]):
            if nxt not in previous:
                previous[nxt] = state
                queue.append(nxt)
    if target not in previous:
        raise AssertionError(f"{target} cannot be reached from planned")
    path: list[State] = []
    cursor: State | None = target
    while cursor is not None and cursor != State.PLANNED:
        path.append(cursor)
        cursor = previous[cursor]
    return list(reversed(path))


def changes_for(step: Step, target: State) -> dict[str, Any]:
    """The extra fields the real caller of a move writes, so the row's constraints hold.

    A worker's claim takes a lease and a new fence; a lookup that moves an unknown step to
    verifying holds a lease too; failed and dead steps carry their failure class.
    """
    changes: dict[str, Any] = {}
    if target in LEASED and (target == State.RUNNING or State(step.state) not in LEASED):
        changes["lease_owner"] = WORKER
        changes["lease_expires_at"] = timezone.now() + timedelta(seconds=60)
    if target == State.RUNNING:
        changes["fence"] = step.fence + 1
    if target in (State.FAILED, State.DEAD):
        changes["failure_class"] = "permanent" if target == State.FAILED else "transient"
        changes["failure_message"] = f"made {target} by a test"
    return changes


def ensure_tool() -> None:
    if not Tool.objects.filter(name=TOOL).exists():
        tools_sync()


def new_step(run: Run, *, key: str | None = None) -> Step:
    """A fresh planned step with its first Event, inserted the way step_post does."""
    ensure_tool()
    step = Step(
        run=run,
        key=key or f"step-{uuid.uuid4().hex[:12]}",
        tool_id=TOOL,
        input={"message": "hello"},
        input_hash=call_hash(TOOL, {"message": "hello"}),
    )
    return transitions.insert(step, actor="agent:test", reason="posted by a test")


def advance(step: Step, target: State, *, actor: str = "test", reason: str = "") -> Step:
    return transitions.move(
        step, target, actor=actor, reason=reason, changes=changes_for(step, target)
    )


def step_in(run: Run, state: State, *, key: str | None = None) -> Step:
    """A step in `state`, reached from planned along allowed moves, each with its Event."""
    step = new_step(run, key=key)
    for target in path_from_planned(state):
        advance(step, target, reason=f"on the way to {state}")
    return step


def event_count(step: Step) -> int:
    return Event.objects.filter(step_id=step.pk).count()


def snapshot(step: Step) -> tuple[str, int, str, int, int]:
    """What a refused move must leave alone, read back from the database."""
    row = Step.objects.get(pk=step.pk)
    return (row.state, row.version, row.head_hash, row.fence, event_count(step))


def chain_problems(step: Step) -> list[str]:
    """Everything wrong with the step's event chain; empty when it verifies."""
    row = Step.objects.get(pk=step.pk)
    events = list(Event.objects.filter(step_id=step.pk).order_by("seq"))
    problems: list[str] = []
    if [e.seq for e in events] != list(range(1, len(events) + 1)):
        problems.append(f"seqs {[e.seq for e in events]} are not 1..{len(events)}")
    if len(events) != row.version:
        problems.append(f"{len(events)} events for version {row.version}")
    prev = ""
    previous_state = ""
    for event in events:
        if event.prev_hash != prev:
            problems.append(f"event {event.seq} does not point at its predecessor")
        if transitions.event_hash(event.content()) != event.hash:
            problems.append(f"event {event.seq} does not match its hash")
        if event.from_state != previous_state:
            problems.append(f"event {event.seq} starts at {event.from_state}, not {previous_state}")
        prev = event.hash
        previous_state = event.to_state
    if events and row.head_hash != prev:
        problems.append("head_hash is not the newest event's hash")
    if events and row.state != previous_state:
        problems.append(f"step is {row.state} but its last event ends at {previous_state}")
    return problems


def stored_digest(value: str) -> Any:
    """A digest (hex) as raw SQL must pass it for a DigestField's column: its bytes on
    PostgreSQL, the hex itself elsewhere."""
    return Event._meta.get_field("hash").get_db_prep_value(value, connection)
