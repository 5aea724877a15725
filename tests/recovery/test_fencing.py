"""Two workers given one step after a lease expiry: the stale one writes nothing
(DESIGN.md §7, §13.4). Worker A is frozen with SIGSTOP while its request waits inside the
desk, the sweeper takes the step back, worker B finishes it, and then A wakes up."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from executor.ledger.records import Attempt, Phase, Step
from executor.ledger.states import State
from tests.support.cluster import Cluster
from tests.support.processes import Worker

pytestmark = pytest.mark.django_db(transaction=True)

# Longer than a lease plus a sweep, so A's request is still inside the desk when the
# sweeper recovers the step.
DESK_LATENCY_MS = 6000


def freeze_during_the_call(cluster: Cluster, worker: Worker, delayed_before: int) -> None:
    cluster.wait_for(
        lambda: cluster.desk.delayed() > delayed_before, what="A's request to reach the desk"
    )
    worker.pause()


def take_over(cluster: Cluster, post: Callable[..., Step], tool: str) -> tuple[Step, Worker]:
    """A claims and calls, is frozen; B completes the step. Returns it and A (still frozen)."""
    cluster.desk.faults(latency_ms=DESK_LATENCY_MS)
    cluster.sweeper().start()
    stale = cluster.worker("wa").start()
    delayed_before = cluster.desk.delayed()
    step = post(tool, {"title": f"fenced {uuid.uuid4().hex[:8]}"})
    freeze_during_the_call(cluster, stale, delayed_before)
    cluster.worker("wb").start()
    cluster.wait_state(step, State.COMPLETED, seconds=120)
    return step, stale


def assert_stale_worker_wrote_nothing(
    cluster: Cluster, step: Step, stale: Worker, actor: str
) -> Attempt:
    completed = Step.objects.get(pk=step.pk)
    stale.resume()
    fenced = cluster.wait_for(
        lambda: Attempt.objects.filter(step=step, number=1, fenced_out_at__isnull=False).first(),
        what="A's late write to be refused",
    )
    after = Step.objects.get(pk=step.pk)
    # Nothing about the step moved once A woke up; its only event is its own claim.
    assert (after.state, after.version, after.external_id) == (
        State.COMPLETED,
        completed.version,
        completed.external_id,
    )
    assert list(after.events.filter(actor=actor).values_list("to_state", flat=True)) == ["running"]
    assert after.events.filter(to_state=State.COMPLETED).count() == 1
    first, second = after.attempts.order_by("number")
    assert (first.fence, first.phase, first.error_class) == (1, Phase.ABANDONED, "lease_expired")
    assert (second.fence, second.phase) == (2, Phase.RESPONDED)
    assert second.worker != first.worker
    assert cluster.desk.ticket_ids(after.operation_id) == [int(after.external_id)]
    return fenced


def test_a_stale_worker_of_a_keyed_call_is_fenced_out_and_one_ticket_exists(
    cluster: Cluster, post: Callable[..., Step]
) -> None:
    step, stale = take_over(cluster, post, "ticketdesk.create_keyed")
    actor = stale.actor

    fenced = assert_stale_worker_wrote_nothing(cluster, step, stale, actor)

    # A's request landed first and B's, with the same key, was answered the same ticket;
    # A's answer, read after waking, was refused by the ledger's fence.
    assert fenced.fenced_out_write == "responded"
    second = Attempt.objects.get(step=step, number=2)
    assert second.response_evidence["replayed"] is True


def test_a_stale_worker_of_a_plain_create_is_refused_by_the_desk_and_one_ticket_exists(
    cluster: Cluster, post: Callable[..., Step]
) -> None:
    refused_before = cluster.desk.stats()["stale_fence_refused"]
    step, stale = take_over(cluster, post, "ticketdesk.create")
    actor = stale.actor

    fenced = assert_stale_worker_wrote_nothing(cluster, step, stale, actor)

    # The lookup raised the desk's fence above A's before A's request could commit, so
    # the desk refused it (409), and A's report of that refusal was refused by the ledger.
    assert cluster.desk.stats()["stale_fence_refused"] == refused_before + 1
    assert fenced.fenced_out_write == "failure:conflict"
    events = list(Step.objects.get(pk=step.pk).events.values_list("to_state", flat=True))
    # After the post's one event (posted, approved by policy, pending).
    assert events[1:] == ["running", "unknown", "pending", "running", "verifying", "completed"]
