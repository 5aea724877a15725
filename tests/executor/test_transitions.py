"""transitions.move is the only way a step changes state, and it cannot be fooled (DESIGN.md §4)."""

from __future__ import annotations

import threading

import hypothesis
import pytest
from django.db import IntegrityError, connection, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor.ledger.records import Event, Run, Step
from executor.ledger.states import ALLOWED, LEASED, TERMINAL, State
from executor.ledger.transitions import IllegalTransition, StaleStep, event_hash, move
from tests.support.factories import (
    WORKER,
    advance,
    chain_problems,
    changes_for,
    event_count,
    snapshot,
    step_in,
)

ALLOWED_PAIRS = sorted(
    (source, target) for source, targets in ALLOWED.items() for target in targets
)
REFUSED_PAIRS = sorted(
    (source, target) for source in State for target in State if target not in ALLOWED[source]
)


def pair_id(pair: tuple[State, State]) -> str:
    return f"{pair[0]}->{pair[1]}"


# --- every allowed move -------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(("source", "target"), ALLOWED_PAIRS, ids=map(pair_id, ALLOWED_PAIRS))
def test_allowed_move_changes_state_and_writes_one_chained_event(
    run: Run, source: State, target: State
) -> None:
    step = step_in(run, source)
    before = Step.objects.get(pk=step.pk)
    events_before = event_count(step)

    move(
        step,
        target,
        actor="user:bob",
        reason="because the test says so",
        changes=changes_for(step, target),
        data={"note": "checked"},
    )

    row = Step.objects.get(pk=step.pk)
    assert row.state == target
    assert row.version == before.version + 1
    assert (step.state, step.version, step.head_hash) == (row.state, row.version, row.head_hash)
    new_events = list(Event.objects.filter(step_id=step.pk, seq__gt=before.version))
    assert len(new_events) == 1
    assert event_count(step) == events_before + 1
    event = new_events[0]
    assert (event.from_state, event.to_state) == (source, target)
    assert (event.actor, event.reason) == ("user:bob", "because the test says so")
    assert event.data == {"note": "checked"}
    assert event.seq == row.version
    assert event.run_id == run.pk
    assert event.prev_hash == before.head_hash
    assert event_hash(event.content()) == event.hash
    assert row.head_hash == event.hash != before.head_hash
    assert chain_problems(step) == []


@pytest.mark.django_db
@pytest.mark.parametrize(("source", "target"), ALLOWED_PAIRS, ids=map(pair_id, ALLOWED_PAIRS))
def test_allowed_move_keeps_the_lease_only_in_running_and_verifying(
    run: Run, source: State, target: State
) -> None:
    step = step_in(run, source)
    fence_before = Step.objects.get(pk=step.pk).fence

    advance(step, target)

    row = Step.objects.get(pk=step.pk)
    if target in LEASED:
        assert row.lease_owner == WORKER
        assert row.lease_expires_at is not None
    else:
        assert row.lease_owner == ""
        assert row.lease_expires_at is None
    # Only a claim takes a new fence; nothing else may reuse or rewind one.
    assert row.fence == (fence_before + 1 if target == State.RUNNING else fence_before)


# --- every refused move -------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(("source", "target"), REFUSED_PAIRS, ids=map(pair_id, REFUSED_PAIRS))
def test_move_outside_the_table_is_refused_and_changes_nothing(
    run: Run, source: State, target: State
) -> None:
    step = step_in(run, source)
    before = snapshot(step)
    in_memory = (step.state, step.version, step.head_hash)

    with pytest.raises(IllegalTransition) as refused:
        move(step, target, actor="user:bob", changes=changes_for(step, target))

    assert (refused.value.source, refused.value.target) == (source, target)
    assert snapshot(step) == before
    assert (step.state, step.version, step.head_hash) == in_memory


def test_every_state_has_at_least_one_refused_move() -> None:
    assert {source for source, _ in REFUSED_PAIRS} == set(State)


# --- stale readers ------------------------------------------------------------------------


@pytest.mark.django_db
def test_move_from_a_stale_state_raises_stale_step_and_writes_nothing(run: Run) -> None:
    worker_copy = step_in(run, State.PENDING)
    agent_copy = Step.objects.get(pk=worker_copy.pk)
    advance(worker_copy, State.RUNNING)
    after_claim = snapshot(worker_copy)

    with pytest.raises(StaleStep):
        move(agent_copy, State.CANCELLED, actor="agent:alice-bot", reason="too late")

    assert snapshot(worker_copy) == after_claim
    assert (agent_copy.state, agent_copy.version) == (State.PENDING, after_claim[1] - 1)
    assert chain_problems(worker_copy) == []


@pytest.mark.django_db
def test_move_from_a_stale_version_in_the_same_state_raises_stale_step(run: Run) -> None:
    # unknown -> unknown keeps the state, so only the version can tell the readers apart.
    first = step_in(run, State.UNKNOWN)
    second = Step.objects.get(pk=first.pk)
    move(first, State.UNKNOWN, actor="executor:lookup", reason="lookup could not tell")
    after_lookup = snapshot(first)

    with pytest.raises(StaleStep):
        move(second, State.PENDING, actor="user:bob", reason="did not happen")

    assert snapshot(first) == after_lookup
    assert after_lookup[0] == State.UNKNOWN
    assert not Event.objects.filter(
        step_id=first.pk, from_state=State.UNKNOWN, to_state=State.PENDING
    ).exists()


