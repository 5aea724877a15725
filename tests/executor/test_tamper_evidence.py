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
from unittest import mock

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from executor import engine
from executor.common import dispatch
from executor.ledger import chain, runs
from executor.ledger.records import (
    Agent,
    Approval,
    Attempt,
    Checkpoint,
    Event,
    Run,
    RunAction,
    RunEvent,
    Step,
    Workspace,
    call_hash,
    pack_listing,
)
from executor.ledger.states import State
from executor.services.posting import step_post
from executor.services.reviews import step_approve
from executor.services.runs import run_create, run_extend_budget
from executor.services.tools import tool_policy_set
from executor.worker import sweeper
from tests.support import tooling
from tests.support.factories import stored_digest

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
        step_post(agent=agent, run=run, key=f"s{n}", tool_name="echo", input={"n": n})[0]
        for n in range(count)
    ]
    for step in steps:
        assert engine.process(step.pk, worker="w1") == State.COMPLETED
    assert chain.checkpoint_take() is not None
    return [Step.objects.get(pk=step.pk) for step in steps]


def cut_tail(step: Step) -> None:
    """Deletes the step's newest Event and rolls the step row back to the one before, as
    consistently as someone without the key can."""
    running = Event.objects.get(step=step, seq=step.version - 1)
    sql(f"DELETE FROM {EVENTS} WHERE step_id = %s AND seq = %s", [step.pk.hex, step.version])
    sql(
        f"UPDATE {STEPS} SET state = %s, version = %s, head_hash = %s, result = NULL, "
        "external_id = '', lease_owner = 'w1', lease_expires_at = %s WHERE id = %s",
        [State.RUNNING, step.version - 1, stored_digest(running.hash), timezone.now(), step.pk.hex],
    )


def listed(checkpoint: Checkpoint | None) -> list[list[Any]]:
    assert checkpoint is not None
    return checkpoint.listed("heads")


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
    # Each step's post (posted, approved by policy, pending: one Event), claim and completion.
    assert lines[0] == "3 steps, 9 events verified, 0 broken"
    assert lines[1].startswith("newest checkpoint 2 at ")
    assert Checkpoint.objects.count() == 2


def test_cutting_a_chains_tail_and_rolling_the_step_back_is_caught(agent: Agent, run: Run) -> None:
    steps = completed_steps(agent, run)
    cut = steps[1]
    cut_tail(cut)

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
    assert (
        f"step {gone.pk} (in checkpoint 1): was deleted, and its run was not archived" in findings
    )


def test_deleting_the_newest_step_and_its_number_is_caught_by_the_checkpoint(
    agent: Agent, run: Run
) -> None:
    steps = completed_steps(agent, run)
    gone = steps[-1]
    for table in (APPROVALS, ATTEMPTS, EVENTS):
        sql(f"DELETE FROM {table} WHERE step_id = %s", [gone.pk.hex])
    sql(f"DELETE FROM {STEPS} WHERE id = %s", [gone.pk.hex])
    sql("UPDATE executor_stepcounter SET last_position = 2 WHERE run_id = %s", [run.pk.hex])

    assert verify() == [
        f"step {gone.pk} (in checkpoint 1): was deleted, and its run was not archived"
    ]


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
    other, _ = run_create(agent=agent, name="elsewhere")
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
    listed = Checkpoint.objects.get(seq=1).listed("heads")
    shorter = pack_listing("heads", listed[1:])
    sql(f"UPDATE {CHECKPOINTS} SET packed_heads = %s WHERE seq = 1", [shorter])

    assert verify() == ["checkpoint 1: its content does not match its hash"]


def test_a_checkpoint_lists_its_heads_and_attempts_packed(agent: Agent, run: Run) -> None:
    """68 bytes a head and 56 an attempt (migration 0024), read back as the JSON held them."""
    steps = completed_steps(agent, run)
    checkpoint = Checkpoint.objects.get(seq=1)

    assert (checkpoint.heads, checkpoint.attempts) == ([], [])
    assert len(checkpoint.packed_heads) == 68 * 3
    assert len(checkpoint.packed_attempts) == 56 * 3
    assert sorted(checkpoint.listed("heads")) == sorted(
        [str(step.pk), str(run.pk), step.version, step.head_hash]
        for step in Step.objects.filter(pk__in=[s.pk for s in steps])
    )
    assert sorted(entry[1] for entry in checkpoint.listed("attempts")) == sorted(
        str(step.pk) for step in steps
    )
    assert "packed" in checkpoint.content()
    assert "heads" not in checkpoint.content()


