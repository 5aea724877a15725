"""Runs with nothing left to do leave the open set (issue 25): the sweeper closes a run whose
every step is settled and over, a step posted into it opens it again, and a closed run takes
work as an open one does (executor/ledger/runs.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from executor import engine
from executor.common import dispatch
from executor.contract.tool import FailureClass
from executor.ledger import runs
from executor.ledger.records import Agent, Run, RunAction, RunEvent, RunStatus
from executor.ledger.states import UNFINISHED, State
from executor.services.reviews import compensation_request, deadletter_replay
from executor.worker import sweeper
from tests.support import tooling
from tests.support.api import ApiClient
from tests.support.tooling import LookupTool, WriteTool, post, reload

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def engine_env(agent: Agent, settings: Any) -> Iterator[None]:
    settings.EXECUTOR_CLOSE_RUNS_AFTER = 0
    with tooling.installed(agent), dispatch.publishing(dispatch.dropping_publisher):
        yield


def status(run: Run) -> str:
    return Run.objects.get(pk=run.pk).status


def actions(run: Run) -> list[tuple[str, str]]:
    return [
        (action, actor.partition(":")[0])
        for action, actor in RunEvent.objects.filter(run=run)
        .order_by("pk")
        .values_list("action", "actor")
    ]


def sweep() -> sweeper.SweepReport:
    report = sweeper.sweep(owner="test")
    assert report is not None
    return report


def test_a_finished_run_is_closed_and_a_step_posted_opens_it_again(
    agent: Agent, run: Run, api: ApiClient
) -> None:
    step = post(agent, run, "test.write")
    assert sweep().runs_closed == 0  # its step is pending
    assert status(run) == RunStatus.OPEN

    assert engine.process(step.pk, worker="w1") == State.COMPLETED
    assert sweep().runs_closed == 1
    assert status(run) == RunStatus.CLOSED
    assert api.get(f"/api/v1/runs/{run.pk}").json()["status"] == "closed"
    assert sweep().runs_closed == 0  # closed once

    answer = api.post(
        f"/api/v1/runs/{run.pk}/steps", {"key": "later", "tool": "test.write", "input": {}}
    )
    assert answer.status_code == 201, answer.content
    assert status(run) == RunStatus.OPEN
    assert engine.process(answer.json()["id"], worker="w1") == State.COMPLETED
    assert sweep().runs_closed == 1

    assert actions(run) == [
        (RunAction.CLOSED, "sweeper"),
        (RunAction.REOPENED, "agent"),
        (RunAction.CLOSED, "sweeper"),
    ]


def test_a_step_committed_into_a_closed_run_runs_and_the_sweeper_opens_the_run(
    agent: Agent, run: Run
) -> None:
    first = post(agent, run, "test.write")
    engine.process(first.pk, worker="w1")
    sweep()
    # A post that read the run open while the sweeper closed it: its step is in a closed run.
    late = post(agent, run, "test.write")
    assert status(run) == RunStatus.CLOSED

    assert engine.process(late.pk, worker="w1") == State.COMPLETED  # it takes work all the same

    again = post(agent, run, "test.write")
    report = sweep()
    assert (report.runs_reopened, report.runs_closed) == (1, 0)
    assert status(run) == RunStatus.OPEN
    assert reload(again).state == State.PENDING


@pytest.mark.parametrize("decision", ["compensation", "replay"])
def test_a_reviewer_giving_a_closed_run_work_opens_it_at_once(
    agent: Agent, run: Run, reviewer: Any, decision: str
) -> None:
    if decision == "compensation":
        step = post(agent, run, "test.undoable")
        assert engine.process(step.pk, worker="w1") == State.COMPLETED
    else:
        step = post(agent, run, "test.write")
        WriteTool.will(FailureClass.INVALID_INPUT)  # a failure that proves no effect
        assert engine.process(step.pk, worker="w1") == State.FAILED
    sweep()
    assert status(run) == RunStatus.CLOSED

    step = reload(step)
    if decision == "compensation":
        work = compensation_request(step=step, user=reviewer, version=step.version, reason="x")
    else:
        work = deadletter_replay(step=step, user=reviewer, version=step.version, reason="fixed")

    assert reload(work).state in UNFINISHED  # the run has work
    assert status(run) == RunStatus.OPEN  # now, not at the sweeper's next look
    assert actions(run)[-1] == (RunAction.REOPENED, "user")
    assert sweep().runs_closed == 0


@pytest.mark.parametrize("waiting", ["unknown", "planned"])
def test_a_run_with_a_step_waiting_for_a_person_stays_open(
    agent: Agent, run: Run, waiting: str
) -> None:
    if waiting == "unknown":
        step = post(agent, run, "test.lookup")
        LookupTool.will(FailureClass.AMBIGUOUS)
        assert engine.process(step.pk, worker="w1") == State.UNKNOWN
    else:
        step = post(agent, run, "test.destructive")  # approval by policy: a person's
        assert reload(step).state == State.PLANNED

    assert sweep().runs_closed == 0
    assert status(run) == RunStatus.OPEN


def test_a_run_made_within_the_quiet_time_is_not_closed(run: Run, settings: Any) -> None:
    settings.EXECUTOR_CLOSE_RUNS_AFTER = 300
    assert sweep().runs_closed == 0  # no step yet: an agent that has just made it
    settings.EXECUTOR_CLOSE_RUNS_AFTER = 0
    assert sweep().runs_closed == 1


def test_a_closed_run_can_be_paused_and_cancelled(run: Run) -> None:
    sweep()
    assert runs.pause(Run.objects.get(pk=run.pk), reason="deadline passed")
    assert status(run) == RunStatus.PAUSED
    assert not runs.reopen(Run.objects.get(pk=run.pk), actor="agent:a", reason="not closed")
    runs.resume(Run.objects.get(pk=run.pk), actor="user:bob", reason="extended")
    sweep()
    assert runs.cancel(Run.objects.get(pk=run.pk), actor="agent:a", reason="done")
    assert status(run) == RunStatus.CANCELLED
