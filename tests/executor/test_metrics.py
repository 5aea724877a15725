"""GET /metrics (API.md "For operators: metrics"): the ledger in Prometheus text format (or
OpenMetrics), guarded by METRICS_TOKEN, each series what the ledger implies, no counter ever
lower than at the scrape before, in a fixed number of queries that read no history."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from executor import engine
from executor.common import dispatch
from executor.engine import recovery
from executor.ledger.records import Agent, Run, RunStatus, Step
from executor.ledger.states import State
from executor.services.reviews import compensation_request, step_approve
from executor.services.runs import run_create
from executor.services.tools import tools_sync
from executor.surfaces.metrics import STEP_SECONDS_BUCKETS
from tests.support import grown, tooling
from tests.support.factories import step_in

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def engine_env(agent: Agent) -> Iterator[None]:
    with tooling.installed(agent), dispatch.publishing(dispatch.dropping_publisher):
        yield


def scrape(**headers: Any) -> Any:
    return Client().get("/metrics", **headers)


def series(response: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, by name and labels."""
    assert response.status_code == 200, response.content
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.content.decode())
        for sample in family.samples
    }


def test_metrics_need_the_token_when_one_is_set(settings: Any) -> None:
    settings.METRICS_TOKEN = "scrape-me"

    assert scrape().status_code == 401
    assert scrape(HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert scrape(HTTP_AUTHORIZATION="Bearer scrape-me").status_code == 200


def test_metrics_are_open_without_a_token(settings: Any) -> None:
    settings.METRICS_TOKEN = ""

    assert scrape().status_code == 200


def test_each_series_has_the_value_the_ledger_implies(agent: Agent, run: Run) -> None:
    for state, count in {
        State.COMPLETED: 3,
        State.UNKNOWN: 2,
        State.DEAD: 1,
        State.PLANNED: 1,
    }.items():
        for _ in range(count):
            step_in(run, state)
    # A write step whose worker died after submitting: recovery takes its expired lease.
    lost = tooling.post(agent, run, "test.keyed")
    claim = engine.claim_step(lost.pk, worker="w1")
    assert isinstance(claim, engine.Claim)
    tooling.submit(claim)
    tooling.expire_lease(lost)
    assert recovery.recover_expired(lost.pk) == State.PENDING
    Step.objects.filter(pk=lost.pk).update(not_before=timezone.now() - timedelta(seconds=90))
    done = tooling.post(agent, run, "test.pure")
    assert engine.process(done.pk, worker="w1") == State.COMPLETED
    paused, _ = run_create(agent=agent, name="paused")
    Run.objects.filter(pk=paused.pk).update(status=RunStatus.PAUSED, pause_reason="budget")

    got = series(scrape())

    def steps(state: str) -> float:
        return got[("stepward_steps", (("state", state),))]

    assert [steps(s) for s in ("completed", "unknown", "dead", "planned", "pending")] == [
        4,
        2,
        1,
        1,
        1,
    ]
    assert steps("running") == 0
    assert got[("stepward_inbox", (("reason", "unknown"),))] == 2
    assert got[("stepward_inbox", (("reason", "dead"),))] == 1
    assert got[("stepward_inbox", (("reason", "approval"),))] == 1
    assert got[("stepward_inbox", (("reason", "paused_run"),))] == 1
    assert got[("stepward_lease_recoveries_total", ())] == 1
    assert got[("stepward_attempts_total", (("outcome", "abandoned"), ("tool", "test.keyed")))] == 1
    assert got[("stepward_attempts_total", (("outcome", "responded"), ("tool", "test.pure")))] == 1
    assert 89 <= got[("stepward_oldest_due_seconds", ())] < 600
    assert got[("stepward_step_seconds_count", ())] == 4
    assert got[("stepward_step_seconds_bucket", (("le", "+Inf"),))] == 4
    assert got[("stepward_step_seconds_bucket", (("le", "3600"),))] == 4


def make_steps(run: Run, count: int) -> None:
    """`count` step rows in a spread of states (rows only: the metrics read nothing else)."""
    tools_sync()
    states = (State.COMPLETED, State.UNKNOWN, State.PENDING, State.DEAD)
    Step.objects.bulk_create(
        Step(
            run=run,
            position=n + 1,
            key=f"k{n}",
            tool_id="echo",
            input={"n": n},
            input_hash=f"{n:064d}",
            state=states[n % len(states)],
            failure_class="transient" if states[n % len(states)] == State.DEAD else "",
            not_before=timezone.now(),
        )
        for n in range(count)
    )


@pytest.mark.parametrize("count", [10, 10_000])
def test_a_scrape_costs_the_same_queries_however_large_the_ledger(run: Run, count: int) -> None:
    make_steps(run, count)

    with CaptureQueriesContext(connection) as queries:
        got = series(scrape())

    # The counters, failed compensations, paused runs, the oldest due step.
    assert len(queries.captured_queries) == 4
    assert sum(v for (name, _), v in got.items() if name == "stepward_steps") == count


# --- counters only grow (issue 24.4) --------------------------------------------------------


def counters_of(got: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[Any, float]:
    """The samples Prometheus reads as counters: a lower value is a reset to it."""
    return {
        key: value
        for key, value in got.items()
        if key[0].endswith(("_total", "_bucket", "_count", "_sum"))
    }


def test_no_counter_goes_down_across_a_compensation(
    agent: Agent, run: Run, reviewer: Any, settings: Any
) -> None:
    settings.EXECUTOR_ALLOW_SELF_APPROVAL = True
    done = tooling.post(agent, run, "test.undoable")
    assert engine.process(done.pk, worker="w1") == State.COMPLETED
    in_flight = tooling.post(agent, run, "test.keyed")
    claim = engine.claim_step(in_flight.pk, worker="w1")
    assert isinstance(claim, engine.Claim)
    first = series(scrape())
    assert first[("stepward_attempts_open", (("tool", "test.keyed"),))] == 1
    assert first[("stepward_step_seconds_count", ())] == 1

    done.refresh_from_db()
    undo = compensation_request(step=done, user=reviewer, version=done.version, reason="undo it")
    step_approve(step=undo, user=reviewer, version=undo.version, reason="ok")
    assert engine.process(undo.pk, worker="w1") == State.COMPLETED
    done.refresh_from_db()
    assert done.state == State.COMPENSATED
    tooling.submit(claim)
    tooling.expire_lease(in_flight)
    assert recovery.recover_expired(in_flight.pk) == State.PENDING
    second = series(scrape())

    before, after = counters_of(first), counters_of(second)
    lower = {
        key: (value, after.get(key)) for key, value in before.items() if after.get(key, -1) < value
    }
    assert lower == {}
    # The compensated step stays counted; its compensation is the second completion.
    assert second[("stepward_step_seconds_count", ())] == 2
    assert second[("stepward_steps", (("state", "compensated"),))] == 1
    # The attempt in flight left the gauge and entered the counter once, when it ended.
    assert second[("stepward_attempts_open", (("tool", "test.keyed"),))] == 0
    assert (
        second[("stepward_attempts_total", (("outcome", "abandoned"), ("tool", "test.keyed")))] == 1
    )
    assert not any(dict(labels).get("outcome") == "open" for _, labels in second)


def test_the_histogram_buckets_are_the_ones_the_triggers_sort_into() -> None:
    counters = importlib.import_module("executor.migrations.0018_counters_and_indexes")

    assert tuple(f"{bound:g}" for bound in STEP_SECONDS_BUCKETS) == counters.BUCKETS


def test_each_completion_lands_in_its_bucket(run: Run) -> None:
    tools_sync()
    now = timezone.now()
    took = [0.05, 0.3, 2, 100, 7200, 200_000]
    for n, seconds in enumerate(took):
        step = Step.objects.create(
            run=run,
            position=n + 1,
            key=f"k{n}",
            tool_id="echo",
            input={},
            input_hash="0" * 64,
            state=State.PENDING,
            not_before=now,
        )
        Step.objects.filter(pk=step.pk).update(
            state=State.COMPLETED,
            created_at=now - timedelta(seconds=seconds),
            state_since=now,
        )

    got = series(scrape())

    def bucket(le: str) -> float:
        return got[("stepward_step_seconds_bucket", (("le", le),))]

    assert [
        bucket(le) for le in ("0.1", "0.5", "1", "5", "60", "300", "21600", "86400", "+Inf")
    ] == [
        1,
        2,
        2,
        3,
        3,
        4,
        5,
        5,
        6,
    ]
    assert got[("stepward_step_seconds_sum", ())] == pytest.approx(sum(took), rel=1e-3)


# --- the exposition's formats -----------------------------------------------------------------


@pytest.fixture
def busy_ledger(agent: Agent, run: Run) -> None:
    """Every kind of series with samples: steps in states, attempts ended and in flight."""
    for state in (State.COMPLETED, State.UNKNOWN, State.DEAD, State.PLANNED):
        step_in(run, state)
    done = tooling.post(agent, run, "test.pure")
    assert engine.process(done.pk, worker="w1") == State.COMPLETED
    flying = tooling.post(agent, run, "test.keyed")
    assert isinstance(engine.claim_step(flying.pk, worker="w1"), engine.Claim)


@pytest.mark.usefixtures("busy_ledger")
def test_openmetrics_when_the_scraper_asks_for_it() -> None:
    response = scrape(HTTP_ACCEPT="application/openmetrics-text; version=1.0.0,text/plain;q=0.5")

    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/openmetrics-text")
    text = response.content.decode()
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in openmetrics_families(text)}
    assert families["stepward_attempts"].type == "counter"
    assert families["stepward_step_seconds"].type == "histogram"
    assert families["stepward_attempts_open"].type == "gauge"


@pytest.mark.usefixtures("busy_ledger")
def test_the_text_format_otherwise() -> None:
    response = scrape(HTTP_ACCEPT="text/plain")

    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    assert "# EOF" not in response.content.decode()
    assert scrape()["Content-Type"] == response["Content-Type"]


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(
    PROMTOOL is None and not os.environ.get("STEPWARD_REQUIRE_PROMTOOL"),
    reason="promtool (Debian's prometheus package) is not installed",
)
@pytest.mark.usefixtures("busy_ledger")
def test_promtool_finds_nothing_to_say() -> None:
    assert PROMTOOL is not None, "STEPWARD_REQUIRE_PROMTOOL is set and promtool is missing"
    text = scrape().content

    checked = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=60, check=False
    )

    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout + checked.stderr == b""


