"""A message is only a hint (DESIGN.md §2): a lost one delays work until the sweeper
resends it, a duplicated one does nothing twice.

The workers here do not drain further due steps after their message, so a step moves only
when a message naming it reaches a worker (stale messages left in a shared queue by other
runs name no step of this test database and are skipped).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from executor.common import dispatch
from executor.ledger.records import Phase, Step
from executor.ledger.states import State
from executor.worker import tasks
from tests.support.cluster import Cluster
from tests.support.processes import Worker

pytestmark = pytest.mark.django_db(transaction=True)

NO_DRAIN = {"EXECUTOR_DRAIN_LIMIT": "0"}
# Long enough that the duplicate arrives while the first copy's call is still running.
DESK_LATENCY_MS = 1500


def ticket_input() -> dict[str, str]:
    return {"title": f"message test {uuid.uuid4().hex[:8]}"}


def outcomes(workers: list[Worker]) -> dict[str, str]:
    return {task: outcome for w in workers for task, outcome in w.task_outcomes().items()}


def test_a_posted_step_is_published_where_the_workers_consume(
    cluster: Cluster, post: Callable[..., Step]
) -> None:
    # No sweeper runs: only the message published when the post committed can move it.
    worker = cluster.worker().start(**NO_DRAIN)
    step = post("ticketdesk.create", ticket_input())

    done = cluster.wait_settled(step)

    assert done.state == State.COMPLETED, cluster.diagnose()
    cluster.wait_task_outcome(worker, "completed")
    assert cluster.desk.ticket_ids(done.operation_id) == [int(done.external_id)]


def test_a_lost_message_is_resent_by_the_sweeper_and_the_step_completes(
    cluster: Cluster, post: Callable[..., Step]
) -> None:
    worker = cluster.worker().start(**NO_DRAIN)
    with dispatch.publishing(dispatch.dropping_publisher):
        step = post("ticketdesk.create", ticket_input())
    assert Step.objects.get(pk=step.pk).state == State.PENDING

    sweeper = cluster.sweeper().start()
    done = cluster.wait_settled(step)

    assert done.state == State.COMPLETED, cluster.diagnose()
    # The sweeper logs its pass after sending; the step may settle before that line is out.
    cluster.wait_for(lambda: sweeper.redispatched() >= 1, what="the sweeper to log a resend")
    cluster.wait_task_outcome(worker, "completed")
    assert cluster.desk.ticket_ids(done.operation_id) == [int(done.external_id)]
    assert list(done.attempts.values_list("phase", flat=True)) == [Phase.RESPONDED]


def test_a_duplicated_message_executes_the_step_once(
    cluster: Cluster, post: Callable[..., Step]
) -> None:
    cluster.desk.faults(latency_ms=DESK_LATENCY_MS)
    workers = [cluster.worker("w1").start(**NO_DRAIN), cluster.worker("w2").start(**NO_DRAIN)]
    with dispatch.publishing(dispatch.dropping_publisher):
        step = post("ticketdesk.create", ticket_input())

    # No sweeper: these two copies are the only messages about this step.
    copies = [tasks.execute_step.delay(str(step.pk)).id for _ in range(2)]

    handled = cluster.wait_for(
        lambda: all(task in outcomes(workers) for task in copies) and outcomes(workers),
        what="both copies of the message to be handled",
    )
    done = Step.objects.get(pk=step.pk)
    assert done.state == State.COMPLETED, cluster.diagnose()
    assert sorted(handled[task] for task in copies) == ["completed", "skipped"]
    assert cluster.desk.ticket_ids(done.operation_id) == [int(done.external_id)]
    assert list(done.attempts.values_list("phase", flat=True)) == [Phase.RESPONDED]