@pytest.mark.parametrize("listing", ["packed_heads", "packed_attempts"])
def test_a_flipped_byte_in_a_packed_listing_is_caught(agent: Agent, run: Run, listing: str) -> None:
    completed_steps(agent, run)
    packed = bytearray(getattr(Checkpoint.objects.get(seq=1), listing))
    packed[-1] ^= 1  # the last digest's last bit
    sql(f"UPDATE {CHECKPOINTS} SET {listing} = %s WHERE seq = 1", [bytes(packed)])

    findings = verify()

    assert "checkpoint 1: its content does not match its hash" in findings
    # And what the flipped digest no longer matches is named.
    assert any("(in checkpoint 1)" in finding for finding in findings), findings


def test_checkpoints_taken_before_0024_keep_their_json_listings_and_verify(
    agent: Agent, run: Run
) -> None:
    """A ledger older than packed listings: its checkpoints list heads as JSON, verify as
    they did, and an edit of one is still caught; the next checkpoint packs its own."""
    completed_steps(agent, run)  # checkpoint 1, packed
    old = Checkpoint.objects.get(seq=1)
    # As it was taken before 0024: the JSON listings, signed as such.
    old.heads, old.attempts = old.listed("heads"), old.listed("attempts")
    old.packed_heads = old.packed_attempts = b""
    old.hash = chain.event_hash(old.content())
    old.save()
    later, _ = step_post(agent=agent, run=run, key="later", tool_name="echo", input={})
    newer = chain.checkpoint_take()
    assert newer is not None
    assert newer.prev_hash == old.hash
    assert [head[0] for head in newer.listed("heads")] == [str(later.pk)]
    assert len(newer.packed_heads) == 68

    assert chain.verify_ledger().findings == []
    sql(f"UPDATE {CHECKPOINTS} SET heads = %s WHERE seq = 1", [json.dumps(old.heads[1:])])
    assert verify() == ["checkpoint 1: its content does not match its hash"]


def test_a_checkpoint_holding_both_listings_is_caught(agent: Agent, run: Run) -> None:
    completed_steps(agent, run)
    heads = Checkpoint.objects.get(seq=1).listed("heads")
    sql(f"UPDATE {CHECKPOINTS} SET heads = %s WHERE seq = 1", [json.dumps(heads)])

    assert verify() == ["checkpoint 1: holds two listings"]


def test_a_deleted_checkpoint_is_caught(agent: Agent, run: Run) -> None:
    completed_steps(agent, run)
    chain.checkpoint_take()
    chain.checkpoint_take()
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
    # Checkpoint 1 lists every step where it stands: nothing changed since, nothing listed.
    assert newest.listed("heads") == []


def test_a_checkpoint_lists_each_step_changed_since_the_one_before_once(
    agent: Agent, run: Run
) -> None:
    completed_steps(agent, run)  # checkpoint 1 lists all three
    # Their moves are within the next ones' overlap window: read again, not listed again.
    assert listed(chain.checkpoint_take()) == []
    later, _ = step_post(agent=agent, run=run, key="later", tool_name="echo", input={})

    checkpoint = chain.checkpoint_take()

    assert checkpoint is not None
    assert [(head[0], head[2]) for head in checkpoint.listed("heads")] == [(str(later.pk), 1)]
    assert listed(chain.checkpoint_take()) == []
    assert engine.process(later.pk, worker="w1") == State.COMPLETED
    assert [head[0] for head in listed(chain.checkpoint_take())] == [str(later.pk)]
    assert chain.verify_ledger().findings == []


# --- approvals, attempts, run events and budgets are in the chain too ------------------------

RUNS = Run._meta.db_table
RUN_EVENTS = RunEvent._meta.db_table


@pytest.fixture
def decided(agent: Agent, workspace: Workspace, reviewer: Any) -> Iterator[dict[str, Any]]:
    """A run with a budget whose step a reviewer approved and the engine completed, whose
    budget a reviewer extended, paused and resumed; then a checkpoint."""
    with tooling.installed(agent):
        yield _decided(agent, workspace, reviewer)


