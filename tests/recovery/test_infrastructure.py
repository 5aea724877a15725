"""The infrastructure a worker depends on going away under it (issue 22, item 4), with real
processes: every database connection of the workers and the sweeper killed mid-drain
(`pg_terminate_backend` on the test's own database, never the machine's server) with 200
calls in flight; the broker's queue lost, and the broker itself (a Redis server of the
test's own) killed mid-drain and started again empty; a worker cut off from the database (a
TCP proxy the test cuts and restores) past its lease while its calls are in flight and
another worker takes them over, and then from the tool as well. Judged by the slow service's
own count: nothing lost, nothing that is not safe to repeat sent twice, the late worker's
writes fenced."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from console.celery import app as celery_app
from executor.common import dispatch
from executor.drill.config import current_database_url
from executor.ledger.records import Agent, Attempt, Run, Step
from executor.ledger.states import State
from tests.recovery.test_in_flight import (
    load_slow_tools,
    post,
    posts,
    service,
    settled,
    slow_tools,
)
from tests.support.cluster import Cluster
from tests.support.own_redis import OwnRedis
from tests.support.slow_service import Running
from tests.support.tcp_proxy import TcpProxy

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


def wait_fenced_out(cluster: Cluster, worker: str, count: int, *, seconds: float) -> None:
    """Until `count` of `worker`'s attempts have had a late write refused by their fence."""
    cluster.wait_for(
        lambda: (
            Attempt.objects.filter(worker=worker).exclude(fenced_out_at=None).count() == count
            or None
        ),
        what=f"{worker}'s {count} late writes refused by their fence",
        seconds=seconds,
    )


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
    restarted without its data): the ledger is the truth, and the due steps are found there
    (by the sweeper's pass, or by a worker's own drain) and completed, each effect once."""
    keyed = posts(agent, run, "slow.keyed", times=2, each=50)
    queued = celery_app.control.purge()
    cluster.worker().start(**slow_tools)
    cluster.sweeper().start()

    done = settled(cluster, keyed, seconds=180)
    stats = service.stats()

    assert queued >= 1  # the posts' messages were there, and were lost
    assert {s.state for s in done} == {State.COMPLETED}, cluster.diagnose()
    assert {stats["effects_by_key"][str(s.operation_id)] for s in done} == {1}
    assert stats["effects"] == 100


def test_a_worker_cut_off_from_the_database_past_its_lease_is_fenced_out_when_it_returns(
    cluster: Cluster, service: Running, slow_tools: dict[str, str], agent: Agent, run: Run
) -> None:
    """Worker A reaches PostgreSQL through a TCP proxy; with its calls in flight the link
    goes dark (connections open, nothing moving) for longer than its lease. The sweeper and
    worker B take the steps over with a newer fence and complete them; when A's link comes
    back, its late writes are refused by their fence. The service sees each key's effect
    once, and B's requests carry the newer fence."""
    keyed = post(agent, run, "slow.keyed", 20)
    db = connection.settings_dict
    with TcpProxy((db.get("HOST") or "127.0.0.1", int(db.get("PORT") or 5432))) as link:
        through = current_database_url().replace(f":{db.get('PORT') or 5432}/", f":{link.port}/")
        late = cluster.worker("a").start(DATABASE_URL=through, **slow_tools)
        cluster.wait_for(
            lambda: service.stats()["in_flight"] >= 20 or None, what="A's 20 calls in flight"
        )
        link.cut()
        cluster.sweeper().start()
        cluster.worker("b").start(**slow_tools)
        done = settled(cluster, keyed, seconds=120)
        link.restore()
        # A's answers arrived long ago; its writes go through once the link is back.
        wait_fenced_out(cluster, late.worker_name, 20, seconds=60)
    stats = service.stats()
    fences = stats["fences_by_operation"]

    assert {s.state for s in done} == {State.COMPLETED}, cluster.diagnose()
    assert {stats["effects_by_key"][str(s.operation_id)] for s in done} == {1}
    for step in done:
        seen = fences[str(step.operation_id)]
        assert seen[0] == "1", (step.key, seen)  # A's call, first
        assert max(seen, key=int) == str(step.fence), (step.key, seen)  # B's, the newer
    a_attempts = Attempt.objects.filter(worker=late.worker_name)
    # Each of A's 20 calls had been sent; each answer's write came back after the takeover
    # and was refused by its fence, and recorded so.
    assert set(a_attempts.values_list("fenced_out_write", flat=True)) == {"responded"}
    assert a_attempts.exclude(fenced_out_at=None).count() == 20
    # None of A's writes landed: every step's completion is B's.
    assert not Step.objects.filter(pk__in=[s.pk for s in done], fence=1).exists()


