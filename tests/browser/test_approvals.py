"""Approvals in Chromium (issue 11, "What must be shown"): an admin makes a tool wait for a
person in a workspace without code, a reviewer approves the exact call and it runs; an
approval past its expiry authorizes nothing; who asked for a compensation does not approve
it too; "it happened" takes only an external id of the form the tool declares.

Every step is made by the engine or the API, never written into the ledger by hand; the one
thing aged by hand is an approval's timestamps, which only the clock would otherwise move.
Set STEPWARD_SCREENSHOTS=1 to write the README's screenshots into docs/.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.db.models import F
from django.utils import timezone
from playwright.sync_api import Locator, Page, expect

from executor import engine
from executor.ledger import selectors
from executor.ledger.records import Agent, Approval, Event, Run, Step, ToolPolicy
from executor.ledger.states import State
from executor.services.tools import tool_policy_set
from stepward_client.client import Stepward
from tests.support.api import AgentAuth
from tests.support.browser import (
    DOCS_DIR,
    VIEWPORT,
    WORKER,
    Desk,
    decide,
    events_by,
    execute,
    fresh,
    hand_made_post,
    inbox_row,
    open_page,
    png_size,
    post,
    sign_in,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

TICKET = {"title": "Printer on fire", "body": "Third floor, room 3.14: smoke from the tray."}


def shown_time(where: Locator) -> datetime:
    """The absolute time of the <time> element in `where`."""
    value = where.locator("time").get_attribute("datetime")
    assert value, "no <time> with a datetime"
    return datetime.fromisoformat(value)


def choose_in_autocomplete(page: Page, field: str, text: str) -> None:
    """Picks `text` in one of the admin's autocomplete (select2) fields, as a person does."""
    page.locator(f'[role="combobox"][aria-labelledby="select2-id_{field}-container"]').click()
    page.locator(".select2-search__field").fill(text)
    page.locator(".select2-results__option", has_text=text).first.click()
    expect(page.locator(f"#select2-id_{field}-container")).to_contain_text(text)


def set_policy_in_admin(page: Page, base_url: str, *, workspace: str, tool: str) -> None:
    """On the admin's approval policy page, makes every call of `tool` wait for a person."""
    open_page(page, base_url, "/admin/executor/toolpolicy/add/")
    choose_in_autocomplete(page, "workspace", workspace)
    choose_in_autocomplete(page, "tool", tool)
    page.get_by_label("Approval").select_option("always")
    page.get_by_role("button", name="Save", exact=True).click()
    expect(page.locator(".messagelist")).to_contain_text(
        f"{tool} in {workspace}: always” was added successfully"
    )


# --- 1. an admin's policy, an agent's step, a reviewer's approval ---------------------------


