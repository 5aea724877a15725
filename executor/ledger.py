"""Verifies the per-step Event hash chains (DESIGN.md §3): the check behind `verify_ledger`.

The chain is unkeyed, so it proves that no event was edited, dropped or slipped in behind
the application's back; someone able to rewrite a whole chain and its step row can still
forge a consistent one.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from executor.models import Event, Step
from executor.transitions import event_hash

# Steps per chunk: each chunk costs two queries (its steps, then all their events).
DEFAULT_CHUNK_SIZE = 500
# A step moved by a live worker between the two reads of its chunk looks broken; it is
# read again on its own before it is reported, a few times for a busy step.
RECHECKS = 3

STEP_FIELDS = ("id", "run_id", "state", "version", "head_hash")


@dataclass(frozen=True)
class Finding:
    """The first broken link of one step's chain."""

    step_id: uuid.UUID
    # None when the step has no event to point at.
    event_id: int | None
    seq: int | None
    problem: str

    def __str__(self) -> str:
        where = (
            f"event {self.event_id} (seq {self.seq})" if self.event_id is not None else "no event"
        )
        return f"step {self.step_id}: {where}: {self.problem}"


@dataclass
class ChainReport:
    steps: int = 0
    events: int = 0
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def summary(self) -> str:
        return f"{self.steps} steps, {self.events} events verified, {len(self.findings)} broken"


def step_chain_finding(step: Step, events: Sequence[Event]) -> Finding | None:
    """The first thing wrong with `step`'s chain, given its events in `seq` order, or None.

    Each event must carry the next seq, link to its predecessor's stored hash, hash to its
    stored hash, and continue from the state its predecessor reached; the last one must be
    the step's head (hash, version and state).
    """

    def broken(event: Event | None, problem: str) -> Finding:
        return Finding(
            step_id=step.pk,
            event_id=event.pk if event else None,
            seq=event.seq if event else None,
            problem=problem,
        )

    if not events:
        return broken(None, f"has no events although it is at version {step.version}")
    previous: Event | None = None
    for expected_seq, event in enumerate(events, start=1):
        if event.seq != expected_seq:
            return broken(
                event,
                f"seq {expected_seq} is missing: the chain jumps from seq {expected_seq - 1} "
                f"to seq {event.seq}",
            )
        if event.seq > step.version:
            return broken(
                event,
                f"lies beyond the step's version {step.version}: no transition wrote it",
            )
        expected_prev = previous.hash if previous else ""
        if event.prev_hash != expected_prev:
            return broken(
                event,
                f"its prev_hash {event.prev_hash[:12] or '(empty)'} does not match the hash "
                f"{expected_prev[:12] or '(empty)'} of the event before it",
            )
        if event_hash(event.content()) != event.hash:
            return broken(event, "its content does not match its hash: it was edited")
        if event.run_id != step.run_id:
            return broken(event, f"belongs to run {event.run_id}, its step to run {step.run_id}")
        expected_from = previous.to_state if previous else ""
        if event.from_state != expected_from:
            return broken(
                event,
                f"moves from {event.from_state or '(nothing)'} but the event before it left "
                f"the step {expected_from or '(nothing)'}",
            )
        previous = event
    last = events[-1]
    if last.seq != step.version:
        return broken(
            last,
            f"the chain ends at seq {last.seq} but the step is at version {step.version}: "
            f"later events are missing",
        )
    if last.hash != step.head_hash:
        return broken(last, "the step's head_hash is not the hash of its last event")
    if last.to_state != step.state:
        return broken(
            last, f"the step is {step.state} but its last event moved it to {last.to_state}"
        )
    return None


def verify_chain(
    *, step_ids: Iterable[uuid.UUID] | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> ChainReport:
    """Verifies the chains of `step_ids` (every step when None), `chunk_size` steps at a time.

    Reports at most one finding per step: its first broken link.
    """
    report = ChainReport()
    for steps, events_by_step in _chunks(step_ids, chunk_size):
        for step in steps:
            events = events_by_step.get(step.pk, [])
            finding = step_chain_finding(step, events)
            if finding is not None:
                finding, events = _recheck(step.pk, finding)
            report.steps += 1
            report.events += len(events)
            if finding is not None:
                report.findings.append(finding)
    return report


def _chunks(
    step_ids: Iterable[uuid.UUID] | None, chunk_size: int
) -> Iterator[tuple[list[Step], dict[uuid.UUID, list[Event]]]]:
    # Keyset pagination on the primary key: each chunk is one indexed range scan, however
    # far into the ledger it is, and steps posted meanwhile are simply picked up or not.
    base = Step.objects.only(*STEP_FIELDS).order_by("pk")
    if step_ids is not None:
        base = base.filter(pk__in=list(step_ids))
    last_pk: uuid.UUID | None = None
    while True:
        page = base if last_pk is None else base.filter(pk__gt=last_pk)
        steps = list(page[:chunk_size])
        if not steps:
            return
        yield steps, _events_of([step.pk for step in steps])
        last_pk = steps[-1].pk


def _events_of(step_ids: list[uuid.UUID]) -> dict[uuid.UUID, list[Event]]:
    events_by_step: dict[uuid.UUID, list[Event]] = defaultdict(list)
    for event in Event.objects.filter(step_id__in=step_ids).order_by("step_id", "seq"):
        events_by_step[event.step_id].append(event)
    return events_by_step


def _recheck(step_id: uuid.UUID, finding: Finding) -> tuple[Finding | None, list[Event]]:
    events: list[Event] = []
    for _ in range(RECHECKS):
        step = Step.objects.only(*STEP_FIELDS).filter(pk=step_id).first()
        if step is None:
            # Steps are never deleted by the application; keep the original finding.
            return finding, events
        events = _events_of([step_id]).get(step_id, [])
        again = step_chain_finding(step, events)
        if again is None:
            return None, events
        finding = again
    return finding, events
