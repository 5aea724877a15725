"""The review desk of a team in Chromium (issue 23.3): search, sort, bulk approve and reject
with one stale item among them, a claim seen by a second reviewer, the decisions page and its
CSV, an approval made with the keyboard alone, and the step page following another reviewer's
decision without a reload.

Steps are posted through the services and moved by the engine, never written by hand; the
second reviewer is a second browser with her own session. Set STEPWARD_SCREENSHOTS=1 to
write the screenshots of docs/reviewers.md (docs/inbox-*.png).
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Browser, BrowserContext, Page, expect

from executor.ledger.records import Agent, Event, Run, Step, StepClaim
from executor.ledger.states import State
from executor.services.reviews import step_approve, step_reject
from tests.support.browser import (
    DOCS_DIR,
    VIEWPORT,
    dead_letter,
    events_by,
    fresh,
    inbox_row,
    open_page,
    post,
    sign_in,
)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("tools"),
]


def shots(tmp_path: Path) -> Path:
    return DOCS_DIR if os.environ.get("STEPWARD_SCREENSHOTS") == "1" else tmp_path


def refund(agent: Agent, run: Run, key: str, amount: int, order: str) -> Step:
    step = post(agent, run, "example.refund", key, {"order": order, "amount": amount})
    Step.objects.filter(pk=step.pk).update(input_summary=f"refund {amount} EUR on order {order}")
    assert step.state == State.PLANNED
    return fresh(step)


@pytest.fixture
def erin_context(
    browser: Browser, live_server: Any, second_reviewer: User
) -> Iterator[BrowserContext]:
    """erin's own browser, signed in as her."""
    context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
    sign_in(context, second_reviewer, live_server.url)
    try:
        yield context
    finally:
        context.close()


def listed_keys(page: Page) -> list[str]:
    return page.locator('[data-testid="inbox-row"] a.step-key').all_inner_texts()


# --- search and sort ----------------------------------------------------------------------


def test_a_reviewer_searches_the_inbox_and_sorts_it(
    bob_page: Page, live_server: Any, agent: Agent, run: Run, tmp_path: Path
) -> None:
    page = bob_page
    first = refund(agent, run, "refund-7001", 120, "A-7001")
    second = refund(agent, run, "refund-7002", 80, "B-7002")
    third = refund(agent, run, "refund-7003", 640, "A-7003")
    open_page(page, live_server.url, "/")
    expect(page.get_by_test_id("inbox-row")).to_have_count(3)

    # Words of the summary.
    page.get_by_label("Search").fill("order A-")
    page.get_by_label("Search").press("Enter")
    expect(page.get_by_test_id("inbox-row")).to_have_count(2)
    assert listed_keys(page) == ["refund-7001", "refund-7003"]
    expect(page.get_by_test_id("inbox-total")).to_have_text("2")
    assert "q=order%20A-" in page.url

    # The operation id a colleague pasted from a log line.
    page.get_by_label("Search").fill(str(second.operation_id))
    page.get_by_label("Search").press("Enter")
    expect(page.get_by_test_id("inbox-row")).to_have_count(1)
    expect(inbox_row(page, second)).to_be_visible()

    # Everything again, newest first.
    page.get_by_label("Search").fill("")
    page.get_by_label("Search").press("Enter")
    expect(page.get_by_test_id("inbox-row")).to_have_count(3)
    page.get_by_test_id("inbox-sort").select_option("newest")
    expect(page.get_by_test_id("inbox-row").first).to_have_attribute("data-step", str(third.pk))
    assert listed_keys(page) == ["refund-7003", "refund-7002", "refund-7001"]
    assert "sort=newest" in page.url
    page.get_by_label("Search").fill("refund-700")
    page.get_by_label("Search").press("Enter")
    expect(page.get_by_test_id("search-echo")).to_have_text("refund-700")
    assert listed_keys(page) == ["refund-7003", "refund-7002", "refund-7001"]
    page.screenshot(path=str(shots(tmp_path) / "inbox-search.png"))
    assert first.pk  # all three were found by their key's start


# --- bulk approve and reject --------------------------------------------------------------


