"""The sweeper: one at a time, and what makes a lost message or a dead worker harmless (§2)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from executor import engine
from executor.common import dispatch
from executor.contract.tool import FailureClass, Lookup, LookupOutcome, unregister
from executor.engine import recovery
from executor.ledger import transitions
from executor.ledger.records import Agent, Run, Step, SweeperLease
from executor.ledger.states import State
from executor.services.tools import tools_sync
from executor.worker import sweeper
from tests.support import tooling
from tests.support.factories import step_in
from tests.support.tooling import LookupTool, WriteTool, expire_lease, post, reload

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def engine_env(agent: Agent) -> Iterator[None]:
    with tooling.installed(agent), dispatch.publishing(dispatch.dropping_publisher):
        yield


@pytest.fixture
def redispatch_at_once(settings: Any) -> None:
    settings.EXECUTOR_REDISPATCH_AFTER = 0


# --- one sweeper at a time ------------------------------------------------------------------


def test_second_sweeper_stands_back_while_the_first_is_sweeping(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.lookup")
    LookupTool.will(FailureClass.AMBIGUOUS)
    assert engine.process(step.pk, worker="w1") == State.UNKNOWN
    seen: list[sweeper.SweepReport | None] = []
    # B tries while A is in the middle of its pass (A is running this step's lookup).
    LookupTool.during_lookup = lambda: seen.append(sweeper.sweep(owner="B"))

    report = sweeper.sweep(owner="A")

    assert seen == [None]
    assert report is not None
    assert report.reconciled == 1
    assert len(LookupTool.lookups) == 1


def test_sweeper_lease_is_released_after_a_pass() -> None:
    assert sweeper.sweep(owner="A") is not None

    lease = SweeperLease.objects.get(name=sweeper.LEASE_NAME)
    assert (lease.owner, lease.expires_at) == ("", None)
    assert lease.last_finished_at is not None
    assert sweeper.sweep(owner="B") is not None


def test_sweeper_lease_held_by_another_refuses_the_pass() -> None:
    assert sweeper.take_lease("A")

    assert sweeper.sweep(owner="B") is None

    assert SweeperLease.objects.get(name=sweeper.LEASE_NAME).owner == "A"


def test_expired_sweeper_lease_of_a_stuck_sweep_is_taken_over(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")
    engine.claim_step(step.pk, worker="w1")
    expire_lease(step)
    SweeperLease.objects.create(
        name=sweeper.LEASE_NAME, owner="A", expires_at=timezone.now() - timedelta(seconds=1)
    )

    report = sweeper.sweep(owner="B")

    assert report is not None
    assert report.recovered == 1
    assert reload(step).state == State.PENDING
    # The stuck sweeper's late release does not free B's (or anyone's) lease.
    assert sweeper.take_lease("B")
    sweeper.release_lease("A")
    assert SweeperLease.objects.get(name=sweeper.LEASE_NAME).owner == "B"


def test_take_over_of_a_sweeper_lease_moves_its_fence() -> None:
    SweeperLease.objects.create(
        name=sweeper.LEASE_NAME, owner="A", expires_at=timezone.now() - timedelta(seconds=1)
    )

    assert sweeper.take_lease("B")

    assert SweeperLease.objects.get(name=sweeper.LEASE_NAME).fence == 1


# --- lost messages ---------------------------------------------------------------------------


@pytest.mark.usefixtures("redispatch_at_once")
def test_lost_message_is_sent_again_and_the_step_completes(
    agent: Agent, run: Run, django_capture_on_commit_callbacks: Callable[..., Any]
) -> None:
    with django_capture_on_commit_callbacks(execute=True) as posted:
        step = post(agent, run, "test.write")
    assert len(posted) == 1  # its message, dropped by publish_suppressed
    assert reload(step).state == State.PENDING

    with django_capture_on_commit_callbacks(execute=True) as resent:
        report = sweeper.sweep(owner="s1")

    assert report is not None
    assert report.redispatched == 1
    assert len(resent) == 1
    # The worker that gets the new message claims the step (and any other due work).
    assert engine.drain(worker="w1", limit=10) == 1
    assert reload(step).state == State.COMPLETED
    assert len(WriteTool.calls) == 1


def test_due_step_is_not_sent_again_within_the_grace_period(
    agent: Agent, run: Run, settings: Any
) -> None:
    settings.EXECUTOR_REDISPATCH_AFTER = 3600
    post(agent, run, "test.write")

    report = sweeper.sweep(owner="s1")

    assert report is not None
    assert report.redispatched == 0


@pytest.mark.usefixtures("redispatch_at_once")
def test_steps_waiting_for_a_backoff_or_a_person_are_not_sent_again(agent: Agent, run: Run) -> None:
    retrying = post(agent, run, "test.write")
    WriteTool.will(FailureClass.TRANSIENT)
    assert engine.process(retrying.pk, worker="w1") == State.PENDING
    unknown = post(agent, run, "test.write")
    WriteTool.will(FailureClass.AMBIGUOUS)
    assert engine.process(unknown.pk, worker="w1") == State.UNKNOWN

    report = sweeper.sweep(owner="s1")

    assert report is not None
    assert report.redispatched == 0
    assert len(WriteTool.calls) == 2


@pytest.mark.usefixtures("redispatch_at_once")
def test_lost_message_of_a_pending_step_without_not_before_is_sent_again(run: Run) -> None:
    step = step_in(run, State.PENDING)  # the echo tool; not_before left NULL
    assert reload(step).not_before is None

    report = sweeper.sweep(owner="s1")

    assert report is not None
    assert report.redispatched == 1


# --- dead workers, unknown outcomes, lost promotions ----------------------------------------


def test_sweeper_recovers_expired_leases(agent: Agent, run: Run) -> None:
    claimed = post(agent, run, "test.write")
    engine.claim_step(claimed.pk, worker="w1")
    expire_lease(claimed)
    alive = post(agent, run, "test.write")
    engine.claim_step(alive.pk, worker="w2")

    report = sweeper.sweep(owner="s1")

    assert report is not None
    assert report.recovered == 1
    assert reload(claimed).state == State.PENDING
    assert tooling.history(claimed)[-1] == (State.RUNNING, State.PENDING, "sweeper:s1")
    assert reload(alive).state == State.RUNNING


def test_sweeper_asks_the_lookup_again_and_gives_up_after_a_few_tries(
    agent: Agent, run: Run
) -> None:
    step = post(agent, run, "test.lookup")
    LookupTool.will(FailureClass.AMBIGUOUS)
    engine.process(step.pk, worker="w1")

    for _ in range(recovery.RECONCILE_TRIES + 2):
        Step.objects.filter(pk=step.pk, not_before__isnull=False).update(not_before=timezone.now())
        sweeper.sweep(owner="s1")

    row = reload(step)
    assert (row.state, row.not_before) == (State.UNKNOWN, None)
    assert len(LookupTool.lookups) == recovery.RECONCILE_TRIES
    assert "a reviewer has it" in tooling.last_event(step).reason
    assert len(LookupTool.calls) == 1


def test_sweeper_completes_an_unknown_step_when_a_later_lookup_finds_it(
    agent: Agent, run: Run
) -> None:
    step = post(agent, run, "test.lookup")
    LookupTool.will(FailureClass.AMBIGUOUS)
    engine.process(step.pk, worker="w1")
    sweeper.sweep(owner="s1")  # cannot tell yet
    assert reload(step).state == State.UNKNOWN
    LookupTool.answer = Lookup(LookupOutcome.FOUND, external_id="T-7")
    Step.objects.filter(pk=step.pk).update(not_before=timezone.now())

    report = sweeper.sweep(owner="s1")

    assert report is not None
    assert report.reconciled == 1
    assert (reload(step).state, reload(step).external_id) == (State.COMPLETED, "T-7")
    assert len(LookupTool.calls) == 1


def test_sweeper_promotes_a_step_whose_dependency_completed_without_promoting_it(
    agent: Agent, run: Run
) -> None:
    first = post(agent, run, "test.pure", key="first")
    second = post(agent, run, "test.write", key="second", depends_on=["first"])
    claim = engine.claim_step(first.pk, worker="w1")
    assert isinstance(claim, engine.Claim)
    # The worker stored the completion and died before promoting the dependent step.
    transitions.move(claim.step, State.COMPLETED, actor="executor:w1", fence=claim.fence)

    report = sweeper.sweep(owner="s1")

    assert report is not None
    assert report.promoted == 1
    assert reload(second).state == State.PENDING
    assert engine.process(second.pk, worker="w1") == State.COMPLETED


@pytest.mark.usefixtures("redispatch_at_once")
def test_one_step_of_an_unregistered_tool_does_not_stop_the_sweep(agent: Agent, run: Run) -> None:
    orphan = post(agent, run, "test.write")
    engine.claim_step(orphan.pk, worker="w1")
    expire_lease(orphan)
    unregister("test.write")
    tools_sync()
    lost = post(agent, run, "test.pure")

    report = sweeper.sweep(owner="s1")

    assert report is not None
    assert report.redispatched == 1
    assert reload(lost).state == State.PENDING
