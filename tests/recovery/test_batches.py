"""A worker killed between a batch's claim and its outcomes (DESIGN.md §14): each step of the
batch is left exactly where one step claimed alone would be, and recovery — row by row,
by the table of §7 — finishes each with one effect."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import connection

from executor.ledger.records import Agent, Event, Phase, Run, Step
from executor.ledger.states import State
from executor.services.posting import StepRequest, steps_post
from tests.support.cluster import STALL_MARKER, STALL_SECONDS, Cluster, Stall

pytestmark = pytest.mark.django_db(transaction=True)

ECHOES = 20
TICKETS = 4  # of each desk tool
# The write steps' calls are still inside the desk when the worker dies.
DESK_LATENCY_MS = 1500


class LightPersistStall(Stall):
    """Holds (PostgreSQL) or fails (SQLite) the commit that stores a batch of pure/read
    outcomes: the first `running → completed` event a worker inserts."""

    def at_batch_persist(self) -> None:
        self._install(
            "executor_event",
            "BEFORE INSERT",
            "NEW.actor LIKE 'executor:%' AND NEW.from_state = 'running' "
            "AND NEW.to_state = 'completed'",
        )


@pytest.fixture
def light_stall(transactional_db: Any) -> Any:
    stall = LightPersistStall()
    yield stall
    stall.remove()


def post_batch(agent: Agent, run: Run) -> list[Step]:
    requests = [
        StepRequest(f"echo-{i}", "echo", {"n": i, "nonce": uuid.uuid4().hex}) for i in range(ECHOES)
    ]
    for tool in ("ticketdesk.create", "ticketdesk.create_keyed"):
        requests += [
            StepRequest(f"{tool}-{i}", tool, {"title": f"batch {uuid.uuid4().hex[:8]}"})
            for i in range(TICKETS)
        ]
    steps, created = steps_post(agent=agent, run=run, requests=requests)
    assert all(created)
    return steps


def test_a_worker_killed_between_batch_claim_and_batch_persist_is_recovered_row_by_row(
    cluster: Cluster, light_stall: LightPersistStall, agent: Agent, run: Run
) -> None:
    cluster.desk.faults(latency_ms=DESK_LATENCY_MS)
    light_stall.at_batch_persist()
    steps = post_batch(agent, run)
    echoes = [s for s in steps if s.tool_id == "echo"]
    worker = cluster.worker().start()

    cluster.wait_for(lambda: light_stall.holds(worker), what="the batch's persist to stall")
    light_stall.kill(worker)

    # Every pure step of the batch is where a crash before its own persist leaves one step:
    # running, its attempt submitting, nothing of an answer stored.
    crashed = list(Step.objects.filter(pk__in=[s.pk for s in echoes]))
    assert {s.state for s in crashed} == {State.RUNNING}, cluster.diagnose()
    assert {s.result is None and s.external_id == "" for s in crashed} == {True}
    for step in crashed:
        (attempt,) = step.attempts.all()
        assert (attempt.phase, attempt.response_evidence, attempt.finished_at) == (
            Phase.SUBMITTING,
            None,
            None,
        )
    # They were claimed together: one claim commit wrote all their `running` events.
    claim_times = set(
        Event.objects.filter(step__in=crashed, to_state=State.RUNNING).values_list(
            "created_at", flat=True
        )
    )
    assert len(claim_times) == 1
    if connection.vendor == "postgresql":
        assert f"pg_sleep({STALL_SECONDS})" not in worker.log()
    else:
        assert STALL_MARKER in worker.log()

    light_stall.remove()
    cluster.sweeper().start()
    worker.restart()
    done = [cluster.wait_settled(step) for step in steps]

    assert {s.state for s in done} == {State.COMPLETED}, cluster.diagnose()
    for step in done:
        phases = list(step.attempts.order_by("number").values_list("phase", flat=True))
        if step.tool_id == "echo":
            # §7: a submitted pure step is simply run again.
            assert phases == [Phase.ABANDONED, Phase.RESPONDED]
            assert step.result == step.input
        else:
            # One ticket each, whatever moment of its call the kill met.
            assert cluster.desk.ticket_ids(step.operation_id) == [int(step.external_id)]