def _decided(agent: Agent, workspace: Workspace, reviewer: Any) -> dict[str, Any]:
    run, _ = run_create(agent=agent, name="decided", max_calls=5)
    tool_policy_set(workspace=workspace, tool="test.pure", approval="always")
    step, _ = step_post(agent=agent, run=run, key="k", tool_name="test.pure", input={})
    step_approve(step=step, user=reviewer, version=step.version, reason="looks right")
    assert engine.process(step.pk, worker="w1") == State.COMPLETED
    run_extend_budget(run=run, user=reviewer, version=run.version, reason="more room", add_calls=5)
    runs.pause(run, reason="deadline check", actor="policy")
    runs.resume(run, actor="user:bob", reason="carry on")
    assert chain.checkpoint_take() is not None
    approval = Approval.objects.get(step=step, approver=reviewer)
    return {"run": run, "step": step, "approval": approval, "attempt": step.attempts.get()}


def test_an_untouched_ledger_with_decisions_verifies(decided: dict[str, Any]) -> None:
    out = StringIO()

    call_command("verify_ledger", stdout=out)

    assert out.getvalue().splitlines()[0].endswith(" 0 broken")


@pytest.mark.parametrize(
    ("column", "value"),
    [("reason", "rubber-stamped"), ("input_hash", "0" * 64), ("approver_id", None)],
    ids=["reason", "input_hash", "approver"],
)
def test_editing_an_approval_is_caught(
    decided: dict[str, Any], owner: Any, column: str, value: Any
) -> None:
    approval, step = decided["approval"], decided["step"]
    value = owner.pk if column == "approver_id" else value
    sql(f"UPDATE {APPROVALS} SET {column} = %s WHERE id = %s", [value, approval.pk])

    findings = verify()

    approved = Event.objects.get(step=step, to_state=State.APPROVED)
    assert findings == [
        f"step {step.pk}: event {approved.pk} (seq {approved.seq}): the approval it recorded "
        "is no longer there as it was: its approver, reason, input hash or policy version was "
        "edited, or it was deleted",
        f"step {step.pk}: no event: approval {approval.pk} is recorded by no event: it was "
        "added or edited behind the application's back",
    ]


def test_deleting_an_approval_is_caught(decided: dict[str, Any]) -> None:
    approval, step = decided["approval"], decided["step"]
    sql(f"DELETE FROM {APPROVALS} WHERE id = %s", [approval.pk])

    [finding] = verify()

    assert finding.startswith(f"step {step.pk}: event ")
    assert finding.endswith(
        "the approval it recorded is no longer there as it was: its "
        "approver, reason, input hash or policy version was edited, or it "
        "was deleted"
    )


def test_editing_the_policys_approval_of_a_posted_step_is_caught(agent: Agent, run: Run) -> None:
    # The policy's approval has no row: the Event that approved the step records its version.
    # That is the step's post, which passed through approved on its way to pending.
    [step, *_] = completed_steps(agent, run, 1)
    assert not Approval.objects.filter(step=step).exists()
    posted = Event.objects.get(step=step, seq=1)
    assert posted.data["through"] == [State.PLANNED, State.APPROVED]
    assert posted.data["policy_version"] != "v0"
    sql(
        f"UPDATE {EVENTS} SET data = %s WHERE id = %s",
        [json.dumps({**posted.data, "policy_version": "v0"}), posted.pk],
    )

    [finding] = verify()

    assert finding.startswith(f"step {step.pk}: event ")
    assert "its content does not match its hash: it was edited" in finding


def test_a_policy_approval_row_added_by_hand_is_caught(agent: Agent, run: Run) -> None:
    [step, *_] = completed_steps(agent, run, 1)
    forged = Approval.objects.create(
        step=step,
        input_hash=step.input_hash,
        tool=step.tool_id,
        policy_version="x",
        reason="the tool's policy needs no approval",
        approved_at=timezone.now(),
    )

    assert verify() == [
        f"step {step.pk}: no event: approval {forged.pk} is recorded by no event: it was added "
        "or edited behind the application's back"
    ]


