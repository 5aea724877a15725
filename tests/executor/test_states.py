"""The table of allowed moves is complete and has no dead ends (DESIGN.md §4)."""

from __future__ import annotations

from collections import deque

import pytest

from executor.ledger.states import (
    ALLOWED,
    CANCELLABLE,
    CONFIRMED,
    ENDED_WITHOUT_EFFECT,
    IN_FLIGHT,
    IN_PROGRESS,
    INBOX,
    LEASED,
    NEEDS_REVIEW,
    PROGRESS_ORDER,
    REPORT_SECTIONS,
    SETTLED,
    TERMINAL,
    State,
    is_allowed,
)
from stepward_client import client


def reachable(start: State) -> set[State]:
    """States reachable from `start` in one or more moves."""
    seen: set[State] = set()
    queue = deque(ALLOWED[start])
    while queue:
        state = queue.popleft()
        if state not in seen:
            seen.add(state)
            queue.extend(ALLOWED[state])
    return seen


def test_there_are_thirteen_states_and_each_has_an_entry_in_the_table() -> None:
    assert len(State) == 13
    assert set(ALLOWED) == set(State)


def test_every_target_in_the_table_is_a_state() -> None:
    for source, targets in ALLOWED.items():
        assert all(isinstance(t, State) for t in targets), source


def test_terminal_states_are_exactly_rejected_cancelled_and_compensated() -> None:
    assert {State.REJECTED, State.CANCELLED, State.COMPENSATED} == TERMINAL
    for state in TERMINAL:
        assert ALLOWED[state] == frozenset()


def test_leased_review_and_settled_sets_are_what_the_design_says() -> None:
    assert {State.RUNNING, State.VERIFYING} == LEASED
    assert {State.UNKNOWN, State.DEAD, State.BLOCKED} == NEEDS_REVIEW
    assert NEEDS_REVIEW | {State.PLANNED} == INBOX
    # Settled: at an outcome or waiting for a person; the rest moves on by itself or awaits
    # its approval.
    assert {State.PLANNED, State.APPROVED, State.PENDING, *LEASED} == IN_PROGRESS
    assert set(State) - IN_PROGRESS == SETTLED
    assert TERMINAL <= SETTLED
    assert NEEDS_REVIEW <= SETTLED
    assert IN_PROGRESS - {State.PLANNED} == IN_FLIGHT


def test_the_report_sections_partition_the_states() -> None:
    sections = [state for states in REPORT_SECTIONS.values() for state in states]
    assert sorted(sections) == sorted(State)


def test_the_progress_bar_shows_every_state_once() -> None:
    assert sorted(PROGRESS_ORDER) == sorted(State)


def test_nothing_cancellable_was_submitted_and_nothing_confirmed_ended_without_effect() -> None:
    assert not CANCELLABLE & (LEASED | CONFIRMED | TERMINAL)
    assert not CONFIRMED & ENDED_WITHOUT_EFFECT
    assert ENDED_WITHOUT_EFFECT <= SETTLED


def test_the_clients_copy_of_the_states_is_the_ledgers() -> None:
    # stepward_client/client.py stands alone (copied into agents): its copy is checked here.
    assert {state.value for state in State} == client.STATES
    assert {state.value for state in IN_PROGRESS} == client.IN_PROGRESS
    assert {state.value for state in SETTLED} == client.SETTLED


def test_every_state_is_reachable_from_planned() -> None:
    assert reachable(State.PLANNED) | {State.PLANNED} == set(State)


@pytest.mark.parametrize("state", sorted(set(State) - TERMINAL))
def test_every_non_terminal_state_can_reach_a_terminal_or_review_state(state: State) -> None:
    assert reachable(state) & (TERMINAL | NEEDS_REVIEW)


@pytest.mark.parametrize("state", sorted(set(State) - TERMINAL))
def test_no_non_terminal_state_is_a_trap_without_a_way_to_a_terminal_state(
    state: State,
) -> None:
    assert reachable(state) & TERMINAL


def test_a_completed_step_can_only_ever_become_compensated() -> None:
    # Confirmed work is never repeated (DESIGN.md §13): nothing leads from completed back
    # to pending, and so to another submission.
    assert reachable(State.COMPLETED) == {State.COMPENSATED}


def test_is_allowed_accepts_states_and_their_string_values() -> None:
    assert is_allowed(State.PLANNED, State.APPROVED)
    assert is_allowed("planned", "approved")
    assert not is_allowed("planned", "running")
    assert not is_allowed(State.COMPLETED, State.PENDING)


def test_is_allowed_refuses_a_name_that_is_not_a_state() -> None:
    with pytest.raises(ValueError):
        is_allowed("planned", "done")
