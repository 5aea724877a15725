"""Tamper evidence (DESIGN.md §15): each kind of tampering that someone with write access to
the database but without the ledger key could try is named by `verify_ledger`.

Every test completes a few steps through the engine, signs a checkpoint (as the sweeper does
every EXECUTOR_CHECKPOINT_SECONDS), then changes the database behind the application's back
with plain SQL, as consistently as such a person could, and runs the command.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from executor import dispatch, engine, ledger, services, sweeper
from executor.models import Agent, Approval, Attempt, Checkpoint, Event, Run, Step, call_hash
from executor.states import State

pytestmark = pytest.mark.django_db

STEPS = Step._meta.db_table
EVENTS = Event._meta.db_table
ATTEMPTS = Attempt._meta.db_table
APPROVALS = Approval._meta.db_table
CHECKPOINTS = Checkpoint._meta.db_table


@pytest.fixture(autouse=True)
def no_messages() -> Iterator[None]:
    with dispatch.publishing(dispatch.dropping_publisher):
        yield


def sql(statement: str, params: list[Any]) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def completed_steps(agent: Agent, run: Run, count: int = 3) -> list[Step]:
    steps = [
        services.step_post(agent=agent, run=run, key=f"s{n}", tool_name="echo", input={"n": n})[0]
        for n in range(count)
    ]
    for step in steps:
        assert engine.process(step.pk, worker="w1") == State.COMPLETED
    assert ledger.checkpoint_take() is not None
    return [Step.objects.get(pk=step.pk) for step in steps]


def verify() -> list[str]:
    """The command's findings; it must fail (exit non-zero)."""
    out = StringIO()
    with pytest.raises(CommandError, match="the ledger is broken"):
        call_command("verify_ledger", stdout=out, stderr=StringIO())
    return out.getvalue().splitlines()[:-1]


def test_an_untouched_ledger_verifies_with_its_checkpoints(agent: Agent, run: Run) -> None:
    completed_steps(agent, run)
    out = StringIO()

    call_command("verify_ledger", "--checkpoint", stdout=out)

    lines = out.getvalue().splitlines()
    assert lines[0] == "3 steps, 15 events verified, 0 broken"
    assert lines[1].startswith("newest checkpoint 2 at ")
    assert Checkpoint.objects.count() == 2


def test_cutting_a_chains_tail_and_rolling_the_step_back_is_caught(agent: Agent, run: Run) -> None:
    steps = completed_steps(agent, run)
    cut = steps[1]
    running = Event.objects.get(step=cut, seq=cut.version - 1)
    sql(f"DELETE FROM {EVENTS} WHERE step_id = %s AND seq = %s", [cut.pk.hex, cut.version])
    sql(
        f"UPDATE {STEPS} SET state = %s, version = %s, head_hash = %s, result = NULL, "
        "external_id = '', lease_owner = 'w1', lease_expires_at = %s WHERE id = %s",
        [State.RUNNING, cut.version - 1, running.hash, timezone.now(), cut.pk.hex],
    )

    findings = verify()

    assert findings == [
        f"step {cut.pk} (in checkpoint 1): was at version {cut.version} with head "
        f"{cut.head_hash[:12]}; its chain no longer holds that (now at version "
        f"{cut.version - 1}): events were cut or rewritten"
    ]


def test_deleting_a_whole_step_is_caught(agent: Agent, run: Run) -> None:
    steps = completed_steps(agent, run)
    gone = steps[1]
    for table in (APPROVALS, ATTEMPTS, EVENTS):
        sql(f"DELETE FROM {table} WHERE step_id = %s", [gone.pk.hex])
    sql(f"DELETE FROM {STEPS} WHERE id = %s", [gone.pk.hex])

    findings = verify()

    assert f"run {run.pk}: holds 2 steps but numbered 3: 1 step(s) were deleted" in findings
    assert f"step {gone.pk} (in checkpoint 1): was deleted" in findings


