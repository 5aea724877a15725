"""The console, the admin and the API docs in Chromium under the Content-Security-Policy: no
page makes the browser report a violation, and htmx still swaps, polls and posts with eval
off (its one inline handler moved to static/js/console.js)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import ConsoleMessage, Page, Response, expect

from executor.ledger.records import Agent, Run
from executor.ledger.states import State
from tests.support.browser import blocked_step, dead_letter, fresh

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

# Runs before any script of the page: whatever the policy refuses lands in this list.
RECORD_VIOLATIONS = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", (event) => {
  window.__cspViolations.push(
    `${event.violatedDirective} blocked ${event.blockedURI || "inline"} ` +
    `at ${event.sourceFile}:${event.lineNumber}`
  );
});
"""


class Reports:
    """What the browser said: violation events, console errors, uncaught exceptions."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.console: list[str] = []
        self.violations: list[str] = []
        page.on("console", self.on_console)
        page.on("pageerror", lambda error: self.console.append(f"pageerror: {error}"))
        page.on("response", self.on_response)

    def on_console(self, message: ConsoleMessage) -> None:
        # A refused inline script, eval or style is logged as an error; so is htmx's
        # htmx:evalDisallowedError. A failed load is checked by its response instead.
        if message.text.startswith("Failed to load resource"):
            return
        if message.type == "error" or "Content Security Policy" in message.text:
            self.console.append(f"{message.type}: {message.text}")

    def on_response(self, response: Response) -> None:
        # The admin has no favicon link, so the browser asks for /favicon.ico: not ours.
        if response.status >= 400 and not response.url.endswith("/favicon.ico"):
            self.console.append(f"{response.status}: {response.url}")

    def collect(self) -> None:
        self.violations += self.page.evaluate("window.__cspViolations || []")

    def assert_clean(self, where: str) -> None:
        self.collect()
        assert self.violations == [], where
        assert self.console == [], where


@pytest.fixture
def reports(page: Page) -> Reports:
    page.context.add_init_script(RECORD_VIOLATIONS)
    return Reports(page)


def visit(page: Page, reports: Reports, url: str) -> None:
    reports.collect()  # the page being left
    response = page.goto(url)
    assert response is not None
    assert response.status == 200, (url, response.status)
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy
    assert "unsafe" not in policy


@pytest.mark.usefixtures("tools")
def test_console_admin_and_api_docs_run_under_the_policy_with_no_violation(
    page: Page, reports: Reports, live_server: Any, owner: User, agent: Agent, run: Run
) -> None:
    replayed = dead_letter(agent, run, "notify-partner-1")
    left = dead_letter(agent, run, "notify-partner-2")
    stuck = blocked_step(agent, run, "email-1")
    base = live_server.url

    # Signing in through the form (and the throttling backend) as alice, who is staff.
    visit(page, reports, f"{base}/accounts/login/")
    form = page.get_by_test_id("login-form")
    form.get_by_label("Username").fill("alice")
    form.get_by_label("Password").fill("alice-pw")
    form.get_by_role("button", name="Sign in").click()
    expect(page.locator(".account .username")).to_have_text("alice")

    # The inbox: htmx swaps the list for a tab, then posts the bulk replay; console.js
    # clears the form once the server accepted it.
    visit(page, reports, f"{base}/")
    expect(page.get_by_test_id("nav-count-total")).to_contain_text("3")
    page.get_by_test_id("tab-dead").click()
    expect(page.get_by_test_id("tab-dead")).to_have_attribute("aria-current", "page")
    page.get_by_label(f"Select {replayed.key} for replay").check()
    bulk = page.get_by_test_id("bulk-replay-form")
    reason = bulk.get_by_label("Reason for replaying the selected dead letters")
    reason.fill("The partner's endpoint is back.")
    bulk.get_by_role("button", name="Replay selected").click()
    expect(page.get_by_test_id("bulk-notice")).to_have_text("Replayed 1 dead letter.")
    expect(reason).to_have_value("")
    assert fresh(replayed).state == State.PENDING
    assert fresh(left).state == State.DEAD
    reports.assert_clean("inbox")

    # A step, the runs and a run with its SVG bars, the drills.
    visit(page, reports, f"{base}/steps/{stuck.pk}/")
    expect(page.get_by_test_id("step-state")).to_have_text("blocked")
    visit(page, reports, f"{base}/runs/")
    expect(page.locator("svg.mini-progress rect")).to_have_count(1)
    visit(page, reports, f"{base}/runs/{run.pk}/")
    for state in ("dead", "pending", "blocked"):
        # Drawn from SVG geometry: a visible width with no inline style.
        box = page.locator(f"svg.stackbar rect.seg.state-{state}").bounding_box()
        assert box is not None, state
        assert box["width"] > 3, (state, box)
    visit(page, reports, f"{base}/drills/")
    reports.assert_clean("console pages")

    # The admin, with Stepward's own stylesheet for its fields.
    visit(page, reports, f"{base}/admin/")
    visit(page, reports, f"{base}/admin/executor/step/{stuck.pk}/change/")
    expect(page.locator("pre.stepward-json").first).to_have_css("white-space", "pre-wrap")
    visit(page, reports, f"{base}/admin/executor/step/")
    reports.assert_clean("admin")

    # The API docs: Swagger UI from static files, its settings a JSON block, not a script.
    visit(page, reports, f"{base}/api/v1/docs")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("Stepward")
    expect(page.locator(".opblock").first).to_be_visible()
    reports.assert_clean("API docs")


def test_an_inline_script_would_be_reported(page: Page, reports: Reports, live_server: Any) -> None:
    """The listener above does hear the policy: an injected inline script is refused."""
    visit(page, reports, f"{live_server.url}/accounts/login/")
    page.evaluate(
        """() => {
          const script = document.createElement("script");
          script.textContent = "window.__ran = true";
          document.body.append(script);
        }"""
    )
    expect(page.locator("body")).to_be_visible()
    page.wait_for_function("window.__cspViolations.length > 0")
    assert page.evaluate("window.__ran === undefined")
    reports.collect()
    assert any("script-src" in violation for violation in reports.violations)
