"""Approvals a reviewer can actually give (issue 11): policies per tool and workspace set
without code, four eyes on what a reviewer asked for, and "it happened" checked."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command

from executor import engine
from executor.common import dispatch
from executor.contract.tool import FailureClass, Lookup, LookupOutcome
from executor.ledger.records import Agent, Approval, Run, Step, Workspace
from executor.ledger.selectors import InboxFilter, InboxKind, inbox_counts
from executor.ledger.states import State
from executor.services.accounts import agent_set_tools, reviewer_create
from executor.services.base import Conflict, Invalid, NotPermitted
from executor.services.posting import step_post
from executor.services.reviews import (
    Resolution,
    compensation_request,
    step_approve,
    step_resolve_unknown,
)
from executor.services.runs import run_create
from executor.services.tools import tool_policy_set
from tests.support import tooling
from tests.support.api import ApiClient
from tests.support.tooling import CostlyTool, LookupTool, UndoTool, post, reload

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def engine_env(agent: Agent) -> Iterator[None]:
    with tooling.installed(agent), dispatch.publishing(dispatch.dropping_publisher):
        yield


def set_policy(workspace: Workspace, tool: str, approval: str, **options: Any) -> str:
    out = StringIO()
    call_command("tool_policy", workspace.slug, tool, approval=approval, stdout=out, **options)
    return out.getvalue().strip()


# --- policies per tool and workspace ----------------------------------------------------------


def test_email_send_is_irreversible_and_waits_for_a_person_by_default(
    agent: Agent, run: Run, api: ApiClient
) -> None:
    step, _ = step_post(
        agent=agent,
        run=run,
        key="mail",
        tool_name="email.send",
        input={"to": "ada@example.com", "subject": "hi", "body": "hello"},
    )

    assert step.state == State.PLANNED
    listed = {t["name"]: t for t in api.get("/api/v1/tools").json()}
    assert listed["email.send"]["requires_approval"] is True
    assert listed["echo"]["requires_approval"] is False


def test_a_policy_is_named_by_its_tool_name_workspace_and_rule(workspace: Workspace) -> None:
    policy = tool_policy_set(workspace=workspace, tool="test.pure", approval="always")

    assert str(policy) == "test.pure in acme: always"


def test_always_makes_every_call_of_the_tool_wait_in_that_workspace_only(
    agent: Agent, run: Run, workspace: Workspace, other_agent_auth: Any
) -> None:
    said = set_policy(workspace, "test.pure", "always")

    assert said == "test.pure in acme: approval always."
    here = post(agent, run, "test.pure")
    assert here.state == State.PLANNED
    assert engine.process(here.pk, worker="w1") == engine.Outcome.SKIPPED
    other = other_agent_auth.agent
    agent_set_tools(agent=other, tools=None)
    elsewhere_run, _ = run_create(agent=other, name="elsewhere")
    elsewhere, _ = step_post(
        agent=other, run=elsewhere_run, key="k", tool_name="test.pure", input={}
    )
    assert elsewhere.state == State.PENDING


def test_a_reviewers_approval_lets_it_run_and_a_policy_change_voids_it(
    agent: Agent, run: Run, workspace: Workspace, reviewer: User
) -> None:
    set_policy(workspace, "test.pure", "always")
    waiting = post(agent, run, "test.pure", key="waiting")
    approved = post(agent, run, "test.pure", key="approved")
    step_approve(step=approved, user=reviewer, version=approved.version, reason="ok")
    assert engine.process(approved.pk, worker="w1") == State.COMPLETED
    step_approve(step=waiting, user=reviewer, version=waiting.version, reason="ok")

    set_policy(workspace, "test.pure", "by_policy")

    assert engine.process(waiting.pk, worker="w1") == State.BLOCKED
    assert "policy changed" in reload(waiting).failure_message


def test_never_lets_a_destructive_tool_run_without_a_person(
    agent: Agent, run: Run, workspace: Workspace
) -> None:
    assert post(agent, run, "test.destructive", key="before").state == State.PLANNED

    set_policy(workspace, "test.destructive", "never")

    step = post(agent, run, "test.destructive", key="after")
    assert step.state == State.PENDING
    assert engine.process(step.pk, worker="w1") == State.COMPLETED


def test_by_policy_asks_a_person_above_a_cost(
    agent: Agent, run: Run, workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        CostlyTool, "estimated_cost", classmethod(lambda cls, i: Decimal(i["amount"]))
    )
    set_policy(workspace, "test.costly", "by_policy", cost_above="100")

    assert post(agent, run, "test.costly", key="cheap", input={"amount": 5}).state == (
        State.PENDING
    )
    assert post(agent, run, "test.costly", key="dear", input={"amount": 500}).state == (
        State.PLANNED
    )


def test_default_removes_the_workspaces_policy(
    agent: Agent, run: Run, workspace: Workspace
) -> None:
    set_policy(workspace, "test.pure", "always")

    said = set_policy(workspace, "test.pure", "default")

    assert "the tool's own declaration holds" in said
    assert post(agent, run, "test.pure").state == State.PENDING


def test_a_policy_for_an_unknown_tool_is_refused(workspace: Workspace) -> None:
    with pytest.raises(CommandError, match="no such tool: nope"):
        set_policy(workspace, "nope", "always")


# --- four eyes ---------------------------------------------------------------------------------


@pytest.fixture
def completed_undoable(agent: Agent, run: Run) -> Step:
    step = post(agent, run, "test.undoable")
    assert engine.process(step.pk, worker="w1") == State.COMPLETED
    return reload(step)


def test_the_reviewer_who_requested_a_compensation_cannot_approve_it(
    completed_undoable: Step, reviewer: User, workspace: Workspace
) -> None:
    undo = compensation_request(
        step=completed_undoable, user=reviewer, version=completed_undoable.version, reason="x"
    )

    with pytest.raises(NotPermitted, match="you requested this step yourself"):
        step_approve(step=undo, user=reviewer, version=undo.version, reason="mine")

    assert reload(undo).state == State.PLANNED
    other = reviewer_create(workspace=workspace, username="erin")
    step_approve(step=undo, user=other, version=undo.version, reason="checked")
    assert reload(undo).state == State.PENDING


def test_a_one_person_team_may_approve_its_own_request(
    completed_undoable: Step, reviewer: User, settings: Any
) -> None:
    settings.EXECUTOR_ALLOW_SELF_APPROVAL = True
    undo = compensation_request(
        step=completed_undoable, user=reviewer, version=completed_undoable.version, reason="x"
    )

    step_approve(step=undo, user=reviewer, version=undo.version, reason="alone")

    assert reload(undo).state == State.PENDING


def test_a_failed_compensation_stays_in_the_inbox(
    completed_undoable: Step, reviewer: User, workspace: Workspace
) -> None:
    undo = compensation_request(
        step=completed_undoable, user=reviewer, version=completed_undoable.version, reason="x"
    )
    other = reviewer_create(workspace=workspace, username="erin")
    step_approve(step=undo, user=other, version=undo.version, reason="ok")
    UndoTool.will(FailureClass.INVALID_INPUT)

    assert engine.process(undo.pk, worker="w1") == State.FAILED

    counts = inbox_counts(inbox=InboxFilter(workspace_ids=(workspace.pk,)))
    assert counts["all"][InboxKind.FAILED_COMPENSATION] == 1
    assert reload(completed_undoable).state == State.COMPLETED


# --- "it happened" is checked --------------------------------------------------------------------


@pytest.fixture
def unknown(agent: Agent, run: Run) -> Step:
    step = post(agent, run, "test.lookup")
    LookupTool.will(FailureClass.AMBIGUOUS)
    assert engine.process(step.pk, worker="w1") == State.UNKNOWN
    return reload(step)


def resolve(step: Step, user: User, external_id: str) -> Step:
    return step_resolve_unknown(
        step=step,
        user=user,
        version=step.version,
        resolution=Resolution.HAPPENED,
        reason="found it at the desk",
        external_id=external_id,
    )


def test_an_external_id_of_the_wrong_form_is_refused_naming_the_form(
    unknown: Step, reviewer: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(LookupTool, "external_id_pattern", r"T-[0-9]+")
    monkeypatch.setattr(LookupTool, "external_id_example", "T-42")

    with pytest.raises(Invalid, match=r"expected an id matching T-\[0-9\]\+, e.g. T-42") as refused:
        resolve(unknown, reviewer, "R1-found")

    # The field's own error names the form too (the console shows it under the field).
    assert refused.value.details == {
        "external_id": ["expected an id matching T-[0-9]+, e.g. T-42"],
        "expected": "an id matching T-[0-9]+, e.g. T-42",
        "given": "R1-found",
    }
    assert reload(unknown).state == State.UNKNOWN


def test_the_lookup_confirms_the_external_id_before_it_is_recorded(
    unknown: Step, reviewer: User
) -> None:
    LookupTool.answer = Lookup(LookupOutcome.FOUND, external_id="T-7")

    with pytest.raises(Conflict, match="finds this operation's effect as 'T-7'"):
        resolve(unknown, reviewer, "T-8")

    done = resolve(unknown, reviewer, "T-7")
    assert (done.state, done.external_id) == (State.COMPLETED, "T-7")


def test_an_authoritative_not_found_refuses_it_happened(unknown: Step, reviewer: User) -> None:
    LookupTool.answer = Lookup(LookupOutcome.NOT_FOUND)

    with pytest.raises(Conflict, match="finds no effect of this operation"):
        resolve(unknown, reviewer, "T-1")

    assert not Approval.objects.filter(step=unknown, approver=reviewer).exists()
