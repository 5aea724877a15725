"""Sign-in and visibility: every page needs a login, and another workspace's objects do not
exist for a reviewer, whether asked for as a page or as a region."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.template.loader import render_to_string
from django.test import Client
from django.urls import reverse

from executor.ledger.records import Agent, Run
from executor.services import decisions
from tests.support.console import dead, htmx, planned, read

pytestmark = pytest.mark.usefixtures("tools")

PAGES = ["inbox", "runs", "nav_counts"]
STEP_URLS = ["step", "step_decisions", "step_timeline"]
RUN_URLS = ["run", "run_live"]


@pytest.fixture
def step(agent: Agent, run: Run) -> Any:
    return planned(agent, run)


def every_get_url(step: Any, run: Run) -> list[str]:
    return [
        *(reverse(name) for name in PAGES),
        *(reverse(name, args=[step.pk]) for name in STEP_URLS),
        *(reverse(name, args=[run.pk]) for name in RUN_URLS),
    ]


def test_the_login_page_renders_with_labelled_fields(client: Client) -> None:
    response = client.get(reverse("login"))
    assert response.status_code == 200
    page = read(response)
    form = page.form("login-form")
    assert page.label_for(form.field("username")["id"]) == "Username"
    assert page.label_for(form.field("password")["id"]) == "Password"
    assert form.field("csrfmiddlewaretoken")
    assert form.buttons == ["Sign in"]


def test_signing_in_lands_on_the_inbox(client: Client, reviewer: User) -> None:
    response = client.post(reverse("login"), {"username": "bob", "password": "bob-pw"}, follow=True)
    assert response.redirect_chain[-1][0] == reverse("inbox")
    assert "Nothing waits for you" in read(response).text


def test_a_wrong_password_is_said_plainly(client: Client, reviewer: User) -> None:
    response = client.post(reverse("login"), {"username": "bob", "password": "nope"})
    assert response.status_code == 200
    assert "login-error" in read(response).testids()


def test_signing_out_returns_to_the_login_page(bob: Client) -> None:
    response = bob.post(reverse("logout"), {"next": reverse("login")})
    assert response.status_code == 302
    assert response["Location"] == reverse("login")
    assert bob.get(reverse("inbox")).status_code == 302


def test_every_console_url_sends_an_anonymous_visitor_to_sign_in(
    client: Client, step: Any, run: Run
) -> None:
    for url in every_get_url(step, run):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"] == f"{reverse('login')}?next={url}", url


def test_every_decision_sends_an_anonymous_visitor_to_sign_in(
    client: Client, step: Any, run: Run
) -> None:
    urls = [reverse("step_decide", args=[step.pk, d.name]) for d in decisions.DECISIONS]
    urls += [reverse("run_extend", args=[run.pk]), reverse("deadletters_replay")]
    for url in urls:
        response = client.post(url, {"version": 1, "reason": "x"})
        assert response.status_code == 302, url
        assert response["Location"].startswith(reverse("login")), url


def test_an_htmx_request_without_a_session_redirects_the_whole_page(client: Client) -> None:
    response = client.get(reverse("inbox"), **htmx(target="inbox-list", current_url="/?state=dead"))
    assert response.status_code == 200
    assert response["HX-Redirect"] == f"{reverse('login')}?next=/%3Fstate%3Ddead"


def test_an_outsider_gets_404_for_every_page_and_region_of_another_workspace(
    charlie: Client, step: Any, run: Run
) -> None:
    for name in STEP_URLS:
        assert charlie.get(reverse(name, args=[step.pk])).status_code == 404, name
        assert charlie.get(reverse(name, args=[step.pk]), **htmx()).status_code == 404, name
    for name in RUN_URLS:
        assert charlie.get(reverse(name, args=[run.pk])).status_code == 404, name
        assert charlie.get(reverse(name, args=[run.pk]), **htmx()).status_code == 404, name


def test_a_reviewer_sees_pages_and_regions_of_their_workspace(
    bob: Client, step: Any, run: Run
) -> None:
    for url in every_get_url(step, run):
        assert bob.get(url).status_code == 200, url
        assert bob.get(url, **htmx()).status_code == 200, url


def test_the_superuser_sees_every_workspace(
    alice: Client, other_agent_auth: Any, owner: User
) -> None:
    from executor.services.runs import run_create
    from executor.services.tools import tools_sync

    tools_sync()
    other_run, _ = run_create(agent=other_agent_auth.agent, name="globex run")
    step = dead(other_agent_auth.agent, other_run, key="globex-dead", tool="echo")
    assert alice.get(reverse("step", args=[step.pk])).status_code == 200
    assert alice.get(reverse("run", args=[other_run.pk])).status_code == 200


def test_a_user_without_review_steps_sees_nothing(step: Any, run: Run) -> None:
    nobody = User.objects.create_user("eve", password="eve-pw")
    client = Client()
    client.force_login(nobody)
    assert "Nothing waits for you" in read(client.get(reverse("inbox"))).text
    assert client.get(reverse("step", args=[step.pk])).status_code == 404
    assert client.get(reverse("run", args=[run.pk])).status_code == 404
    assert "test run" not in read(client.get(reverse("runs"))).text


def test_a_deactivated_reviewer_is_signed_out(reviewer: User, step: Any) -> None:
    client = Client()
    client.force_login(reviewer)
    User.objects.filter(pk=reviewer.pk).update(is_active=False)
    response = client.get(reverse("step", args=[step.pk]))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("login"))


def test_an_unknown_step_id_is_404(bob: Client) -> None:
    assert bob.get("/steps/00000000-0000-0000-0000-000000000000/").status_code == 404


def test_the_404_page_is_the_consoles_with_a_way_back(
    bob: Client, charlie: Client, step: Any
) -> None:
    for client in (bob, charlie):
        url = reverse("step", args=[step.pk]) if client is charlie else "/steps/nothing-here/"
        page = read(client.get(url))
        assert "not-found" in page.testids()
        assert "or it belongs to a workspace you do not review" in page.text
        links = {a["href"] for tag, a in page.elements if tag == "a" and "href" in a}
        assert {reverse("inbox"), reverse("runs")} <= links
        # Nothing of the step leaks into the page that hides it.
        assert step.key not in page.text


def test_the_404_page_offers_sign_in_to_a_visitor(client: Client) -> None:
    response = client.get("/no/such/page/")
    assert response.status_code == 404
    page = read(response)
    assert "not-found" in page.testids()
    assert reverse("login") in {a["href"] for tag, a in page.elements if tag == "a" and "href" in a}


def test_the_500_page_renders_without_a_request() -> None:
    html = render_to_string("500.html")
    assert "Something went wrong on our side" in html
    assert "csrf" not in html.lower()