# --- a scrape reads no history (issue 25.1) ---------------------------------------------------


@pytest.mark.postgres
def test_a_scrape_reads_no_history_on_a_grown_ledger(agent: Agent, run: Run) -> None:
    tools_sync()
    grown.grow_steps(run, 50_000)
    waiting = run_create(agent=agent, name="waiting")[0]
    grown.grow_steps(waiting, 300, state=State.PENDING)
    grown.grow_steps(waiting, 20, state=State.UNKNOWN, start=300)

    with CaptureQueriesContext(connection) as queries:
        got = series(scrape())

    assert got[("stepward_steps", (("state", "completed"),))] == 50_000
    assert got[("stepward_steps", (("state", "pending"),))] == 300
    assert got[("stepward_inbox", (("reason", "unknown"),))] == 20
    assert got[("stepward_attempts_total", (("outcome", "responded"), ("tool", "echo")))] == 50_320
    assert len(queries.captured_queries) == 4
    for query in queries.captured_queries:
        tree = grown.plan(query["sql"], run=True)
        assert grown.full_scans(tree) == [], f"{query['sql']}\n{grown.describe(tree)}"
        # What waits (320 steps), never the 50,000 that are done.
        read = sum(grown.rows_read(tree).values())
        assert read <= 1_000, f"{query['sql']}\n{grown.describe(tree)}"
