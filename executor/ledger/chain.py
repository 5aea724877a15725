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
where every step's chain stood, each checkpoint's head leaving the database (`export`; checked
by `verify_ledger --against`). The records beside the chains are covered as executor/ledger/seals.py
says: approvals and attempts through their steps' Events (and closed attempts through the
checkpoints), run events and budgets through each run's own chain and seal. What no check
here can prove: changes made after the newest checkpoint to steps it does not list, or
anything done by someone who holds the key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Count, Max, Min
from django.utils import timezone

from executor.ledger.records import (
    OPEN_PHASES,
    RECORDS,
    Approval,
    Attempt,
    Checkpoint,
    Event,
    Run,
    RunEvent,
    Step,
    StepCounter,
    call_hash,
    pack_listing,
    unpack_listing,
)
from executor.ledger.seals import attempt_digest, digest_of_approval, run_seal
from executor.ledger.transitions import (
    _CANONICAL_WITH_STR,
    digest_after,
    event_hash,
    ledger_mac,
)

logger = logging.getLogger(__name__)

# Steps per chunk: each chunk costs four queries (its steps, then all their events,
# approvals and attempts).
DEFAULT_CHUNK_SIZE = 500
# A step moved by a live worker between the two reads of its chunk looks broken; it is
# read again on its own before it is reported, a few times for a busy step.
RECHECKS = 3
# A checkpoint lists the steps updated since the one before, less this margin: a move
# stamped just before a checkpoint but committed just after it is listed by the next.
CHECKPOINT_OVERLAP = timedelta(minutes=5)

ATTEMPT_FIELDS = (
    "id",
    "step_id",
    "number",
    "fence",
    "worker",
    "phase",
    "request_evidence",
    "response_evidence",
    "error_class",
    "error_message",
    "cost",
)
# The first Event format whose steps name every approval in their chain (EVENT_FORMAT 3).
RECORDS_FORMAT = 3

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
        records = _records_of([step.pk for step in steps])
        for step in steps:
            events = events_by_step.get(step.pk, [])
            finding = step_chain_finding(step, events)
            if finding is not None:
                finding, events = _recheck(step.pk, finding)
            report.steps += 1
            report.events += len(events)
            if finding is not None:
                report.findings.append(finding)
            else:
                report.findings += record_findings(step, events, *records.get(step.pk, ([], [])))
    return report


def record_findings(
    step: Step, events: Sequence[Event], approvals: Sequence[Approval], attempts: Sequence[Any]
) -> list[Finding]:
    """What is wrong with the approvals and attempts beside a step's (sound) chain.

    Each approval an Event recorded must still be there as it was (its digest), and each
    attempt a claim Event opened must still exist; on steps written since the chain names
    them (RECORDS_FORMAT), an approval or attempt no Event names was put there by hand.
    """
    findings = []
    by_digest = {digest_of_approval(approval): approval for approval in approvals}
    numbers = {attempt.number for attempt in attempts}
    named_digests, named_numbers = set(), set()
    for event in events:
        digest = event.data.get("approval_digest") if isinstance(event.data, dict) else None
        if isinstance(digest, str):
            named_digests.add(digest)
            if digest not in by_digest:
                findings.append(
                    Finding(
                        step.pk,
                        event.pk,
                        event.seq,
                        "the approval it recorded is no longer there as it was: its approver, "
                        "reason, input hash or policy version was edited, or it was deleted",
                    )
                )
        number = event.data.get("attempt") if isinstance(event.data, dict) else None
        if isinstance(number, int):
            named_numbers.add(number)
            if number not in numbers:
                findings.append(
                    Finding(step.pk, event.pk, event.seq, f"attempt {number} it opened was deleted")
                )
    if events and events[0].format >= RECORDS_FORMAT:
        for digest, approval in by_digest.items():
            if digest not in named_digests:
                findings.append(
                    Finding(
                        step.pk,
                        None,
                        None,
                        f"approval {approval.pk} is recorded by no event: it was added or "
                        f"edited behind the application's back",
                    )
                )
        for number in sorted(numbers - named_numbers):
            findings.append(
                Finding(
                    step.pk,
                    None,
                    None,
                    f"attempt {number} was opened by no claim: it was added behind the "
                    f"application's back",
                )
            )
    return findings


