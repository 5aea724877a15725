"""Company sign-in in Chromium (issue 23.4): a person signs in with the company's provider,
a real OpenID Connect provider (django-oauth-toolkit's, tests/oidc_provider/) in a process of
its own, by its own sign-in form, and lands in the inbox with the role their group maps to.

Set STEPWARD_SCREENSHOTS=1 to write docs/sign-in.png.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from console import signin
from executor.ledger.records import Agent, Run, SignInRole, Workspace, WorkspaceRole
from executor.ledger.states import State
from executor.services.signin import sign_in_role_save
from executor.services.tools import tool_policy_set
from tests.support.browser import DOCS_DIR, VIEWPORT, inbox_row, png_size, post
from tests.support.oidc import (
    CALLBACK,
    CLIENT_ID,
    CLIENT_SECRET,
    COMPANY,
    Provider,
    start_provider,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

APPROVERS = "stepward-approvers"
REVIEWERS = "stepward-reviewers"


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory, live_server: Any) -> Iterator[Provider]:
    started = start_provider(tmp_path_factory.mktemp("provider"), [f"{live_server.url}{CALLBACK}"])
    yield started
    started.stop()


@pytest.fixture
def company(settings: Any, provider: Provider, workspace: Workspace) -> Provider:
    settings.OIDC_ISSUER = provider.issuer
    settings.OIDC_RP_CLIENT_ID = CLIENT_ID
    settings.OIDC_RP_CLIENT_SECRET = CLIENT_SECRET
    settings.OIDC_PROVIDER_NAME = COMPANY
    settings.OIDC_RP_SCOPES = "openid email profile groups"
    signin.discovery_forget()
    for idp_group, role in ((APPROVERS, WorkspaceRole.APPROVER), (REVIEWERS, "reviewer")):
        sign_in_role_save(role=SignInRole(workspace=workspace, idp_group=idp_group, role=role))
    return provider


@pytest.fixture
def waiting(agent: Agent, run: Run) -> Any:
    """A call waiting for a person's approval in acme."""
    tool_policy_set(workspace=run.workspace, tool="echo", approval="always")
    step = post(agent, run, "echo", "echo-sso", {"message": "signed in by the company"})
    assert step.state == State.PLANNED
    return step


def sign_in_at_the_provider(page: Page, base_url: str, username: str, password: str) -> None:
    page.goto(base_url + "/")
    expect(page).to_have_url(f"{base_url}/accounts/login/?next=/")
    page.get_by_role("link", name=f"Sign in with {COMPANY}").click()
    # The provider's own page, on its own port.
    expect(page.get_by_role("heading", name="Example Corp")).to_be_visible()
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in to Example Corp").click()


def test_an_approver_signs_in_with_the_company_and_approves_from_the_inbox(
    page: Page, live_server: Any, company: Provider, waiting: Any, tmp_path: Path
) -> None:
    company.person("alice", "alice-at-example", [APPROVERS, "everyone"], first_name="Alice")
    out = DOCS_DIR if os.environ.get("STEPWARD_SCREENSHOTS") == "1" else tmp_path

    page.goto(live_server.url + "/")
    expect(page.get_by_test_id("company-sign-in")).to_have_text(f"Sign in with {COMPANY}")
    expect(page.get_by_test_id("login-form")).to_be_visible()
    page.screenshot(path=out / "sign-in.png", full_page=True)
    width, _ = png_size(out / "sign-in.png")
    assert width == VIEWPORT["width"]

    sign_in_at_the_provider(page, live_server.url, "alice", "alice-at-example")

    expect(page).to_have_url(f"{live_server.url}/")
    expect(page.locator(".username")).to_have_text("alice")
    row = inbox_row(page, waiting)
    expect(row).to_be_visible()
    row.locator("a.step-key").click()
    expect(page.get_by_test_id("step-state")).to_have_text("planned")
    decision = page.get_by_test_id("decision-approve")
    decision.get_by_label("Reason").fill("Approved by the approver the company named.")
    decision.get_by_role("button", name="Approve this call").click()
    expect(page.get_by_test_id("decision-notice")).to_have_text("Approved.")


def test_a_reviewer_sees_the_step_but_cannot_approve_it(
    page: Page, live_server: Any, company: Provider, waiting: Any
) -> None:
    company.person("bruno", "bruno-at-example", [REVIEWERS])
    sign_in_at_the_provider(page, live_server.url, "bruno", "bruno-at-example")

    expect(page).to_have_url(f"{live_server.url}/")
    expect(inbox_row(page, waiting)).to_be_visible()
    page.goto(f"{live_server.url}/steps/{waiting.pk}/")
    expect(page.get_by_test_id("step-state")).to_have_text("planned")
    expect(page.get_by_test_id("decision-approve")).to_have_count(0)


def test_a_person_in_no_mapped_group_signs_in_to_an_empty_inbox(
    page: Page, live_server: Any, company: Provider, waiting: Any
) -> None:
    company.person("mallory", "mallory-at-example", ["marketing"])
    sign_in_at_the_provider(page, live_server.url, "mallory", "mallory-at-example")

    expect(page).to_have_url(f"{live_server.url}/")
    expect(page.locator(".username")).to_have_text("mallory")
    expect(page.get_by_test_id("inbox-empty")).to_be_visible()
    expect(inbox_row(page, waiting)).to_have_count(0)
    assert page.goto(f"{live_server.url}/steps/{waiting.pk}/").status == 404  # type: ignore[union-attr]