def test_an_approval_added_by_hand_is_caught(decided: dict[str, Any], owner: Any) -> None:
    step = decided["step"]
    forged = Approval.objects.create(
        step=step,
        input_hash=step.input_hash,
        tool=step.tool_id,
        policy_version="x",
        approver=owner,
        reason="trust me",
        approved_at=timezone.now(),
        expires_at=timezone.now() + timedelta(hours=1),
    )

    assert verify() == [
        f"step {step.pk}: no event: approval {forged.pk} is recorded by no event: it was added "
        "or edited behind the application's back"
    ]


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("response_evidence", json.dumps({"external_id": "forged"})),
        ("request_evidence", json.dumps({"tool": "test.pure", "input": {"amount": 1}})),
        ("error_class", "transient"),
        ("error_message", "it never happened"),
    ],
)
def test_editing_a_closed_attempts_evidence_or_error_is_caught(
    decided: dict[str, Any], column: str, value: str
) -> None:
    attempt, step = decided["attempt"], decided["step"]
    sql(f"UPDATE {ATTEMPTS} SET {column} = %s WHERE id = %s", [value, attempt.pk])

    assert verify() == [
        f"attempt {attempt.pk} of step {step.pk} (in checkpoint 1): is not what was signed: "
        "its evidence, error, cost, worker or fence was edited"
    ]


def test_deleting_an_attempt_is_caught(decided: dict[str, Any]) -> None:
    attempt, step = decided["attempt"], decided["step"]
    sql(f"DELETE FROM {ATTEMPTS} WHERE id = %s", [attempt.pk])

    findings = verify()

    claimed = Event.objects.get(step=step, to_state=State.RUNNING)
    assert findings == [
        f"step {step.pk}: event {claimed.pk} (seq {claimed.seq}): attempt 1 it opened was deleted",
        f"attempt {attempt.pk} of step {step.pk} (in checkpoint 1): was deleted",
    ]


def test_an_attempt_added_by_hand_is_caught(decided: dict[str, Any]) -> None:
    step = decided["step"]
    Attempt.objects.create(step=step, number=2, fence=9, worker="w9", phase="errored")

    assert verify() == [
        f"step {step.pk}: no event: attempt 2 was opened by no claim: it was added behind the "
        "application's back"
    ]


@pytest.mark.parametrize(("column", "value"), [("actor", "user:alice"), ("reason", "approved")])
def test_editing_a_run_events_actor_or_reason_is_caught(
    decided: dict[str, Any], column: str, value: str
) -> None:
    run = decided["run"]
    extended = RunEvent.objects.get(run=run, action=RunAction.BUDGET_EXTENDED)
    sql(f"UPDATE {RUN_EVENTS} SET {column} = %s WHERE id = %s", [value, extended.pk])

    assert verify() == [
        f"run {run.pk}: run event {extended.pk} (budget_extended): its content does not match "
        "its hash: its actor, reason or data was edited"
    ]


@pytest.mark.parametrize("which", ["first", "last"])
def test_deleting_a_run_event_is_caught(decided: dict[str, Any], which: str) -> None:
    run = decided["run"]
    events = list(RunEvent.objects.filter(run=run).order_by("pk"))
    gone = events[0] if which == "first" else events[-1]
    sql(f"DELETE FROM {RUN_EVENTS} WHERE id = %s", [gone.pk])

    [finding] = verify()

    assert finding.startswith(f"run {run.pk}: ")
    if which == "first":
        assert "does not link to the run event before it" in finding
    else:
        assert "its newest run events are not what was sealed" in finding


@pytest.mark.parametrize(
    ("column", "value"),
    [("max_calls", 1000), ("max_cost", "99.0000"), ("deadline", "2099-01-01 00:00:00+00:00")],
)
def test_editing_a_runs_budget_is_caught(decided: dict[str, Any], column: str, value: Any) -> None:
    run = decided["run"]
    sql(f"UPDATE {RUNS} SET {column} = %s WHERE id = %s", [value, run.pk.hex])

    assert verify() == [
        f"run {run.pk}: its budget (max_calls, max_cost, deadline) or its newest run events are "
        "not what was sealed: the budget was edited or run events were cut"
    ]


# --- anchors outside the database ------------------------------------------------------------


@pytest.fixture
def exported(settings: Any, tmp_path: Any) -> Any:
    settings.EXECUTOR_CHECKPOINT_EXPORT = str(tmp_path / "checkpoints.log")
    return tmp_path / "checkpoints.log"


