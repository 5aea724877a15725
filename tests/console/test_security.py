"""What every page carries for safety (a Content-Security-Policy with no inline or eval
script, `Cache-Control: no-store`) and sign-in throttling with lockout for the console and
the admin (django-axes)."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client, RequestFactory
from django.urls import reverse
from django.utils import timezone

from console.security import client_ip
from executor.ledger.records import Agent, DrillReport, Run
from tests.support.console import dead, unknown

pytestmark = pytest.mark.django_db

CONSOLE = "203.0.113.10"


# --- the pages ----------------------------------------------------------------------------


@pytest.fixture
def pages(agent: Agent, run: Run, tools: None) -> list[str]:
    """Every screen of the console with something on it, the admin's, the sign-in page and
    the API docs."""
    waiting = unknown(agent, run)
    dead(agent, run)
    drill = DrillReport.objects.create(version="0.1.0", started_at=timezone.now(), passed=True)
    return [
        reverse("inbox"),
        reverse("inbox") + "?state=dead",
        reverse("step", args=[waiting.pk]),
        reverse("runs"),
        reverse("run", args=[run.pk]),
        reverse("drills"),
        reverse("drill", args=[drill.pk]),
        reverse("admin:index"),
        reverse("admin:executor_step_changelist"),
        reverse("admin:executor_step_change", args=[waiting.pk]),
        "/api/v1/docs",
    ]


def signed_in_owner(owner: User) -> Client:
    client = Client()
    client.force_login(owner)
    return client


def responses(owner: User, pages: list[str]) -> list[tuple[str, Any]]:
    """Each page as alice (a superuser, so the admin answers too), and the sign-in pages."""
    client = signed_in_owner(owner)
    answered = [(path, client.get(path)) for path in pages]
    anonymous = Client()
    answered += [(path, anonymous.get(path)) for path in (reverse("login"), "/admin/login/")]
    for path, response in answered:
        assert response.status_code == 200, (path, response.status_code)
    return answered


def directives(policy: str) -> dict[str, list[str]]:
    return {
        name: values
        for name, *values in (part.split() for part in policy.split(";") if part.strip())
    }


def test_every_page_has_a_policy_that_runs_no_inline_or_eval_script(
    owner: User, pages: list[str]
) -> None:
    for path, response in responses(owner, pages):
        assert "Content-Security-Policy" in response, path
        policy = directives(response["Content-Security-Policy"])
        # No script source but the site's own files; default-src would stand in for it.
        assert policy["script-src"] == ["'self'"], (path, policy)
        assert policy["default-src"] == ["'self'"], (path, policy)
        assert policy["style-src"] == ["'self'"], (path, policy)
        assert policy["object-src"] == ["'none'"], (path, policy)
        for unsafe in ("'unsafe-inline'", "'unsafe-eval'", "'unsafe-hashes'", "*"):
            assert unsafe not in response["Content-Security-Policy"], (path, unsafe)


class InlineCode(HTMLParser):
    """Collects what the policy would refuse: inline script, handler attributes (onclick,
    hx-on), style attributes and <style> blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self.in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = dict(attrs)
        # A JSON data block is not executed (the API docs' settings, json_script).
        if tag == "script" and "src" not in names and names.get("type") != "application/json":
            self.in_script = True
        if tag == "style":
            self.found.append("<style>")
        for name, _value in attrs:
            if name == "style" or re.match(r"on[a-z]+$|hx-on|data-hx-on", name):
                self.found.append(f"<{tag} {name}>")

    def handle_data(self, data: str) -> None:
        if self.in_script and data.strip():
            self.found.append(f"<script>{data.strip()[:40]}")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self.in_script = False


def test_no_page_holds_inline_script_handlers_or_styles(owner: User, pages: list[str]) -> None:
    for path, response in responses(owner, pages):
        parser = InlineCode()
        parser.feed(response.content.decode())
        assert parser.found == [], path


