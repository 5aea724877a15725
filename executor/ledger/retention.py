"""Retention (API.md "Retention"): runs that finished long ago leave the database with their
proof. `archive_runs` writes them to a compressed JSON-lines file and a manifest signed with
the ledger's key, reads the file back and verifies every chain in it, records the runs as
archived in a signed checkpoint, and only then deletes their rows, a few hundred steps per
transaction. `verify_archive` checks a file offline; `verify_ledger` tells an archived run
(recorded by a checkpoint) from a deleted one (a break).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import models, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from executor.ledger import chain
from executor.ledger.chain import ChainReport, Finding
from executor.ledger.records import (
    Approval,
    Attempt,
    Checkpoint,
    Event,
    Run,
    RunEvent,
    RunStatus,
    RunStepCount,
    Signoff,
    Step,
    StepClaim,
    StepCounter,
    SweeperLease,
)
from executor.ledger.seals import content_digest
from executor.ledger.states import CONFIRMED, ENDED_WITHOUT_EFFECT
from executor.ledger.transitions import event_hash

logger = logging.getLogger(__name__)

ARCHIVE_FORMAT = 1
# Steps in one of these are over: nothing will move them again but a person's compensation
# of a completed one, which the cut-off (weeks without a change) rules out in practice.
ARCHIVABLE = frozenset(CONFIRMED | ENDED_WITHOUT_EFFECT)
# Steps deleted per transaction (with their events, approvals and attempts): each holds its
# locks for a few milliseconds.
DELETE_BATCH = 500
# Runs written to one archive file.
RUNS_PER_FILE = 1000
# The name of each line's record, and the model it holds.
MODELS: dict[str, type[models.Model]] = {
    "run": Run,
    "runevent": RunEvent,
    "stepcounter": StepCounter,
    "step": Step,
    "event": Event,
    "approval": Approval,
    "signoff": Signoff,
    "attempt": Attempt,
}
MANIFEST_SUFFIX = ".manifest.json"


class ArchiveError(Exception):
    """An archive could not be written, read or trusted."""


# --- which runs ------------------------------------------------------------------------------


def archivable_runs(*, before: datetime) -> models.QuerySet[Run]:
    """Runs whose last change is older than `before` and have nothing left to do: every step
    completed, compensated, failed, rejected or cancelled. A paused run, a step waiting for a
    person (unknown, planned for approval, dead, blocked) or in flight keeps its run."""
    unfinished = Step.objects.filter(run=OuterRef("pk")).filter(
        ~Q(state__in=ARCHIVABLE) | Q(updated_at__gte=before)
    )
    return (
        Run.objects.filter(updated_at__lt=before)
        .exclude(status=RunStatus.PAUSED)
        .exclude(Exists(unfinished))
        .order_by("created_at", "pk")
    )


# --- rows as lines ---------------------------------------------------------------------------


def _dump(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Decimal | uuid.UUID):
        return str(value)
    return value


def row_of(instance: models.Model) -> dict[str, Any]:
    """Every column of a row, as JSON: what `instance_of` rebuilds exactly (times to the
    microsecond, decimals as written), so the chains verify from the file alone."""
    return {f.attname: _dump(getattr(instance, f.attname)) for f in instance._meta.concrete_fields}


def instance_of(name: str, row: dict[str, Any]) -> models.Model:
    model = MODELS[name]
    values = {}
    for f in model._meta.concrete_fields:
        if f.attname in row:
            value = row[f.attname]
            values[f.attname] = None if value is None else f.to_python(value)
    return model(**values)


def run_digest(run: Run, heads: Sequence[tuple[Any, int, str]]) -> str:
    """What a checkpoint records of an archived run, and its archive must hold: the run's
    seal (its budget and run events) and each step's id, version and head, in order."""
    return content_digest(
        {
            "run": str(run.pk),
            "seal": run.seal,
            "heads": [[str(step_id), version, head] for step_id, version, head in heads],
        }
    )