def test_each_checkpoint_is_exported_to_the_file_and_the_log(
    agent: Agent, run: Run, exported: Any, caplog: Any
) -> None:
    with caplog.at_level("INFO", logger="executor.ledger.chain"):
        completed_steps(agent, run)
        second = chain.checkpoint_take()

    assert second is not None
    kept = chain.read_exported(exported)
    assert kept == list(Checkpoint.objects.order_by("seq").values_list("seq", "hash"))
    assert len(kept) == 2
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint")]
    assert logged == exported.read_text().splitlines()


def test_all_checkpoints_deleted_and_a_tail_cut_is_caught_against_the_export(
    agent: Agent, run: Run, exported: Any
) -> None:
    steps = completed_steps(agent, run)
    cut = steps[1]
    cut_tail(cut)
    sql(f"DELETE FROM {CHECKPOINTS}", [])

    call_command("verify_ledger", stdout=StringIO())  # without the export, nothing shows
    out = StringIO()
    with pytest.raises(CommandError, match="the ledger is broken"):
        call_command("verify_ledger", "--against", str(exported), stdout=out)

    assert out.getvalue().splitlines()[:-1] == [
        "checkpoint 1: is kept outside the database but is missing from it: checkpoints were "
        "deleted"
    ]


def test_checkpoints_rewritten_with_the_key_are_caught_against_the_export(
    agent: Agent, run: Run, exported: Any
) -> None:
    completed_steps(agent, run)
    kept = exported.read_text()
    sql(f"DELETE FROM {CHECKPOINTS}", [])
    chain.checkpoint_take(now=timezone.now() + timedelta(seconds=1))  # a new checkpoint 1
    exported.write_text(kept)

    out = StringIO()
    with pytest.raises(CommandError):
        call_command("verify_ledger", "--against", str(exported), stdout=out)

    [finding] = out.getvalue().splitlines()[:-1]
    assert finding.startswith("checkpoint 1: is not the one kept outside the database (hash ")
    assert finding.endswith("): it was rewritten")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "holds no exported checkpoint head"),
        ('checkpoint signed {"seq": "x"}\n', ":1: not an exported checkpoint head"),
    ],
)
def test_against_a_file_that_holds_no_heads_is_refused(
    tmp_path: Any, text: str, error: str
) -> None:
    path = tmp_path / "heads.log"
    path.write_text(text)

    with pytest.raises(CommandError, match=error):
        call_command("verify_ledger", "--against", str(path), stdout=StringIO())
    with pytest.raises(CommandError, match="No such file"):
        call_command("verify_ledger", "--against", str(tmp_path / "none"), stdout=StringIO())


def test_since_verifies_what_changed_after_that_checkpoint(agent: Agent, run: Run) -> None:
    with mock.patch("django.utils.timezone.now", return_value=timezone.now() - timedelta(hours=1)):
        completed_steps(agent, run)  # checkpoint 1, an hour ago
    later, _ = step_post(agent=agent, run=run, key="later", tool_name="echo", input={})
    assert engine.process(later.pk, worker="w1") == State.COMPLETED
    checkpoint = chain.checkpoint_take()
    assert checkpoint is not None
    assert [head[0] for head in checkpoint.listed("heads")] == [str(later.pk)]  # checkpoint 2
    sql(f"UPDATE {STEPS} SET external_id = %s WHERE id = %s", ["forged", later.pk.hex])

    out = StringIO()
    with pytest.raises(CommandError):
        call_command("verify_ledger", "--since", "2", stdout=out)

    lines = out.getvalue().splitlines()
    assert lines[-1] == "1 steps, 3 events verified, 1 broken"
    assert lines[0].startswith(f"step {later.pk}: event ")
    with pytest.raises(CommandError, match="--since: there is no checkpoint 7"):
        call_command("verify_ledger", "--since", "7", stdout=StringIO())


def test_against_reads_the_heads_from_a_json_log(
    agent: Agent, run: Run, exported: Any, tmp_path: Any
) -> None:
    completed_steps(agent, run)
    log = tmp_path / "worker.jsonl"
    log.write_text(
        '{"level": "INFO", "message": "sweep: nothing"}\n'
        + "".join(
            json.dumps({"level": "INFO", "message": line}) + "\n"
            for line in exported.read_text().splitlines()
        )
    )
    sql(f"DELETE FROM {CHECKPOINTS}", [])

    out = StringIO()
    with pytest.raises(CommandError):
        call_command("verify_ledger", "--against", str(log), stdout=out)

    assert out.getvalue().splitlines()[0].startswith("checkpoint 1: is kept outside")
