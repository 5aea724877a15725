"""The infrastructure a worker depends on going away under it (issue 22, item 4), with real
processes: every database connection of the workers and the sweeper killed mid-drain
(`pg_terminate_backend` on the test's own database, never the machine's server), while 200
calls are in flight at a slow service that counts what it saw. Judged by the service's own
count: nothing lost, nothing that is not safe to repeat sent twice."""

from __future__ import annotations

import time

import pytest
from django.db import connection

from console.celery import app as celery_app
from executor.models import Agent, Run
from executor.states import State
from tests.recovery.test_in_flight import post, posts, service, settled, slow_tools
from tests.support.cluster import Cluster
from tests.support.slow_service import Running

__all__ = ["service", "slow_tools"]  # fixtures, used by name

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]


def terminate_other_backends() -> int:
    """Ends every client backend on the test database but this test's own connection."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND backend_type = 'client backend'"
            " AND pid <> pg_backend_pid()"
        )
        (count,) = cursor.fetchone()
    return int(count)


def test_every_worker_connection_killed_mid_drain_loses_and_repeats_nothing_unsafe(
    cluster: Cluster, service: Running, slow_tools: dict[str, str], agent: Agent, run: Run
) -> None:
    keyed = post(agent, run, "slow.keyed", 100)
    plain = post(agent, run, "slow.plain", 100)
    cluster.sweeper().start()
    cluster.worker().start(**slow_tools)
    cluster.wait_for(
        lambda: service.stats()["in_flight"] >= 200 or None,
        what="200 calls in flight at the service",
    )

    killed = terminate_other_backends()

    keyed_done = settled(cluster, keyed, seconds=180)
    plain_done = settled(cluster, plain, seconds=180)
    time.sleep(3)  # calls still in flight end at the service
    stats = service.stats()
    requests = stats["requests_by_operation"]

    assert killed >= 2  # the worker's drain and lease keeper, the sweeper's
    # Keyed calls are safe to repeat: all completed, one effect each.
    assert {s.state for s in keyed_done} == {State.COMPLETED}, cluster.diagnose()
    assert {stats["effects_by_key"][str(s.operation_id)] for s in keyed_done} == {1}
    # A plain write is never sent twice: its answer stored, or a person's to decide.
    assert {requests[str(s.operation_id)] for s in plain_done} == {1}
    assert {s.state for s in plain_done} <= {State.COMPLETED, State.UNKNOWN}, cluster.diagnose()
    assert stats["effects"] == 200


def test_a_broker_that_lost_its_queue_loses_no_step(
    cluster: Cluster, service: Running, slow_tools: dict[str, str], agent: Agent, run: Run
) -> None:
    """Steps posted while no worker runs, then every message in the queue lost (the broker
    restarted without its data): the ledger is the truth, and the sweeper finds the due
    steps and wakes a worker for them."""
    keyed = posts(agent, run, "slow.keyed", times=2, each=50)
    queued = celery_app.control.purge()
    cluster.worker().start(**slow_tools)
    time.sleep(2)  # a worker with nothing queued does nothing by itself...
    idle = service.stats()["requests"]
    cluster.sweeper().start()  # ...until the sweeper's pass dispatches what is due

    done = settled(cluster, keyed, seconds=180)
    stats = service.stats()

    assert queued >= 1  # the posts' messages were there, and were lost
    assert idle == 0
    assert {s.state for s in done} == {State.COMPLETED}, cluster.diagnose()
    assert {stats["effects_by_key"][str(s.operation_id)] for s in done} == {1}
    assert stats["effects"] == 100