def test_an_admin_sets_approval_always_and_the_agents_call_waits_until_a_reviewer_approves_it(
    page: Page,
    live_server: Any,
    owner: User,
    reviewer: User,
    agent_auth: AgentAuth,
    run: Run,
) -> None:
    workspace = run.workspace
    # The admin signs in through Django admin's own form.
    page.goto(live_server.url + "/admin/")
    expect(page).to_have_url(f"{live_server.url}/admin/login/?next=/admin/")
    page.get_by_label("Username").fill("alice")
    page.get_by_label("Password").fill("alice-pw")
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("#site-name")).to_be_visible()

    set_policy_in_admin(page, live_server.url, workspace=workspace.slug, tool="echo")
    policy = ToolPolicy.objects.get(workspace=workspace, tool__name="echo")
    assert policy.approval == "always"
    page.context.clear_cookies()

    # The agent posts a pure, harmless call through the API: it now waits for a person.
    with Stepward(live_server.url, agent_auth.token, retries=0) as agent:
        posted = agent.get_run(str(run.pk)).step(
            "echo-greeting", "echo", {"message": "hello from alice-bot"}
        )
    assert posted.created
    assert posted.state == State.PLANNED
    step = Step.objects.get(pk=posted.id)
    # The engine, were it to look, finds nothing to run.
    assert engine.process(step.pk, worker=WORKER) == engine.Outcome.SKIPPED
    assert fresh(step).state == State.PLANNED

    sign_in(page.context, reviewer, live_server.url)
    open_page(page, live_server.url, "/")
    page.get_by_test_id("tab-approval").click()
    expect(page.get_by_test_id("tab-approval")).to_have_attribute("aria-current", "page")
    row = inbox_row(page, step)
    expect(row).to_have_attribute("data-kind", "approval")
    row.get_by_role("link", name=step.key).click()

    # What the reviewer approves: this exact call, under the workspace's policy, until when.
    expect(page.get_by_test_id("step-state")).to_have_text("planned")
    expect(page.get_by_test_id("asked-by")).to_have_text("What the agent asked")
    expect(page.get_by_test_id("approval-rule")).to_contain_text("needed")
    expect(page.get_by_test_id("approving-input")).to_contain_text(
        '"message": "hello from alice-bot"'
    )
    tool = selectors.tool_info(name="echo", workspace_id=workspace.pk)
    assert tool.approval_rule == "always"
    expect(page.get_by_test_id("approving-policy")).to_have_text(tool.policy_version)
    max_age = timedelta(seconds=django_settings.EXECUTOR_APPROVAL_MAX_AGE)
    shown_expiry = shown_time(page.get_by_test_id("approving-expiry"))
    assert abs(shown_expiry - (timezone.now() + max_age)) < timedelta(minutes=1)

    decide(page, "decision-approve", "Approve this call", "A greeting harms nobody.")
    expect(page.get_by_test_id("decision-notice")).to_have_text("Approved.")
    expect(page.get_by_test_id("step-state")).to_have_text("pending")

    approval = Approval.objects.get(step_id=step.pk)
    assert approval.approver == reviewer
    assert approval.policy_version == tool.policy_version
    assert approval.input_hash == step.input_hash
    assert approval.expires_at is not None
    assert approval.expires_at - approval.approved_at == max_age
    assert approval.expires_at - shown_expiry < timedelta(minutes=1)

    done = execute(step)
    assert done.state == State.COMPLETED
    assert done.result == {"message": "hello from alice-bot"}
    expect(page.get_by_test_id("step-state")).to_have_text("completed")
    approval.refresh_from_db()
    assert approval.consumed_at is not None
    assert [(e.from_state, e.to_state) for e in events_by(step, "user:bob")] == [
        (State.PLANNED, State.APPROVED)
    ]


# --- 2. an approval past its expiry ---------------------------------------------------------


def test_an_approval_past_its_expiry_is_refused_at_claim_and_the_step_page_shows_why(
    bob_page: Page, live_server: Any, agent: Agent, run: Run, reviewer: User
) -> None:
    page = bob_page
    tool_policy_set(workspace=run.workspace, tool="echo", approval="always")
    step = post(agent, run, "echo", "echo-late", {"message": "approved, then forgotten"})
    assert step.state == State.PLANNED

    open_page(page, live_server.url, f"/steps/{step.pk}/")
    decide(page, "decision-approve", "Approve this call", "Fine to send today.")
    expect(page.get_by_test_id("decision-notice")).to_have_text("Approved.")
    expect(page.get_by_test_id("step-state")).to_have_text("pending")

    # No worker takes it until its approval's time has passed: the clock is moved by
    # ageing the approval, as a day and a minute would have.
    approval = Approval.objects.get(step_id=step.pk)
    age = timedelta(seconds=django_settings.EXECUTOR_APPROVAL_MAX_AGE, minutes=1)
    Approval.objects.filter(pk=approval.pk).update(
        approved_at=F("approved_at") - age, expires_at=F("expires_at") - age
    )
    approval.refresh_from_db()
    assert approval.expires_at is not None
    assert approval.expires_at < timezone.now()

    assert engine.process(step.pk, worker=WORKER) == State.BLOCKED
    blocked = fresh(step)
    reason = blocked.failure_message
    assert reason == "the approval is older than EXECUTOR_APPROVAL_MAX_AGE"
    # Nothing was sent and the stale approval was not used up.
    assert blocked.result is None
    assert not blocked.attempts.filter(submitted_at__isnull=False).exists()
    approval.refresh_from_db()
    assert approval.consumed_at is None
    (refusal,) = Event.objects.filter(step_id=step.pk, to_state=State.BLOCKED)
    assert (refusal.actor, refusal.reason) == ("policy", reason)

    # The page the reviewer left open moves on by itself and says why.
    expect(page.get_by_test_id("step-state")).to_have_text("blocked")
    expect(
        page.get_by_test_id("timeline-event").filter(has_text=reason).filter(has_text="policy")
    ).to_be_visible()
    open_page(page, live_server.url, "/")
    page.get_by_test_id("tab-blocked").click()
    expect(inbox_row(page, step)).to_contain_text(reason)

    # The way on: approving the same call again, now, in the reviewer's name.
    inbox_row(page, step).get_by_role("link", name=step.key).click()
    decide(page, "decision-resume", "Resume this step", "Still wanted: approved again.")
    expect(page.get_by_test_id("decision-notice")).to_contain_text("Resumed")
    assert execute(step).state == State.COMPLETED
    expect(page.get_by_test_id("step-state")).to_have_text("completed")
    live = Approval.objects.filter(step_id=step.pk).exclude(pk=approval.pk).get()
    assert live.approver == reviewer
    assert live.consumed_at is not None