def _records_of(
    step_ids: list[uuid.UUID],
) -> dict[uuid.UUID, tuple[list[Approval], list[Any]]]:
    records: dict[uuid.UUID, tuple[list[Approval], list[Any]]] = defaultdict(lambda: ([], []))
    for approval in Approval.objects.filter(step_id__in=step_ids).order_by("pk"):
        records[approval.step_id][0].append(approval)
    for attempt in Attempt.objects.filter(step_id__in=step_ids).only("id", "step_id", "number"):
        records[attempt.step_id][1].append(attempt)
    return records


class NoSuchCheckpoint(ValueError):
    """`verify_ledger(since=N)` names a checkpoint the database does not hold."""


def verify_ledger(
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    since: int | None = None,
    against: Sequence[tuple[int, str]] = (),
) -> ChainReport:
    """Every step's chain and records, every run's events and budget, the runs' numbering
    and the checkpoints: each break named.

    `since` (a checkpoint's number) verifies incrementally: only the steps and runs changed
    since that checkpoint was taken, and the checkpoints from it on. `against` holds
    checkpoint heads kept outside the database (`read_exported`), which the database's
    checkpoints must still hold.
    """
    changed_after: datetime | None = None
    if since is not None:
        # Its time only: a checkpoint's listing is the biggest thing verification reads.
        taken_at = Checkpoint.objects.filter(seq=since).values_list("taken_at", flat=True).first()
        if taken_at is None:
            raise NoSuchCheckpoint(f"there is no checkpoint {since}")
        changed_after = taken_at - CHECKPOINT_OVERLAP
    step_ids = None if changed_after is None else changed_steps(changed_after)
    report = verify_chain(step_ids=step_ids, chunk_size=chunk_size)
    report.findings += run_findings(changed_after=changed_after, chunk_size=chunk_size)
    report.findings += position_findings()
    checkpoint_report = verify_checkpoints(since=since)
    report.findings += checkpoint_report.findings
    report.findings += exported_findings(against)
    report.checkpoints = checkpoint_report.checkpoints
    report.newest_checkpoint = checkpoint_report.newest_checkpoint
    return report


