"""Tamper evidence (DESIGN.md §3, §15): the checks behind `verify_ledger`, and the signed
checkpoints that anchor them.

Each Event's hash is an HMAC (keyed by EXECUTOR_LEDGER_KEY) over its content, its
predecessor's hash, its run and a digest of what its step was right after it (run, key,
tool, input hash, state, external id, result). So without the key nobody can edit, insert
or drop an event, edit a step row (its result, external id, input, state) or move a step to
another run, and leave a chain that verifies. What a consistent rewrite by someone with
write access could still do — cut the newest events of a chain and roll the step back, or
delete a whole step — is caught by two anchors: positions in a run are numbered without
gaps by its StepCounter, and signed checkpoints (`checkpoint_take`, by the sweeper) record
where every step's chain stood. What no check here can prove: changes made after the newest
checkpoint to steps it does not list, or anything done by someone who holds the key.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.db.models import Count, Max, Min, Q
from django.utils import timezone

from executor.models import Checkpoint, Event, Step, StepCounter, call_hash
from executor.transitions import digest_after, event_hash

# Steps per chunk: each chunk costs two queries (its steps, then all their events).
DEFAULT_CHUNK_SIZE = 500
# A step moved by a live worker between the two reads of its chunk looks broken; it is
# read again on its own before it is reported, a few times for a busy step.
RECHECKS = 3
# A checkpoint lists the steps updated since the one before, less this margin: a move
# stamped just before a checkpoint but committed just after it is listed by the next.
CHECKPOINT_OVERLAP = timedelta(minutes=5)

STEP_FIELDS = (
    "id",
    "run_id",
    "key",
    "tool",
    "input",
    "input_hash",
    "state",
    "version",
    "head_hash",
    "external_id",
    "result",
)


@dataclass(frozen=True)
class Finding:
    """One break: the first broken link of one step's chain, or a broken anchor."""

    step_id: uuid.UUID | None
    # None when there is no event to point at.
    event_id: int | None
    seq: int | None
    problem: str
    # What the finding is about when it is not one step: a run, a checkpoint.
    subject: str = ""

    def __str__(self) -> str:
        if self.step_id is None:
            return f"{self.subject}: {self.problem}"
        where = (
            f"event {self.event_id} (seq {self.seq})" if self.event_id is not None else "no event"
        )
        return f"step {self.step_id}: {where}: {self.problem}"


@dataclass
class ChainReport:
    steps: int = 0
    events: int = 0
    checkpoints: int = 0
    findings: list[Finding] = field(default_factory=list)
    newest_checkpoint: Checkpoint | None = None

    @property
    def ok(self) -> bool:
        return not self.findings

    def summary(self) -> str:
        return f"{self.steps} steps, {self.events} events verified, {len(self.findings)} broken"


