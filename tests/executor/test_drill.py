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
import tomllib
from collections import Counter
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from executor.common import dispatch, faults
from executor.contract.tool import unregister
from executor.drill import broken
from executor.drill import tools as file_tools
from executor.drill import upstream as drill_upstream
from executor.drill.report import as_record
from executor.gateway import tools as upstream_tools
from executor.gateway.connections import gateway
from executor.ledger.records import DrillReport, HttpToolSpec, Step
from executor.services.posting import step_post
from executor.tools import http as http_tools

SEED = 20261130
ROOT = Path(__file__).resolve().parents[2]
DESK_TOOLS_FILE = ROOT / "examples" / "desk-tools.toml"
FILE_TOOLS = ("desk.open_ticket", "desk.close_ticket", "desk.open_ticket_keyed")


@pytest.fixture(autouse=True)
def _no_broker_messages() -> None:
    """Overrides tests/conftest.py: the drill's workers consume real messages."""


def drill(**options: Any) -> tuple[DrillReport, str]:
    out = StringIO()
    try:
        # The timeout only decides when a stuck drill gives up; a loaded CI machine needs room:
        # the crash drill, 86 s alone on this machine, was 40 of 51 steps settled at 407 s
        # beside the SQLite pass on a slow day, and failed at 480.
        call_command("drill", seed=SEED, stdout=out, **{"timeout": 900, **options})
    except CommandError as error:
        # What failed is in the summary the drill printed: its violations and notes.
        pytest.fail(f"{error}\n{out.getvalue()}")
    return DrillReport.objects.get(), out.getvalue()


def forget_logs(report: DrillReport) -> None:
    """A failed drill keeps its processes' logs; an expected failure needs them no more."""
    kept = re.search(r"process logs kept in (\S+)", report.notes)
    assert kept is not None, report.notes
    shutil.rmtree(kept.group(1))


@pytest.fixture
def forget_file_tools() -> Iterator[None]:
    """The drill registers the file's HTTP tools in this process too: other tests must not
    see them once this test's database is gone."""
    yield
    for name in FILE_TOOLS:
        unregister(name)
    http_tools._mine.clear()


def tickets_at_desk_by_tool(report: DrillReport) -> dict[str, list[Step]]:
    steps = Step.objects.filter(run_id=report.parameters["run_id"], compensates__isnull=True)
    by_tool: dict[str, list[Step]] = {}
    for step in steps:
        by_tool.setdefault(step.tool_id, []).append(step)
    return by_tool


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


@pytest.fixture
def forget_upstream_tools() -> Iterator[None]:
    """The drill registers the upstream's tools in this process too, and opens a session."""
    yield
    gateway().close()
    for name in upstream_tools.upstream_tool_names():
        unregister(name)
    upstream_tools._mine.clear()


def commits_in_the_drills_repository(report: DrillReport) -> Counter[str]:
    """The commits of a failed drill's repository (a failed drill keeps its folder)."""
    steps = Step.objects.filter(run_id=report.parameters["run_id"], tool_id=drill_upstream.TOOL)
    repository = Path(steps.first().input["repo_path"])  # type: ignore[union-attr]
    return drill_upstream.commits_by_message(repository)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_drill_with_an_mcp_upstream_leaves_one_commit_per_step_and_the_rest_for_a_person(
    forget_upstream_tools: None,
) -> None:
    report, _ = drill(
        steps=48,
        workers=2,
        rates="before_invoke:0.05,after_submit:0.15,before_persist:0.05",
        kill_every=0,
        freeze_every=0,
        compensate=0,
        upstream="git",
    )

    assert report.passed, report.notes
    assert report.parameters["upstream"] == "git"
    assert report.interruption_points["worker"]["after_submit"]["hits"] >= 1
    steps = Step.objects.filter(run_id=report.parameters["run_id"], tool_id=drill_upstream.TOOL)
    assert steps.count() == 12
    completed = steps.filter(state="completed").count()
    # Whatever is not completed had its answer lost with its worker: a person decides. (How
    # many of each depends on where the crashes fell: a crash takes every call its process
    # had on its way, and an upstream's commits are the slowest calls of the drill.)
    assert steps.exclude(state="completed").exclude(state="unknown").count() == 0
    for step in steps.filter(state="unknown"):
        submitted = step.attempts.exclude(request_evidence=None).last()
        assert submitted is not None
        assert submitted.request_evidence["upstream"] == "git"
        assert submitted.request_evidence["input"]["message"] == step.input["message"]
    # The drill counted the commits in its repository (removed with the drill's folder
    # when it passes): one per completed step, at most one per unknown one, never two.
    found = re.search(
        r"upstream git: 12 git_commit step\(s\) \(.*?\); (\d+) commit\(s\) in the "
        r"repository, 0 step\(s\) with more than one",
        report.notes,
    )
    assert found is not None, report.notes
    assert completed <= int(found.group(1)) <= steps.count()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_drill_on_an_engine_that_repeats_lost_writes_fails_naming_the_second_commits(
    forget_upstream_tools: None,
) -> None:
    report, _, error = failed_drill(
        steps=40,
        workers=2,
        rates="after_submit:0.2",
        kill_every=0,
        freeze_every=0,
        compensate=0,
        timeout=300,
        upstream="git",
        break_engine="repeat",
    )

    assert "FAILED" in error
    assert not report.passed
    assert re.search(
        r"duplicate: step \S+ \(git\.git_commit, .*took effect \d+ times", report.notes
    )
    assert any(count > 1 for count in commits_in_the_drills_repository(report).values())
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