def run_findings(
    *, changed_after: datetime | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> list[Finding]:
    """Each run's events chained (id order, keyed) and its budget sealed to the newest."""
    findings: list[Finding] = []
    runs = Run.objects.only("id", "max_calls", "max_cost", "deadline", "seal").order_by("pk")
    if changed_after is not None:
        runs = runs.filter(updated_at__gte=changed_after)
    last_pk: uuid.UUID | None = None
    while True:
        page = list((runs if last_pk is None else runs.filter(pk__gt=last_pk))[:chunk_size])
        if not page:
            return findings
        last_pk = page[-1].pk
        events: dict[uuid.UUID, list[RunEvent]] = defaultdict(list)
        for event in RunEvent.objects.filter(run_id__in=[run.pk for run in page]).order_by("pk"):
            events[event.run_id].append(event)
        for run in page:
            finding = run_chain_finding(run, events.get(run.pk, []))
            if finding is not None:
                findings.append(finding)


def run_chain_finding(run: Run, events: Sequence[RunEvent]) -> Finding | None:
    subject = f"run {run.pk}"
    head = ""
    for event in events:
        where = f"run event {event.pk} ({event.action})"
        if event.prev_hash != head:
            return _anchor(
                subject,
                f"{where} does not link to the run event before it: one was deleted or inserted",
            )
        if event_hash(event.content()) != event.hash:
            return _anchor(
                subject,
                f"{where}: its content does not match its hash: its actor, "
                f"reason or data was edited",
            )
        head = event.hash
    if run.seal != run_seal(run, head):
        return _anchor(
            subject,
            "its budget (max_calls, max_cost, deadline) or its newest run events are not what "
            "was sealed: the budget was edited or run events were cut",
        )
    return None


def changed_steps(after: datetime) -> Iterator[uuid.UUID]:
    """The steps with an event stamped at or after `after`, in id order, streamed (a
    server-side cursor on PostgreSQL): what changed, read through the events' time index."""
    return (
        Event.objects.filter(created_at__gte=after)
        .order_by("step_id")
        .values_list("step_id", flat=True)
        .distinct()
        .iterator(chunk_size=2000)
    )


def _chunks(
    step_ids: Iterable[uuid.UUID] | None, chunk_size: int
) -> Iterator[tuple[list[Step], dict[uuid.UUID, list[Event]]]]:
    """Steps and their events, `chunk_size` steps at a time: memory holds one chunk."""
    if step_ids is not None:
        for ids in _batched(step_ids, chunk_size):
            steps = list(Step.objects.only(*STEP_FIELDS).filter(pk__in=ids).order_by("pk"))
            yield steps, _events_of([step.pk for step in steps])
        return
    # Keyset pagination on the primary key: each chunk is one indexed range scan, however
    # far into the ledger it is, and steps posted meanwhile are simply picked up or not.
    base = Step.objects.only(*STEP_FIELDS).order_by("pk")
    last_pk: uuid.UUID | None = None
    while True:
        page = base if last_pk is None else base.filter(pk__gt=last_pk)
        steps = list(page[:chunk_size])
        if not steps:
            return
        yield steps, _events_of([step.pk for step in steps])
        last_pk = steps[-1].pk


def _batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


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


def checkpoint_take(
    *,
    now: datetime | None = None,
    archived: Sequence[list[Any]] = (),
    pruned: Sequence[Any] = (),
) -> Checkpoint | None:
    """Signs where the chains of the steps changed since the last checkpoint stand, and the
    runs `archived` since (API.md "Retention"), and the checkpoints `pruned` (`[seq, hash]`
    of the newest one about to be deleted).

    Each step's head is listed once: a step already listed at its present version by a
    checkpoint of the overlap window is not listed again. Returns the checkpoint, or None
    when another process took one with the same number first.
    """
    now = now or timezone.now()
    previous = Checkpoint.objects.order_by("-seq").first()
    since = previous.taken_at - CHECKPOINT_OVERLAP if previous else None
    rows = _unlisted_heads(since)
    checkpoint = Checkpoint(
        seq=(previous.seq + 1) if previous else 1,
        taken_at=now,
        since=since,
        packed_heads=pack_listing("heads", rows),
        packed_attempts=pack_listing("attempts", _closed_attempts([pk for pk, *_ in rows])),
        archived=list(archived),
        pruned=list(pruned),
        prev_hash=previous.hash if previous else "",
    )
    checkpoint.hash = event_hash(checkpoint.content())
    try:
        with transaction.atomic():
            checkpoint.save(force_insert=True)
    except IntegrityError:
        return None
    export(checkpoint)
    return checkpoint


def _unlisted_heads(since: datetime | None) -> list[tuple[uuid.UUID, uuid.UUID, int, str]]:
    """`(step, run, version, head)` of every step changed at or after `since` (every step
    when None) that no checkpoint taken since then lists at that version already."""
    fields = ("pk", "run_id", "version", "head_hash")
    if since is None:
        rows: list[tuple[uuid.UUID, uuid.UUID, int, str]] = []
        last_pk: uuid.UUID | None = None
        while True:
            page = Step.objects.order_by("pk")
            if last_pk is not None:
                page = page.filter(pk__gt=last_pk)
            chunk = list(page.values_list(*fields)[:DEFAULT_CHUNK_SIZE])
            if not chunk:
                return rows
            rows += chunk
            last_pk = chunk[-1][0]
    # A step is listed at the version it had when the checkpoint read it, whose move was
    # stamped before that: so only the checkpoints taken since `since` can list a version
    # stamped at or after it.
    listed: dict[str, int] = {}
    # Newest first along the seq index, stopping at the first one taken before `since`: a
    # few rows, however many checkpoints a year has left.
    recent = Checkpoint.objects.order_by("-seq").only("taken_at", "heads", "packed_heads")
    for checkpoint in recent.iterator(chunk_size=1):
        if checkpoint.taken_at < since:
            break
        for step_id, _, version, _ in checkpoint.listed("heads"):
            listed[step_id] = max(version, listed.get(step_id, 0))
    rows = []
    for ids in _batched(changed_steps(since), DEFAULT_CHUNK_SIZE):
        read = Step.objects.filter(pk__in=ids).order_by("pk").values_list(*fields)
        rows += [row for row in read if listed.get(str(row[0]), 0) < row[2]]
    return rows


def _closed_attempts(step_ids: list[uuid.UUID]) -> list[list[str]]:
    """`[attempt, step, digest]` of the closed attempts of `step_ids` (which never change)."""
    closed = []
    for start in range(0, len(step_ids), DEFAULT_CHUNK_SIZE):
        rows = (
            Attempt.objects.filter(step_id__in=step_ids[start : start + DEFAULT_CHUNK_SIZE])
            .exclude(phase__in=OPEN_PHASES)
            .only(*ATTEMPT_FIELDS)
            .order_by("pk")
        )
        closed += [[str(a.pk), str(a.step_id), attempt_digest(a)] for a in rows]
    return closed


# --- anchors outside the database ----------------------------------------------------------

EXPORT_MARK = "checkpoint signed "


def export(checkpoint: Checkpoint) -> None:
    """Writes the checkpoint's head where the database's owner cannot rewrite it alone: a
    log line always (ship the logs elsewhere), and a line appended to
    EXECUTOR_CHECKPOINT_EXPORT when it names a file. `verify_ledger --against` reads either."""
    line = json.dumps(
        {
            "seq": checkpoint.seq,
            "hash": checkpoint.hash,
            "taken_at": checkpoint.taken_at.isoformat(),
        }
    )
    logger.info("%s%s", EXPORT_MARK, line)
    path = settings.EXECUTOR_CHECKPOINT_EXPORT
    if not path:
        return
    try:
        with Path(path).open("a", encoding="utf-8") as out:
            out.write(f"{EXPORT_MARK}{line}\n")
    except OSError as error:
        # The checkpoint itself is signed and stored; the next one's head, which chains to
        # it, is exported in its turn.
        logger.error("could not append checkpoint %s to %s: %s", checkpoint.seq, path, error)


def read_exported(path: str | Path) -> list[tuple[int, str]]:
    """The (seq, hash) pairs in a file of exported checkpoint heads, or in a log holding the
    lines `export` wrote; other lines are ignored. Raises ValueError naming a bad line."""
    heads = []
    with Path(path).open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            text = _logged_message(line)
            at = text.find(EXPORT_MARK)
            if at < 0:
                continue
            try:
                head = json.loads(text[at + len(EXPORT_MARK) :])
                heads.append((int(head["seq"]), str(head["hash"])))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: not an exported checkpoint head") from None
    return heads


def _logged_message(line: str) -> str:
    """The message of a line of a JSON log (LOG_FORMAT=json), or the line itself."""
    if line.lstrip().startswith("{") and EXPORT_MARK in line:
        try:
            record = json.loads(line)
        except ValueError:
            return line
        if isinstance(record, dict) and isinstance(record.get("message"), str):
            return str(record["message"])
    return line


def exported_findings(against: Sequence[tuple[int, str]]) -> list[Finding]:
    """Each head kept outside must still be in the database, unchanged."""
    if not against:
        return []
    stored = dict(
        Checkpoint.objects.filter(seq__in=[seq for seq, _ in against]).values_list("seq", "hash")
    )
    findings = []
    pruned = pruned_through()
    for seq, hash_ in against:
        subject = f"checkpoint {seq}"
        if pruned is not None and seq <= pruned[0]:
            # Deleted once it listed only archived runs; the chain kept the newest one's hash.
            if seq == pruned[0] and hash_ != pruned[1]:
                findings.append(
                    _anchor(subject, "is not the checkpoint the chain records as pruned")
                )
            continue
        if seq not in stored:
            findings.append(
                _anchor(
                    subject,
                    "is kept outside the database but is missing from it: checkpoints were deleted",
                )
            )
        elif stored[seq] != hash_:
            findings.append(
                _anchor(
                    subject,
                    f"is not the one kept outside the database (hash "
                    f"{hash_[:12]}, here {stored[seq][:12]}): it was rewritten",
                )
            )
    return findings


def archived_runs() -> dict[str, int]:
    """Every run the checkpoints record as archived, with the checkpoint that records it."""
    runs: dict[str, int] = {}
    rows = Checkpoint.objects.exclude(archived=[]).values_list("seq", "archived")
    for seq, archived in rows.iterator(chunk_size=50):
        for entry in archived:
            runs[str(entry[0])] = seq
    return runs


def pruned_through() -> tuple[int, str] | None:
    """`(seq, hash)` of the newest checkpoint pruned, as the checkpoints record it."""
    marks = Checkpoint.objects.exclude(pruned=[]).order_by("-seq").values_list("pruned", flat=True)
    newest = marks.first()
    return (int(newest[0]), str(newest[1])) if newest else None


def verify_checkpoints(*, since: int | None = None) -> ChainReport:
    """The checkpoints' own chain (from checkpoint `since` on, else from the oldest one kept),
    and every step and closed attempt they list against the ledger now, one checkpoint at a
    time (memory holds one). A listed step that is gone is a break unless a checkpoint records
    its run as archived."""
    report = ChainReport()
    archived = archived_runs()
    checkpoints = Checkpoint.objects.order_by("seq")
    previous: Checkpoint | None = None
    first_seq = since or 1
    if since is not None:
        checkpoints = checkpoints.filter(seq__gte=since)
        previous = Checkpoint.objects.only(*_LINK_FIELDS).filter(seq=since - 1).first()
    expected_prev: str | None = previous.hash if previous else ""
    pruned = pruned_through()
    if previous is None and pruned is not None and first_seq <= pruned[0]:
        # The checkpoints up to `pruned` were deleted once they listed only archived runs;
        # the one after must link to the hash the chain recorded for the last of them.
        first_seq = pruned[0] + 1
        checkpoints = checkpoints.filter(seq__gte=first_seq)
        expected_prev = pruned[1]
    # Their numbers first, then each one alone: an iterator's generator would hold the one
    # before while the next is read, and a checkpoint's listing is what verification holds.
    for seq in list(checkpoints.values_list("seq", flat=True)):
        checkpoint = Checkpoint.objects.defer(*LISTINGS, *PACKED).filter(seq=seq).first()
        if checkpoint is None:
            pruned = pruned_through()
            if pruned is not None and seq <= pruned[0]:  # pruned meanwhile, by the sweeper
                previous, first_seq, expected_prev = None, pruned[0] + 1, pruned[1]
            # Else deleted meanwhile: the next one's number and link say so.
            continue
        report.checkpoints += 1
        subject = f"checkpoint {checkpoint.seq}"
        expected_seq = previous.seq + 1 if previous else first_seq
        if checkpoint.seq != expected_seq:
            report.findings.append(_anchor(subject, f"checkpoint {expected_seq} is missing"))
        if previous is not None:
            expected_prev = previous.hash
        if checkpoint.prev_hash != expected_prev:
            report.findings.append(_anchor(subject, "does not link to the checkpoint before it"))
        mac, findings = _listing_findings(checkpoint, archived)
        if mac != checkpoint.hash:
            report.findings.append(_anchor(subject, "its content does not match its hash"))
        report.findings += findings
        previous = Checkpoint(**{name: getattr(checkpoint, name) for name in _LINK_FIELDS})
    report.newest_checkpoint = previous
    return report


# What a checkpoint's successor and `describe` read of it.
_LINK_FIELDS = ("pk", "seq", "taken_at", "hash")
# A checkpoint's listings: what verification streams rather than holds (`_listed`,
# `_packed`), as JSON (before migration 0024) or packed.
LISTINGS = ("heads", "attempts")
PACKED = tuple(f"packed_{name}" for name in LISTINGS)


def _listing_findings(
    checkpoint: Checkpoint, archived: dict[str, int]
) -> tuple[str, list[Finding]]:
    """The checkpoint's hash, computed over its content as `event_hash(content())` would,
    and what is wrong with each step and closed attempt it lists, against the ledger now;
    its listings streamed from the database a chunk at a time, never held whole (a
    checkpoint taken while agents post a thousand steps a second lists a hundred thousand).

    A listing at an older version still holds: a chain only grows, and its event at that
    version keeps its hash."""
    lengths, sizes = _listing_lengths(checkpoint.seq)
    if not any(sizes.values()):
        return _json_listing_findings(checkpoint, archived, lengths)
    findings: list[Finding] = []
    if any(lengths.values()):
        findings.append(_anchor(f"checkpoint {checkpoint.seq}", "holds two listings"))
    packed: dict[str, tuple[int, str]] = {}
    for name, size in sizes.items():
        if not size:
            continue
        if size % RECORDS[name].size:
            findings.append(
                _anchor(f"checkpoint {checkpoint.seq}", f"its {name} are not whole records")
            )
        digest = hashlib.sha256()
        check = _head_findings if name == "heads" else _attempt_findings
        for chunk in _packed(checkpoint.seq, name, size):
            digest.update(chunk)
            findings += check(checkpoint.seq, unpack_listing(name, chunk), archived)
        packed[name] = (size, digest.hexdigest())
    return event_hash(checkpoint.content(packed=packed)), findings


def _json_listing_findings(
    checkpoint: Checkpoint, archived: dict[str, int], lengths: dict[str, int]
) -> tuple[str, list[Finding]]:
    """`_listing_findings` of a checkpoint taken before migration 0024: its JSON listings
    streamed, the HMAC fed their canonical JSON key by key, element by element."""
    findings: list[Finding] = []
    # Stand-ins, so that the keys are those of `content()`; the listings are streamed below.
    content = checkpoint.content(
        listings={name: [None] if lengths[name] else [] for name in LISTINGS}, packed={}
    )
    mac = ledger_mac()
    # `content()`'s canonical JSON, written key by key: a listing element by element.
    mac.update(b"{")
    for number, key in enumerate(sorted(content)):
        mac.update(f"{',' if number else ''}{_CANONICAL_WITH_STR.encode(key)}:".encode())
        if key not in LISTINGS:
            mac.update(_CANONICAL_WITH_STR.encode(content[key]).encode())
            continue
        mac.update(b"[")
        check = _head_findings if key == "heads" else _attempt_findings
        for start, chunk in enumerate(_listed(checkpoint.seq, key)):
            mac.update(
                f"{',' if start else ''}"
                f"{','.join(_CANONICAL_WITH_STR.encode(entry) for entry in chunk)}".encode()
            )
            findings += check(checkpoint.seq, chunk, archived)
        mac.update(b"]")
    mac.update(b"}")
    return mac.hexdigest(), findings


def _listing_lengths(seq: int) -> tuple[dict[str, int], dict[str, int]]:
    """The entries of checkpoint `seq`'s JSON listings, and the bytes of its packed ones."""
    table = connection.ops.quote_name(Checkpoint._meta.db_table)
    postgres = connection.vendor == "postgresql"
    length = "jsonb_array_length" if postgres else "json_array_length"
    size = "octet_length" if postgres else "length"
    columns = [f"{length}({name})" for name in LISTINGS] + [f"{size}({name})" for name in PACKED]
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {', '.join(columns)} FROM {table} WHERE seq = %s",  # noqa: S608
            [seq],
        )
        row = cursor.fetchone() or (0,) * len(columns)
    values = [int(value or 0) for value in row]
    lengths, sizes = values[: len(LISTINGS)], values[len(LISTINGS) :]
    return dict(zip(LISTINGS, lengths, strict=True)), dict(zip(LISTINGS, sizes, strict=True))


