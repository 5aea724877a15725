"""Operator commands: create_agent, create_reviewer and verify_ledger (API.md)."""

from __future__ import annotations

import math
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.urls import reverse

from executor.ledger import chain
from executor.ledger.records import (
    REVIEWER_PERMISSIONS,
    Agent,
    Event,
    Run,
    Step,
    Tool,
    Workspace,
    hash_token,
)
from executor.ledger.states import State
from executor.ledger.transitions import event_hash
from executor.services.posting import step_post
from tests.support.api import AgentAuth, ApiClient
from tests.support.factories import advance, step_in, stored_digest

EVENTS = Event._meta.db_table


def run_command(name: str, *args: str, **options: Any) -> list[str]:
    out = StringIO()
    call_command(name, *args, stdout=out, stderr=StringIO(), **options)
    return out.getvalue().splitlines()


def failing_command(name: str, *args: str, **options: Any) -> tuple[list[str], str]:
    out = StringIO()
    with pytest.raises(CommandError) as raised:
        call_command(name, *args, stdout=out, stderr=StringIO(), **options)
    return out.getvalue().splitlines(), str(raised.value)


def raw_sql(sql: str, params: list[Any]) -> None:
    """Changes the ledger behind the application's back, as a tamperer with SQL access would."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def post_steps(agent: Agent, run: Run, count: int) -> list[Step]:
    return [
        step_post(agent=agent, run=run, key=f"step-{n}", tool_name="echo", input={"n": n})[0]
        for n in range(count)
    ]


def event_of(step: Step, seq: int) -> Event:
    return Event.objects.get(step=step, seq=seq)


def claimed_and_released(step: Step) -> Step:
    """A posted step's chain made three events long: its post (seq 1, to pending), a
    worker's claim (seq 2) and its release back to pending for a retry (seq 3)."""
    advance(step, State.RUNNING, actor="executor:test-worker")
    return advance(step, State.PENDING, actor="executor:test-worker", reason="retry")


# --- create_agent -------------------------------------------------------------------------


@pytest.mark.django_db
def test_create_agent_prints_its_token_alone_on_the_last_line() -> None:
    lines = run_command("create_agent", "carol-bot", workspace="initech")

    agent = Agent.objects.get(name="carol-bot", workspace__slug="initech")
    token = lines[-1]
    assert len(lines) >= 2
    assert "carol-bot" in lines[0]
    assert token == token.strip()
    assert " " not in token
    assert hash_token(token) == agent.token_hash


@pytest.mark.django_db
def test_create_agent_token_authenticates_against_the_api() -> None:
    token = run_command("create_agent", "carol-bot", workspace="initech")[-1]
    agent = Agent.objects.get(name="carol-bot")

    response = ApiClient(AgentAuth(agent, token)).get("/api/v1/tools")
    refused = ApiClient(AgentAuth(agent, token + "x")).get("/api/v1/tools")

    assert response.status_code == 200
    assert refused.status_code == 401


@pytest.mark.django_db
def test_create_agent_grants_submit_steps_on_the_workspace_and_use_tool_on_every_tool() -> None:
    run_command("create_agent", "carol-bot", workspace="initech")

    agent = Agent.objects.select_related("user", "workspace").get(name="carol-bot")
    tools = list(Tool.objects.filter(registered=True))
    assert agent.workspace.slug == "initech"
    assert agent.user.has_perm("executor.submit_steps", agent.workspace)
    assert tools
    assert all(agent.user.has_perm("executor.use_tool", tool) for tool in tools)


def test_create_agent_uses_an_existing_workspace(workspace: Workspace) -> None:
    run_command("create_agent", "carol-bot", workspace=workspace.slug)

    assert Workspace.objects.filter(slug=workspace.slug).count() == 1
    assert Agent.objects.get(name="carol-bot").workspace_id == workspace.pk