def test_the_console_tells_htmx_to_use_no_eval_and_no_inline_styles(bob: Client) -> None:
    body = bob.get(reverse("inbox")).content.decode()
    config = re.search(r"<meta name=\"htmx-config\" content='([^']+)'>", body)
    assert config is not None
    assert '"allowEval": false' in config.group(1)
    assert '"includeIndicatorStyles": false' in config.group(1)
    assert 'src="/static/js/console.js"' in body


def test_every_page_is_no_store(owner: User, pages: list[str]) -> None:
    for path, response in responses(owner, pages):
        cache_control = {part.strip() for part in response["Cache-Control"].split(",")}
        assert "no-store" in cache_control, (path, response["Cache-Control"])


def test_htmx_partials_and_the_api_are_no_store_too(bob: Client, agent_auth: Any, run: Run) -> None:
    partial = bob.get(reverse("nav_counts"), headers={"HX-Request": "true"})
    assert "no-store" in partial["Cache-Control"]
    api = Client().get(f"/api/v1/runs/{run.pk}", **agent_auth.headers)
    assert api.status_code == 200
    assert "no-store" in api["Cache-Control"]


def test_static_files_keep_their_caching(client: Client) -> None:
    response = client.get("/static/css/console.css")
    assert response.status_code == 200
    assert "no-store" not in response.get("Cache-Control", "")


# --- sign-in throttling -------------------------------------------------------------------


def sign_in(path: str, username: str, password: str, address: str = CONSOLE) -> Any:
    return Client(REMOTE_ADDR=address).post(path, {"username": username, "password": password})


def signed_in_as(response: Any) -> str | None:
    """Whose session the response started, if any."""
    session = response.client.session
    user_id = session.get("_auth_user_id")
    return None if user_id is None else User.objects.get(pk=user_id).username


def fail(path: str, username: str, times: int, address: str = CONSOLE) -> None:
    for _ in range(times):
        response = sign_in(path, username, "wrong", address)
        assert signed_in_as(response) is None


CONSOLE_LOGIN = "/accounts/login/"
ADMIN_LOGIN = "/admin/login/"


def test_the_right_password_after_fewer_wrong_ones_than_the_limit_signs_in(
    reviewer: User,
) -> None:
    fail(CONSOLE_LOGIN, "bob", settings.AXES_FAILURE_LIMIT - 1)
    response = sign_in(CONSOLE_LOGIN, "bob", "bob-pw")
    assert response.status_code == 302
    assert signed_in_as(response) == "bob"


def test_after_the_limit_of_wrong_passwords_the_right_one_is_refused_on_the_console(
    reviewer: User,
) -> None:
    fail(CONSOLE_LOGIN, "bob", settings.AXES_FAILURE_LIMIT)

    response = sign_in(CONSOLE_LOGIN, "bob", "bob-pw")

    assert response.status_code == 429
    assert signed_in_as(response) is None
    assert b"Sign-in locked" in response.content
    assert "no-store" in response["Cache-Control"]


def test_after_the_limit_of_wrong_passwords_the_right_one_is_refused_on_the_admin(
    owner: User,
) -> None:
    assert sign_in(ADMIN_LOGIN, "alice", "alice-pw").status_code == 302  # it works at first
    fail(ADMIN_LOGIN, "alice", settings.AXES_FAILURE_LIMIT)

    response = sign_in(ADMIN_LOGIN, "alice", "alice-pw")

    assert response.status_code == 429
    assert signed_in_as(response) is None
    # The console's form is the same door: the lockout holds there too.
    assert signed_in_as(sign_in(CONSOLE_LOGIN, "alice", "alice-pw")) is None


def test_a_lockout_holds_one_user_at_one_address_only(reviewer: User, owner: User) -> None:
    fail(CONSOLE_LOGIN, "bob", settings.AXES_FAILURE_LIMIT)
    assert signed_in_as(sign_in(CONSOLE_LOGIN, "bob", "bob-pw")) is None

    # Another user from the same address, and bob from another address, still sign in.
    assert signed_in_as(sign_in(CONSOLE_LOGIN, "alice", "alice-pw")) == "alice"
    assert signed_in_as(sign_in(CONSOLE_LOGIN, "bob", "bob-pw", "198.51.100.7")) == "bob"