def _packed(seq: int, name: str, size: int) -> Iterator[bytes]:
    """Checkpoint `seq`'s packed listing `name` (`size` bytes), `DEFAULT_CHUNK_SIZE` records
    at a time: a slice read from the database each (stored uncompressed on PostgreSQL, so a
    slice reads only its own pages)."""
    table = connection.ops.quote_name(Checkpoint._meta.db_table)
    function = "substring" if connection.vendor == "postgresql" else "substr"
    step = RECORDS[name].size * DEFAULT_CHUNK_SIZE
    with connection.cursor() as cursor:
        for start in range(0, size, step):
            cursor.execute(
                f"SELECT {function}(packed_{name}, %s, %s) FROM {table} "  # noqa: S608
                f"WHERE seq = %s",
                [start + 1, step, seq],
            )
            row = cursor.fetchone()
            chunk = bytes(row[0]) if row and row[0] is not None else b""
            if not chunk:
                return
            yield chunk


def _listed(seq: int, name: str) -> Iterator[list[Any]]:
    """The entries of checkpoint `seq`'s listing `name`, in order, `DEFAULT_CHUNK_SIZE` at a
    time, through a server-side cursor on PostgreSQL."""
    table = connection.ops.quote_name(Checkpoint._meta.db_table)
    if connection.vendor == "postgresql":
        sql = (
            f"SELECT e.value::text FROM {table} c, "  # noqa: S608 - names, not input
            f"jsonb_array_elements(c.{name}) WITH ORDINALITY AS e(value, n) "
            f"WHERE c.seq = %s ORDER BY e.n"
        )
    else:
        sql = (
            f"SELECT e.value FROM {table} c, json_each(c.{name}) AS e "  # noqa: S608
            f"WHERE c.seq = %s ORDER BY e.key"
        )
    cursor = connection.chunked_cursor()
    try:
        cursor.execute(sql, [seq])
        while rows := cursor.fetchmany(DEFAULT_CHUNK_SIZE):
            yield [json.loads(value) for (value,) in rows]
    finally:
        cursor.close()