def test_create_agent_refuses_a_duplicate_name_with_a_command_error(agent: Agent) -> None:
    hash_before = agent.token_hash

    _, message = failing_command("create_agent", agent.name, workspace=agent.workspace.slug)

    agent.refresh_from_db()
    assert "already exists" in message
    assert Agent.objects.filter(name=agent.name).count() == 1
    assert agent.token_hash == hash_before


@pytest.mark.django_db
def test_create_agent_refuses_a_bad_slug_and_creates_nothing() -> None:
    _, message = failing_command("create_agent", "carol-bot", workspace="not a slug")

    assert "slug" in message
    assert not Workspace.objects.exists()
    assert not Agent.objects.exists()


# --- create_reviewer ----------------------------------------------------------------------


def signs_in(username: str, password: str) -> bool:
    """Through the sign-in form, as a person would (the throttling backend needs a request,
    which `Client.login` does not give it)."""
    response = Client().post(reverse("login"), {"username": username, "password": password})
    return response.status_code == 302


@pytest.mark.django_db
def test_create_reviewer_grants_every_reviewer_permission_and_the_password_logs_in() -> None:
    lines = run_command("create_reviewer", "dave", workspace="initech", password="dave-pw")

    user = get_user_model().objects.get(username="dave")
    workspace = Workspace.objects.get(slug="initech")
    assert lines
    assert all(user.has_perm(f"executor.{perm}", workspace) for perm in REVIEWER_PERMISSIONS)
    assert not user.has_perm("executor.submit_steps", workspace)
    assert signs_in("dave", "dave-pw")


@pytest.mark.django_db
def test_create_reviewer_without_a_password_cannot_log_in_yet() -> None:
    lines = run_command("create_reviewer", "dave", workspace="initech")

    user = get_user_model().objects.get(username="dave")
    assert not user.has_usable_password()
    assert any("changepassword" in line for line in lines)


def test_create_reviewer_again_grants_another_workspace_and_keeps_the_password(
    reviewer: Any, workspace: Workspace
) -> None:
    lines = run_command("create_reviewer", reviewer.username, workspace="globex")

    user = get_user_model().objects.get(pk=reviewer.pk)
    globex = Workspace.objects.get(slug="globex")
    assert "Updated existing" in lines[0]
    assert all(user.has_perm(f"executor.{perm}", globex) for perm in REVIEWER_PERMISSIONS)
    assert all(user.has_perm(f"executor.{perm}", workspace) for perm in REVIEWER_PERMISSIONS)
    assert signs_in(reviewer.username, "bob-pw")


def test_create_reviewer_twice_for_the_same_workspace_is_harmless(reviewer: Any) -> None:
    run_command("create_reviewer", reviewer.username, workspace="acme")

    user = get_user_model().objects.get(pk=reviewer.pk)
    assert get_user_model().objects.filter(username=reviewer.username).count() == 1
    assert all(
        user.has_perm(f"executor.{perm}", Workspace.objects.get(slug="acme"))
        for perm in REVIEWER_PERMISSIONS
    )


def test_create_reviewer_refuses_an_agents_user(agent: Agent) -> None:
    _, message = failing_command("create_reviewer", agent.user.username, workspace="acme")

    user = get_user_model().objects.get(pk=agent.user_id)
    assert "agent" in message
    assert not user.has_perm("executor.approve_steps", agent.workspace)


# --- verify_ledger ------------------------------------------------------------------------


def test_verify_ledger_passes_on_a_ledger_written_through_the_services(
    agent: Agent, run: Run
) -> None:
    post_steps(agent, run, 3)

    lines = run_command("verify_ledger")

    # One Event a posted step: its post, policy approval and release to pending together.
    assert lines == ["3 steps, 3 events verified, 0 broken", "no checkpoint yet"]


def test_verify_ledger_passes_on_steps_in_every_state(run: Run) -> None:
    steps = [step_in(run, state) for state in State]
    events = Event.objects.count()

    lines = run_command("verify_ledger")

    assert lines == [f"{len(steps)} steps, {events} events verified, 0 broken", "no checkpoint yet"]