# --- HTTP tools from a file (--tools-file, --tools) ---------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_drill_with_the_http_tools_of_a_file_passes_under_crashes_and_desk_faults(
    forget_file_tools: None,
) -> None:
    report, output = drill(
        steps=35,
        workers=2,
        rates="before_invoke:0.1,after_submit:0.1,before_persist:0.1",
        desk_faults="503:0.1,429:0.1,drop:0.1,latency:25",
        kill_every=5,
        freeze_every=8,
        compensate=0.2,
        tools_file=str(DESK_TOOLS_FILE),
    )

    assert report.passed, report.notes
    assert "verdict: PASSED" in output
    # The report names the tools used, the file's write tools beside the built-ins.
    file_writes = ["desk.open_ticket", "desk.open_ticket_keyed"]
    assert report.parameters["file_tools"] == file_writes
    assert report.parameters["tools"] == [
        "echo",
        "ticketdesk.create",
        "ticketdesk.create_keyed",
        *file_writes,
    ]
    assert report.parameters["tools_file"] == str(DESK_TOOLS_FILE)
    assert f"from {DESK_TOOLS_FILE}: desk.open_ticket, desk.open_ticket_keyed" in output
    # Their steps really ran against the drill's desk, each with its one ticket, and the
    # invariants looked at them: the drill's checks would have named any other count.
    by_tool = tickets_at_desk_by_tool(report)
    for name in file_writes:
        done = [s for s in by_tool[name] if s.state in ("completed", "compensated")]
        assert done, (name, [s.state for s in by_tool[name]])
        assert all(s.external_id.isdigit() for s in done)
    # The file's close tool undid some of them, through the reviewer path.
    undone = Step.objects.filter(
        run_id=report.parameters["run_id"], tool_id="desk.close_ticket", state="completed"
    )
    assert undone.exists(), report.notes
    originals = set(undone.values_list("compensates__tool_id", "compensates__state"))
    assert {tool for tool, _ in originals} <= set(file_writes)
    assert {state for _, state in originals} == {"compensated"}
    assert re.search(r"undone with desk\.close_ticket", report.notes), report.notes
    # ${DESK_TOKEN} was a throwaway value the drill checked the ledger for.
    assert "${DESK_TOKEN}" in report.notes
    assert "appears nowhere in the ledger" in report.notes
    assert report.interruption_points["worker_crashes"] >= 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_drill_with_a_file_tool_whose_lookup_lies_fails_and_names_its_duplicates(
    forget_file_tools: None,
) -> None:
    # desk.open_ticket is not idempotent: a dropped answer makes it `unknown`, the broken
    # lookup says "not found", and the step is sent again: a second ticket at the desk.
    report, output, error = failed_drill(
        steps=32,
        workers=2,
        rates="after_submit:0.1",
        desk_faults="drop:0.5",
        kill_every=0,
        freeze_every=0,
        compensate=0,
        timeout=300,
        break_engine="lookup",
        tools_file=str(DESK_TOOLS_FILE),
        tools="desk.open_ticket",
    )

    assert "FAILED" in error
    assert "verdict: FAILED" in output
    assert report.parameters["file_tools"] == ["desk.open_ticket"]
    named = re.findall(r"§13\.3 duplicate: step \S+ \(desk\.open_ticket, ", report.notes)
    assert named, report.notes
    assert report.duplicates >= len(named)
    forget_logs(report)


