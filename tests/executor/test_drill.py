"""`manage.py drill`: real workers, sweeper and desk processes on the test database; the
drill passes on the real engine and fails, naming what broke, on a broken one."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from executor import faults
from executor.drill import broken
from executor.drill.report import as_record
from executor.models import DrillReport, Step

SEED = 20261130


@pytest.fixture(autouse=True)
def _no_broker_messages() -> None:
    """Overrides tests/conftest.py: the drill's workers consume real messages."""


def drill(**options: Any) -> tuple[DrillReport, str]:
    out = StringIO()
    # The timeout only decides when a stuck drill gives up; a loaded CI machine needs room.
    call_command("drill", seed=SEED, stdout=out, **{"timeout": 480, **options})
    return DrillReport.objects.get(), out.getvalue()


def forget_logs(report: DrillReport) -> None:
    """A failed drill keeps its processes' logs; an expected failure needs them no more."""
    kept = re.search(r"process logs kept in (\S+)", report.notes)
    assert kept is not None, report.notes
    shutil.rmtree(kept.group(1))


def failed_drill(**options: Any) -> tuple[DrillReport, str, str]:
    out = StringIO()
    with pytest.raises(CommandError) as raised:
        call_command("drill", seed=SEED, stdout=out, **options)
    return DrillReport.objects.get(), out.getvalue(), str(raised.value)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_drill_under_crashes_kills_freezes_and_desk_faults_passes_and_records_its_report() -> None:
    report, output = drill(
        steps=45,
        workers=2,
        # Per step and point. A worker crash strands its whole batch until the lease
        # expires, and the pure steps of a batch pass before_invoke together: at 0.2 each,
        # nearly every generation died on its first batch and the drill never finished.
        rates="before_invoke:0.1,after_submit:0.1,before_persist:0.1",
        desk_faults="503:0.1,429:0.1,drop:0.1,latency:25",
        kill_every=4,
        freeze_every=6,
        compensate=0.2,
    )

    assert report.passed, report.notes
    assert "verdict: PASSED" in output
    steps = Step.objects.filter(run_id=report.parameters["run_id"])
    compensations = steps.filter(compensates__isnull=False).count()
    assert sum(report.counts.values()) == steps.count() == 45 + compensations
    assert report.counts.get("compensated", 0) >= 1
    assert (report.duplicates, report.lost) == (0, 0)
    hits = {point: report.interruption_points["worker"][point]["hits"] for point in faults.POINTS}
    assert all(hits.values()), hits
    # Each logged hit is a worker that really ended there (exit status 137).
    assert report.interruption_points["worker_crashes"] == sum(hits.values()), hits
    assert report.finished_at is not None
    assert report.version.startswith("0.")
    assert report.parameters["seed"] == SEED


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_drill_on_an_engine_whose_lookup_lies_fails_and_names_the_duplicates() -> None:
    # Dropped connections after the desk committed make ticketdesk.create ambiguous; the
    # broken lookup then says "not found" and the step is sent again.
    report, output, error = failed_drill(
        steps=24,
        workers=2,
        rates="after_submit:0.1",
        desk_faults="drop:0.4",
        kill_every=0,
        freeze_every=0,
        compensate=0,
        timeout=300,
        break_engine="lookup",
    )

    assert "FAILED" in error
    assert "verdict: FAILED" in output
    assert not report.passed
    assert report.duplicates >= 1
    assert report.notes.count("§13.3 duplicate") == report.duplicates
    assert report.parameters["break"] == "lookup"
    forget_logs(report)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_drill_whose_steps_never_settle_reports_them_lost_and_fails() -> None:
    # Every attempt ends its worker before the call: no step can ever finish.
    report, _, error = failed_drill(
        steps=6,
        workers=1,
        rates="before_invoke:1",
        desk_faults="",
        kill_every=0,
        freeze_every=0,
        compensate=0,
        timeout=3,
    )

    assert "FAILED" in error
    assert not report.passed
    assert report.lost == 6
    assert "not quiet after --timeout 3s" in report.notes
    assert report.notes.count("§13.1 lost") == 6
    forget_logs(report)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_drill_reports_into_the_consoles_database_too(tmp_path: Path) -> None:
    console = f"sqlite:///{tmp_path / 'console.sqlite3'}"
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--verbosity", "0"],
        env={**os.environ, "DATABASE_URL": console},
        check=True,
    )
    report, output, _ = failed_drill(
        steps=2,
        workers=1,
        rates="before_invoke:1",
        desk_faults="",
        kill_every=0,
        freeze_every=0,
        compensate=0,
        timeout=2,
        report_to=console,
    )
    forget_logs(report)

    assert re.search(r"recorded as drill 1 in sqlite:///", output), output
    with sqlite3.connect(tmp_path / "console.sqlite3") as db:
        rows = db.execute(
            "SELECT passed, lost, parameters, notes FROM executor_drillreport"
        ).fetchall()
    assert len(rows) == 1
    passed, lost, parameters, notes = rows[0]
    assert (passed, lost) == (0, 2)
    assert json.loads(parameters)["drilled_as"] == report.pk
    assert notes == report.notes


@pytest.mark.django_db
def test_record_drill_records_a_report_given_on_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    original = DrillReport.objects.create(
        version="0.9.0",
        started_at=timezone.now(),
        finished_at=timezone.now(),
        parameters={"steps": 3},
        counts={"completed": 3},
        elapsed_seconds=4.5,
        passed=True,
    )
    data = as_record(original)
    monkeypatch.setattr("sys.stdin", StringIO(json.dumps(data)))
    out = StringIO()
    call_command("record_drill", stdout=out)
    copy = DrillReport.objects.exclude(pk=original.pk).get()
    assert out.getvalue().strip() == f"recorded as drill {copy.pk}"
    assert (copy.version, copy.passed, copy.counts) == ("0.9.0", True, {"completed": 3})
    assert copy.started_at == original.started_at
    assert copy.parameters == {"steps": 3, "drilled_as": original.pk}


@pytest.mark.parametrize(
    ("stdin", "message"),
    [("not json", "not JSON"), ("[1]", "not a JSON object"), ('{"version": "1"}', "missing")],
)
@pytest.mark.django_db
def test_record_drill_refuses_what_is_not_a_report(
    stdin: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", StringIO(stdin))
    with pytest.raises(CommandError, match=message):
        call_command("record_drill", stdout=StringIO())
    assert not DrillReport.objects.exists()


@pytest.mark.django_db
def test_drill_refuses_an_unknown_interruption_point_before_starting_anything() -> None:
    with pytest.raises(CommandError, match="before_lunch"):
        call_command("drill", rates="before_lunch:0.1", stdout=StringIO())

    assert not DrillReport.objects.exists()


def test_broken_engine_is_refused_where_faults_are_not_allowed(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.EXECUTOR_ALLOW_FAULTS = False
    monkeypatch.setenv("EXECUTOR_BREAK", "lookup")

    with pytest.raises(ImproperlyConfigured, match="EXECUTOR_ALLOW_FAULTS"):
        broken.requested_break()


@pytest.mark.django_db(transaction=True)
def test_drill_refuses_a_database_with_live_runs_of_other_workspaces(run: Any) -> None:
    with pytest.raises(CommandError, match="open run"):
        call_command("drill", "--steps", "4", "--workers", "1")
    assert not DrillReport.objects.exists()