def test_verify_ledger_names_an_event_whose_content_was_edited(agent: Agent, run: Run) -> None:
    steps = post_steps(agent, run, 3)
    claimed_and_released(steps[1])
    edited = event_of(steps[1], 2)
    raw_sql(f"UPDATE {EVENTS} SET reason = %s WHERE id = %s", ["nothing to see", edited.pk])

    lines, message = failing_command("verify_ledger")

    [finding] = lines[:-1]
    assert f"step {steps[1].pk}" in finding
    assert f"event {edited.pk} (seq 2)" in finding
    assert "edited" in finding
    assert lines[-1] == "3 steps, 5 events verified, 1 broken"
    assert "1 break" in message


def test_verify_ledger_names_the_gap_left_by_a_deleted_middle_event(agent: Agent, run: Run) -> None:
    steps = post_steps(agent, run, 2)
    claimed_and_released(steps[0])
    raw_sql(f"DELETE FROM {EVENTS} WHERE id = %s", [event_of(steps[0], 2).pk])
    after_gap = event_of(steps[0], 3)

    lines, _ = failing_command("verify_ledger")

    [finding] = lines[:-1]
    assert f"step {steps[0].pk}" in finding
    assert f"event {after_gap.pk} (seq 3)" in finding
    assert "seq 2 is missing" in finding
    assert lines[-1] == "2 steps, 3 events verified, 1 broken"


def test_verify_ledger_names_a_deleted_last_event(agent: Agent, run: Run) -> None:
    steps = post_steps(agent, run, 2)
    claimed_and_released(steps[1])
    raw_sql(f"DELETE FROM {EVENTS} WHERE id = %s", [event_of(steps[1], 3).pk])
    new_last = event_of(steps[1], 2)

    lines, _ = failing_command("verify_ledger")

    [finding] = lines[:-1]
    assert f"step {steps[1].pk}" in finding
    assert f"event {new_last.pk} (seq 2)" in finding
    assert "later events are missing" in finding


def test_verify_ledger_names_a_step_whose_events_were_all_deleted(agent: Agent, run: Run) -> None:
    [step] = post_steps(agent, run, 1)
    raw_sql(f"DELETE FROM {EVENTS} WHERE step_id = %s", [step.pk.hex])

    lines, _ = failing_command("verify_ledger")

    assert f"step {step.pk}: no event: has no events" in lines[0]
    assert lines[-1] == "1 steps, 0 events verified, 1 broken"


def test_verify_ledger_names_a_forged_event_appended_to_a_chain(agent: Agent, run: Run) -> None:
    [step] = post_steps(agent, run, 1)
    last = event_of(step, 1)  # its post, to pending
    forged = Event.objects.create(
        run=run,
        step=step,
        seq=2,
        from_state="pending",
        to_state="completed",
        actor="executor:forger",
        created_at=last.created_at,
        prev_hash=last.hash,
        hash="0" * 64,
    )

    lines, _ = failing_command("verify_ledger")

    assert f"step {step.pk}: event {forged.pk} (seq 2)" in lines[0]
    assert "beyond the step's version 1" in lines[0]


def test_verify_ledger_catches_an_edited_event_rehashed_by_its_successors_link(
    agent: Agent, run: Run
) -> None:
    [step] = post_steps(agent, run, 1)
    claimed_and_released(step)
    edited = event_of(step, 1)  # its post, with the policy's approval
    edited.actor = "user:mallory"
    raw_sql(
        f"UPDATE {EVENTS} SET actor = %s, hash = %s WHERE id = %s",
        [edited.actor, stored_digest(event_hash(edited.content())), edited.pk],
    )

    lines, _ = failing_command("verify_ledger")

    assert f"event {event_of(step, 2).pk} (seq 2)" in lines[0]
    assert "prev_hash" in lines[0]