def _head_findings(seq: int, entries: list[Any], archived: dict[str, int]) -> list[Finding]:
    """What is wrong with a chunk of a checkpoint's heads, against the ledger now."""
    findings = []
    chunk = [entry for entry in entries if entry[1] not in archived]
    if chunk:
        ids = [uuid.UUID(step_id) for step_id, _, _, _ in chunk]
        rows = {
            str(pk): (str(run_id), version)
            for pk, run_id, version in Step.objects.filter(pk__in=ids).values_list(
                "pk", "run_id", "version"
            )
        }
        hashes = event_hashes([(uuid.UUID(step_id), version) for step_id, _, version, _ in chunk])
        for step_id, run_id, version, head in chunk:
            subject = f"step {step_id} (in checkpoint {seq})"
            row = rows.get(step_id)
            if row is None:
                findings.append(_anchor(subject, "was deleted, and its run was not archived"))
            elif row[0] != run_id:
                findings.append(_anchor(subject, f"was moved from run {run_id} to {row[0]}"))
            elif row[1] < version or hashes.get((step_id, version)) != head:
                findings.append(
                    _anchor(
                        subject,
                        f"was at version {version} with head {head[:12]}; its chain no longer "
                        f"holds that (now at version {row[1]}): events were cut or rewritten",
                    )
                )
    return findings


