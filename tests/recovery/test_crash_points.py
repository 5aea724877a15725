"""A real worker dies at each interruption point and in each row of DESIGN.md §7; the
sweeper (its own process) and a restarted worker finish the work, and the desk's own
records say how many tickets each step made."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from executor.common import faults
from executor.ledger.records import Phase, Run, Step
from executor.ledger.states import State
from executor.services.tools import tool_policy_set
from tests.support.cluster import Cluster, Stall

pytestmark = pytest.mark.django_db(transaction=True)

DESK_TOOLS = ("ticketdesk.create", "ticketdesk.create_keyed")
TOOLS = (*DESK_TOOLS, "echo")
# The states every step goes through before a worker takes it.
POSTED = ["pending", "running"]
# Long enough that the lease expires and the sweeper acts while the request still waits
# inside the desk.
IN_FLIGHT_LATENCY_MS = 8000

# What happens after a crash at each point (DESIGN.md §7): the states after `running`.
AFTER_CRASH = {
    # Nothing reached the desk: its authoritative lookup says not_found, so it runs again.
    ("ticketdesk.create", "before_invoke"): [
        "unknown",
        "pending",
        "running",
        "verifying",
        "completed",
    ],
    # The ticket exists but its answer was lost: the lookup finds it, nothing is resent.
    ("ticketdesk.create", "after_submit"): ["unknown", "verifying", "completed"],
    ("ticketdesk.create", "before_persist"): ["unknown", "verifying", "completed"],
    # Safe to repeat with the same key: the desk answers the original ticket.
    **{
        ("ticketdesk.create_keyed", point): ["pending", "running", "verifying", "completed"]
        for point in faults.POINTS
    },
    # Pure: simply run again.
    **{("echo", point): ["pending", "running", "completed"] for point in faults.POINTS},
}


def tool_input(tool: str) -> dict[str, Any]:
    if tool == "echo":
        return {"message": "hello", "nonce": uuid.uuid4().hex}
    return {"title": f"printer on fire {uuid.uuid4().hex[:8]}", "body": "third floor"}


def states(step: Step) -> list[str]:
    return [event.to_state for event in step.events.order_by("seq")]


def assert_no_half_written_state(step: Step) -> None:
    """At a crash the attempt is open and nothing it would have written next exists."""
    crashed = Step.objects.get(pk=step.pk)
    assert crashed.state == State.RUNNING
    assert crashed.external_id == ""
    assert crashed.result is None
    assert states(crashed) == POSTED
    (attempt,) = crashed.attempts.all()
    assert attempt.phase == Phase.SUBMITTING
    assert attempt.response_evidence is None
    assert attempt.finished_at is None


@pytest.mark.parametrize("point", faults.POINTS)
@pytest.mark.parametrize("tool", TOOLS)
def test_a_worker_that_dies_at_an_interruption_point_leaves_one_effect_and_completes(
    cluster: Cluster, post: Callable[..., Step], tool: str, point: str
) -> None:
    worker = cluster.worker().start(faults=f"{point}:1.0")
    step_input = tool_input(tool)
    step = post(tool, step_input)

    assert worker.wait_dead(seconds=60, diagnose=cluster.diagnose) == faults.CRASH_EXIT_STATUS
    assert f"fault injected at {point}" in worker.log()
    assert_no_half_written_state(step)
    if tool in DESK_TOOLS:
        created_before_crash = 0 if point == "before_invoke" else 1
        assert cluster.desk.count(step.operation_id) == created_before_crash

    cluster.sweeper().start()
    worker.restart()
    done = cluster.wait_settled(step)

    assert done.state == State.COMPLETED, cluster.diagnose()
    assert states(done) == POSTED + AFTER_CRASH[tool, point]
    phases = list(done.attempts.order_by("number").values_list("phase", flat=True))
    if tool in DESK_TOOLS:
        assert cluster.desk.ticket_ids(done.operation_id) == [int(done.external_id)]
    else:
        assert done.result == step_input
    if tool == "ticketdesk.create" and point != "before_invoke":
        # Found by the lookup: the desk was never asked to create it again.
        assert phases == [Phase.ABANDONED]
        assert done.result == {"ticket_id": int(done.external_id)}
    else:
        assert phases == [Phase.ABANDONED, Phase.RESPONDED]
    if tool == "ticketdesk.create_keyed":
        replayed = done.attempts.get(number=2).response_evidence["replayed"]
        assert replayed is (point != "before_invoke")


def test_a_worker_killed_before_its_submission_commits_is_retried_without_asking_the_desk(
    stall: Stall, cluster: Cluster, post: Callable[..., Step]
) -> None:
    """§7 row `claimed`: nothing was sent, so the step is simply pending again."""
    step = post("ticketdesk.create", tool_input("ticketdesk.create"))
    stall.at_submitting(step)
    worker = cluster.worker().start()
    cluster.wait_for(lambda: stall.holds(worker), what="the worker inside its submitting commit")
    stall.kill(worker)

    crashed = Step.objects.get(pk=step.pk)
    assert crashed.state == State.RUNNING
    assert list(crashed.attempts.values_list("phase", flat=True)) == [Phase.CLAIMED]
    assert cluster.desk.count(step.operation_id) == 0

    cluster.sweeper().start()
    worker.restart()
    done = cluster.wait_settled(step)

    assert done.state == State.COMPLETED, cluster.diagnose()
    assert states(done) == [*POSTED, "pending", "running", "verifying", "completed"]
    recovery = done.events.get(seq=len(POSTED) + 1)
    assert recovery.actor.startswith("sweeper:")
    assert "nothing was sent" in recovery.reason
    assert cluster.desk.ticket_ids(done.operation_id) == [int(done.external_id)]
    phases = list(done.attempts.order_by("number").values_list("phase", flat=True))
    assert phases == [Phase.ABANDONED, Phase.RESPONDED]


def test_a_worker_killed_after_the_response_is_stored_is_completed_without_resubmitting(
    stall: Stall, cluster: Cluster, post: Callable[..., Step]
) -> None:
    """§7 row `responded`: verifying → completed by recovery; never submitted again."""
    step = post("ticketdesk.create", tool_input("ticketdesk.create"))
    stall.at_completion(step)
    worker = cluster.worker().start()
    cluster.wait_for(lambda: stall.holds(worker), what="the worker inside its completing commit")
    stall.kill(worker)

    crashed = Step.objects.get(pk=step.pk)
    assert crashed.state == State.VERIFYING
    assert list(crashed.attempts.values_list("phase", flat=True)) == [Phase.RESPONDED]
    ticket_ids = cluster.desk.ticket_ids(step.operation_id)
    assert ticket_ids == [int(crashed.external_id)]

    cluster.sweeper().start()
    worker.restart()
    done = cluster.wait_settled(step)

    assert done.state == State.COMPLETED, cluster.diagnose()
    assert states(done) == [*POSTED, "verifying", "completed"]
    completion = done.events.get(to_state=State.COMPLETED)
    assert completion.actor.startswith("sweeper:")
    assert "response was stored" in completion.reason
    assert done.external_id == crashed.external_id
    assert cluster.desk.ticket_ids(done.operation_id) == ticket_ids
    assert done.attempts.count() == 1


def kill_during_a_slow_call(cluster: Cluster, post: Callable[..., Step], tool: str) -> Step:
    """SIGKILLs a worker while its request waits inside the desk; returns the settled step."""
    cluster.desk.faults(latency_ms=IN_FLIGHT_LATENCY_MS)
    cluster.sweeper().start()
    worker = cluster.worker().start()
    delayed_before = cluster.desk.delayed()
    step = post(tool, tool_input(tool))
    cluster.wait_for(
        lambda: cluster.desk.delayed() > delayed_before, what="the request to reach the desk"
    )
    assert Step.objects.get(pk=step.pk).state == State.RUNNING
    worker.kill()
    worker.start()
    return cluster.wait_settled(step, seconds=120)


def test_a_worker_killed_during_a_slow_keyed_call_is_retried_with_the_same_key(
    cluster: Cluster, post: Callable[..., Step]
) -> None:
    """§7 row `submitting`, idempotency key: pending, then the same key again."""
    done = kill_during_a_slow_call(cluster, post, "ticketdesk.create_keyed")

    assert done.state == State.COMPLETED, cluster.diagnose()
    assert cluster.desk.ticket_ids(done.operation_id) == [int(done.external_id)]
    first, second = done.attempts.order_by("number")
    assert (first.phase, first.error_class) == (Phase.ABANDONED, "lease_expired")
    assert second.phase == Phase.RESPONDED
    assert second.response_evidence["replayed"] is True


def test_a_worker_killed_during_a_slow_call_never_gets_a_second_ticket(
    cluster: Cluster, post: Callable[..., Step]
) -> None:
    """§7 row `submitting`, lookup: unknown, then the lookup decides; one ticket at most.

    The lookup runs while the dead worker's request still waits inside the desk; it must
    fence that request out, or the desk would create it after answering "not found".
    """
    refused_before = cluster.desk.stats()["stale_fence_refused"]
    done = kill_during_a_slow_call(cluster, post, "ticketdesk.create")

    assert done.state == State.COMPLETED, cluster.diagnose()
    assert cluster.desk.ticket_ids(done.operation_id) == [int(done.external_id)]
    refused = cluster.desk.stats()["stale_fence_refused"] - refused_before
    if states(done) == [*POSTED, "unknown", "pending", "running", "verifying", "completed"]:
        # "Not found" while the old request waited: the desk refused it when it woke.
        assert refused == 1
    else:
        # Only a very slow recovery lets the old request land before the lookup.
        assert states(done) == [*POSTED, "unknown", "verifying", "completed"]
        assert refused == 0


def mail_count(mail_dir: Path, step: Step) -> int:
    message_id = f"<{step.operation_id}@stepward>"
    return sum(path.read_text().count(message_id) for path in mail_dir.iterdir())


def test_an_irreversible_write_without_lookup_waits_for_a_person_after_a_crash(
    cluster: Cluster, post: Callable[..., Step], run: Run
) -> None:
    """§7 row `submitting`, none of these: unknown, and never retried automatically."""
    # email.send waits for approval by default (issue 11); this test is about the crash.
    tool_policy_set(workspace=run.workspace, tool="email.send", approval="never")
    worker = cluster.worker().start(faults="after_submit:1.0")
    step = post("email.send", {"to": "ops@example.com", "subject": "disk full", "body": "df -h"})
    assert worker.wait_dead(seconds=60, diagnose=cluster.diagnose) == faults.CRASH_EXIT_STATUS
    assert mail_count(cluster.mail_dir, step) == 1

    sweeper = cluster.sweeper().start()
    worker.restart()
    cluster.wait_state(step, State.UNKNOWN)
    # Several more sweeps and a live worker: still nobody sends it again.
    seen = sweeper.passes()
    cluster.wait_for(lambda: sweeper.passes() >= seen + 3, what="three more sweeps")

    waiting = Step.objects.get(pk=step.pk)
    assert waiting.state == State.UNKNOWN
    assert waiting.not_before is None
    assert waiting.failure_class == "ambiguous"
    assert states(waiting) == [*POSTED, "unknown"]
    assert list(waiting.attempts.values_list("phase", flat=True)) == [Phase.ABANDONED]
    assert mail_count(cluster.mail_dir, step) == 1