def test_bulk_approval_lands_every_step_but_the_stale_one_which_is_named(
    bob_page: Page,
    live_server: Any,
    agent: Agent,
    run: Run,
    second_reviewer: User,
    tmp_path: Path,
) -> None:
    page = bob_page
    steps = [refund(agent, run, f"refund-{n}", 40 + n, f"C-{n}") for n in range(1, 5)]
    open_page(page, live_server.url, "/?state=approval")
    expect(page.get_by_test_id("inbox-row")).to_have_count(4)
    for step in steps:
        page.get_by_label(f"Select {step.key} to approve or reject").check()
    # While bob was choosing, erin rejected refund-3: bob's page shows a version now gone.
    step_reject(
        step=steps[2], user=second_reviewer, version=steps[2].version, reason="duplicate of C-1"
    )
    bulk = page.get_by_test_id("bulk-decide-form")
    bulk.get_by_label("One reason for every selected step").fill("Orders checked: refunds due.")
    page.get_by_test_id("bulk-approve").click()

    results = page.get_by_test_id("bulk-result")
    expect(results).to_have_count(4)
    for step in (steps[0], steps[1], steps[3]):
        expect(
            page.locator(f'[data-testid="bulk-result"][data-step="{step.pk}"]')
        ).to_have_attribute("data-outcome", "approved")
    stale = page.locator(f'[data-testid="bulk-result"][data-step="{steps[2].pk}"]')
    expect(stale).to_have_attribute("data-outcome", "stale")
    expect(stale).to_contain_text("refund-3")
    expect(stale).to_contain_text("Already handled by user:erin")
    expect(page.get_by_test_id("inbox-row")).to_have_count(0)
    page.screenshot(path=str(shots(tmp_path) / "inbox-bulk.png"))

    assert [fresh(s).state for s in steps] == [
        State.PENDING,
        State.PENDING,
        State.REJECTED,
        State.PENDING,
    ]
    for step in (steps[0], steps[1], steps[3]):
        (approval,) = events_by(step, "user:bob")
        assert (approval.to_state, approval.reason) == (
            State.APPROVED,
            "Orders checked: refunds due.",
        )
    assert events_by(steps[2], "user:bob") == []


def test_bulk_rejection_lands_every_step_but_the_stale_one(
    bob_page: Page, live_server: Any, agent: Agent, run: Run, second_reviewer: User
) -> None:
    page = bob_page
    steps = [refund(agent, run, f"mistake-{n}", 10, f"D-{n}") for n in range(1, 4)]
    open_page(page, live_server.url, "/")
    for step in steps:
        page.get_by_label(f"Select {step.key} to approve or reject").check()
    step_approve(
        step=steps[0], user=second_reviewer, version=steps[0].version, reason="this one is right"
    )
    page.get_by_label("One reason for every selected step").fill("Posted twice by the agent.")
    page.get_by_test_id("bulk-reject").click()
    expect(page.get_by_test_id("bulk-result")).to_have_count(3)
    stale = page.locator(f'[data-testid="bulk-result"][data-step="{steps[0].pk}"]')
    expect(stale).to_have_attribute("data-outcome", "stale")
    expect(stale).to_contain_text("mistake-1")
    for step in steps[1:]:
        expect(
            page.locator(f'[data-testid="bulk-result"][data-step="{step.pk}"]')
        ).to_have_attribute("data-outcome", "rejected")
    assert [fresh(s).state for s in steps] == [State.PENDING, State.REJECTED, State.REJECTED]


# --- claims -------------------------------------------------------------------------------


