"""GET /metrics (API.md "For operators: metrics"): the ledger in Prometheus text format,
guarded by METRICS_TOKEN, each series what the ledger implies, in a fixed number of queries."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from executor import dispatch, engine, recovery, services
from executor.models import Agent, Run, RunStatus, Step
from executor.states import State
from tests.support import tooling
from tests.support.factories import step_in

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def engine_env(agent: Agent) -> Iterator[None]:
    with tooling.installed(agent), dispatch.publishing(dispatch.dropping_publisher):
        yield


def scrape(**headers: str) -> Any:
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
    paused, _ = services.run_create(agent=agent, name="paused")
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
    services.tools_sync()
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

    # Steps by state, the inbox, paused runs, attempts, the oldest due step, the histogram.
    assert len(queries.captured_queries) == 6
    assert sum(v for (name, _), v in got.items() if name == "stepward_steps") == count
