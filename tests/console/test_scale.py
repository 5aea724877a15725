"""The runs list and a run's page cost what a page shows, not what the ledger holds
(issue 25.1): a fixed number of statements, each an index range scan bounded by its LIMIT,
on tables grown fast and left un-analyzed (tests/support/grown.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from executor.ledger import selectors
from executor.ledger.records import Agent, Run
from executor.ledger.states import State
from executor.services.runs import run_create
from tests.support import grown

pytestmark = [pytest.mark.postgres, pytest.mark.usefixtures("tools")]


def plans(queries: CaptureQueriesContext) -> list[dict[str, Any]]:
    return [grown.plan(query["sql"], run=True) for query in queries.captured_queries]


def assert_bounded(query: dict[str, Any], tree: dict[str, Any], *, most: int) -> None:
    """No hot table read whole, none of its rows met beyond `most`, no run table scan."""
    shown = f"{query['sql']}\n{grown.describe(tree)}"
    assert grown.full_scans(tree) == [], shown
    assert sum(grown.rows_read(tree).values()) <= most, shown
    assert not any(
        node["Node Type"] == "Seq Scan" and node.get("Relation Name") == "executor_run"
        for node in grown.nodes(tree)
    ), shown


def test_the_runs_list_reads_a_page_of_runs_and_their_counters(agent: Agent, run: Run) -> None:
    grown.grow_runs(agent, 5_000)
    grown.grow_steps(run, 50_000)
    newest, _ = run_create(agent=agent, name="newest")
    grown.grow_steps(newest, 30, state=State.UNKNOWN)

    with CaptureQueriesContext(connection) as queries:
        page, cursor = selectors.runs_page(workspace_ids=(agent.workspace_id,), size=25)

    assert len(queries.captured_queries) == 2  # the page of runs, their counters
    assert [page[0].name, page[0].steps_total, page[0].steps_waiting] == ["newest", 30, 30]
    assert cursor is not None
    for query, tree in zip(queries.captured_queries, plans(queries), strict=True):
        assert_bounded(query, tree, most=0)  # no step read at all
        assert "executor_step" not in grown.describe(tree)

    # A page deep in the list costs the same.
    for _ in range(3):
        page, cursor = selectors.runs_page(
            workspace_ids=(agent.workspace_id,), after=cursor, size=25
        )
    with CaptureQueriesContext(connection) as deeper:
        selectors.runs_page(
            workspace_ids=(agent.workspace_id,), workspace_id=agent.workspace_id, after=cursor
        )
    assert len(deeper.captured_queries) == 2
    for query, tree in zip(deeper.captured_queries, plans(deeper), strict=True):
        assert_bounded(query, tree, most=0)


def open_run_page(client: Client, run: Run) -> tuple[CaptureQueriesContext, str]:
    with CaptureQueriesContext(connection) as queries:
        response = client.get(reverse("run", args=[run.pk]))
    assert response.status_code == 200
    return queries, response.content.decode()


def shapes(queries: CaptureQueriesContext) -> list[str]:
    """Each statement's plan without its row counts: the same shape, the same plan."""
    return [
        "\n".join(line.split(" (rows")[0] for line in grown.describe(tree).splitlines())
        for tree in plans(queries)
    ]


def test_a_run_of_fifty_thousand_steps_opens_as_one_of_fifty(
    bob: Client, agent: Agent, run: Run
) -> None:
    small, _ = run_create(agent=agent, name="small")
    grown.grow_steps(small, 40)
    grown.grow_steps(small, 10, state=State.UNKNOWN, start=40)
    grown.grow_steps(run, 49_990)
    grown.grow_steps(run, 10, state=State.UNKNOWN, start=49_990)
    assert bob.get(reverse("runs")).status_code == 200  # the session and permissions, warm

    few, _ = open_run_page(bob, small)
    many, many_page = open_run_page(bob, run)

    assert len(many.captured_queries) == len(few.captured_queries)
    assert shapes(many) == shapes(few)
    for query, tree in zip(many.captured_queries, plans(many), strict=True):
        assert_bounded(query, tree, most=1_000)
    assert "49990 completed, 10 uncertain" in many_page
    assert 'data-testid="run-steps-next"' in many_page
    assert "and 49940 more" in many_page


def test_a_runs_first_completed_steps_behind_many_others_are_read_a_window_at_a_time(
    bob: Client, agent: Agent, run: Run
) -> None:
    # Completed steps are not in the (run, state, position) index (they are most of a
    # ledger); the report finds a run's first ones through (run, position), COMPLETED_WINDOW
    # positions a statement, so a run whose completed steps come late costs more statements,
    # never a statement reading the run.
    other, _ = run_create(agent=agent, name="the rest of the ledger")
    grown.grow_steps(other, 50_000)
    grown.grow_steps(run, 1_200, state=State.UNKNOWN)
    grown.grow_steps(run, 80, start=1_200)

    queries, page = open_run_page(bob, run)

    # The report's statements (the inbox's counts in the page's navigation read the 1,200
    # steps that wait for a person: they are what it counts).
    report_queries = [
        query
        for query in queries.captured_queries
        if '"executor_step"."position" ASC LIMIT' in query["sql"]
    ]
    for query in report_queries:
        assert_bounded(query, grown.plan(query["sql"], run=True), most=1_000)
    windows = [q for q in report_queries if "'completed'" in q["sql"]]
    assert len(windows) == 3  # positions 1-500 (with the other sections), 501-1000, 1001-1500
    report = page.split('data-testid="run-steps"', 1)[0]
    assert ">grown-1201<" in report
    assert ">grown-1250<" in report
    assert ">grown-1251<" not in report  # the first 50 only


def test_the_steps_of_a_run_page_on_by_position(bob: Client, agent: Agent, run: Run) -> None:
    grown.grow_steps(run, 250)

    first = bob.get(reverse("run", args=[run.pk])).content.decode()
    second = bob.get(reverse("run", args=[run.pk]) + "?after=100").content.decode()
    last = bob.get(reverse("run", args=[run.pk]) + "?after=200").content.decode()

    def keys(page: str) -> list[int]:
        table = page.split('data-testid="run-steps"', 1)[1]
        return [int(n) for n in re.findall(r">grown-(\d+)<", table)]

    assert keys(first) == list(range(1, 101))
    assert keys(second) == list(range(101, 201))
    assert keys(last) == list(range(201, 251))
    assert 'data-testid="run-steps-first"' in second
    assert 'data-testid="run-steps-next"' not in last
    assert bob.get(reverse("run", args=[run.pk]) + "?after=x").status_code == 200


def test_the_inbox_reads_what_waits_not_what_is_done(agent: Agent, run: Run) -> None:
    grown.grow_steps(run, 50_000)
    grown.grow_steps(run, 60, state=State.UNKNOWN, start=50_000)
    grown.grow_steps(run, 20, state=State.DEAD, start=50_060)
    inbox = selectors.InboxFilter(workspace_ids=(agent.workspace_id,))

    with CaptureQueriesContext(connection) as queries:
        counts = selectors.inbox_counts(inbox=inbox)
        page = selectors.inbox_page(inbox=inbox, size=25)
        selectors.inbox_page(inbox=inbox, size=25, after=page.next)

    assert counts["all"]["unknown"] == 60
    assert counts["all"]["dead"] == 20
    assert len(page.rows) == 25
    assert len(queries.captured_queries) == 3
    for query, tree in zip(queries.captured_queries, plans(queries), strict=True):
        assert_bounded(query, tree, most=1_000)
