"""The counters the database keeps as the ledger moves (executor/ledger/counters.py, migration
0018): each session writes rows of its own, and the sweeper folds those of sessions gone."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.db import connection

from executor.ledger import counters
from executor.ledger.records import Agent, Counter, Run, Step
from executor.ledger.states import State
from executor.services.tools import tools_sync
from tests.support.factories import step_in


def pending_rows() -> dict[int, float]:
    return dict(
        Counter.objects.filter(name="steps", label_a=State.PENDING).values_list("shard", "value")
    )


def own_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_each_session_counts_in_rows_of_its_own_folded_once_it_has_ended(
    agent: Agent, run: Run
) -> None:
    tools_sync()
    steps = [step_in(run, State.PLANNED) for _ in range(3)]
    other = connection.get_new_connection(connection.get_connection_params())
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            other_pid = cursor.fetchone()[0]
            cursor.execute(
                "UPDATE executor_step SET state = 'pending' WHERE id = ANY(%s)",
                [[step.pk for step in steps[:2]]],
            )
        other.commit()
        Step.objects.filter(pk=steps[2].pk).update(state=State.PENDING)

        assert pending_rows() == {other_pid: 2, own_pid(): 1}
        counters.fold()  # both sessions are alive: nothing moves
        assert pending_rows() == {other_pid: 2, own_pid(): 1}
    finally:
        other.close()

    def folded() -> bool:
        counters.fold()
        return other_pid not in pending_rows()

    wait_until(folded)
    assert pending_rows() == {0: 2, own_pid(): 1}
    assert counters.counter_values()[("steps", "pending", "")] == 3
    assert counters.run_state_counts([run.pk]) == {run.pk: {"pending": 3}}


def wait_until(condition: Any, seconds: float = 10) -> None:
    """Polls `condition` (a backend's end shows in pg_stat_activity a moment after)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not folded in time"
        time.sleep(0.05)


@pytest.mark.django_db
def test_a_runs_counts_follow_its_steps(agent: Agent, run: Run) -> None:
    tools_sync()
    done = step_in(run, State.COMPLETED)
    step_in(run, State.UNKNOWN)
    Step.objects.filter(pk=done.pk).update(state=State.COMPENSATED)

    assert counters.run_state_counts([run.pk]) == {run.pk: {"unknown": 1, "compensated": 1}}