def _run_lines(run: Run) -> Iterator[tuple[str, models.Model]]:
    yield "run", run
    for run_event in RunEvent.objects.filter(run=run).order_by("pk"):
        yield "runevent", run_event
    counter = StepCounter.objects.filter(run=run).first()
    if counter is not None:
        yield "stepcounter", counter
    last = 0
    while True:
        steps = list(Step.objects.filter(run=run, position__gt=last).order_by("position")[:200])
        if not steps:
            return
        ids = [step.pk for step in steps]
        related: dict[str, dict[uuid.UUID, list[models.Model]]] = {}
        for name, rows in (
            ("event", Event.objects.filter(step_id__in=ids).order_by("step_id", "seq")),
            ("approval", Approval.objects.filter(step_id__in=ids).order_by("pk")),
            # A require_two rule's first reviewers (docs/rules.md): who approved is the record.
            ("signoff", Signoff.objects.filter(step_id__in=ids).order_by("pk")),
            ("attempt", Attempt.objects.filter(step_id__in=ids).order_by("step_id", "number")),
        ):
            grouped: dict[uuid.UUID, list[models.Model]] = {}
            for row in rows:
                grouped.setdefault(row.step_id, []).append(row)
            related[name] = grouped
        for step in steps:
            yield "step", step
            for name in ("event", "approval", "signoff", "attempt"):
                for record in related[name].get(step.pk, []):
                    yield name, record
        last = steps[-1].position


# --- writing ---------------------------------------------------------------------------------


@dataclass
class Archived:
    """One archive file written and verified: its runs as `[run, steps, digest, file]`."""

    path: Path
    runs: list[list[Any]] = field(default_factory=list)
    steps: int = 0


