"""Approval rules in Chromium (issue 23.1): a refund a rule gives to two reviewers is approved
by two different people, and the step page says, at each point, who has approved and who is
still needed; the first reviewer cannot count twice."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Browser, Page, expect

from executor.ledger.records import Agent, Rule, Run, Signoff
from executor.ledger.states import State
from executor.services.reviews import step_approve
from executor.services.rules import rules_load
from tests.support.browser import (
    DOCS_DIR,
    VIEWPORT,
    decide,
    execute,
    fresh,
    open_page,
    png_size,
    post,
    sign_in,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

RULES = [
    {
        "tool": "example.refund",
        "when": "input.amount > 1000",
        "action": "require_two",
        "reason": "refunds over 1,000 need two people",
    },
    {
        "tool": "example.refund",
        "when": "input.amount <= 100",
        "action": "allow",
        "reason": "small refunds go through",
    },
]


def test_a_require_two_step_is_approved_by_two_reviewers_and_the_page_says_who_is_still_needed(
    bob_page: Page,
    browser: Browser,
    browser_context_args: dict[str, Any],
    live_server: Any,
    agent: Agent,
    run: Run,
    reviewer: User,
    second_reviewer: User,
    tools: None,
) -> None:
    rules_load(tables=RULES)
    small = post(agent, run, "example.refund", "refund-small", {"amount": 40})
    assert small.state == State.PENDING  # the allow rule wins over the tool's "always"
    step = post(agent, run, "example.refund", "refund-large", {"amount": 5000})
    assert step.state == State.PLANNED

    page = bob_page
    open_page(page, live_server.url, f"/steps/{step.pk}/")
    expect(page.get_by_test_id("approval-rule-decided")).to_contain_text(
        "require_two: refunds over 1,000 need two people"
    )
    expect(page.get_by_test_id("approved-by")).to_have_text("Approved by: nobody yet.")
    expect(page.get_by_test_id("still-needed")).to_have_text("Still needed: 2 more reviewers.")

    decide(page, "decision-approve", "Approve this call", "The customer was charged twice.")
    expect(page.get_by_test_id("decision-notice")).to_contain_text(
        "a rule asks for two reviewers, so the step waits for a second, different approver"
    )
    expect(page.get_by_test_id("step-state")).to_have_text("planned")
    expect(page.get_by_test_id("approved-by")).to_have_text("Approved by: bob.")
    expect(page.get_by_test_id("still-needed")).to_have_text(
        "Still needed: 1 more reviewer, other than bob."
    )
    # bob cannot be the second approver: the form is gone, and the page says why.
    expect(page.get_by_test_id("decision-approve")).to_have_count(0)
    expect(page.get_by_test_id("decision-approve-unavailable")).to_contain_text(
        "a second, different reviewer must approve it"
    )
    assert fresh(step).state == State.PLANNED

    erin_context = browser.new_context(**browser_context_args)
    try:
        sign_in(erin_context, second_reviewer, live_server.url)
        erin_page = erin_context.new_page()
        open_page(erin_page, live_server.url, f"/steps/{step.pk}/")
        expect(erin_page.get_by_test_id("approved-by")).to_have_text("Approved by: bob.")
        expect(erin_page.get_by_test_id("still-needed")).to_have_text(
            "Still needed: 1 more reviewer, other than bob."
        )
        decide(erin_page, "decision-approve", "Approve this call", "Checked the ledger too.")
        expect(erin_page.get_by_test_id("decision-notice")).to_have_text(
            "Approved by bob and erin: both approvals are given."
        )
        expect(erin_page.get_by_test_id("step-state")).to_have_text("pending")
    finally:
        erin_context.close()

    done = execute(step)
    assert done.state == State.COMPLETED
    assert sorted(s.approver.username for s in Signoff.objects.filter(step_id=step.pk)) == [
        "bob",
        "erin",
    ]
    open_page(page, live_server.url, f"/steps/{step.pk}/")
    expect(page.get_by_test_id("step-state")).to_have_text("completed")
    expect(page.get_by_test_id("approvers")).to_have_count(0)


def test_screenshots_of_a_step_waiting_for_a_second_reviewer_and_a_rules_admin_page(
    page: Page,
    live_server: Any,
    owner: User,
    reviewer: User,
    agent: Agent,
    run: Run,
    tools: None,
    tmp_path: Path,
) -> None:
    out = DOCS_DIR if os.environ.get("STEPWARD_SCREENSHOTS") == "1" else tmp_path
    rules_load(tables=RULES)
    for number, amount in enumerate((40, 250, 80, 5000, 1800), start=1):
        post(agent, run, "example.refund", f"refund-{number}", {"amount": amount})
    step = post(agent, run, "example.refund", "refund-order-1042", {"amount": 2400})
    step_approve(step=step, user=reviewer, version=step.version, reason="Charged twice.")

    sign_in(page.context, owner, live_server.url)
    rule = Rule.objects.get(action="require_two")
    open_page(page, live_server.url, f"/admin/executor/rule/{rule.pk}/change/")
    expect(page.locator("#content")).to_contain_text("this rule decides 3 of them")
    page.screenshot(path=out / "admin-rule.png", full_page=True)

    page.context.clear_cookies()
    sign_in(page.context, reviewer, live_server.url)
    open_page(page, live_server.url, f"/steps/{step.pk}/")
    expect(page.get_by_test_id("still-needed")).to_have_text(
        "Still needed: 1 more reviewer, other than bob."
    )
    page.screenshot(path=out / "rules-two-reviewers.png", full_page=True)

    for name in ("admin-rule.png", "rules-two-reviewers.png"):
        width, height = png_size(out / name)
        assert width == VIEWPORT["width"], (name, width)
        assert height >= VIEWPORT["height"], (name, height)
