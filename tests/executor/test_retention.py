"""Retention (API.md "Retention"): runs archived with their proof and deleted, the chain
telling an archived run from a deleted one, checkpoints pruned once they list only archived
runs, and verification that holds one chunk in memory whatever the ledger's size."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.models.signals import post_init
from django.utils import timezone

from executor import engine
from executor.ledger import chain, retention, runs
from executor.ledger.records import (
    RECORDS,
    Agent,
    Approval,
    Attempt,
    Checkpoint,
    Event,
    Run,
    RunEvent,
    RunStepCount,
    Signoff,
    Step,
    StepClaim,
    StepCounter,
    Workspace,
)
from executor.ledger.states import State
from executor.services.posting import StepRequest, step_post, steps_post
from executor.services.reviews import step_approve
from executor.services.runs import run_create, run_extend_budget
from executor.worker import sweeper
from tests.support import tooling

pytestmark = pytest.mark.django_db


@pytest.fixture
def tools(agent: Agent) -> Iterator[None]:
    with tooling.installed(agent):
        yield


def new_run(agent: Agent, workspace: Workspace, name: str) -> Run:
    return run_create(agent=agent, name=name)[0]


def completed(agent: Agent, run: Run, count: int, prefix: str = "s") -> list[Step]:
    steps, _ = steps_post(
        agent=agent,
        run=run,
        requests=[StepRequest(f"{prefix}{n}", "echo", {"n": n}) for n in range(count)],
    )
    for step in steps:
        assert engine.process(step.pk, worker="w1") == State.COMPLETED
    return steps


def archive(tmp_path: Path) -> list[str]:
    out = StringIO()
    call_command("archive_runs", "--older-than", "0d", "--to", str(tmp_path), stdout=out)
    return out.getvalue().splitlines()


def verify(*args: str) -> list[str]:
    out = StringIO()
    call_command("verify_ledger", *args, stdout=out)
    return out.getvalue().splitlines()


def broken(*args: str) -> list[str]:
    out = StringIO()
    with pytest.raises(CommandError, match="broken"):
        call_command("verify_ledger", *args, stdout=out)
    return out.getvalue().splitlines()


def rows_of(run_id: Any) -> dict[str, int]:
    return {
        "runs": Run.objects.filter(pk=run_id).count(),
        "steps": Step.objects.filter(run_id=run_id).count(),
        "events": Event.objects.filter(run_id=run_id).count(),
        "attempts": Attempt.objects.filter(step__run_id=run_id).count(),
        "approvals": Approval.objects.filter(step__run_id=run_id).count(),
        "run events": RunEvent.objects.filter(run_id=run_id).count(),
        "counters": StepCounter.objects.filter(run_id=run_id).count(),
    }


NOTHING = dict.fromkeys(
    ("runs", "steps", "events", "attempts", "approvals", "run events", "counters"), 0
)


def sql(statement: str, params: list[Any]) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


@pytest.fixture
def ledger_with_runs(
    agent: Agent, workspace: Workspace, reviewer: Any, tools: None
) -> dict[str, Any]:
    """A finished run (three steps, one approved by a person, its budget extended), a run
    with a step waiting for a person, a paused run; a checkpoint listing them all."""
    done = new_run(agent, workspace, "done")
    completed(agent, done, 2)
    approved, _ = step_post(
        agent=agent, run=done, key="approved", tool_name="test.destructive", input={"n": 1}
    )
    step_approve(step=approved, user=reviewer, version=approved.version, reason="ok")
    assert engine.process(approved.pk, worker="w1") == State.COMPLETED
    fresh = Run.objects.get(pk=done.pk)
    run_extend_budget(run=fresh, user=reviewer, version=fresh.version, reason="more", add_calls=10)
    waiting = new_run(agent, workspace, "waiting")
    completed(agent, waiting, 1)
    planned, _ = step_post(
        agent=agent, run=waiting, key="destroy", tool_name="test.destructive", input={"n": 2}
    )
    assert planned.state == State.PLANNED
    paused = new_run(agent, workspace, "paused")
    completed(agent, paused, 1)
    assert runs.pause(paused, reason="hold on", actor="policy")
    assert chain.checkpoint_take() is not None
    return {"done": done, "waiting": waiting, "paused": paused}


def test_an_archive_round_trip(ledger_with_runs: dict[str, Any], tmp_path: Path) -> None:
    done, waiting = ledger_with_runs["done"], ledger_with_runs["waiting"]
    before = rows_of(done.pk)
    assert (before["steps"], before["approvals"], before["run events"]) == (3, 1, 1)

    lines = archive(tmp_path)

    assert lines[-1].startswith("archived 1 run(s) (3 step(s))")
    # The finished run left the database whole; the one waiting for a person stayed.
    assert rows_of(done.pk) == NOTHING
    assert rows_of(waiting.pk)["steps"] == 2
    assert Run.objects.filter(pk=ledger_with_runs["paused"].pk).exists()
    [record] = [entry for c in Checkpoint.objects.all() for entry in c.archived]
    assert record[:2] == [str(done.pk), 3]
    # The database verifies: its checkpoints say the run's steps were archived.
    assert verify()[0].endswith("0 broken")
    # The archive verifies offline: every chain in it, its signature, the recorded digest.
    [file] = sorted(tmp_path.glob("*.jsonl.gz"))
    assert verify("--archive", str(tmp_path)) == [
        f"{file.name}: 3 steps, 12 events verified, 0 broken"
    ]
    assert verify("--archive", str(retention.manifest_path(file)))[-1].endswith("0 broken")


def test_an_edited_archive_fails(ledger_with_runs: dict[str, Any], tmp_path: Path) -> None:
    archive(tmp_path)
    [file] = sorted(tmp_path.glob("*.jsonl.gz"))
    with gzip.open(file, "rt", encoding="utf-8") as text:
        lines = [json.loads(line) for line in text]
    for line in lines:
        if line["model"] == "step" and line["row"]["key"] == "s0":
            line["row"]["result"] = {"forged": True}
    with gzip.open(file, "wt", encoding="utf-8") as out:
        out.writelines(json.dumps(line) + "\n" for line in lines)

    findings = broken("--archive", str(file))

    assert any("the file is not the one the manifest signed" in f for f in findings)
    assert any("external id or result was changed" in f for f in findings)
    # Whoever edits the manifest to match has no key to sign it.
    manifest = json.loads(retention.manifest_path(file).read_text())
    manifest["sha256"] = retention._file_digest(file)
    retention.manifest_path(file).write_text(json.dumps(manifest))
    findings = broken("--archive", str(file))
    assert any("its manifest's signature does not match" in f for f in findings)


def test_a_deleted_run_is_still_a_break(
    agent: Agent, workspace: Workspace, ledger_with_runs: dict[str, Any], tmp_path: Path
) -> None:
    archive(tmp_path)
    gone = new_run(agent, workspace, "gone")
    [step] = completed(agent, gone, 1)
    assert chain.checkpoint_take() is not None
    # Deleted by hand, every row of it, in the order the foreign keys allow.
    for table, column in (
        ("executor_event", "run_id"),
        ("executor_attempt", "step_id"),
        ("executor_step", "run_id"),
        ("executor_runevent", "run_id"),
        ("executor_stepcounter", "run_id"),
        ("executor_run", "id"),
    ):
        key = step.pk if column == "step_id" else gone.pk
        sql(f"DELETE FROM {table} WHERE {column} = %s", [key.hex])

    findings = broken()

    assert (
        f"step {step.pk} (in checkpoint 3): was deleted, and its run was not archived" in findings
    )


def test_a_run_changed_while_archived_is_kept(
    agent: Agent, workspace: Workspace, tmp_path: Path
) -> None:
    run = new_run(agent, workspace, "busy")
    completed(agent, run, 2)
    written = retention.archive_write([run], directory=tmp_path, now=timezone.now())
    completed(agent, run, 1, prefix="late")

    deleted = retention._run_delete(run, digest=written.runs[0][2], batch=1)

    assert not deleted
    assert rows_of(run.pk)["steps"] == 3


def test_a_run_that_changes_while_it_is_written_is_neither_recorded_nor_deleted(
    agent: Agent, workspace: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = new_run(agent, workspace, "busy")
    completed(agent, run, 2)
    write = retention.archive_write

    def write_then_change(runs: Any, **kwargs: Any) -> retention.Archived:
        written = write(runs, **kwargs)
        completed(agent, run, 1, prefix="late")  # an agent posts to it meanwhile
        return written

    monkeypatch.setattr(retention, "archive_write", write_then_change)

    report = retention.archive_runs(older_than=timedelta(0), directory=tmp_path)

    assert (report.runs, report.kept_changed) == (0, [str(run.pk)])
    assert not any(c.archived for c in Checkpoint.objects.all())
    assert rows_of(run.pk)["steps"] == 3
    assert verify()[0].endswith("0 broken")


def test_rows_are_deleted_in_batches_newest_first(
    agent: Agent, workspace: Workspace, tmp_path: Path
) -> None:
    run = new_run(agent, workspace, "big")
    completed(agent, run, 7)

    report = retention.archive_runs(
        older_than=timedelta(0), directory=tmp_path, delete_batch=2, now=timezone.now()
    )

    assert (report.runs, report.steps) == (1, 7)
    assert rows_of(run.pk) == NOTHING
    assert verify()[0].endswith("0 broken")


def test_checkpoints_listing_only_archived_runs_are_pruned_and_verify_stays_clean(
    agent: Agent, workspace: Workspace, tmp_path: Path, settings: Any
) -> None:
    settings.EXECUTOR_CHECKPOINT_EXPORT = str(tmp_path / "heads.log")
    old = new_run(agent, workspace, "old")
    completed(agent, old, 2)
    assert chain.checkpoint_take() is not None  # 1: lists old's steps
    assert chain.checkpoint_take() is not None  # 2: nothing new
    kept = new_run(agent, workspace, "kept")
    completed(agent, kept, 1)
    assert chain.checkpoint_take() is not None  # 3: lists kept's step

    report = retention.archive_runs(
        older_than=timedelta(0),
        directory=tmp_path / "archive",
        now=timezone.now(),
        limit=1,
    )

    # Checkpoint 4 records old as archived, 5 records the pruning of 1 and 2 (only old's
    # steps); 3 lists a step of a run still here and stays, and so does all after it.
    assert (report.runs, report.checkpoints_pruned) == (1, 2)
    assert list(Checkpoint.objects.values_list("seq", flat=True)) == [3, 4, 5]
    assert Checkpoint.objects.get(seq=5).pruned[0] == 2
    assert verify()[0].endswith("0 broken")
    assert verify("--against", str(tmp_path / "heads.log"))[0].endswith("0 broken")
    # Deleting the oldest checkpoint kept is still caught.
    Checkpoint.objects.filter(seq=3).delete()
    assert "checkpoint 4: checkpoint 3 is missing" in broken()


def test_the_sweeper_archives_daily_when_retention_is_set(
    agent: Agent, workspace: Workspace, tmp_path: Path, settings: Any
) -> None:
    settings.EXECUTOR_ARCHIVE_DIR = str(tmp_path)
    run = new_run(agent, workspace, "old")
    completed(agent, run, 1)
    later = timezone.now() + timedelta(days=3)

    settings.EXECUTOR_RETENTION_DAYS = 0
    assert retention.retention_pass(owner="s1", now=later) is None
    assert Run.objects.filter(pk=run.pk).exists()

    settings.EXECUTOR_RETENTION_DAYS = 2
    report = retention.retention_pass(owner="s1", now=later)
    assert report is not None
    assert report.runs == 1
    assert not Run.objects.filter(pk=run.pk).exists()
    # Once a day.
    assert retention.retention_pass(owner="s1", now=later) is None
    # The sweeper calls it, and goes on when it fails.
    sweeper.retain(owner="s1")


def test_archive_runs_refuses_bad_input_and_dry_run_moves_nothing(
    agent: Agent, workspace: Workspace, tmp_path: Path
) -> None:
    run = new_run(agent, workspace, "old")
    completed(agent, run, 2)
    with pytest.raises(CommandError, match="--older-than: 'soon' is not an age"):
        call_command("archive_runs", "--older-than", "soon", stdout=StringIO())
    with pytest.raises(CommandError, match="--batch-size must be at least 1"):
        call_command("archive_runs", "--older-than", "1d", "--batch-size", "0", stdout=StringIO())
    with pytest.raises(CommandError, match=r"--archive: .* does not exist"):
        call_command("verify_ledger", "--archive", str(tmp_path / "nope"), stdout=StringIO())

    out = StringIO()
    call_command(
        "archive_runs", "--older-than", "0d", "--dry-run", "--to", str(tmp_path), stdout=out
    )

    assert out.getvalue().startswith("would archive 1 run(s) (2 step(s))")
    assert Run.objects.filter(pk=run.pk).exists()
    assert not list(tmp_path.iterdir())


# --- verification in bounded memory ----------------------------------------------------------


def grow(agent: Agent, workspace: Workspace, steps: int) -> None:
    """`steps` completed echo steps in runs of 100, a checkpoint after every 300 (as the
    sweeper takes one a minute)."""
    for start in range(0, steps, 100):
        run = new_run(agent, workspace, f"r{start}")
        steps_post(
            agent=agent,
            run=run,
            requests=[StepRequest(f"s{n}", "echo", {"n": n}) for n in range(100)],
        )
        while engine.drain(worker="w1"):
            pass
        if (start + 100) % 300 == 0:
            assert chain.checkpoint_take() is not None


def verify_peak() -> tuple[int, int]:
    tracemalloc.start()
    try:
        report = chain.verify_ledger(chunk_size=100)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.ok, report.findings[:3]
    return report.steps, peak


def test_verification_memory_does_not_grow_with_the_ledger(
    agent: Agent, workspace: Workspace
) -> None:
    grow(agent, workspace, 300)
    small_steps, small_peak = verify_peak()
    grow(agent, workspace, 2700)
    large_steps, large_peak = verify_peak()

    assert (small_steps, large_steps) == (300, 3000)
    # Ten times the steps, the checkpoints and the runs: the peak is that of one chunk, one
    # checkpoint, and a few bytes a run (their numbering), not ten times the first.
    assert large_peak < 2 * small_peak, (small_peak, large_peak)


def as_taken_before_0024() -> None:
    """Every checkpoint rewritten as one taken before migration 0024 (JSON listings), the
    chain signed again in order."""
    previous = ""
    for checkpoint in Checkpoint.objects.order_by("seq"):
        checkpoint.heads = checkpoint.listed("heads")
        checkpoint.attempts = checkpoint.listed("attempts")
        checkpoint.packed_heads = checkpoint.packed_attempts = b""
        checkpoint.prev_hash = previous
        checkpoint.hash = previous = chain.event_hash(checkpoint.content())
        checkpoint.save()


@pytest.mark.parametrize("listings", ["packed", "json"])
def test_verification_never_holds_a_checkpoints_listing_whole(
    agent: Agent, workspace: Workspace, listings: str
) -> None:
    """A checkpoint lists every step changed since the one before: at a thousand steps a
    second, tens of thousands, the biggest thing verification reads. Its listings are
    streamed a chunk at a time (its hash computed as they pass): no checkpoint is ever read
    with them, and each chunk is let go before the next is read. Packed listings (since
    0024) and JSON ones (before) alike."""
    for name in ("a", "b", "c"):
        completed(agent, new_run(agent, workspace, name), 5)
        taken = chain.checkpoint_take()
        assert taken is not None
        assert len(taken.listed("heads")) == 5
    if listings == "json":
        as_taken_before_0024()
    first = Checkpoint.objects.order_by("seq").values_list("seq", flat=True).first()
    read_whole: list[int] = []
    chunks: list[int] = []

    def read(sender: Any, instance: Checkpoint, **kwargs: Any) -> None:
        # Read from the database with a listing (not deferred, not empty).
        if instance.pk is not None and any(
            instance.__dict__.get(name)
            for name in ("heads", "attempts", "packed_heads", "packed_attempts")
        ):
            read_whole.append(instance.seq)

    listed, packed = chain._listed, chain._packed

    def counted(seq: int, name: str) -> Iterator[list[Any]]:
        for chunk in listed(seq, name):
            chunks.append(len(chunk))
            yield chunk

    def counted_packed(seq: int, name: str, size: int) -> Iterator[bytes]:
        for chunk in packed(seq, name, size):
            chunks.append(len(chunk) // RECORDS[name].size)
            yield chunk

    post_init.connect(read, sender=Checkpoint)
    try:
        with (
            mock.patch.object(chain, "DEFAULT_CHUNK_SIZE", 2),
            mock.patch.object(chain, "_listed", counted),
            mock.patch.object(chain, "_packed", counted_packed),
        ):
            whole = chain.verify_ledger()
            since = chain.verify_ledger(since=first)
    finally:
        post_init.disconnect(read, sender=Checkpoint)

    assert whole.ok, whole.findings[:3]
    assert since.ok, since.findings[:3]
    assert whole.checkpoints == since.checkpoints == 3
    assert read_whole == []
    # 5 heads and 5 attempts a checkpoint, two at a time, by both verifications.
    assert chunks == [2, 2, 1] * 2 * 3 * 2


@pytest.mark.postgres
def test_the_checkpoints_read_of_what_changed_uses_the_events_time_index(
    agent: Agent, workspace: Workspace
) -> None:
    completed(agent, new_run(agent, workspace, "r"), 3)
    since = timezone.now() - timedelta(minutes=5)
    query = chain.changed_steps(since)
    sql_text, params = (
        Event.objects.filter(created_at__gte=since)
        .order_by("step_id")
        .values_list("step_id", flat=True)
        .distinct()
        .query.sql_with_params()
    )
    assert [str(step_id) for step_id in query]  # what the sweeper reads, read
    with connection.cursor() as cursor:
        # A tiny table is read whole, or through another index scanned whole (the run's):
        # forbidding both, inside the test's transaction, shows the time index alone serves
        # the read.
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("DROP INDEX event_run")
        cursor.execute(f"EXPLAIN {sql_text}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())

    assert "event_created_brin" in plan, plan


def test_a_runs_signoffs_are_archived_and_its_claims_and_counts_leave_with_it(
    ledger_with_runs: dict[str, Any], reviewer: Any, tmp_path: Path
) -> None:
    """Rows other features keep beside a step: a require_two rule's first reviewer (part of
    the record: archived), a reviewer's claim and the run's step counts (not records: gone)."""
    done = ledger_with_runs["done"]
    approved = Step.objects.get(run=done, key="approved")
    approval = approved.approvals.get()
    Signoff.objects.create(
        step=approved,
        approver=reviewer,
        input_hash=approved.input_hash,
        policy_version=approval.policy_version,
        reason="first of two",
        signed_at=approval.approved_at,
        approval=approval,
    )
    now = timezone.now()
    StepClaim.objects.create(
        step=approved, user=reviewer, claimed_at=now, expires_at=now + timedelta(minutes=15)
    )
    assert RunStepCount.objects.filter(run_id=done.pk).exists()  # kept by the triggers

    archive(tmp_path)

    assert not Signoff.objects.filter(step_id=approved.pk).exists()
    assert not StepClaim.objects.filter(step_id=approved.pk).exists()
    assert not RunStepCount.objects.filter(run_id=done.pk).exists()
    [file] = sorted(tmp_path.glob("*.jsonl.gz"))
    with gzip.open(file, "rt") as lines:
        kinds = [json.loads(line)["model"] for line in lines]
    assert kinds.count("signoff") == 1
    assert verify("--archive", str(tmp_path))[-1].endswith("0 broken")
