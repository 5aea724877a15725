"""The engine in-process: commit points, fencing, recovery of expired leases (DESIGN.md §5, §7).

No broker and no worker process: the tests call the engine the way a task would, with every
message dropped, and build each crash situation from the engine's own commit points.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.utils import timezone

from executor import engine
from executor.common import dispatch, faults
from executor.contract.tool import (
    FailureClass,
    Invocation,
    Lookup,
    LookupOutcome,
    ToolError,
    ToolResult,
)
from executor.engine import recovery
from executor.ledger import transitions
from executor.ledger.records import Agent, Attempt, Phase, Run, Step
from executor.ledger.states import State
from tests.support import tooling
from tests.support.factories import chain_problems
from tests.support.tooling import (
    KeyedTool,
    LookupTool,
    PureTool,
    ReadTool,
    WeakLookupTool,
    WriteTool,
    approve_as,
    attempts,
    call_tool,
    expire_lease,
    history,
    post,
    reload,
    store_response,
    submit,
)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def engine_env(agent: Agent) -> Iterator[None]:
    with tooling.installed(agent), dispatch.publishing(dispatch.dropping_publisher):
        yield


# A post is one Event: planned and approved by the policy, passed through as it was recorded.
POSTED = [("", State.PENDING, "agent:alice-bot")]


# --- happy paths ----------------------------------------------------------------------------


def test_pure_step_completes_in_two_commits_with_one_attempt(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.pure")

    assert engine.process(step.pk, worker="w1") == State.COMPLETED

    row = reload(step)
    assert row.state == State.COMPLETED
    assert row.result == {"echo": step.input}
    assert row.lease_owner == ""
    assert row.lease_expires_at is None
    assert history(step) == [
        *POSTED,
        (State.PENDING, State.RUNNING, "executor:w1"),
        (State.RUNNING, State.COMPLETED, "executor:w1"),
    ]
    [attempt] = attempts(step)
    assert (attempt.number, attempt.fence, attempt.worker) == (1, 1, "w1")
    assert attempt.phase == Phase.RESPONDED
    assert attempt.submitted_at is not None
    assert attempt.finished_at is not None
    # The submitting point is part of the claim's commit: same instant as the claim event.
    claim_event = row.events.get(to_state=State.RUNNING)
    assert attempt.submitted_at == claim_event.created_at
    assert len(PureTool.calls) == 1
    assert chain_problems(step) == []


def test_write_step_goes_through_verifying_to_completed(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")

    assert engine.process(step.pk, worker="w1") == State.COMPLETED

    row = reload(step)
    assert row.external_id == f"test.write-{step.operation_id}-1"
    assert history(step) == [
        *POSTED,
        (State.PENDING, State.RUNNING, "executor:w1"),
        (State.RUNNING, State.VERIFYING, "executor:w1"),
        (State.VERIFYING, State.COMPLETED, "executor:w1"),
    ]
    [attempt] = attempts(step)
    assert attempt.phase == Phase.RESPONDED
    assert attempt.submitted_at is not None
    assert attempt.response_evidence == {"external_id": row.external_id}
    assert attempt.request_evidence == {"tool": "test.write", "input": step.input}
    [call] = WriteTool.calls
    assert (call.operation_id, call.fence, call.attempt) == (str(step.operation_id), 1, 1)
    assert chain_problems(step) == []


def test_completion_consumes_the_approval(agent: Agent, run: Run, reviewer: Any) -> None:
    step = post(agent, run, "test.destructive")
    approve_as(reviewer, step)

    assert engine.process(step.pk, worker="w1") == State.COMPLETED

    [approval] = step.approvals.all()
    assert approval.consumed_at is not None


def test_a_step_the_policy_approves_runs_with_no_approval_row(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")

    assert engine.process(step.pk, worker="w1") == State.COMPLETED

    assert not step.approvals.exists()
    assert chain_problems(reload(step)) == []


def test_step_becomes_pending_only_when_its_dependency_completes(agent: Agent, run: Run) -> None:
    first = post(agent, run, "test.pure", key="first")
    second = post(agent, run, "test.write", key="second", depends_on=["first"])
    assert reload(second).state == State.APPROVED

    assert engine.process(second.pk, worker="w1") == engine.Outcome.SKIPPED
    assert WriteTool.calls == []

    engine.process(first.pk, worker="w1")
    assert reload(second).state == State.PENDING

    assert engine.process(second.pk, worker="w1") == State.COMPLETED
    assert len(WriteTool.calls) == 1


def test_drain_completes_every_due_step(agent: Agent, run: Run) -> None:
    steps = [post(agent, run, "test.pure") for _ in range(4)]

    assert engine.drain(worker="w1", limit=10) == 4

    assert {reload(s).state for s in steps} == {State.COMPLETED}
    assert len(PureTool.calls) == 4


# --- duplicate messages ---------------------------------------------------------------------


def test_duplicate_message_executes_the_step_once(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")

    assert engine.process(step.pk, worker="w1") == State.COMPLETED
    assert engine.process(step.pk, worker="w2") == engine.Outcome.SKIPPED

    assert len(WriteTool.calls) == 1
    assert len(attempts(step)) == 1


def test_message_for_a_step_another_worker_holds_is_skipped(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")
    claim = engine.claim_step(step.pk, worker="A")
    assert isinstance(claim, engine.Claim)

    assert engine.process(step.pk, worker="B") == engine.Outcome.SKIPPED

    assert WriteTool.calls == []
    assert reload(step).lease_owner == "A"


# --- fencing --------------------------------------------------------------------------------


def take_over(step: Step, *, worker: str = "B") -> engine.Claim:
    """A's lease expires, the sweeper recovers the step, and `worker` claims it."""
    expire_lease(step)
    assert recovery.recover_expired(step.pk, actor="sweeper") == State.PENDING
    claim = engine.claim_step(step.pk, worker=worker)
    assert isinstance(claim, engine.Claim)
    return claim