# --- 3. four eyes on a compensation ----------------------------------------------------------


def test_a_reviewer_cannot_approve_the_compensation_they_asked_for_not_even_by_a_hand_made_post(
    bob_page: Page, live_server: Any, agent: Agent, run: Run, desk: Desk
) -> None:
    page = bob_page
    original = execute(post(agent, run, "ticketdesk.create", "open-duplicate-ticket", TICKET))
    assert original.state == State.COMPLETED
    ticket_id = original.external_id

    open_page(page, live_server.url, f"/steps/{original.pk}/")
    decide(page, "decision-compensate", "Request compensation", "Opened twice: close this one.")
    expect(page.get_by_test_id("decision-notice")).to_contain_text("Compensation requested")
    compensation = Step.objects.get(compensates=original)
    assert compensation.state == State.PLANNED

    page.get_by_test_id("step-summary").get_by_role("link", name=compensation.key).click()
    expect(page.get_by_test_id("step-state")).to_have_text("planned")
    expect(page.get_by_test_id("asked-by")).to_have_text("What bob (a reviewer) asked")
    expect(page.get_by_test_id("approval-rule")).to_contain_text("this step waits for a person")
    expect(page.get_by_test_id("decision-approve")).to_have_count(0)
    expect(page.get_by_test_id("decision-approve-unavailable")).to_contain_text(
        "You requested this step yourself: another reviewer must approve it"
    )

    # Past the page: the decide URL itself refuses, and says why.
    status, body = hand_made_post(
        page,
        f"/steps/{compensation.pk}/decide/approve/",
        {"version": str(compensation.version), "reason": "I asked, so I approve."},
    )
    assert status == 403, body
    assert 'data-testid="decision-error"' in body
    assert "you requested this step yourself: another reviewer must approve it" in body

    unchanged = fresh(compensation)
    assert (unchanged.state, unchanged.version) == (State.PLANNED, compensation.version)
    assert not Approval.objects.filter(step_id=compensation.pk).exists()
    assert [(e.from_state, e.to_state) for e in events_by(compensation, "user:bob")] == [
        ("", State.PLANNED)
    ]
    # Nothing runs it, and the ticket stays open at the desk.
    assert engine.process(compensation.pk, worker=WORKER) == engine.Outcome.SKIPPED
    assert fresh(compensation).state == State.PLANNED
    assert desk.ticket(ticket_id)["status"] == "open"


# --- 4. "it happened" with an id of the wrong form -------------------------------------------