def _attempt_findings(seq: int, entries: list[Any], archived: dict[str, int]) -> list[Finding]:
    """What is wrong with a chunk of a checkpoint's closed attempts (those of the steps it
    lists). An attempt of a step that is gone is named with its step (a deleted step, or one
    of an archived run: the archive holds it)."""
    return _listed_attempt_findings(
        {attempt_id: (step_id, digest, seq) for attempt_id, step_id, digest in entries}
    )


def event_hashes(pairs: Sequence[tuple[uuid.UUID, int]]) -> dict[tuple[str, int], str]:
    """The hash of the event at each `(step, seq)`: one query joining a VALUES list to the
    (step, seq) index, rather than an OR of pairs the planner must expand."""
    if not pairs:
        return {}
    table = connection.ops.quote_name(Event._meta.db_table)
    params: list[Any] = []
    if connection.vendor == "postgresql":
        values = ", ".join(["(%s::uuid, %s::integer)"] * len(pairs))
        for step_id, seq in pairs:
            params += [step_id, seq]
    else:
        values = ", ".join(["(%s, %s)"] * len(pairs))
        for step_id, seq in pairs:
            params += [step_id.hex, seq]
    sql = (
        f"WITH wanted (step_id, seq) AS (VALUES {values}) "  # noqa: S608 - placeholders only
        f"SELECT e.step_id, e.seq, e.hash FROM wanted w "
        f"JOIN {table} e ON e.step_id = w.step_id AND e.seq = w.seq"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        digest = Event._meta.get_field("hash")
        return {
            (str(uuid.UUID(str(step_id))), int(seq)): digest.from_db_value(hash_, None, connection)
            for step_id, seq, hash_ in cursor.fetchall()
        }


def _listed_attempt_findings(listed: dict[str, tuple[str, str, int]]) -> list[Finding]:
    findings = []
    entries = list(listed.items())
    for start in range(0, len(entries), DEFAULT_CHUNK_SIZE):
        chunk = dict(entries[start : start + DEFAULT_CHUNK_SIZE])
        found = {
            str(attempt.pk): attempt
            for attempt in Attempt.objects.filter(pk__in=[int(pk) for pk in chunk]).only(
                *ATTEMPT_FIELDS
            )
        }
        wanted = {step_id for step_id, _, _ in chunk.values()}
        present = Step.objects.filter(pk__in=[uuid.UUID(step_id) for step_id in wanted])
        gone_steps = wanted - {str(pk) for pk in present.values_list("pk", flat=True)}
        for attempt_id, (step_id, digest, seq) in chunk.items():
            subject = f"attempt {attempt_id} of step {step_id} (in checkpoint {seq})"
            attempt = found.get(attempt_id)
            if attempt is None:
                if step_id not in gone_steps:  # a deleted step is named as such already
                    findings.append(_anchor(subject, "was deleted"))
            elif attempt_digest(attempt) != digest:
                findings.append(
                    _anchor(
                        subject,
                        "is not what was signed: its evidence, error, cost, worker or fence "
                        "was edited",
                    )
                )
    return findings


def checkpoints_prune(*, now: datetime | None = None) -> int:
    """Deletes the oldest checkpoints whose every listed step belongs to a run archived since
    (its archive file holds its proof, and a checkpoint records the archive): a new signed
    checkpoint first records the newest of them (`pruned`), so the chain of those kept still
    starts from a signed link. Never the newest checkpoint. Returns how many were deleted."""
    archived = archived_runs()
    newest = Checkpoint.objects.order_by("-seq").values_list("seq", flat=True).first()
    if newest is None or not archived:
        return 0
    last: tuple[int, str] | None = None
    rows = (
        Checkpoint.objects.filter(seq__lt=newest)
        .order_by("seq")
        .only("seq", "hash", "heads", "packed_heads")
    )
    for checkpoint in rows.iterator(chunk_size=1):
        if any(entry[1] not in archived for entry in checkpoint.listed("heads")):
            break
        last = (checkpoint.seq, checkpoint.hash)
    if last is None:
        return 0
    for _ in range(3):
        if checkpoint_take(now=now, pruned=list(last)) is not None:
            break
    else:
        return 0
    # Their archive records go with them: no checkpoint kept lists a step of those runs.
    return int(Checkpoint.objects.filter(seq__lte=last[0])._raw_delete(Checkpoint.objects.db))


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