def step_chain_finding(step: Step, events: Sequence[Event]) -> Finding | None:
    """The first thing wrong with `step`'s chain, given its events in `seq` order, or None.

    Each event must carry the next seq, link to its predecessor's stored hash, hash to its
    stored hash, and continue from the state its predecessor reached; the last one must be
    the step's head (hash, version and state) and digest the step row as it is.
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
    if last.format >= 2 and last.step_digest != digest_after(step, step.state):
        return broken(
            last,
            "the step row is not what its last event recorded: its run, key, tool, input "
            "hash, external id or result was changed",
        )
    if step.input_hash != call_hash(step.tool_id, step.input):
        return broken(last, "the step's input does not match its input hash: it was edited")
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


def verify_ledger(*, chunk_size: int = DEFAULT_CHUNK_SIZE) -> ChainReport:
    """Every step's chain, the runs' numbering and the checkpoints: each break named."""
    report = verify_chain(chunk_size=chunk_size)
    report.findings += position_findings()
    checkpoint_report = verify_checkpoints()
    report.findings += checkpoint_report.findings
    report.checkpoints = checkpoint_report.checkpoints
    report.newest_checkpoint = checkpoint_report.newest_checkpoint
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


# --- anchors ----------------------------------------------------------------------------------


def position_findings() -> list[Finding]:
    """Every run's steps are numbered 1..n with no gap (its StepCounter hands out n): a
    gap is a deleted step. Two queries."""
    counters = dict(StepCounter.objects.values_list("run_id", "last_position"))
    findings = []
    rows = Step.objects.values("run_id").annotate(
        n=Count("pk"), low=Min("position"), high=Max("position")
    )
    seen = set()
    for row in rows.order_by():
        run_id, n, high = row["run_id"], row["n"], row["high"]
        seen.add(run_id)
        expected = max(high, counters.get(run_id, 0))
        if n != expected or row["low"] != 1:
            findings.append(
                Finding(
                    step_id=None,
                    event_id=None,
                    seq=None,
                    subject=f"run {run_id}",
                    problem=f"holds {n} steps but numbered {expected}: "
                    f"{expected - n} step(s) were deleted",
                )
            )
    for run_id, last in counters.items():
        if run_id not in seen and last:
            findings.append(
                Finding(
                    step_id=None,
                    event_id=None,
                    seq=None,
                    subject=f"run {run_id}",
                    problem=f"numbered {last} steps but holds none: they were deleted",
                )
            )
    return findings


def checkpoint_take(*, now: datetime | None = None) -> Checkpoint | None:
    """Signs where the chains of the steps changed since the last checkpoint stand.

    Returns it, or None when another process took one with the same number first.
    """
    now = now or timezone.now()
    previous = Checkpoint.objects.order_by("-seq").first()
    since = previous.taken_at - CHECKPOINT_OVERLAP if previous else None
    steps = Step.objects.order_by("pk")
    if since is not None:
        steps = steps.filter(updated_at__gte=since)
    heads = [
        [str(pk), str(run_id), version, head]
        for pk, run_id, version, head in steps.values_list("pk", "run_id", "version", "head_hash")
    ]
    checkpoint = Checkpoint(
        seq=(previous.seq + 1) if previous else 1,
        taken_at=now,
        since=since,
        heads=heads,
        prev_hash=previous.hash if previous else "",
    )
    checkpoint.hash = event_hash(checkpoint.content())
    try:
        with transaction.atomic():
            checkpoint.save(force_insert=True)
    except IntegrityError:
        return None
    return checkpoint


def verify_checkpoints() -> ChainReport:
    """The checkpoints' own chain, and every step they list against the ledger now."""
    report = ChainReport()
    listed: dict[str, tuple[str, int, str, int]] = {}
    previous: Checkpoint | None = None
    for checkpoint in Checkpoint.objects.order_by("seq").iterator():
        report.checkpoints += 1
        subject = f"checkpoint {checkpoint.seq}"
        expected_seq = previous.seq + 1 if previous else 1
        if checkpoint.seq != expected_seq:
            report.findings.append(_anchor(subject, f"checkpoint {expected_seq} is missing"))
        if checkpoint.prev_hash != (previous.hash if previous else ""):
            report.findings.append(_anchor(subject, "does not link to the checkpoint before it"))
        if event_hash(checkpoint.content()) != checkpoint.hash:
            report.findings.append(_anchor(subject, "its content does not match its hash"))
        for step_id, run_id, version, head in checkpoint.heads:
            listed[step_id] = (run_id, version, head, checkpoint.seq)
        previous = checkpoint
    report.newest_checkpoint = previous
    if not listed:
        return report
    rows: dict[str, tuple[str, int]] = {}
    hashes: dict[tuple[str, int], str] = {}
    entries = list(listed.items())
    for start in range(0, len(entries), DEFAULT_CHUNK_SIZE):
        chunk = entries[start : start + DEFAULT_CHUNK_SIZE]
        ids = [uuid.UUID(step_id) for step_id, _ in chunk]
        rows.update(
            (str(pk), (str(run_id), version))
            for pk, run_id, version in Step.objects.filter(pk__in=ids).values_list(
                "pk", "run_id", "version"
            )
        )
        wanted = Q()
        for step_id, (_, version, _, _) in chunk:
            wanted |= Q(step_id=uuid.UUID(step_id), seq=version)
        hashes.update(
            ((str(step_id), seq), hash_)
            for step_id, seq, hash_ in Event.objects.filter(wanted).values_list(
                "step_id", "seq", "hash"
            )
        )
    for step_id, (run_id, version, head, seq) in listed.items():
        subject = f"step {step_id} (in checkpoint {seq})"
        row = rows.get(step_id)
        if row is None:
            report.findings.append(_anchor(subject, "was deleted"))
        elif row[0] != run_id:
            report.findings.append(_anchor(subject, f"was moved from run {run_id} to {row[0]}"))
        elif row[1] < version or hashes.get((step_id, version)) != head:
            report.findings.append(
                _anchor(
                    subject,
                    f"was at version {version} with head {head[:12]}; its chain no longer "
                    f"holds that (now at version {row[1]}): events were cut or rewritten",
                )
            )
    return report


def _anchor(subject: str, problem: str) -> Finding:
    return Finding(step_id=None, event_id=None, seq=None, subject=subject, problem=problem)


def checkpoint_due(*, every: timedelta, now: datetime | None = None) -> bool:
    now = now or timezone.now()
    newest = Checkpoint.objects.order_by("-seq").values_list("taken_at", flat=True).first()
    return newest is None or newest <= now - every


def describe(checkpoint: Checkpoint | None) -> str:
    if checkpoint is None:
        return "no checkpoint yet"
    return (
        f"newest checkpoint {checkpoint.seq} at {checkpoint.taken_at:%Y-%m-%d %H:%M:%S} UTC, "
        f"hash {checkpoint.hash} (keep it elsewhere to prove nothing before it was rewritten)"
    )