def test_a_claim_is_seen_by_a_second_reviewer(
    bob_page: Page,
    erin_context: BrowserContext,
    live_server: Any,
    agent: Agent,
    run: Run,
    tmp_path: Path,
) -> None:
    page = bob_page
    step = refund(agent, run, "refund-claimed", 300, "E-1")
    other = refund(agent, run, "refund-free", 20, "E-2")
    erin = erin_context.new_page()
    open_page(erin, live_server.url, "/")
    open_page(page, live_server.url, "/")

    inbox_row(page, step).get_by_test_id("claim").click()
    expect(inbox_row(page, step).get_by_test_id("claimed-by")).to_have_text("being handled by you")

    # erin's inbox refreshes itself: she sees who has it, and that the other is free.
    expect(inbox_row(erin, step).get_by_test_id("claimed-by")).to_have_text("being handled by bob")
    expect(inbox_row(erin, other).get_by_test_id("claimed-by")).to_have_count(0)
    erin.screenshot(path=str(shots(tmp_path) / "inbox-claim.png"))

    # On the step page too; her own claim is refused while bob's holds.
    open_page(erin, live_server.url, f"/steps/{step.pk}/")
    expect(erin.get_by_test_id("step-claim")).to_contain_text("Being handled by bob")
    expect(erin.get_by_test_id("step-claim").get_by_test_id("claim")).to_have_count(0)

    # bob releases it on his step page: erin's open page offers the claim again, without a
    # reload.
    open_page(page, live_server.url, f"/steps/{step.pk}/")
    page.get_by_test_id("step-claim").get_by_test_id("release").click()
    expect(page.get_by_test_id("step-claim").get_by_test_id("claim")).to_be_visible()
    expect(erin.get_by_test_id("step-claim").get_by_test_id("claim")).to_be_visible()
    erin.get_by_test_id("step-claim").get_by_test_id("claim").click()
    expect(erin.get_by_test_id("step-claim")).to_contain_text("Being handled by you")
    assert StepClaim.objects.get(step=step).user.username == "erin"


# --- the decisions page -------------------------------------------------------------------


def test_the_decisions_page_says_who_decided_what_and_exports_it(
    bob_page: Page,
    live_server: Any,
    agent: Agent,
    run: Run,
    reviewer: User,
    second_reviewer: User,
    tmp_path: Path,
) -> None:
    page = bob_page
    approved = refund(agent, run, "refund-ok", 50, "F-1")
    rejected = refund(agent, run, "refund-no", 5000, "F-2")
    step_approve(step=approved, user=reviewer, version=approved.version, reason="customer called")
    step_reject(
        step=rejected, user=second_reviewer, version=rejected.version, reason="over the limit"
    )
    open_page(page, live_server.url, "/")
    page.get_by_test_id("nav-decisions").click()
    expect(page.get_by_test_id("decision-row")).to_have_count(2)
    expect(page.get_by_test_id("decisions-total")).to_have_text("2")
    expect(page.get_by_test_id("decision-person")).to_have_text(["erin", "bob"])
    expect(page.get_by_test_id("decision-reason")).to_have_text(
        ["over the limit", "customer called"]
    )
    page.screenshot(path=str(shots(tmp_path) / "inbox-decisions.png"))

    page.get_by_label("Person").select_option("erin")
    expect(page.get_by_test_id("decision-row")).to_have_count(1)
    expect(page.get_by_test_id("decision-row")).to_have_attribute("data-kind", "rejected")
    assert "person=erin" in page.url

    with page.expect_download() as download:
        page.get_by_test_id("decisions-csv").click()
    rows = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text())))
    assert [(r["person"], r["decision"], r["step_key"], r["reason"]) for r in rows] == [
        ("erin", "rejected", "refund-no", "over the limit")
    ]

    # A day no calendar has is said, not a failure.
    open_page(page, live_server.url, "/decisions/?until=9999-12-31")
    expect(page.get_by_test_id("filter-problem")).to_contain_text("9999-12-31")
    expect(page.get_by_test_id("decision-row")).to_have_count(2)


# --- the keyboard -------------------------------------------------------------------------


