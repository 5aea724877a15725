"""The claim's plan does not depend on fresh statistics (issue 25.1): on tables grown in a
burst and never analyzed (autovacuum is off on this machine's PostgreSQL), with a run's worth
of dead entries in the due index and a thousand open runs with nothing due, it probes the
index run by run, each probe bounded by LIMIT, and reads runs by their key only."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from executor.engine import claiming
from executor.ledger.records import Agent, Run
from executor.ledger.states import State
from executor.services.runs import run_create
from executor.services.tools import tools_sync
from tests.support import grown

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]

DUE_RUNS = 5


@pytest.fixture
def burst(agent: Agent, run: Run) -> list[Run]:
    """A run whose 50,000 steps were claimed and done since the last vacuum, 1,000 open
    runs with nothing due, and DUE_RUNS runs with 20 due steps each."""
    tools_sync()
    grown.grow_steps(run, 50_000, state=State.PENDING)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE executor_step SET state = 'completed' WHERE run_id = %s", [run.pk])
    grown.grow_runs(agent, 1_000)
    due = [run_create(agent=agent, name=f"due {n}")[0] for n in range(DUE_RUNS)]
    for each in due:
        grown.grow_steps(each, 20, state=State.PENDING)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_user_tables WHERE relname = 'executor_step'"
            " AND last_analyze IS NULL AND last_autoanalyze IS NULL"
        )
        assert cursor.fetchone()[0] == 1, "the test wants a table never analyzed"
    return due


def test_the_claim_probes_the_due_index_and_reads_runs_by_key(burst: list[Run]) -> None:
    sql, params = claiming.fair_statement(light=True, limit=10, now=timezone.now())

    tree = grown.plan(sql, params, run=True)

    shown = grown.describe(tree)
    assert tree["Node Type"] == "Limit", shown
    steps = [n for n in grown.nodes(tree) if n.get("Relation Name") == "executor_step"]
    runs = [n for n in grown.nodes(tree) if n.get("Relation Name") == "executor_run"]
    # Every read of steps is an index scan (no scan of the table, no bitmap over the dead
    # entries), each probe of the due index under a LIMIT.
    assert {n["Node Type"] for n in steps} <= {"Index Scan", "Index Only Scan"}, shown
    assert {n["Index Name"] for n in steps} <= {"step_due_in_run", "executor_step_pkey"}, shown
    # Runs by their key, once for each run found with due work: not a loop over open runs.
    assert runs, shown
    assert {(n["Node Type"], n["Index Name"]) for n in runs} == {
        ("Index Scan", "executor_run_pkey")
    }, shown
    assert sum(n["Actual Loops"] for n in runs) <= DUE_RUNS, shown
    assert grown.rows_read(tree)["executor_step"] <= 1_000, shown


def test_the_claim_takes_from_every_run_with_due_work_first(burst: list[Run]) -> None:
    with transaction.atomic():
        taken = claiming._due_steps(light=DUE_RUNS * 2, writes=0, now=timezone.now())

    by_run: dict[Any, list[int]] = {}
    for step in taken:
        by_run.setdefault(step.run_id, []).append(step.position)
    assert by_run == {each.pk: [1, 2] for each in burst}


BACKLOG_RUNS = 40


@pytest.fixture
def backlog(agent: Agent) -> list[Run]:
    """BACKLOG_RUNS runs with 500 due steps each, the statistics fresh (analyzed): the
    planner knows each run's backlog, and a claim must still read a few steps of each."""
    tools_sync()
    runs = [run_create(agent=agent, name=f"backlog {n}")[0] for n in range(BACKLOG_RUNS)]
    for each in runs:
        grown.grow_steps(each, 500, state=State.PENDING)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE executor_step")
    return runs


def test_the_claim_reads_a_few_steps_of_each_run_whatever_its_backlog(
    backlog: list[Run],
) -> None:
    """Found in bench/scale.py at 511k steps (489k due in about a hundred runs): each claim
    ranked up to 400 steps of every run found, through a bitmap of each run's whole backlog,
    1.2-1.8 s a claim of 100. The candidates are now shared among the runs found."""
    limit = 10
    sql, params = claiming.fair_statement(light=True, limit=limit, now=timezone.now())

    tree = grown.plan(sql, params, run=True)

    shown = grown.describe(tree)
    steps = [n for n in grown.nodes(tree) if n.get("Relation Name") == "executor_step"]
    assert {n["Node Type"] for n in steps} <= {"Index Scan", "Index Only Scan"}, shown
    # One probe a run on each side of the start, the limit's candidates ranked, each taken
    # by its key: not a run's backlog (500) times the runs.
    most = 2 * BACKLOG_RUNS + 2 * claiming.CANDIDATES_PER_LIMIT * limit + limit
    assert grown.rows_read(tree)["executor_step"] <= most, shown
    with transaction.atomic():
        taken = claiming._due_steps(light=limit, writes=0, now=timezone.now())
    assert len(taken) == limit
    assert len({step.run_id for step in taken}) == limit
