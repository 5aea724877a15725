"""The review console in Chromium: a reviewer signs in, triages what waits, and every
decision shows on the page and lands in the ledger as an Event in the reviewer's name.

The step behind each screen is made by the engine (and, for the crash, by a real worker
process that dies after the desk created the ticket), never written into the ledger by hand.
Set STEPWARD_SCREENSHOTS=1 to write the README's screenshots into docs/.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.contrib.sessions.models import Session
from django.utils import timezone
from playwright.sync_api import Browser, Page, Route, expect

from executor import engine
from executor.common import faults
from executor.engine import recovery
from executor.ledger import selectors
from executor.ledger.records import Agent, Approval, Attempt, Event, Phase, Run, RunStatus, Step
from executor.ledger.states import State
from executor.services.reviews import compensation_request, step_approve
from executor.services.runs import run_create
from tests.support.browser import (
    DOCS_DIR,
    VIEWPORT,
    Desk,
    WorkerProcess,
    blocked_step,
    dead_letter,
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
    wait_until,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

TICKET = {"title": "Printer on fire", "body": "Third floor, room 3.14: smoke from the tray."}


# --- helpers ----------------------------------------------------------------------------


def sessions_of(user: User) -> list[Session]:
    return [
        session
        for session in Session.objects.filter(expire_date__gt=timezone.now())
        if session.get_decoded().get("_auth_user_id") == str(user.pk)
    ]


# --- 1. signing in ---------------------------------------------------------------------


@pytest.mark.usefixtures("tools")
def test_signing_in_through_the_form_after_a_wrong_password_lands_on_the_page_asked_for(
    page: Page, live_server: Any, reviewer: User, agent: Agent, run: Run
) -> None:
    step = post(agent, run, "example.refund", "refund-1042", {"order": 1042})
    step_path = f"/steps/{step.pk}/"

    page.goto(live_server.url + step_path)
    expect(page).to_have_url(f"{live_server.url}/accounts/login/?next={step_path}")
    form = page.get_by_test_id("login-form")
    expect(form).to_be_visible()
    expect(page.get_by_test_id("step")).to_have_count(0)

    form.get_by_label("Username").fill("bob")
    form.get_by_label("Password").fill("not-bobs-password")
    form.get_by_role("button", name="Sign in").click()
    expect(page.get_by_test_id("login-error")).to_contain_text(
        "Please enter a correct username and password"
    )
    assert sessions_of(reviewer) == []

    form.get_by_label("Username").fill("bob")
    form.get_by_label("Password").fill("bob-pw")
    form.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(live_server.url + step_path)
    expect(page.get_by_test_id("step-state")).to_have_text("planned")
    expect(page.locator(".account .username")).to_have_text("bob")
    assert len(sessions_of(reviewer)) == 1
    # Signing in decided nothing.
    assert fresh(step).state == State.PLANNED
    assert events_by(step, "user:bob") == []


# --- 2. an unknown outcome from a real crash, resolved by hand -----------------------------


def test_a_ticket_created_before_the_worker_died_is_marked_completed_with_its_ticket_id(
    bob_page: Page,
    live_server: Any,
    agent: Agent,
    run: Run,
    desk: Desk,
    worker: Callable[..., WorkerProcess],
    settings: Any,
) -> None:
    page = bob_page
    # Posting publishes "look at this step" on the broker; the worker then takes it.
    step = post(agent, run, "ticketdesk.create", "open-printer-ticket", TICKET)
    assert step.state == State.PENDING
    crashing = worker(EXECUTOR_ALLOW_FAULTS="1", EXECUTOR_FAULTS="after_submit:1.0")

    # The worker sends the ticket, the desk creates it, the worker dies before it records
    # the answer: the ledger knows only that the call was submitted.
    assert crashing.wait_exit() == faults.CRASH_EXIT_STATUS, crashing.log()
    assert len(desk.tickets(step.operation_id)) == 1
    crashed = fresh(step)
    assert crashed.state == State.RUNNING
    assert crashed.external_id == ""
    assert [a.phase for a in crashed.attempts.all()] == [Phase.SUBMITTING]
    claimed = Event.objects.get(step_id=step.pk, to_state=State.RUNNING)
    assert claimed.actor == f"executor:{socket.gethostname()}:{crashing.pid}"

    # The lease runs out. The desk is frozen while the sweeper's recovery asks it, so its
    # lookup cannot tell either way and the step waits for a person.
    wait_until(
        lambda: fresh(step).lease_expires_at <= timezone.now(),
        what="the crashed worker's lease to expire",
    )
    settings.TICKETDESK_TIMEOUT_SECONDS = 1
    desk.process.pause()
    try:
        outcome = recovery.recover_expired(step.pk)
    finally:
        desk.process.resume()
    assert outcome == State.UNKNOWN
    recovered = fresh(step)
    assert recovered.state == State.UNKNOWN
    assert recovered.failure_class == "ambiguous"
    assert Event.objects.filter(
        step_id=step.pk,
        from_state=State.UNKNOWN,
        to_state=State.UNKNOWN,
        data__lookup="cannot_tell",
    ).exists()

    open_page(page, live_server.url, "/")
    page.get_by_test_id("tab-unknown").click()
    expect(page.get_by_test_id("tab-unknown")).to_have_attribute("aria-current", "page")
    row = inbox_row(page, step)
    expect(row).to_have_attribute("data-kind", "unknown")
    row.get_by_role("link", name=step.key).click()

    expect(page.get_by_test_id("step-state")).to_have_text("unknown")
    timeline = page.get_by_test_id("timeline")
    expect(
        timeline.get_by_test_id("timeline-event").filter(has_text="after submission")
    ).to_be_visible()
    expect(
        timeline.get_by_test_id("timeline-event").filter(has_text="lookup could not tell")
    ).to_be_visible()
    expect(timeline.get_by_test_id("timeline-attempt")).to_contain_text("lease_expired")

    # The reviewer looks the operation up at the desk, as a person would.
    (ticket,) = desk.tickets(step.operation_id)
    ticket_id = str(ticket["ticket_id"])
    decide(
        page,
        "decision-resolve-happened",
        "Mark as completed",
        "The desk has the ticket; the worker died before recording it.",
        {
            "External id": ticket_id,
            "Evidence": f"GET /tickets?client_ref={step.operation_id} lists ticket {ticket_id}",
        },
    )

    expect(page.get_by_test_id("decision-notice")).to_have_text("Marked as completed.")
    expect(page.get_by_test_id("step-state")).to_have_text("completed")
    expect(page.get_by_test_id("external-id")).to_have_text(ticket_id)

    done = fresh(step)
    assert done.state == State.COMPLETED
    assert done.external_id == ticket_id
    (decision,) = events_by(step, "user:bob")
    assert (decision.from_state, decision.to_state) == (State.UNKNOWN, State.COMPLETED)
    assert decision.data["external_id"] == ticket_id
    assert len(desk.tickets(step.operation_id)) == 1


# --- 3. approving a call -------------------------------------------------------------------


@pytest.mark.usefixtures("tools")
def test_an_approved_call_runs_and_the_page_shows_it_completed(
    bob_page: Page, live_server: Any, agent: Agent, run: Run, reviewer: User
) -> None:
    page = bob_page
    step = post(agent, run, "example.refund", "refund-1042", {"order": 1042, "amount": "19.90"})
    assert step.state == State.PLANNED

    open_page(page, live_server.url, "/")
    row = inbox_row(page, step)
    expect(row).to_have_attribute("data-kind", "approval")
    row.get_by_role("link", name=step.key).click()
    expect(page.get_by_test_id("step-state")).to_have_text("planned")
    expect(page.get_by_test_id("tool-declarations")).to_contain_text("needed")

    decide(page, "decision-approve", "Approve this call", "Order 1042 was returned unopened.")
    expect(page.get_by_test_id("decision-notice")).to_have_text("Approved.")
    expect(page.get_by_test_id("step-state")).to_have_text("pending")
    approval = Approval.objects.get(step_id=step.pk)
    assert approval.approver == reviewer
    assert fresh(step).state == State.PENDING

    done = execute(step)
    assert done.state == State.COMPLETED
    # The page of a step in flight refreshes itself when the step moves on.
    expect(page.get_by_test_id("step-state")).to_have_text("completed")
    expect(page.get_by_test_id("external-id")).to_have_text(done.external_id)

    approved = events_by(step, "user:bob")
    assert [(e.from_state, e.to_state) for e in approved] == [(State.PLANNED, State.APPROVED)]
    assert approved[0].reason == "Order 1042 was returned unopened."
    approval.refresh_from_db()
    assert approval.consumed_at is not None


# --- 4. replaying dead letters from the inbox -----------------------------------------------


@pytest.mark.usefixtures("tools")
def test_a_dead_letter_checked_in_the_inbox_is_replayed_and_the_other_stays_dead(
    bob_page: Page, live_server: Any, agent: Agent, run: Run
) -> None:
    page = bob_page
    replayed = dead_letter(agent, run, "notify-partner-1")
    left = dead_letter(agent, run, "notify-partner-2")
    assert replayed.attempt_count == 3

    open_page(page, live_server.url, "/")
    page.get_by_test_id("tab-dead").click()
    expect(page.get_by_test_id("tab-dead")).to_have_attribute("aria-current", "page")
    expect(inbox_row(page, replayed)).to_have_attribute("data-kind", "dead")
    expect(inbox_row(page, left)).to_have_attribute("data-kind", "dead")

    page.get_by_label(f"Select {replayed.key} for replay").check()
    bulk = page.get_by_test_id("bulk-replay-form")
    bulk.get_by_label("Reason for replaying the selected dead letters").fill(
        "The partner's endpoint is back."
    )
    bulk.get_by_role("button", name="Replay selected").click()

    expect(page.get_by_test_id("bulk-notice")).to_have_text("Replayed 1 dead letter.")
    expect(inbox_row(page, replayed)).to_have_count(0)
    expect(inbox_row(page, left)).to_be_visible()

    assert fresh(replayed).state == State.PENDING
    assert fresh(left).state == State.DEAD
    (replay,) = events_by(replayed, "user:bob")
    assert (replay.from_state, replay.to_state) == (State.DEAD, State.PENDING)
    assert replay.reason == "The partner's endpoint is back."
    assert events_by(left, "user:bob") == []


# The refresh, exactly as the list's own timer sends it (its element, its sync, its confirm).
REFRESH = """() => htmx.ajax("GET", "/?state=dead",
                             {source: "#inbox-list", target: "#inbox-list", swap: "outerHTML"})"""


@pytest.mark.usefixtures("tools")
def test_a_refresh_due_while_a_filter_is_on_its_way_is_skipped_and_the_filter_lands(
    bob_page: Page, live_server: Any, agent: Agent, run: Run
) -> None:
    """The list refreshes itself every 5 s and the filters replace the same list. A refresh
    that landed first would leave the filter's answer without its target: the reviewer's
    choice silently ignored."""
    page = bob_page
    step = dead_letter(agent, run, "notify-partner-3")  # minutes old, not hours
    open_page(page, live_server.url, "/?state=dead")
    expect(inbox_row(page, step)).to_be_visible()
    held: list[Route] = []
    page.route(lambda url: "age=1h" in url, lambda route: held.append(route))

    with page.expect_request(lambda request: "age=1h" in request.url):
        page.get_by_test_id("inbox-filters").get_by_label("Age").select_option("1h")
    page.evaluate(REFRESH)
    held[0].continue_()

    expect(inbox_row(page, step)).to_have_count(0)
    expect(page).to_have_url(re.compile(r"age=1h"))


@pytest.mark.usefixtures("tools")
def test_a_refresh_keeps_the_boxes_a_reviewer_checked(
    bob_page: Page, live_server: Any, agent: Agent, run: Run
) -> None:
    """The boxes are hx-preserve: a refresh replaces the list around them."""
    page = bob_page
    checked = dead_letter(agent, run, "notify-partner-4")
    open_page(page, live_server.url, "/?state=dead")
    box = page.get_by_label(f"Select {checked.key} for replay")
    box.check()

    page.evaluate(REFRESH)

    expect(box).to_be_checked()
    box.uncheck()
    other = dead_letter(agent, run, "notify-partner-5")
    page.evaluate(REFRESH)  # nothing checked: the refresh goes through
    expect(inbox_row(page, other)).to_be_visible()


# --- 5. compensating a completed ticket --------------------------------------------------------


def test_a_compensation_requested_and_approved_closes_the_ticket_at_the_desk(
    bob_page: Page,
    live_server: Any,
    agent: Agent,
    run: Run,
    desk: Desk,
    second_reviewer: User,
    browser: Browser,
) -> None:
    page = bob_page
    original = execute(post(agent, run, "ticketdesk.create", "open-duplicate-ticket", TICKET))
    assert original.state == State.COMPLETED
    ticket_id = original.external_id
    assert desk.ticket(ticket_id)["status"] == "open"

    open_page(page, live_server.url, f"/steps/{original.pk}/")
    expect(page.get_by_test_id("step-state")).to_have_text("completed")
    decide(page, "decision-compensate", "Request compensation", "Opened twice: close this one.")
    expect(page.get_by_test_id("decision-notice")).to_contain_text("Compensation requested")

    compensation = Step.objects.get(compensates=original)
    assert compensation.state == State.PLANNED
    assert compensation.tool_id == "ticketdesk.close"
    page.get_by_test_id("step-summary").get_by_role("link", name=compensation.key).click()
    expect(page.get_by_test_id("step-state")).to_have_text("planned")
    # Four eyes: who asked for the compensation does not approve it too.
    expect(page.get_by_test_id("asked-by")).to_contain_text("bob")
    expect(page.get_by_test_id("decision-approve")).to_have_count(0)
    expect(page.get_by_test_id("decision-approve-unavailable")).to_contain_text(
        "You requested this step yourself: another reviewer must approve it"
    )

    erin = browser.new_context(base_url=live_server.url)
    sign_in(erin, second_reviewer, live_server.url)
    erin_page = erin.new_page()
    open_page(erin_page, live_server.url, f"/steps/{compensation.pk}/")
    decide(erin_page, "decision-approve", "Approve this compensation", "The duplicate must go.")
    expect(erin_page.get_by_test_id("decision-notice")).to_have_text("Approved.")
    expect(erin_page.get_by_test_id("step-state")).to_have_text("pending")

    assert execute(compensation).state == State.COMPLETED
    expect(erin_page.get_by_test_id("step-state")).to_have_text("completed")
    erin_page.get_by_test_id("step-summary").get_by_role("link", name=original.key).click()
    expect(erin_page.get_by_test_id("step-state")).to_have_text("compensated")
    erin.close()

    assert desk.ticket(ticket_id)["status"] == "closed"
    assert fresh(original).state == State.COMPENSATED
    assert fresh(compensation).state == State.COMPLETED
    assert [(e.from_state, e.to_state) for e in events_by(compensation, "user:bob")] == [
        ("", State.PLANNED),
    ]
    assert [(e.from_state, e.to_state) for e in events_by(compensation, "user:erin")] == [
        (State.PLANNED, State.APPROVED),
    ]
    assert Approval.objects.get(step=compensation).approver.username == "erin"


# --- 6. an outsider ----------------------------------------------------------------------------


@pytest.mark.usefixtures("tools")
def test_an_outsider_gets_404_for_another_workspaces_step_and_an_empty_inbox(
    page: Page, live_server: Any, outsider: User, agent: Agent, run: Run
) -> None:
    step = post(agent, run, "example.refund", "refund-1042", {"order": 1042})
    sign_in(page.context, outsider, live_server.url)

    open_page(page, live_server.url, "/")
    expect(page.get_by_test_id("inbox-empty")).to_contain_text("Nothing waits for you")
    expect(page.get_by_test_id("inbox-row")).to_have_count(0)
    expect(page.get_by_test_id("nav-count-total")).to_contain_text("0")
    expect(page.get_by_test_id("inbox")).not_to_contain_text("acme")
    expect(page.get_by_test_id("inbox")).not_to_contain_text(step.key)

    for path in (f"/steps/{step.pk}/", f"/runs/{run.pk}/"):
        response = page.goto(live_server.url + path)
        assert response is not None, path
        assert response.status == 404, (path, response.status)
        expect(page.locator("h1")).to_have_text("Not Found")
        expect(page.get_by_test_id("step")).to_have_count(0)

    # Even a hand-made request from charlie's signed-in page finds nothing to approve.
    open_page(page, live_server.url, "/")
    status, _ = hand_made_post(
        page,
        f"/steps/{step.pk}/decide/approve/",
        {"version": str(step.version), "reason": "let me"},
    )
    assert status == 404

    unchanged = fresh(step)
    assert (unchanged.state, unchanged.version) == (State.PLANNED, step.version)
    assert events_by(step, "user:charlie") == []
    assert not Approval.objects.filter(step_id=step.pk).exists()


# --- 7. two reviewers, one decision --------------------------------------------------------------


@pytest.mark.usefixtures("tools")
def test_of_two_reviewers_approving_the_same_step_only_the_first_decision_lands(
    bob_page: Page,
    browser: Browser,
    browser_context_args: dict[str, Any],
    live_server: Any,
    second_reviewer: User,
    agent: Agent,
    run: Run,
) -> None:
    step = post(agent, run, "example.refund", "refund-1042", {"order": 1042})
    erin_context = browser.new_context(**browser_context_args)
    try:
        sign_in(erin_context, second_reviewer, live_server.url)
        erin_page = erin_context.new_page()
        pages = {"bob": bob_page, "erin": erin_page}
        for page in pages.values():
            open_page(page, live_server.url, f"/steps/{step.pk}/")
            expect(page.get_by_test_id("step-state")).to_have_text("planned")
            approve = page.get_by_test_id("decision-approve")
            approve.get_by_label("Reason").fill("Looks right to me.")

        for name in ("bob", "erin"):
            approve = pages[name].get_by_test_id("decision-approve")
            approve.get_by_role("button", name="Approve this call").click()
            if name == "bob":
                expect(pages["bob"].get_by_test_id("decision-notice")).to_have_text("Approved.")

        expect(bob_page.get_by_test_id("decision-error")).to_have_count(0)
        expect(erin_page.get_by_test_id("decision-error")).to_contain_text(
            "already handled by user:bob"
        )
        expect(erin_page.get_by_test_id("decision-notice")).to_have_count(0)
        expect(erin_page.get_by_test_id("step-state")).to_have_text("pending")
    finally:
        erin_context.close()

    approvals = Event.objects.filter(step_id=step.pk, to_state=State.APPROVED)
    assert [event.actor for event in approvals] == ["user:bob"]
    assert events_by(step, "user:erin") == []
    assert [a.approver.username for a in Approval.objects.filter(step_id=step.pk)] == ["bob"]


# --- 8. the README's screenshots -----------------------------------------------------------------


def build_scene(
    agent: Agent, reviewer: User, approver: User, desk: Desk, settings: Any
) -> dict[str, Any]:
    """One run with something in every review state, made by the engine, and a paused run.
    `reviewer` asks for the compensations; `approver` approves one (four eyes)."""
    run, _ = run_create(
        agent=agent,
        name="support-triage-0412",
        max_calls=40,
        max_cost=Decimal("5"),
        deadline_seconds=2 * 3600,
    )
    execute(post(agent, run, "example.summarize", "summarize-inbox", {"mailbox": "support"}))
    execute(post(agent, run, "ticketdesk.create", "open-ticket-printer", TICKET))
    duplicate = execute(post(agent, run, "ticketdesk.create", "open-ticket-printer-again", TICKET))
    undo = compensation_request(
        step=duplicate, user=reviewer, version=duplicate.version, reason="Opened twice."
    )
    step_approve(step=undo, user=approver, version=undo.version, reason="Close it.")
    execute(undo)
    vpn = execute(
        post(
            agent,
            run,
            "ticketdesk.create",
            "open-ticket-vpn",
            {"title": "VPN drops every hour", "body": "Since Monday's update."},
        )
    )
    compensation_request(
        step=vpn, user=reviewer, version=vpn.version, reason="The customer fixed it themselves."
    )

    # The desk creates the ticket and drops the connection before answering; then, frozen,
    # it cannot answer the lookup either.
    desk.faults(drop_after_commit_rate=1.0)
    unknown = execute(
        post(
            agent,
            run,
            "ticketdesk.create",
            "open-ticket-badge",
            {"title": "Badge reader refuses everyone", "body": "Main entrance."},
        )
    )
    desk.faults(reset=True)
    assert unknown.state == State.UNKNOWN
    settings.TICKETDESK_TIMEOUT_SECONDS = 1
    desk.process.pause()
    try:
        assert recovery.reconcile(unknown.pk) == State.UNKNOWN
    finally:
        desk.process.resume()

    dead = dead_letter(agent, run, "notify-partner")
    planned = post(
        agent, run, "example.refund", "refund-order-1042", {"order": 1042, "amount": "19.90"}
    )
    blocked = blocked_step(agent, run, "email-customer")
    execute(post(agent, run, "example.summarize", "summarize-thread", {"thread": 77}))

    nightly, _ = run_create(agent=agent, name="nightly-digest", max_calls=1)
    execute(post(agent, nightly, "echo", "collect", {"message": "collect"}))
    assert engine.process(post(agent, nightly, "echo", "send", {"message": "send"}).pk) == (
        State.PENDING
    )
    nightly.refresh_from_db()
    assert nightly.status == RunStatus.PAUSED
    return {
        "run": run,
        "unknown": fresh(unknown),
        "dead": dead,
        "planned": planned,
        "blocked": blocked,
        "compensation": Step.objects.get(compensates=vpn),
        "paused": nightly,
    }


@pytest.mark.usefixtures("tools")
def test_screenshots_of_the_inbox_an_unknown_step_and_a_run(
    bob_page: Page,
    live_server: Any,
    agent: Agent,
    reviewer: User,
    second_reviewer: User,
    desk: Desk,
    settings: Any,
    tmp_path: Path,
) -> None:
    page = bob_page
    scene = build_scene(agent, reviewer, second_reviewer, desk, settings)
    out = DOCS_DIR if os.environ.get("STEPWARD_SCREENSHOTS") == "1" else tmp_path
    run: Run = scene["run"]

    open_page(page, live_server.url, "/")
    for kind in ("unknown", "approval", "compensation", "dead", "blocked"):
        expect(page.locator(f'[data-testid="inbox-row"][data-kind="{kind}"]')).to_have_count(1)
    expect(page.get_by_test_id("paused-runs")).to_contain_text("nightly-digest")
    expect(page.get_by_test_id("nav-count-total")).to_contain_text("6")
    page.screenshot(path=out / "inbox.png", full_page=True)

    unknown: Step = scene["unknown"]
    open_page(page, live_server.url, f"/steps/{unknown.pk}/")
    expect(page.get_by_test_id("step-state")).to_have_text("unknown")
    expect(page.get_by_test_id("timeline-attempt")).to_contain_text("ambiguous")
    expect(
        page.get_by_test_id("timeline-event").filter(has_text="lookup could not tell")
    ).to_be_visible()
    expect(page.get_by_test_id("decision-resolve-happened")).to_be_visible()
    page.screenshot(path=out / "step.png", full_page=True)

    open_page(page, live_server.url, f"/runs/{run.pk}/")
    run.refresh_from_db()
    expect(page.get_by_test_id("run-progress")).to_contain_text(f"{run.steps.count()} steps")
    expect(page.get_by_test_id("budget-calls")).to_contain_text(f"{run.used_calls} of 40")
    expect(page.get_by_test_id("budget-cost")).to_contain_text("0.04 of 5")
    report = selectors.run_report(run=run)
    expect(page.get_by_test_id("report-summary")).to_have_text(report["summary"].replace("`", ""))
    page.screenshot(path=out / "run.png", full_page=True)

    for name in ("inbox.png", "step.png", "run.png"):
        width, height = png_size(out / name)
        # Full page: the whole window's width, and at least its height.
        assert width == VIEWPORT["width"], (name, width)
        assert height >= VIEWPORT["height"], (name, height)

    # The ledger holds what the screens show.
    states = {name: fresh(scene[name]).state for name in ("unknown", "dead", "planned", "blocked")}
    assert states == {
        "unknown": State.UNKNOWN,
        "dead": State.DEAD,
        "planned": State.PLANNED,
        "blocked": State.BLOCKED,
    }
    assert fresh(scene["compensation"]).state == State.PLANNED
    assert run.steps.filter(state=State.COMPENSATED).count() == 1
    assert Run.objects.get(pk=scene["paused"].pk).status == RunStatus.PAUSED
    assert Attempt.objects.filter(step__run=run, submitted_at__isnull=False).count() == (
        run.used_calls
    )