def test_an_approval_with_the_keyboard_alone(
    bob_page: Page, live_server: Any, agent: Agent, run: Run, tmp_path: Path
) -> None:
    page = bob_page
    older = refund(agent, run, "refund-first", 10, "G-1")
    step = refund(agent, run, "refund-second", 20, "G-2")
    Step.objects.filter(pk=older.pk).update(state_since=older.state_since.replace(year=2025))
    open_page(page, live_server.url, "/")
    expect(page.get_by_test_id("inbox-row")).to_have_count(2)

    page.keyboard.press("?")
    expect(page.get_by_test_id("shortcuts-help")).to_be_visible()
    page.screenshot(path=str(shots(tmp_path) / "inbox-shortcuts.png"))
    page.keyboard.press("Escape")
    expect(page.get_by_test_id("shortcuts-help")).to_be_hidden()

    page.keyboard.press("j")
    expect(inbox_row(page, older)).to_have_class(re.compile("is-current"))
    page.keyboard.press("j")
    expect(inbox_row(page, step)).to_have_class(re.compile("is-current"))
    page.keyboard.press("k")
    page.keyboard.press("j")
    page.keyboard.press("a")
    expect(page).to_have_url(f"{live_server.url}/steps/{step.pk}/#approve")
    expect(page.locator("#approve-reason")).to_be_focused()
    page.keyboard.type("Order G-2 was returned.")
    page.keyboard.press("Control+Enter")
    expect(page.get_by_test_id("decision-notice")).to_have_text("Approved.")
    expect(page.get_by_test_id("step-state")).to_have_text("pending")
    (approval,) = events_by(step, "user:bob")
    assert (approval.to_state, approval.reason) == (State.APPROVED, "Order G-2 was returned.")
    assert fresh(older).state == State.PLANNED

    # "/" goes to the search from anywhere on the inbox.
    open_page(page, live_server.url, "/")
    page.keyboard.press("/")
    expect(page.get_by_test_id("inbox-search")).to_be_focused()


# --- live pages ---------------------------------------------------------------------------


def test_the_step_page_follows_another_reviewers_decision_without_a_reload(
    bob_page: Page,
    erin_context: BrowserContext,
    live_server: Any,
    agent: Agent,
    run: Run,
    tmp_path: Path,
) -> None:
    page = bob_page
    step = refund(agent, run, "refund-watched", 75, "H-1")
    open_page(page, live_server.url, f"/steps/{step.pk}/")
    expect(page.get_by_test_id("step-state")).to_have_text("planned")
    expect(page.get_by_test_id("nav-count-total")).to_have_text("1 waiting")
    page.get_by_test_id("decision-approve").get_by_label("Reason").fill("half-typed")
    # A mark that a reload would wipe.
    page.evaluate("window.stillTheSamePage = true")

    erin = erin_context.new_page()
    open_page(erin, live_server.url, f"/steps/{step.pk}/")
    erin.get_by_test_id("decision-approve").get_by_label("Reason").fill("I know this customer.")
    erin.get_by_test_id("decision-approve").get_by_role("button").click()
    expect(erin.get_by_test_id("decision-notice")).to_have_text("Approved.")

    expect(page.get_by_test_id("step-state")).to_have_text("pending")
    expect(page.get_by_test_id("decision-approve")).to_have_count(0)
    expect(page.get_by_test_id("timeline")).to_contain_text("I know this customer.")
    expect(page.get_by_test_id("nav-count-total")).to_have_text("0 waiting")
    assert page.evaluate("window.stillTheSamePage") is True
    page.screenshot(path=str(shots(tmp_path) / "inbox-live-step.png"))
    assert Event.objects.filter(step=step, actor="user:erin").count() == 1


def test_repeated_attempts_fold_into_one_line_of_the_timeline(
    bob_page: Page, live_server: Any, agent: Agent, run: Run, tmp_path: Path
) -> None:
    page = bob_page
    step = dead_letter(agent, run, "notify-partner-folded")
    open_page(page, live_server.url, f"/steps/{step.pk}/")
    group = page.get_by_test_id("timeline-group")
    expect(group).to_have_count(1)
    expect(page.get_by_test_id("timeline-group-summary")).to_contain_text(
        "Attempts 1\u20133 failed: unavailable: ToolError: 503 Service Unavailable"
    )
    # Folded: the attempts inside show when asked for.
    expect(group.get_by_test_id("timeline-attempt").first).to_be_hidden()
    page.get_by_test_id("timeline-group-summary").click()
    expect(group.get_by_test_id("timeline-attempt")).to_have_count(3)
    expect(page.locator(".abs-time").first).to_have_text(
        re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC")
    )
    page.screenshot(path=str(shots(tmp_path) / "inbox-timeline.png"), full_page=True)