def test_axes_reset_unlocks(reviewer: User) -> None:
    fail(CONSOLE_LOGIN, "bob", settings.AXES_FAILURE_LIMIT)
    assert sign_in(CONSOLE_LOGIN, "bob", "bob-pw").status_code == 429

    call_command("axes_reset_username", "bob")

    response = sign_in(CONSOLE_LOGIN, "bob", "bob-pw")
    assert response.status_code == 302
    assert signed_in_as(response) == "bob"


def test_behind_a_proxy_the_address_is_the_one_the_proxy_saw(settings: Any) -> None:
    factory = RequestFactory()
    spoofed = factory.get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="1.1.1.1, 203.0.113.9")
    settings.TRUSTED_PROXY_COUNT = 0
    assert client_ip(spoofed) == "10.0.0.2"
    settings.TRUSTED_PROXY_COUNT = 1
    assert client_ip(spoofed) == "203.0.113.9"  # not the 1.1.1.1 the client wrote
    settings.TRUSTED_PROXY_COUNT = 2
    assert client_ip(spoofed) == "1.1.1.1"
    assert client_ip(factory.get("/", REMOTE_ADDR="10.0.0.2")) == "10.0.0.2"


def test_behind_a_proxy_two_clients_are_throttled_apart(reviewer: User, settings: Any) -> None:
    settings.TRUSTED_PROXY_COUNT = 1
    proxy = "10.0.0.2"

    def through_proxy(client_address: str, password: str) -> Any:
        return Client(REMOTE_ADDR=proxy, HTTP_X_FORWARDED_FOR=client_address).post(
            CONSOLE_LOGIN, {"username": "bob", "password": password}
        )

    for _ in range(settings.AXES_FAILURE_LIMIT):
        through_proxy("203.0.113.66", "wrong")
    assert through_proxy("203.0.113.66", "bob-pw").status_code == 429
    assert signed_in_as(through_proxy("203.0.113.9", "bob-pw")) == "bob"


# --- password reset, rate-limited --------------------------------------------------------------


@pytest.fixture
def fresh_limits() -> None:
    from django.core.cache import cache

    cache.clear()


def ask_reset(email: str, address: str = CONSOLE) -> Any:
    return Client(REMOTE_ADDR=address).post("/accounts/password_reset/", {"email": email})


@pytest.mark.usefixtures("fresh_limits")
def test_ten_resets_for_one_address_send_three_emails_then_429(reviewer: User) -> None:
    from django.core import mail

    User.objects.filter(pk=reviewer.pk).update(email="bob@example.com")
    answers = [ask_reset("bob@example.com", address=f"198.51.100.{n}") for n in range(10)]

    assert [a.status_code for a in answers] == [302] * 3 + [429] * 7
    assert len(mail.outbox) == settings.PASSWORD_RESETS_PER_HOUR_EMAIL == 3
    refused = answers[-1]
    assert 0 < int(refused["Retry-After"]) <= 3600
    assert b"Too many password resets" in refused.content
    assert b"no email was sent" in refused.content


@pytest.mark.usefixtures("fresh_limits")
def test_one_client_address_may_ask_five_an_hour_for_any_emails(reviewer: User) -> None:
    from django.core import mail

    User.objects.filter(pk=reviewer.pk).update(email="bob@example.com")
    # Unknown addresses count too: the answer must not tell which ones have accounts.
    statuses = [ask_reset(f"nobody{n}@example.com").status_code for n in range(5)]
    last = ask_reset("bob@example.com")

    assert statuses == [302] * 5
    assert last.status_code == 429
    assert mail.outbox == []
    # Elsewhere, the same email is still served.
    assert ask_reset("bob@example.com", address="192.0.2.7").status_code == 302
    assert len(mail.outbox) == 1