def test_stale_worker_response_writes_nothing_to_the_step(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.keyed")
    claim_a = engine.claim_step(step.pk, worker="A")
    assert isinstance(claim_a, engine.Claim)
    submit(claim_a)
    late_answer = call_tool(claim_a)
    claim_b = take_over(step)
    before = reload(step)
    events_before = len(history(step))

    outcome = engine.persist_response(claim_a, late_answer)

    assert outcome == engine.Outcome.FENCED_OUT
    row = reload(step)
    assert (row.state, row.version, row.fence, row.lease_owner) == (
        before.state,
        before.version,
        before.fence,
        "B",
    )
    assert row.external_id == ""
    assert row.result is None
    assert len(history(step)) == events_before
    refused = Attempt.objects.get(pk=claim_a.attempt.pk)
    assert refused.fenced_out_at is not None
    assert refused.fenced_out_write == "responded"
    assert refused.fenced_out_evidence["external_id"] == late_answer.external_id
    assert refused.response_evidence is None
    assert Attempt.objects.get(pk=claim_b.attempt.pk).fenced_out_at is None

    assert engine.execute_claimed(claim_b) == State.COMPLETED
    assert reload(step).external_id == f"test.keyed-{step.operation_id}-2"


def test_stale_worker_failure_writes_nothing_to_the_step(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.keyed")
    claim_a = engine.claim_step(step.pk, worker="A")
    assert isinstance(claim_a, engine.Claim)
    submit(claim_a)
    take_over(step)
    before = reload(step)

    outcome = engine.handle_failure(claim_a, ToolError(FailureClass.INVALID_INPUT, "late"))

    assert outcome == engine.Outcome.FENCED_OUT
    row = reload(step)
    assert (row.state, row.version, row.fence, row.failure_class) == (
        State.RUNNING,
        before.version,
        before.fence,
        "",
    )
    refused = Attempt.objects.get(pk=claim_a.attempt.pk)
    assert refused.fenced_out_write == "failure:invalid_input"
    # Recovery closed it; the stale worker's failure did not reopen or relabel it.
    assert (refused.phase, refused.error_class) == (Phase.ABANDONED, "lease_expired")


def test_stale_worker_never_calls_the_tool_after_a_take_over(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")
    claim_a = engine.claim_step(step.pk, worker="A")
    assert isinstance(claim_a, engine.Claim)
    take_over(step)

    assert engine.execute_claimed(claim_a) == engine.Outcome.FENCED_OUT

    assert WriteTool.calls == []
    assert Attempt.objects.get(pk=claim_a.attempt.pk).fenced_out_write == "submitting"
    assert reload(step).lease_owner == "B"


def test_heartbeat_of_a_stale_worker_reports_the_lease_lost(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.keyed")
    claim_a = engine.claim_step(step.pk, worker="A")
    assert isinstance(claim_a, engine.Claim)
    claim_b = take_over(step)
    lease_b = reload(step).lease_expires_at

    assert engine.still_holds_lease(claim_a, now=timezone.now()) is False
    assert reload(step).lease_expires_at == lease_b
    assert engine.still_holds_lease(claim_b, now=timezone.now()) is True


@pytest.mark.django_db(transaction=True)
def test_heartbeat_extends_the_lease_while_a_long_call_runs(
    agent: Agent, run: Run, settings: Any
) -> None:
    settings.EXECUTOR_LEASE_SECONDS = 1  # the heartbeat beats every 0.5 s
    step = post(agent, run, "test.keyed")
    leases: list[datetime] = []

    def long_call(call: Invocation) -> ToolResult:
        # The call lasts until the heartbeat has moved the lease on, or gives up.
        leases.append(reload(step).lease_expires_at)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lease = reload(step).lease_expires_at
            if lease > leases[0]:
                leases.append(lease)
                break
            time.sleep(0.05)
        return ToolResult(result={"done": True}, external_id="slow-1")

    KeyedTool.will(long_call)

    assert engine.process(step.pk, worker="w1") == State.COMPLETED

    assert len(leases) == 2, "the heartbeat never extended the lease"
    assert reload(step).external_id == "slow-1"


def test_recovery_leaves_alone_a_lease_renewed_after_the_sweeper_read_it(
    agent: Agent, run: Run
) -> None:
    step = post(agent, run, "test.write")
    claim_a = engine.claim_step(step.pk, worker="A")
    assert isinstance(claim_a, engine.Claim)
    expire_lease(step)
    fired = False

    # Two processes cannot be interleaved at one exact point on demand; this hook runs worker
    # A's next commit (renew the lease, mark submitting: execute_claimed's first commit) at
    # the moment the sweeper opens its transaction, after it read the step and the attempt.
    def worker_a_commits_first(execute: Any, sql: str, *args: Any) -> Any:
        nonlocal fired
        if not fired and sql.lstrip().upper().startswith("SAVEPOINT"):
            fired = True
            submit(claim_a)
        return execute(sql, *args)

    with connection.execute_wrapper(worker_a_commits_first):
        outcome = recovery.recover_expired(step.pk, actor="sweeper")
    assert fired
    call_tool(claim_a)  # A is in its call now

    assert outcome == engine.Outcome.SKIPPED
    assert reload(step).state == State.RUNNING
    assert engine.process(step.pk, worker="B") == engine.Outcome.SKIPPED
    assert len(WriteTool.calls) == 1


# --- recovery of expired leases (DESIGN.md §7), one test per row ------------------------------


def claimed(step: Step, *, worker: str = "A") -> engine.Claim:
    claim = engine.claim_step(step.pk, worker=worker)
    assert isinstance(claim, engine.Claim)
    return claim


def test_recovery_of_a_leased_step_without_attempt_makes_it_pending(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")
    transitions.move(
        step,
        State.RUNNING,
        actor="executor:A",
        changes={
            "fence": step.fence + 1,
            "lease_owner": "A",
            "lease_expires_at": timezone.now(),
        },
    )
    expire_lease(step)

    assert recovery.recover_expired(step.pk) == State.PENDING

    assert reload(step).not_before is not None
    assert engine.process(step.pk, worker="B") == State.COMPLETED
    assert len(WriteTool.calls) == 1


def test_recovery_of_a_claimed_attempt_makes_it_pending(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")
    claim = claimed(step)
    expire_lease(step)

    assert recovery.recover_expired(step.pk, actor="sweeper:s1") == State.PENDING

    row = reload(step)
    assert (row.lease_owner, row.operation_id) == ("", step.operation_id)
    assert history(step)[-1] == (State.RUNNING, State.PENDING, "sweeper:s1")
    abandoned = Attempt.objects.get(pk=claim.attempt.pk)
    assert (abandoned.phase, abandoned.error_class) == (Phase.ABANDONED, "lease_expired")
    assert engine.process(step.pk, worker="B") == State.COMPLETED
    assert len(WriteTool.calls) == 1


@pytest.mark.parametrize(("tool", "calls"), [("test.pure", PureTool), ("test.read", ReadTool)])
def test_recovery_of_a_submitted_pure_or_read_attempt_retries_it(
    agent: Agent, run: Run, tool: str, calls: type[tooling.ScriptedTool]
) -> None:
    step = post(agent, run, tool)
    claim = claimed(step)  # pure and read tools are submitting from the claim on
    assert Attempt.objects.get(pk=claim.attempt.pk).phase == Phase.SUBMITTING
    call_tool(claim)
    expire_lease(step)

    assert recovery.recover_expired(step.pk) == State.PENDING

    assert engine.process(step.pk, worker="B") == State.COMPLETED
    assert len(calls.calls) == 2


def test_recovery_of_a_submitted_keyed_write_retries_it_with_the_same_key(
    agent: Agent, run: Run
) -> None:
    step = post(agent, run, "test.keyed")
    claim = claimed(step)
    submit(claim)
    call_tool(claim)
    expire_lease(step)

    assert recovery.recover_expired(step.pk) == State.PENDING

    assert engine.process(step.pk, worker="B") == State.COMPLETED
    first, second = KeyedTool.calls
    assert first.idempotency_key == second.idempotency_key == str(step.operation_id)
    assert (first.fence, second.fence) == (1, 2)


def lost_lookup_write(agent: Agent, run: Run, tool: str = "test.lookup") -> Step:
    """A write with a lookup whose worker called the tool and died before storing the answer."""
    step = post(agent, run, tool)
    claim = claimed(step)
    submit(claim)
    call_tool(claim)
    expire_lease(step)
    return step


def test_recovery_of_a_submitted_write_with_lookup_found_completes_without_a_second_call(
    agent: Agent, run: Run
) -> None:
    step = lost_lookup_write(agent, run)
    LookupTool.answer = Lookup(LookupOutcome.FOUND, external_id="T-1", result={"ticket": 1})

    recovery.recover_expired(step.pk)
    assert reload(step).state == State.COMPLETED

    row = reload(step)
    assert (row.external_id, row.result) == ("T-1", {"ticket": 1})
    assert [to for _, to, _ in history(step)][-3:] == [
        State.UNKNOWN,
        State.VERIFYING,
        State.COMPLETED,
    ]
    tooling.run_every_automatic_path()
    assert len(LookupTool.calls) == 1
    assert len(LookupTool.lookups) == 1


def test_recovery_of_a_submitted_write_with_lookup_not_found_retries_the_same_operation(
    agent: Agent, run: Run
) -> None:
    step = lost_lookup_write(agent, run)
    LookupTool.answer = Lookup(LookupOutcome.NOT_FOUND)

    recovery.recover_expired(step.pk)
    assert reload(step).state == State.PENDING

    assert reload(step).operation_id == step.operation_id
    assert engine.process(step.pk, worker="B") == State.COMPLETED
    first, second = LookupTool.calls
    assert first.operation_id == second.operation_id == str(step.operation_id)


def test_recovery_of_a_submitted_write_whose_lookup_cannot_tell_stays_unknown(
    agent: Agent, run: Run
) -> None:
    step = lost_lookup_write(agent, run)
    LookupTool.answer = Lookup(LookupOutcome.CANNOT_TELL)

    assert recovery.recover_expired(step.pk) == State.UNKNOWN

    row = reload(step)
    assert row.failure_class == FailureClass.AMBIGUOUS
    assert engine.process(step.pk, worker="B") == engine.Outcome.SKIPPED
    assert len(LookupTool.calls) == 1


def test_recovery_reports_the_state_the_lookup_left_the_step_in(agent: Agent, run: Run) -> None:
    step = lost_lookup_write(agent, run)
    LookupTool.answer = Lookup(LookupOutcome.FOUND, external_id="T-1")

    outcome = recovery.recover_expired(step.pk)

    assert outcome == reload(step).state == State.COMPLETED


def test_not_found_from_a_lookup_that_is_not_authoritative_proves_nothing(
    agent: Agent, run: Run
) -> None:
    step = lost_lookup_write(agent, run, tool="test.lookup_weak")
    WeakLookupTool.answer = Lookup(LookupOutcome.NOT_FOUND)

    assert recovery.recover_expired(step.pk) == State.UNKNOWN

    engine.process(step.pk, worker="B")
    assert len(WeakLookupTool.calls) == 1


def test_recovery_of_a_submitted_write_without_lookup_or_key_is_never_retried(
    agent: Agent, run: Run
) -> None:
    step = post(agent, run, "test.write")
    claim = claimed(step)
    submit(claim)
    call_tool(claim)
    expire_lease(step)

    assert recovery.recover_expired(step.pk) == State.UNKNOWN

    row = reload(step)
    assert (row.failure_class, row.not_before) == (FailureClass.AMBIGUOUS, None)
    tooling.run_every_automatic_path()
    assert reload(step).state == State.UNKNOWN
    assert len(WriteTool.calls) == 1


def test_recovery_of_a_stored_response_completes_without_submitting_again(
    agent: Agent, run: Run
) -> None:
    step = post(agent, run, "test.write")
    claim = claimed(step)
    submit(claim)
    store_response(claim, call_tool(claim))
    expire_lease(step)

    assert recovery.recover_expired(step.pk) == State.COMPLETED

    row = reload(step)
    assert row.external_id == f"test.write-{step.operation_id}-1"
    assert history(step)[-1][:2] == (State.VERIFYING, State.COMPLETED)
    tooling.run_every_automatic_path()
    assert len(WriteTool.calls) == 1
    assert len(attempts(step)) == 1


def test_recovery_ignores_a_lease_that_has_not_expired(agent: Agent, run: Run) -> None:
    step = post(agent, run, "test.write")
    claimed(step)

    assert recovery.recover_expired(step.pk) == engine.Outcome.SKIPPED

    assert reload(step).state == State.RUNNING


# --- interruption points (faults.py) --------------------------------------------------------


@pytest.fixture
def fresh_faults() -> Iterator[None]:
    faults.reset()
    yield
    faults.reset()


@pytest.mark.parametrize(
    "spec",
    [
        "after_submit",
        "nowhere:0.5",
        "after_submit:often",
        "after_submit:1.5",
        "before_persist:-0.1",
        "after_submit=0.2",
    ],
)
def test_fault_spec_that_is_not_point_rate_is_refused(spec: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="EXECUTOR_FAULTS"):
        faults.parse(spec)


def test_fault_spec_gives_a_rate_per_point() -> None:
    assert faults.parse(" after_submit:0.2, before_persist:1 ,") == {
        "after_submit": 0.2,
        "before_persist": 1.0,
    }
    assert faults.parse("") == {}


@pytest.mark.usefixtures("fresh_faults")
def test_faults_without_permission_are_refused(settings: Any) -> None:
    settings.EXECUTOR_FAULTS = "after_submit:0.2"
    settings.EXECUTOR_ALLOW_FAULTS = False

    with pytest.raises(ImproperlyConfigured, match="EXECUTOR_ALLOW_FAULTS"):
        faults.configured_rates()
    with pytest.raises(ImproperlyConfigured):
        faults.check_startup()


@pytest.mark.usefixtures("fresh_faults")
def test_faults_with_permission_are_configured(settings: Any) -> None:
    settings.EXECUTOR_FAULTS = "after_submit:0.2"
    settings.EXECUTOR_ALLOW_FAULTS = True

    assert faults.configured_rates() == {"after_submit": 0.2}


# Eight threads reach a point whose rate is 1 at once, as the write pool's threads may. The
# log handler writes a hit's line, then waits up to a second for a second hit's line: two
# threads past the point would both be written before either ends the process.
HITS_AT_ONCE = """
import logging
import sys
import threading
import django
django.setup()
from executor.common import faults

class Meeting(logging.Handler):
    second = threading.Barrier(2, timeout=1)
    def handle(self, record):
        sys.stderr.write(record.getMessage() + "\\n")
        sys.stderr.flush()
        try:
            self.second.wait()
        except threading.BrokenBarrierError:
            pass
        return True

log = logging.getLogger("executor.common.faults")
log.handlers, log.propagate = [Meeting()], False
together = threading.Barrier(8)
def call():
    together.wait()
    faults.hit("before_invoke")
threads = [threading.Thread(target=call) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
"""


def test_threads_hitting_a_point_at_once_end_the_process_once_and_log_one_hit() -> None:
    env = {**os.environ, "EXECUTOR_FAULTS": "before_invoke:1", "EXECUTOR_ALLOW_FAULTS": "1"}

    ended = subprocess.run(
        [sys.executable, "-c", HITS_AT_ONCE], env=env, capture_output=True, text=True, timeout=60
    )

    assert ended.returncode == faults.CRASH_EXIT_STATUS, ended.stderr
    # The drill counts logged hits as crashes: one ending, one line.
    assert (ended.stdout + ended.stderr).count("fault injected at before_invoke") == 1


@pytest.mark.usefixtures("fresh_faults")
def test_zero_rate_fault_point_lets_the_step_complete(
    settings: Any, agent: Agent, run: Run
) -> None:
    settings.EXECUTOR_FAULTS = "before_invoke:0,after_submit:0,before_persist:0"
    settings.EXECUTOR_ALLOW_FAULTS = True
    step = post(agent, run, "test.write")

    assert engine.process(step.pk, worker="w1") == State.COMPLETED


def test_message_for_an_unknown_step_id_is_skipped() -> None:
    missing = "00000000-0000-0000-0000-000000000000"

    assert engine.process(missing) == engine.Outcome.SKIPPED
    assert recovery.recover_expired(missing) == engine.Outcome.SKIPPED
    assert recovery.reconcile(missing) == engine.Outcome.SKIPPED