def test_a_worker_cut_off_from_the_database_and_the_tool_is_fenced_out_at_both(
    cluster: Cluster, service: Running, agent: Agent, run: Run, settings: Any, tmp_path: Path
) -> None:
    """As above, but A's link to the tool goes dark too, with its 20 calls in flight: the
    service has their requests, A gets no answer. Worker B (through the same proxy, on new
    connections that flow) takes the steps over with the newer fence; the service sees B's
    fence after A's and makes each key's effect once. When A's links come back, its answers
    arrive and its writes are refused by their fence."""
    with TcpProxy(("127.0.0.1", service.port)) as tool_link:
        tools = load_slow_tools(tool_link.port, agent, settings, tmp_path)
        keyed = post(agent, run, "slow.keyed", 20)
        db = connection.settings_dict
        with TcpProxy((db.get("HOST") or "127.0.0.1", int(db.get("PORT") or 5432))) as db_link:
            port = db.get("PORT") or 5432
            through = current_database_url().replace(f":{port}/", f":{db_link.port}/")
            late = cluster.worker("a").start(DATABASE_URL=through, **tools)
            cluster.wait_for(
                lambda: service.stats()["in_flight"] >= 20 or None, what="A's 20 calls in flight"
            )
            db_link.cut()
            darkened = tool_link.cut_open()
            cluster.sweeper().start()
            cluster.worker("b").start(**tools)
            done = settled(cluster, keyed, seconds=120)
            answered_to_a = service.stats()
            db_link.restore()
            tool_link.restore()
            wait_fenced_out(cluster, late.worker_name, 20, seconds=90)
    stats = service.stats()
    fences = stats["fences_by_operation"]

    assert darkened == 20  # A's calls in flight, each on its own connection; none of B's yet
    assert {s.state for s in done} == {State.COMPLETED}, cluster.diagnose()
    assert {stats["effects_by_key"][str(s.operation_id)] for s in done} == {1}
    assert stats["effects"] == answered_to_a["effects"] == 20
    for step in done:
        seen = fences[str(step.operation_id)]
        assert seen[0] == "1", (step.key, seen)  # A's call, first
        assert max(seen, key=int) == str(step.fence), (step.key, seen)  # B's, the newer
    a_attempts = Attempt.objects.filter(worker=late.worker_name)
    assert a_attempts.exclude(fenced_out_at=None).count() == 20
    # A's answers came back after the takeover; whatever A then tried to write was refused.
    assert set(a_attempts.values_list("fenced_out_write", flat=True)) <= {
        "responded",
        "failure:ambiguous",
        "failure:transient",
    }
    assert not Step.objects.filter(pk__in=[s.pk for s in done], fence=1).exists()


def test_the_broker_killed_and_restarted_empty_mid_drain_loses_and_repeats_nothing(
    cluster: Cluster,
    service: Running,
    slow_tools: dict[str, str],
    agent: Agent,
    run: Run,
    tmp_path: Path,
) -> None:
    """The workers' and sweeper's broker is a Redis server of the test's own. With 100 calls
    in flight it is SIGKILLed, and started again on its port with nothing in it (every queued
    and unacknowledged message gone). The workers reconnect; the ledger holds the rest, and
    the sweeper sends it again. Each step completed, each key's effect once."""
    with OwnRedis(tmp_path) as broker, dispatch.publishing(dispatch.dropping_publisher):
        keyed = posts(agent, run, "slow.keyed", times=4, each=50)  # published nowhere
        env = {"CELERY_BROKER_URL": broker.url, **slow_tools}
        cluster.sweeper().start(**env)
        # Both start together: waiting for a's banner first gave a the time to take every
        # step, and on a loaded machine its calls could end before b was up.
        cluster.worker("a").start(wait=False, **env)
        cluster.worker("b").start(wait=False, **env)
        cluster.wait_for(
            lambda: service.stats()["in_flight"] >= 100 or None, what="100 calls in flight"
        )
        broker.kill()
        time.sleep(3)
        broker.start()
        done = settled(cluster, keyed, seconds=180)
    stats = service.stats()

    assert broker.starts == 2
    assert {s.state for s in done} == {State.COMPLETED}, cluster.diagnose()
    assert {stats["effects_by_key"][str(s.operation_id)] for s in done} == {1}
    assert stats["effects"] == 200