def archive_write(runs: Sequence[Run], *, directory: Path, now: datetime) -> Archived:
    """Writes `runs` to a new archive file in `directory` and its signed manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"stepward-{now:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}.jsonl.gz"
    path = directory / name
    archived = Archived(path=path)
    with gzip.open(path, "wt", encoding="utf-8") as out:
        for run in runs:
            heads: list[tuple[Any, int, str]] = []
            for kind, instance in _run_lines(run):
                out.write(json.dumps({"model": kind, "row": row_of(instance)}) + "\n")
                if isinstance(instance, Step):
                    heads.append((instance.pk, instance.version, instance.head_hash))
            archived.runs.append([str(run.pk), len(heads), run_digest(run, heads), name])
            archived.steps += len(heads)
    manifest = {
        "format": ARCHIVE_FORMAT,
        "file": name,
        "sha256": _file_digest(path),
        "created_at": now.isoformat(),
        "runs": archived.runs,
    }
    manifest["signature"] = event_hash(manifest)
    manifest_path(path).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return archived


def manifest_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".jsonl.gz") + MANIFEST_SUFFIX)


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- verifying -------------------------------------------------------------------------------


def archive_files(path: Path) -> list[Path]:
    """The archive files `path` names: one file (or its manifest), or every one in a folder."""
    if path.is_dir():
        return sorted(path.glob("*.jsonl.gz"))
    if path.name.endswith(MANIFEST_SUFFIX):
        return [path.with_name(path.name.removesuffix(MANIFEST_SUFFIX) + ".jsonl.gz")]
    return [path]


def verify_archive(path: Path) -> ChainReport:
    """An archive file against its signed manifest, and every chain in it: each step's
    events, approvals and attempts, each run's events, budget seal and numbering, each run's
    digest; and, where this database's checkpoints record the run, that same digest. Reads
    the file one step at a time."""
    report = ChainReport()
    subject = f"archive {path.name}"
    try:
        manifest = json.loads(manifest_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ArchiveError(f"{subject}: its manifest cannot be read: {error}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("runs"), list):
        raise ArchiveError(f"{subject}: its manifest is not an archive manifest")
    signature = manifest.pop("signature", None)
    if event_hash(manifest) != signature:
        report.findings.append(
            _finding(
                subject,
                "its manifest's signature does not match: it was edited, or signed with "
                "another key",
            )
        )
    if not path.exists():
        raise ArchiveError(f"{subject}: no such file")
    if _file_digest(path) != manifest.get("sha256"):
        report.findings.append(
            _finding(subject, "the file is not the one the manifest signed: it was edited")
        )
    expected = {str(entry[0]): entry for entry in manifest["runs"]}
    recorded = _recorded_digests(list(expected))
    seen: set[str] = set()
    try:
        for run, run_events, counter, steps in _read_runs(path, report):
            run_id = str(run.pk)
            seen.add(run_id)
            report.findings += _run_findings(run, run_events, counter, steps, expected, recorded)
    except (OSError, EOFError, ValueError, KeyError, TypeError) as error:
        report.findings.append(_finding(subject, f"cannot be read: {error}"))
    for run_id in sorted(set(expected) - seen):
        report.findings.append(_finding(f"run {run_id}", f"is in the manifest, not in {path.name}"))
    return report


def _recorded_digests(run_ids: list[str]) -> dict[str, str]:
    """The digest each run's archive record in this database's checkpoints holds."""
    wanted = set(run_ids)
    digests = {}
    rows = Checkpoint.objects.exclude(archived=[]).values_list("archived", flat=True)
    for archived in rows.iterator(chunk_size=50):
        for entry in archived:
            if entry[0] in wanted:
                digests[str(entry[0])] = str(entry[2])
    return digests


StepRecords = tuple[Step, list[Event], list[Approval], list[Attempt]]


def _read_runs(
    path: Path, report: ChainReport
) -> Iterator[tuple[Run, list[RunEvent], StepCounter | None, Iterator[StepRecords]]]:
    """Each run of the file with its run events and counter, and its steps as they are read
    (each with its events, approvals and attempts): one step in memory at a time."""
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        pending: dict[str, Any] | None = None

        def next_line() -> dict[str, Any] | None:
            nonlocal pending
            if pending is not None:
                line, pending = pending, None
                return line
            text = lines.readline()
            return json.loads(text) if text else None

        def push_back(line: dict[str, Any]) -> None:
            nonlocal pending
            pending = line

        while True:
            line = next_line()
            if line is None:
                return
            if line["model"] != "run":
                raise ValueError(f"a {line['model']} line outside a run")
            run = instance_of("run", line["row"])
            assert isinstance(run, Run)
            run_events: list[RunEvent] = []
            counter: StepCounter | None = None
            while (line := next_line()) is not None and line["model"] in (
                "runevent",
                "stepcounter",
            ):
                instance = instance_of(line["model"], line["row"])
                if isinstance(instance, RunEvent):
                    run_events.append(instance)
                elif isinstance(instance, StepCounter):
                    counter = instance
            if line is not None:
                push_back(line)

            def steps() -> Iterator[StepRecords]:
                while (line := next_line()) is not None and line["model"] == "step":
                    step = instance_of("step", line["row"])
                    assert isinstance(step, Step)
                    events: list[Event] = []
                    approvals: list[Approval] = []
                    attempts: list[Attempt] = []
                    while (line := next_line()) is not None and line["model"] in (
                        "event",
                        "approval",
                        "signoff",
                        "attempt",
                    ):
                        row = instance_of(line["model"], line["row"])
                        if row.step_id != step.pk:  # type: ignore[attr-defined]
                            raise ValueError(f"a {line['model']} of another step after {step.pk}")
                        if isinstance(row, Event):
                            events.append(row)
                        elif isinstance(row, Approval):
                            approvals.append(row)
                        elif isinstance(row, Attempt):
                            attempts.append(row)
                        # A signoff is kept, not chained: its approval's Event names both
                        # reviewers (docs/rules.md), and that Event is verified.
                    if line is not None:
                        push_back(line)
                    report.steps += 1
                    report.events += len(events)
                    yield step, events, approvals, attempts
                if line is not None:
                    push_back(line)

            yield run, run_events, counter, steps()


def _run_findings(
    run: Run,
    run_events: list[RunEvent],
    counter: StepCounter | None,
    steps: Iterator[StepRecords],
    expected: dict[str, list[Any]],
    recorded: dict[str, str],
) -> list[Finding]:
    findings: list[Finding] = []
    run_id = str(run.pk)
    finding = chain.run_chain_finding(run, run_events)
    if finding is not None:
        findings.append(finding)
    heads: list[tuple[Any, int, str]] = []
    for step, events, approvals, attempts in steps:
        if step.run_id != run.pk:
            findings.append(Finding(step.pk, None, None, f"belongs to run {step.run_id}"))
        finding = chain.step_chain_finding(step, events)
        if finding is not None:
            findings.append(finding)
        else:
            findings += chain.record_findings(step, events, approvals, attempts)
        heads.append((step.pk, step.version, step.head_hash))
        if step.position != len(heads):
            findings.append(
                _finding(f"run {run_id}", f"step number {len(heads)} is missing from the archive")
            )
    numbered = counter.last_position if counter is not None else 0
    if numbered != len(heads):
        findings.append(
            _finding(
                f"run {run_id}", f"numbered {numbered} steps but the archive holds {len(heads)}"
            )
        )
    digest = run_digest(run, heads)
    entry = expected.get(run_id)
    if entry is None:
        findings.append(_finding(f"run {run_id}", "is in the file but not in its manifest"))
    elif entry[2] != digest or entry[1] != len(heads):
        findings.append(_finding(f"run {run_id}", "is not what the manifest signed"))
    if run_id in recorded and recorded[run_id] != digest:
        findings.append(
            _finding(
                f"run {run_id}", "is not the run this database's checkpoints record as archived"
            )
        )
    return findings


def _finding(subject: str, problem: str) -> Finding:
    return Finding(step_id=None, event_id=None, seq=None, subject=subject, problem=problem)


# --- archiving and deleting ------------------------------------------------------------------


@dataclass
class RetentionReport:
    runs: int = 0
    steps: int = 0
    files: list[str] = field(default_factory=list)
    kept_changed: list[str] = field(default_factory=list)
    checkpoints_pruned: int = 0


def archive_runs(
    *,
    older_than: timedelta,
    directory: Path,
    now: datetime | None = None,
    runs_per_file: int = RUNS_PER_FILE,
    delete_batch: int = DELETE_BATCH,
    limit: int | None = None,
) -> RetentionReport:
    """Moves every archivable run (`archivable_runs`) last changed more than `older_than`
    ago out of the database, `runs_per_file` runs per archive file: written, read back and
    verified, recorded as archived by a signed checkpoint, then deleted in batches of
    `delete_batch` steps. Then prunes the checkpoints that listed only archived runs."""
    now = now or timezone.now()
    report = RetentionReport()
    candidates = archivable_runs(before=now - older_than)
    while limit is None or report.runs < limit:
        take = runs_per_file if limit is None else min(runs_per_file, limit - report.runs)
        # A run that changed after it was archived is kept, and not archived again now.
        runs = list(candidates.exclude(pk__in=report.kept_changed)[:take])
        if not runs:
            break
        archived = archive_write(runs, directory=directory, now=now)
        check = verify_archive(archived.path)
        if not check.ok:
            raise ArchiveError(
                f"{archived.path} did not verify; nothing was deleted: "
                + "; ".join(str(finding) for finding in check.findings[:5])
            )
        by_id = {str(run.pk): run for run in runs}
        # Only runs still as written are recorded as archived (a person may have acted on
        # one meanwhile): the record is what excuses their rows' absence.
        recorded = []
        for entry in archived.runs:
            if _digest_now(by_id[entry[0]]) == entry[2]:
                recorded.append(entry)
            else:
                report.kept_changed.append(entry[0])
        for _ in range(5):
            if chain.checkpoint_take(archived=recorded) is not None:
                break
        else:
            raise ArchiveError("could not record the archive in a checkpoint; nothing deleted")
        report.files.append(str(archived.path))
        for run_id, steps, digest, _ in recorded:
            if _run_delete(by_id[run_id], digest=digest, batch=delete_batch):
                report.runs += 1
                report.steps += steps
            else:
                report.kept_changed.append(run_id)
        logger.info(
            "archived %d runs (%d steps) to %s", len(archived.runs), archived.steps, archived.path
        )
    report.checkpoints_pruned = chain.checkpoints_prune(now=now)
    return report


def _digest_now(run: Run) -> str | None:
    fresh = Run.objects.filter(pk=run.pk).first()
    if fresh is None:
        return None
    heads = (
        Step.objects.filter(run=run).order_by("position").values_list("pk", "version", "head_hash")
    )
    return run_digest(fresh, list(heads))


def _run_delete(run: Run, *, digest: str, batch: int) -> bool:
    """Deletes a run and everything in it, `batch` steps per transaction, newest first (so a
    compensation goes before the step it undoes). False, with nothing deleted, when the run
    changed since it was archived."""
    db = Step.objects.db
    first = True
    while True:
        with transaction.atomic():
            if first:
                # Locked, then compared: what is deleted is what was archived.
                Run.objects.select_for_update().filter(pk=run.pk).first()
                if _digest_now(run) != digest:
                    logger.warning("run %s changed after it was archived: kept", run.pk)
                    return False
                first = False
            ids = list(
                Step.objects.filter(run=run)
                .order_by("-position")
                .values_list("pk", flat=True)[:batch]
            )
            if not ids:
                RunEvent.objects.filter(run=run)._raw_delete(db)
                StepCounter.objects.filter(run=run)._raw_delete(db)
                # Derived counts, not the ledger (no foreign key): they leave with the run.
                RunStepCount.objects.filter(run_id=run.pk)._raw_delete(db)
                Run.objects.filter(pk=run.pk)._raw_delete(db)
                return True
            # A claim is a note between reviewers, not a record: it is not archived.
            for model in (StepClaim, Event, Signoff, Approval, Attempt):
                model.objects.filter(step_id__in=ids)._raw_delete(db)
            Step.objects.filter(pk__in=ids)._raw_delete(db)


# --- the sweeper's daily pass ----------------------------------------------------------------

RETENTION_LEASE = "retention"
RETENTION_EVERY = timedelta(days=1)


def retention_due(*, now: datetime) -> bool:
    """EXECUTOR_RETENTION_DAYS is set and no pass finished in the last day."""
    if settings.EXECUTOR_RETENTION_DAYS <= 0:
        return False
    last = (
        SweeperLease.objects.filter(name=RETENTION_LEASE)
        .values_list("last_finished_at", flat=True)
        .first()
    )
    return last is None or last <= now - RETENTION_EVERY


def retention_pass(*, owner: str, now: datetime | None = None) -> RetentionReport | None:
    """The sweeper's daily archive of runs older than EXECUTOR_RETENTION_DAYS into
    EXECUTOR_ARCHIVE_DIR, under a lease of its own (an archive may take minutes); None when
    another process holds it or none is due."""
    now = now or timezone.now()
    if not retention_due(now=now):
        return None
    SweeperLease.objects.get_or_create(name=RETENTION_LEASE)
    free = Q(expires_at__isnull=True) | Q(expires_at__lte=now)
    if not SweeperLease.objects.filter(free, name=RETENTION_LEASE).update(
        owner=owner, expires_at=now + timedelta(hours=6)
    ):
        return None
    try:
        report = archive_runs(
            older_than=timedelta(days=settings.EXECUTOR_RETENTION_DAYS),
            directory=Path(settings.EXECUTOR_ARCHIVE_DIR),
            now=now,
        )
    finally:
        # Stamped with the pass's own time: the next is due a day after this one began.
        SweeperLease.objects.filter(name=RETENTION_LEASE, owner=owner).update(
            owner="", expires_at=None, last_finished_at=now
        )
    return report