def test_verify_ledger_reports_only_the_first_broken_link_of_each_step(
    agent: Agent, run: Run
) -> None:
    steps = post_steps(agent, run, 3)
    for step in (steps[0], steps[2]):
        claimed_and_released(step)  # three events, each of them broken below
        raw_sql(f"UPDATE {EVENTS} SET reason = %s WHERE step_id = %s", ["x", step.pk.hex])

    lines, _ = failing_command("verify_ledger")

    assert [line.split(":")[0] for line in lines[:-1]] == sorted(
        [f"step {steps[0].pk}", f"step {steps[2].pk}"]
    )
    assert all("(seq 1)" in line for line in lines[:-1])
    assert lines[-1] == "3 steps, 7 events verified, 2 broken"


def test_verify_ledger_step_option_checks_only_that_step(agent: Agent, run: Run) -> None:
    steps = post_steps(agent, run, 2)
    raw_sql(f"UPDATE {EVENTS} SET reason = %s WHERE id = %s", ["x", event_of(steps[0], 1).pk])

    intact = run_command("verify_ledger", step=str(steps[1].pk))
    broken, _ = failing_command("verify_ledger", step=str(steps[0].pk))

    assert intact == ["1 steps, 1 events verified, 0 broken"]
    assert broken[-1] == "1 steps, 1 events verified, 1 broken"


@pytest.mark.django_db
def test_verify_ledger_refuses_an_unknown_step() -> None:
    _, message = failing_command("verify_ledger", step="00000000-0000-0000-0000-000000000000")
    _, malformed = failing_command("verify_ledger", step="not-a-uuid")

    assert "no step" in message
    assert "not a UUID" in malformed


def test_verify_ledger_reads_each_chunk_in_two_queries(
    agent: Agent, run: Run, django_assert_num_queries: Any
) -> None:
    post_steps(agent, run, 7)
    chunk_size = 3
    chunks = math.ceil(7 / chunk_size)

    # Four queries per chunk (its steps, then all their events, approvals and attempts) and
    # one that finds no more; the runs alike (the one run, its run events, no more); then
    # five for the anchors (the runs' counters and numbering, the runs the checkpoints record
    # as archived, the newest pruning they record, the checkpoints).
    with django_assert_num_queries(4 * chunks + 1 + 2 + 1 + 5):
        lines = run_command("verify_ledger", chunk_size=chunk_size)

    assert lines[0] == "7 steps, 7 events verified, 0 broken"


def test_verify_ledger_names_a_step_whose_state_was_changed_behind_its_chain(
    agent: Agent, run: Run
) -> None:
    [step] = post_steps(agent, run, 1)
    raw_sql(
        f"UPDATE {Step._meta.db_table} SET state = %s WHERE id = %s", ["completed", step.pk.hex]
    )

    lines, _ = failing_command("verify_ledger")

    assert f"step {step.pk}: event {event_of(step, 1).pk} (seq 1)" in lines[0]
    assert "the step is completed but its last event moved it to pending" in lines[0]


def test_verify_ledger_names_a_step_whose_head_hash_was_changed(agent: Agent, run: Run) -> None:
    [step] = post_steps(agent, run, 1)
    raw_sql(
        f"UPDATE {Step._meta.db_table} SET head_hash = %s WHERE id = %s",
        [stored_digest("0" * 64), step.pk.hex],
    )

    lines, _ = failing_command("verify_ledger")

    assert f"step {step.pk}: event {event_of(step, 1).pk} (seq 1)" in lines[0]
    assert "head_hash" in lines[0]


def test_a_step_moved_by_a_worker_while_its_chunk_is_read_is_not_reported(
    agent: Agent, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    [step] = post_steps(agent, run, 1)
    read_events = chain._events_of
    moved: list[Step] = []

    def events_after_a_concurrent_move(step_ids: list[Any]) -> Any:
        # A worker claims the step between the read of its row and the read of its events.
        if not moved:
            moved.append(advance(Step.objects.get(pk=step.pk), State.RUNNING))
        return read_events(step_ids)

    monkeypatch.setattr(chain, "_events_of", events_after_a_concurrent_move)

    report = chain.verify_chain()

    assert moved
    assert report.ok
    assert report.events == 2  # its post, and the claim
