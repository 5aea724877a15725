"""Approvals in Chromium (issue 11, "What must be shown"): an admin makes a tool wait for a
person in a workspace without code, a reviewer approves the exact call and it runs; an
approval past its expiry authorizes nothing; who asked for a compensation does not approve
it too; "it happened" takes only an external id of the form the tool declares.

Every step is made by the engine or the API, never written into the ledger by hand; the one
thing aged by hand is an approval's timestamps, which only the clock would otherwise move.
Set STEPWARD_SCREENSHOTS=1 to write the README's screenshots into docs/.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.utils import timezone
from playwright.sync_api import Locator, Page, expect

from executor import engine, selectors
from executor.client import Stepward
from executor.models import Approval, Run, Step, ToolPolicy
from executor.states import State
from tests.browser.conftest import (
    WORKER,
    decide,
    events_by,
    execute,
    fresh,
    inbox_row,
    open_page,
    sign_in,
)
from tests.conftest import AgentAuth

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
    expect(page.locator(".messagelist")).to_contain_text("was added successfully")


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
