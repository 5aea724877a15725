"""What every page carries for safety: a Content-Security-Policy with no inline or eval
script, and `Cache-Control: no-store`."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from executor.models import Agent, DrillReport, Run
from tests.console.conftest import dead, unknown

pytestmark = pytest.mark.django_db


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