def test_deleting_the_newest_step_and_its_number_is_caught_by_the_checkpoint(
    agent: Agent, run: Run
) -> None:
    steps = completed_steps(agent, run)
    gone = steps[-1]
    for table in (APPROVALS, ATTEMPTS, EVENTS):
        sql(f"DELETE FROM {table} WHERE step_id = %s", [gone.pk.hex])
    sql(f"DELETE FROM {STEPS} WHERE id = %s", [gone.pk.hex])
    sql("UPDATE executor_stepcounter SET last_position = 2 WHERE run_id = %s", [run.pk.hex])

    assert verify() == [f"step {gone.pk} (in checkpoint 1): was deleted"]


@pytest.mark.parametrize(
    ("column", "value"),
    [("result", json.dumps({"n": 999})), ("external_id", "forged-42")],
)
def test_editing_a_steps_result_or_external_id_is_caught(
    agent: Agent, run: Run, column: str, value: str
) -> None:
    steps = completed_steps(agent, run)
    edited = steps[0]
    sql(f"UPDATE {STEPS} SET {column} = %s WHERE id = %s", [value, edited.pk.hex])

    [finding] = verify()

    assert finding.startswith(f"step {edited.pk}: event ")
    assert "the step row is not what its last event recorded" in finding


def test_editing_a_steps_input_is_caught(agent: Agent, run: Run) -> None:
    steps = completed_steps(agent, run)
    edited = steps[0]
    sql(f"UPDATE {STEPS} SET input = %s WHERE id = %s", ['{"n": 1000}', edited.pk.hex])

    [finding] = verify()

    assert "the step's input does not match its input hash" in finding


def test_editing_a_steps_input_and_its_hash_is_caught(agent: Agent, run: Run) -> None:
    steps = completed_steps(agent, run)
    edited = steps[0]
    sql(
        f"UPDATE {STEPS} SET input = %s, input_hash = %s WHERE id = %s",
        ['{"n": 1000}', call_hash("echo", {"n": 1000}), edited.pk.hex],
    )

    [finding] = verify()

    assert "the step row is not what its last event recorded" in finding


def test_moving_a_step_and_its_events_to_another_run_is_caught(agent: Agent, run: Run) -> None:
    steps = completed_steps(agent, run)
    moved = steps[2]
    other, _ = services.run_create(agent=agent, name="elsewhere")
    for table, column in ((EVENTS, "step_id"), (STEPS, "id")):
        sql(f"UPDATE {table} SET run_id = %s WHERE {column} = %s", [other.pk.hex, moved.pk.hex])

    findings = verify()

    assert f"step {moved.pk}: event " in findings[0]
    assert "its content does not match its hash" in findings[0]
    assert f"step {moved.pk} (in checkpoint 1): was moved from run {run.pk} to {other.pk}" in (
        findings
    )


def test_an_edited_checkpoint_is_caught(agent: Agent, run: Run) -> None:
    completed_steps(agent, run)
    sql(f"UPDATE {CHECKPOINTS} SET heads = %s WHERE seq = 1", ["[]"])

    assert verify() == ["checkpoint 1: its content does not match its hash"]


def test_a_deleted_checkpoint_is_caught(agent: Agent, run: Run) -> None:
    completed_steps(agent, run)
    ledger.checkpoint_take()
    ledger.checkpoint_take()
    sql(f"DELETE FROM {CHECKPOINTS} WHERE seq = 2", [])

    findings = verify()

    assert "checkpoint 3: checkpoint 2 is missing" in findings
    assert "checkpoint 3: does not link to the checkpoint before it" in findings


def test_the_sweeper_signs_a_checkpoint_when_one_is_due(
    agent: Agent, run: Run, settings: Any
) -> None:
    settings.EXECUTOR_CHECKPOINT_SECONDS = 60
    completed_steps(agent, run)  # checkpoint 1
    report = sweeper.sweep(owner="s1")
    assert report is not None
    assert report.checkpoints == 0

    Checkpoint.objects.update(taken_at=timezone.now() - timedelta(minutes=2))
    report = sweeper.sweep(owner="s1")

    assert report is not None
    assert report.checkpoints == 1
    newest = Checkpoint.objects.order_by("-seq").first()
    assert newest is not None
    assert newest.seq == 2
    assert {head[0] for head in newest.heads} == {str(s.pk) for s in Step.objects.all()}