def test_it_happened_with_an_external_id_of_the_wrong_form_is_refused_naming_the_expected_form(
    bob_page: Page, live_server: Any, agent: Agent, run: Run, desk: Desk
) -> None:
    page = bob_page
    # The desk creates the ticket and drops the connection before answering.
    desk.faults(drop_after_commit_rate=1.0)
    step = execute(
        post(
            agent,
            run,
            "ticketdesk.create",
            "open-ticket-badge",
            {"title": "Badge reader refuses everyone", "body": "Main entrance."},
        )
    )
    desk.faults(reset=True)
    assert step.state == State.UNKNOWN
    (ticket,) = desk.tickets(step.operation_id)
    ticket_id = str(ticket["ticket_id"])

    open_page(page, live_server.url, f"/steps/{step.pk}/")
    expect(page.get_by_test_id("step-state")).to_have_text("unknown")
    decide(
        page,
        "decision-resolve-happened",
        "Mark as completed",
        "Found it at the desk.",
        {"External id": "R1-found", "Evidence": "the desk's search page"},
    )
    form = page.get_by_test_id("decision-resolve-happened")
    expect(form.get_by_test_id("decision-error")).to_have_text(
        "'R1-found' is not an external id of ticketdesk.create: expected an id matching "
        "[1-9][0-9]{0,18}, e.g. 4211"
    )
    expect(form.get_by_test_id("field-error")).to_have_text(
        "expected an id matching [1-9][0-9]{0,18}, e.g. 4211"
    )
    expect(page.get_by_test_id("step-state")).to_have_text("unknown")
    # What the reviewer typed is still there to correct.
    expect(form.get_by_label("External id")).to_have_value("R1-found")
    expect(form.get_by_label("Evidence")).to_have_value("the desk's search page")

    unchanged = fresh(step)
    assert (unchanged.state, unchanged.version) == (State.UNKNOWN, step.version)
    assert unchanged.external_id == ""
    assert events_by(step, "user:bob") == []

    decide(
        page,
        "decision-resolve-happened",
        "Mark as completed",
        "Found it at the desk.",
        {"External id": ticket_id, "Evidence": f"the desk lists ticket {ticket_id}"},
    )
    expect(page.get_by_test_id("decision-notice")).to_have_text("Marked as completed.")
    expect(page.get_by_test_id("external-id")).to_have_text(ticket_id)
    done = fresh(step)
    assert (done.state, done.external_id) == (State.COMPLETED, ticket_id)
    (decision,) = events_by(step, "user:bob")
    assert decision.data["external_id"] == ticket_id


# --- 5. the README's screenshots -----------------------------------------------------------


def test_screenshots_of_a_step_awaiting_approval_and_the_admin_policy_page(
    page: Page,
    live_server: Any,
    owner: User,
    reviewer: User,
    agent: Agent,
    run: Run,
    tmp_path: Path,
) -> None:
    out = DOCS_DIR if os.environ.get("STEPWARD_SCREENSHOTS") == "1" else tmp_path
    policy = tool_policy_set(workspace=run.workspace, tool="email.send", approval="always")
    assert policy is not None

    sign_in(page.context, owner, live_server.url)
    open_page(page, live_server.url, f"/admin/executor/toolpolicy/{policy.pk}/change/")
    expect(page.locator("#content")).to_contain_text("email.send in acme: always")
    expect(page.locator("#select2-id_tool-container")).to_contain_text("email.send")
    expect(page.get_by_label("Approval")).to_have_value("always")
    page.screenshot(path=out / "admin-policy.png", full_page=True)

    step = post(
        agent,
        run,
        "email.send",
        "email-refund-confirmation",
        {
            "to": "customer@example.com",
            "subject": "Your refund for order 1042",
            "body": "We refunded 19.90 to your card; it shows within five days.",
        },
    )
    assert step.state == State.PLANNED
    page.context.clear_cookies()
    sign_in(page.context, reviewer, live_server.url)
    open_page(page, live_server.url, f"/steps/{step.pk}/")
    expect(page.get_by_test_id("step-state")).to_have_text("planned")
    expect(page.get_by_test_id("approving-input")).to_contain_text("customer@example.com")
    tool = selectors.tool_info(name="email.send", workspace_id=run.workspace_id)
    expect(page.get_by_test_id("approving-policy")).to_have_text(tool.policy_version)
    expect(page.get_by_test_id("decision-approve")).to_be_visible()
    page.screenshot(path=out / "approval.png", full_page=True)

    for name in ("admin-policy.png", "approval.png"):
        width, height = png_size(out / name)
        assert width == VIEWPORT["width"], (name, width)
        assert height >= VIEWPORT["height"], (name, height)
    assert fresh(step).state == State.PLANNED