def refused(**options: Any) -> str:
    with pytest.raises(CommandError) as raised:
        call_command("drill", steps=4, workers=1, stdout=StringIO(), **options)
    assert not DrillReport.objects.exists()
    assert not HttpToolSpec.objects.exists()
    return str(raised.value)


@pytest.mark.django_db
def test_drill_refuses_a_tool_the_file_does_not_have_naming_it() -> None:
    message = refused(tools_file=str(DESK_TOOLS_FILE), tools="desk.open_ticket,desk.nope")

    assert "no tool named 'desk.nope'" in message
    assert "desk.open_ticket, desk.close_ticket, desk.open_ticket_keyed" in message


@pytest.mark.django_db
def test_drill_refuses_to_post_to_a_compensation_tool() -> None:
    message = refused(tools_file=str(DESK_TOOLS_FILE), tools="desk.close_ticket")

    assert "desk.close_ticket is the compensation of" in message


@pytest.mark.django_db
def test_drill_refuses_tools_without_a_file() -> None:
    assert "--tools-file" in refused(tools="desk.open_ticket")


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (None, "[[tool]\nname = ", "not TOML"),
        (None, "[[widget]]\nname = 'x'\n", "unknown table(s) widget"),
        # Checked as load_tools checks: a problem names the tool and the field.
        (
            'approval = "never"\n',
            'approval = "never"\nextra = "field"\n',
            "tool desk.open_ticket: field 'extra': unknown field",
        ),
        (
            'approval = "never"\n',
            'approval = "always"\n',
            "desk.open_ticket waits for a person to approve each call",
        ),
        (
            'required = ["title"]',
            'required = ["summary"]',
            "desk.open_ticket's input_schema refuses the drill's input",
        ),
        (
            'url = "http://127.0.0.1:8765/tickets"',
            'url = "http://${DESK_HOST}/tickets"',
            "tool desk.open_ticket: field 'url': the drill points it at its own desk",
        ),
    ],
)
@pytest.mark.django_db
def test_drill_refuses_a_file_that_does_not_load_and_writes_nothing(
    tmp_path: Path, old: str | None, new: str, expected: str
) -> None:
    tools = tmp_path / "tools.toml"
    source = DESK_TOOLS_FILE.read_text()
    if old is not None:
        assert old in source
    tools.write_text(new if old is None else source.replace(old, new, 1))

    message = refused(tools_file=str(tools))

    assert expected in message


def test_the_reference_desk_tools_file_holds_the_docs_example_word_for_word() -> None:
    text = (ROOT / "docs" / "tools.md").read_text()
    section = text[text.index("**As data: HTTP tools.**") :]
    match = re.search(r"```toml\n(.*?)```", section, flags=re.DOTALL)
    assert match is not None
    readme = tomllib.loads(match.group(1))["tool"]
    reference = tomllib.loads(DESK_TOOLS_FILE.read_text())["tool"]

    assert reference[: len(readme)] == readme
    assert [t["name"] for t in reference] == list(FILE_TOOLS)


def test_the_drill_points_a_files_urls_at_its_own_desk() -> None:
    tables = tomllib.loads(DESK_TOOLS_FILE.read_text())["tool"]

    moved = file_tools.at_desk(tables, "http://127.0.0.1:40123")

    assert moved[0]["url"] == "http://127.0.0.1:40123/tickets"
    assert moved[0]["lookup_url"] == "http://127.0.0.1:40123/tickets?client_ref={operation_id}"
    assert moved[1]["url"] == "http://127.0.0.1:40123/tickets/{ticket_id}/close"
    assert tables[0]["url"] == "http://127.0.0.1:8765/tickets"  # the file's own, untouched


@pytest.mark.django_db
def test_the_drill_finds_a_secrets_value_wherever_the_ledger_keeps_it(agent: Any, run: Any) -> None:
    with dispatch.publishing(dispatch.dropping_publisher):
        step_post(
            agent=agent, run=run, key="s", tool_name="echo", input={"note": "drill-secret-abc"}
        )

    leaks = file_tools.secret_leaks(
        run, {"DESK_TOKEN": "drill-secret-abc", "OTHER": "drill-secret-xyz"}
    )

    assert leaks
    assert all(leak.startswith("§15 the value of ${DESK_TOKEN} appears") for leak in leaks)
    assert any(leak.endswith(": step s") for leak in leaks)
    assert file_tools.secret_leaks(run, {"OTHER": "drill-secret-xyz"}) == []
