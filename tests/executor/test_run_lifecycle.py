"""executor/ledger/runs.py: every run status change is one conditional UPDATE, recorded by one
RunEvent only when a row changed; nothing else writes a run's status or its events."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from executor.ledger import runs
from executor.ledger.records import Run, RunAction, RunEvent, RunStatus
from executor.services.runs import run_cancel, run_extend_budget

ROOT = Path(__file__).resolve().parents[2]


def actions(run: Run) -> list[str]:
    return list(RunEvent.objects.filter(run=run).values_list("action", flat=True))


def test_pause_resume_and_cancel_each_move_once_and_record_once(run: Run) -> None:
    assert runs.pause(run, reason="max_calls reached")
    assert not runs.pause(run, reason="again")  # no longer open: nothing moves
    stored = Run.objects.get(pk=run.pk)
    assert (stored.status, stored.pause_reason) == (RunStatus.PAUSED, "max_calls reached")
    assert (run.status, run.version) == (stored.status, stored.version)

    assert runs.resume(run, actor="user:bob", reason="budget raised")
    assert not runs.resume(run, actor="user:bob", reason="twice")
    assert Run.objects.get(pk=run.pk).status == RunStatus.OPEN

    assert runs.cancel(run, actor="agent:a", reason="done with it")
    assert not runs.cancel(run, actor="agent:a", reason="twice")
    assert not runs.pause(run, reason="a budget check after the cancel")
    assert not runs.resume(run, actor="user:bob", reason="a cancelled run stays cancelled")
    assert Run.objects.get(pk=run.pk).status == RunStatus.CANCELLED

    assert actions(run) == [RunAction.PAUSED, RunAction.RESUMED, RunAction.CANCELLED]


def test_a_paused_run_can_be_cancelled(run: Run) -> None:
    runs.pause(run, reason="deadline passed")
    assert runs.cancel(run, actor="agent:a", reason="give up")
    stored = Run.objects.get(pk=run.pk)
    assert (stored.status, stored.pause_reason) == (RunStatus.CANCELLED, "")


def test_extending_the_budget_of_an_open_run_records_no_resume(run: Run, reviewer: Any) -> None:
    """The old code wrote a "resumed" event even when the run was open (no row changed)."""
    run_extend_budget(run=run, user=reviewer, version=run.version, reason="more room", add_calls=5)
    assert actions(run) == [RunAction.BUDGET_EXTENDED]


def test_cancelling_a_run_twice_records_one_event(run: Run, agent: Any) -> None:
    run_cancel(run=run, actor=agent, reason="stop")
    run_cancel(run=run, actor=agent, reason="stop again")
    assert actions(run) == [RunAction.CANCELLED]


@pytest.mark.parametrize(
    "pattern",
    [
        r"RunEvent\.objects\.(create|bulk_create|update)",
        r"status=RunStatus\.",
        r"(run|locked)\.status = ",
    ],
)
def test_only_the_lifecycle_module_writes_run_statuses_and_events(pattern: str) -> None:
    writers = []
    for path in [*ROOT.glob("executor/**/*.py"), *ROOT.glob("console/**/*.py")]:
        if "migrations" in path.parts or path.name == "runs.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            reads = ("filter(", "exclude(", "Q(")
            if re.search(pattern, line) and not any(read in line for read in reads):
                writers.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert writers == []
