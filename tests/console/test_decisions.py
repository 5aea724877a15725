"""Every decision on a step: allowed with its permission, 403 without, 404 for an outsider,
409 on a stale version, 422 without a reason; each through the services, each an Event."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from executor.ledger.records import Agent, Approval, Run, Step, Workspace
from executor.ledger.states import State
from executor.services.accounts import reviewer_create
from tests.support.console import (
    blocked,
    compensation,
    completed,
    dead,
    events_by,
    htmx,
    planned,
    read,
    reload,
    unchanged,
    unknown,
)

pytestmark = pytest.mark.usefixtures("tools")


def decide(step: Step, decision: str) -> str:
    return reverse("step_decide", args=[step.pk, decision])


@dataclass(frozen=True)
class Case:
    name: str
    url: str
    build: Callable[[Agent, Run, User], Step]
    after: State
    permission: str
    data: dict[str, str] = field(default_factory=dict)

    def post(self, client: Client, step: Step, **extra: Any) -> Any:
        data = {"version": step.version, "reason": "checked with the customer", **self.data}
        return client.post(decide(step, self.url), data, **extra)


CASES = [
    Case("approve", "approve", lambda a, r, u: planned(a, r), State.PENDING, "approve_steps"),
    Case("reject", "reject", lambda a, r, u: planned(a, r), State.REJECTED, "approve_steps"),
    Case(
        "resolve-happened",
        "resolve-happened",
        lambda a, r, u: unknown(a, r),
        State.COMPLETED,
        "resolve_unknown",
        {"external_id": "T-42", "evidence": "found in the desk"},
    ),
    Case(
        "resolve-run-again",
        "resolve-run-again",
        lambda a, r, u: unknown(a, r, tool="console.lookup"),
        State.PENDING,
        "resolve_unknown",
        {},
    ),
    Case(
        "resolve-give-up",
        "resolve-give-up",
        lambda a, r, u: unknown(a, r),
        State.FAILED,
        "resolve_unknown",
        {},
    ),
    Case("replay", "replay", lambda a, r, u: dead(a, r), State.PENDING, "replay_deadletter"),
    Case("resume", "resume", lambda a, r, u: blocked(a, r), State.PENDING, "approve_steps"),
    Case(
        "approve-compensation",
        "approve",
        lambda a, r, u: compensation(a, r, u),
        State.PENDING,
        "approve_compensation",
    ),
    Case(
        "reject-compensation",
        "reject",
        lambda a, r, u: compensation(a, r, u),
        State.REJECTED,
        "approve_compensation",
    ),
]
IDS = [case.name for case in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_decision_with_the_permission_moves_the_step_in_the_reviewers_name(
    case: Case, bob: Client, owner: User, agent: Agent, run: Run
) -> None:
    step = case.build(agent, run, owner)
    response = case.post(bob, step)
    assert response.status_code == 302
    assert response["Location"] == reverse("step", args=[step.pk])
    assert reload(step).state == case.after
    decided = events_by(step, "user:bob")
    assert decided
    assert decided[0].reason == "checked with the customer"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_decision_without_the_permission_is_refused_with_403(
    case: Case, dave: Client, owner: User, agent: Agent, run: Run
) -> None:
    step = case.build(agent, run, owner)
    with unchanged(step):
        response = case.post(dave, step)
    assert response.status_code == 403
    assert f"You need the {case.permission} permission on acme" in read(response).text


def test_approving_ones_own_compensation_request_is_refused_with_403_and_an_alert_saying_why(
    bob: Client, reviewer: User, agent: Agent, run: Run
) -> None:
    """Four eyes holds at the URL too; the page that answers says why in its alert, not
    only on the card that offers no form (a reviewer posting from a stale page sees it)."""
    comp = compensation(agent, run, reviewer)
    with unchanged(comp):
        response = bob.post(
            decide(comp, "approve"), {"version": comp.version, "reason": "mine"}, **htmx("step")
        )
    assert response.status_code == 403
    page = read(response)
    assert {"decision-error", "decision-approve-unavailable"} <= page.testids()
    # The service's words (lower case) are the alert's; the card's start with a capital.
    assert "you requested this step yourself: another reviewer must approve it" in page.text
    assert not Approval.objects.filter(step_id=comp.pk).exists()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_an_outsider_gets_404_and_changes_nothing(
    case: Case, charlie: Client, owner: User, agent: Agent, run: Run
) -> None:
    step = case.build(agent, run, owner)
    with unchanged(step):
        response = case.post(charlie, step)
    assert response.status_code == 404


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_stale_version_answers_409_naming_who_acted_and_when(
    case: Case, bob: Client, alice: Client, agent: Agent, run: Run, workspace: Workspace
) -> None:
    # Requested by a third reviewer: who requests a compensation may not approve it.
    erin = reviewer_create(workspace=workspace, username="erin")
    step = case.build(agent, run, erin)
    assert case.post(alice, step).status_code == 302
    decided = reload(step)
    with unchanged(step):
        response = case.post(bob, step)  # the version bob's page showed
    assert response.status_code == 409
    text = read(response).text
    assert "already handled by user:alice at" in text
    assert f"now {decided.state})" in text
    assert not events_by(step, "user:bob")


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("reason", ["", "   "], ids=["empty", "blank"])
def test_a_decision_needs_a_reason(
    case: Case, reason: str, bob: Client, owner: User, agent: Agent, run: Run
) -> None:
    step = case.build(agent, run, owner)
    with unchanged(step):
        response = bob.post(
            decide(step, case.url),
            {"version": step.version, "reason": reason, **case.data},
        )
    assert response.status_code == 422
    page = read(response)
    assert "Give a reason: it is recorded with your decision." in page.text
    form = page.form(f"decision-{case.name.removesuffix('-compensation')}")
    assert form is not None
    if "external_id" in case.data:
        # What the reviewer typed is kept for the next try.
        assert form.field("external_id")["value"] == case.data["external_id"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_with_htmx_the_step_region_is_redrawn_and_the_inbox_told(
    case: Case, bob: Client, owner: User, agent: Agent, run: Run
) -> None:
    step = case.build(agent, run, owner)
    response = case.post(bob, step, **htmx(target="step"))
    assert response.status_code == 200
    body = response.content.decode()
    assert body.lstrip().startswith('<div id="step"')
    assert f'data-testid="step-state">{case.after}<' in body
    assert "inbox-changed" in response["HX-Trigger"]
    assert reload(step).state == case.after


def test_a_stale_htmx_decision_shows_the_message_in_the_region(
    bob: Client, alice: Client, agent: Agent, run: Run
) -> None:
    step = planned(agent, run)
    alice.post(decide(step, "approve"), {"version": 1, "reason": "fine"})
    response = bob.post(
        decide(step, "reject"),
        {"version": step.version, "reason": "too risky"},
        **htmx(target="step"),
    )
    assert response.status_code == 409
    page = read(response)
    assert "decision-error" in page.testids()
    assert "already handled by user:alice" in page.text
    assert reload(step).state == State.PENDING


def test_it_happened_records_the_external_id_and_the_evidence(
    bob: Client, agent: Agent, run: Run
) -> None:
    step = unknown(agent, run)
    bob.post(
        decide(step, "resolve-happened"),
        {
            "version": step.version,
            "external_id": "T-42",
            "evidence": "seen in the desk",
            "reason": "found it",
        },
    )
    step = reload(step)
    assert step.state == State.COMPLETED
    assert step.external_id == "T-42"
    event = events_by(step, "user:bob")[0]
    assert event.data["evidence"] == "seen in the desk"


def test_run_again_is_refused_for_a_write_that_cannot_be_checked(
    bob: Client, agent: Agent, run: Run
) -> None:
    step = unknown(agent, run)
    with unchanged(step):
        response = bob.post(
            decide(step, "resolve-run-again"),
            {"version": step.version, "reason": "try again"},
        )
    assert response.status_code == 409
    assert "not safe to send again" in read(response).text


def test_an_unknown_decision_is_not_found(bob: Client, agent: Agent, run: Run) -> None:
    step = unknown(agent, run)
    with unchanged(step):
        response = bob.post(
            decide(step, "resolve-maybe"), {"version": step.version, "reason": "hmm"}
        )
    assert response.status_code == 404


def test_a_missing_version_is_a_form_error(bob: Client, agent: Agent, run: Run) -> None:
    step = planned(agent, run)
    with unchanged(step):
        response = bob.post(decide(step, "approve"), {"reason": "fine"})
    assert response.status_code == 422


def test_decisions_answer_only_post(bob: Client, agent: Agent, run: Run) -> None:
    step = planned(agent, run)
    with unchanged(step):
        response = bob.get(decide(step, "approve"))
    assert response.status_code == 405


def test_a_decision_without_the_csrf_token_is_refused(
    reviewer: User, agent: Agent, run: Run
) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(reviewer)
    step = planned(agent, run)
    with unchanged(step):
        response = client.post(decide(step, "approve"), {"version": step.version, "reason": "ok"})
    assert response.status_code == 403


# --- look it up again -------------------------------------------------------------------------


def test_looking_up_again_needs_only_review_steps_and_is_recorded(
    dave: Client, agent: Agent, run: Run
) -> None:
    step = unknown(agent, run, tool="console.lookup")
    response = dave.post(
        decide(step, "probe"),
        {"version": step.version, "reason": "the desk was down earlier"},
    )
    assert response.status_code == 302
    step = reload(step)
    assert step.state == State.UNKNOWN
    assert [(e.from_state, e.to_state) for e in events_by(step, "user:dave")] == [
        ("unknown", "unknown")
    ]


def test_looking_up_again_on_a_stale_page_is_409(bob: Client, agent: Agent, run: Run) -> None:
    step = unknown(agent, run, tool="console.lookup")
    stale = step.version
    bob.post(decide(step, "probe"), {"version": stale, "reason": "once"})
    with unchanged(step):
        response = bob.post(decide(step, "probe"), {"version": stale, "reason": "twice"})
    assert response.status_code == 409
    assert "already handled by user:bob" in read(response).text


def test_looking_up_again_needs_a_reason_and_hides_from_outsiders(
    bob: Client, charlie: Client, agent: Agent, run: Run
) -> None:
    step = unknown(agent, run, tool="console.lookup")
    url = decide(step, "probe")
    with unchanged(step):
        assert bob.post(url, {"version": step.version, "reason": ""}).status_code == 422
        assert charlie.post(url, {"version": step.version, "reason": "x"}).status_code == 404


# --- compensation -----------------------------------------------------------------------------


def test_requesting_a_compensation_creates_a_planned_step_that_undoes_it(
    bob: Client, agent: Agent, run: Run
) -> None:
    step = completed(agent, run)
    response = bob.post(
        decide(step, "compensate"),
        {"version": step.version, "reason": "opened by mistake"},
    )
    assert response.status_code == 302
    (comp,) = Step.objects.filter(compensates=step)
    assert comp.state == State.PLANNED
    assert comp.tool_id == "console.undo"
    assert [e.to_state for e in events_by(comp, "user:bob")] == ["planned"]
    assert reload(step).state == State.COMPLETED
    assert (
        "A compensation is already planned." in read(bob.get(reverse("step", args=[step.pk]))).text
    )


def test_requesting_a_compensation_needs_approve_compensation(
    dave: Client, agent: Agent, run: Run
) -> None:
    step = completed(agent, run)
    response = dave.post(decide(step, "compensate"), {"version": step.version, "reason": "undo"})
    assert response.status_code == 403
    assert not Step.objects.filter(compensates=step).exists()


def test_a_second_compensation_request_is_409(bob: Client, agent: Agent, run: Run) -> None:
    step = completed(agent, run)
    url = decide(step, "compensate")
    bob.post(url, {"version": step.version, "reason": "undo"})
    response = bob.post(url, {"version": step.version, "reason": "undo again"})
    assert response.status_code == 409
    assert Step.objects.filter(compensates=step).count() == 1


def test_compensating_an_irreversible_step_is_409(bob: Client, agent: Agent, run: Run) -> None:
    step = completed(agent, run, tool="console.undo")
    response = bob.post(decide(step, "compensate"), {"version": step.version, "reason": "undo"})
    assert response.status_code == 409
    assert "irreversible" in read(response).text
    assert not Step.objects.filter(compensates=step).exists()


def test_an_outsider_cannot_request_a_compensation(charlie: Client, agent: Agent, run: Run) -> None:
    step = completed(agent, run)
    response = charlie.post(decide(step, "compensate"), {"version": step.version, "reason": "undo"})
    assert response.status_code == 404
    assert not Step.objects.filter(compensates=step).exists()