@pytest.mark.django_db
def test_move_with_a_stale_fence_raises_stale_step_and_writes_nothing(run: Run) -> None:
    step = step_in(run, State.RUNNING)
    old_fence = step.fence
    # The lease expired: recovery put it back and another worker claimed it.
    advance(step, State.PENDING, actor="sweeper")
    advance(step, State.RUNNING, actor="executor:other-worker")
    current = Step.objects.get(pk=step.pk)
    assert current.fence == old_fence + 1
    before = snapshot(step)

    with pytest.raises(StaleStep):
        move(current, State.VERIFYING, actor=WORKER, fence=old_fence)

    assert snapshot(step) == before
    assert current.state == State.RUNNING
    move(current, State.VERIFYING, actor="executor:other-worker", fence=current.fence)
    assert Step.objects.get(pk=step.pk).state == State.VERIFYING


@pytest.mark.django_db
def test_state_does_not_change_when_its_event_cannot_be_written(run: Run) -> None:
    step = step_in(run, State.PLANNED)
    # An event already holding the next seq makes the Event insert fail after the UPDATE.
    Event.objects.create(
        run=run,
        step_id=step.pk,
        seq=step.version + 1,
        to_state=State.APPROVED,
        actor="intruder",
        created_at=step.updated_at,
        hash="f" * 64,
    )
    before = snapshot(step)

    with pytest.raises(IntegrityError):
        move(step, State.APPROVED, actor="policy")

    assert snapshot(step) == before
    assert before[0] == State.PLANNED


# --- random walks -------------------------------------------------------------------------


@pytest.mark.django_db
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_random_moves_never_leave_the_table_or_change_state_without_an_event(
    run: Run, data: st.DataObject
) -> None:
    with transaction.atomic():
        # Walks start anywhere short of a terminal state, so the deep states get explored.
        start = data.draw(st.sampled_from(sorted(set(State) - TERMINAL)), label="start")
        step = step_in(run, start)
        visited = {start}
        length = data.draw(st.integers(min_value=1, max_value=30), label="length")
        for _ in range(length):
            current = State(step.state)
            # Most draws come from the table, so walks go somewhere; the rest are any state.
            from_table = data.draw(st.integers(0, 3)) > 0 and bool(ALLOWED[current])
            pool = sorted(ALLOWED[current]) if from_table else list(State)
            target = data.draw(st.sampled_from(pool), label=f"from {current}")
            before = snapshot(step)
            try:
                advance(step, target, actor="hypothesis")
            except IllegalTransition:
                assert target not in ALLOWED[current]
                assert snapshot(step) == before
            else:
                assert target in ALLOWED[current]
                assert snapshot(step)[:2] == (target, before[1] + 1)
                visited.add(target)

            row = Step.objects.get(pk=step.pk)
            events = list(Event.objects.filter(step_id=step.pk).order_by("seq"))
            assert len(events) == row.version
            for event in events[1:]:
                assert State(event.to_state) in ALLOWED[State(event.from_state)]
            assert chain_problems(step) == []
        # Shown by --hypothesis-show-statistics: which states the walks reach.
        for state in visited:
            hypothesis.event(f"visited {state}")
        # Each example starts from a clean ledger.
        transaction.set_rollback(True)


# --- two writers at once ------------------------------------------------------------------


def race_once(step: Step, targets: tuple[State, State]) -> dict[str, str]:
    """Two moves of `step` to `targets`, from the same read, at once; outcomes by target."""
    barrier = threading.Barrier(2)
    outcomes: dict[str, str] = {}

    def contender(name: str, target: State) -> None:
        try:
            mine = Step.objects.get(pk=step.pk)
            # Both have read the same version before either writes.
            barrier.wait(timeout=30)
            try:
                advance(mine, target, actor=name)
                outcomes[name] = "won"
            except StaleStep:
                outcomes[name] = "stale"
        except Exception as exc:  # noqa: BLE001 - a thread's error must reach the assertion
            outcomes[name] = f"error: {exc!r}"
        finally:
            connection.close()

    threads = [
        threading.Thread(target=contender, args=(f"first:{targets[0]}", targets[0])),
        threading.Thread(target=contender, args=(f"second:{targets[1]}", targets[1])),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a contender never finished"
    return outcomes


# A worker's claim against an agent's cancel; and two reviewers' decisions on an unknown
# step, where the state stays the same and only the version tells the two apart.
RACES = [
    (State.PENDING, (State.RUNNING, State.CANCELLED)),
    (State.UNKNOWN, (State.UNKNOWN, State.PENDING)),
]
RACE_ROUNDS = 20


def assert_one_winner_per_round(run: Run, source: State, targets: tuple[State, State]) -> None:
    for number in range(RACE_ROUNDS):
        step = step_in(run, source)
        read_version = step.version

        outcomes = race_once(step, targets)

        assert sorted(outcomes.values()) == ["stale", "won"], f"round {number}: {outcomes}"
        winner = next(name for name, outcome in outcomes.items() if outcome == "won")
        row = Step.objects.get(pk=step.pk)
        assert row.state == winner.split(":", 1)[1]
        assert row.version == read_version + 1
        assert Event.objects.filter(step_id=step.pk, seq=read_version + 1).count() == 1
        assert Event.objects.filter(step_id=step.pk).count() == row.version
        assert chain_problems(step) == []


# Two real connections: on PostgreSQL the row lock serializes the two UPDATEs; on SQLite
# (a file database, WAL, IMMEDIATE transactions) the database lock does. Either way the
# version check leaves exactly one winner.
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("source", "targets"), RACES, ids=["claim-vs-cancel", "two-reviewers"])
def test_two_concurrent_moves_from_one_version_have_exactly_one_winner(
    run: Run, source: State, targets: tuple[State, State]
) -> None:
    assert_one_winner_per_round(run, source, targets)
