"""Secrets are never shown (DESIGN.md §15): one function, and every surface searched for them.

The surface test posts secrets nested in dicts and lists, lets a tool echo them into its
result, quote them in an error and return them in its evidence, then reads every surface —
the API, the console, admin, the ledger's own columns and the logs — and fails if any one
of them shows any of the secrets. The raw input column is the one place a secret may stay.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from django.contrib.auth.models import User
from django.core import serializers
from django.test import Client
from django.urls import reverse
from guardian.shortcuts import assign_perm

from executor import engine
from executor.common import dispatch
from executor.common.redaction import REDACTED, Redactor, is_secret_key, redact, scrub
from executor.contract.tool import (
    FailureClass,
    Invocation,
    RetryPolicy,
    Tool,
    ToolError,
    ToolResult,
    register,
    unregister,
)
from executor.ledger.records import (
    Agent,
    Approval,
    ApprovalRule,
    Attempt,
    Effect,
    Event,
    Idempotency,
    Run,
    Step,
)
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import State
from executor.services.tools import tools_sync
from tests.support.api import ApiClient

pytestmark = pytest.mark.django_db

PASSWORD = "hunter2-correct-horse"
API_KEY = "sk-live-5f3a9b7c1d"
BEARER = "tok_abcdef0123456789"
COOKIE = "sessionid=c00k13-v4lu3"
PIN = "4455-9911"  # under a key that looks harmless: redacted because the tool declares it
SECRETS = (PASSWORD, API_KEY, BEARER, COOKIE, PIN)

SECRET_INPUT: dict[str, Any] = {
    "auth": {"password": PASSWORD, "api_key": API_KEY},
    "headers": [{"Authorization": f"Bearer {BEARER}"}, {"Accept": "application/json"}],
    "session": {"jar": [{"Set-Cookie": COOKIE}]},
    "account": {"pin": PIN},
    "title": "renew the certificate",
}


class SecretEcho(Tool):
    """A pure tool that echoes its input into its result and evidence, secrets included."""

    name = "test.secret_echo"
    effect = Effect.PURE
    idempotency = Idempotency.NONE
    requires_approval = ApprovalRule.NEVER
    compensation = ""
    retry = RetryPolicy()
    input_schema: ClassVar[dict[str, Any]] = {"type": "object"}
    redact = frozenset({"pin"})

    def invoke(self, call: Invocation) -> ToolResult:
        return ToolResult(
            result={"echo": call.input, "note": f"used {call.input['auth']['password']}"},
            external_id="echo-1",
            evidence={"request_headers": call.input["headers"], "raw": json.dumps(call.input)},
        )


class SecretFailure(SecretEcho):
    """A write that fails quoting its whole input in the message and the evidence."""

    name = "test.secret_failure"
    effect = Effect.WRITE

    def invoke(self, call: Invocation) -> ToolResult:
        raise ToolError(
            FailureClass.INVALID_INPUT,
            f"the server refused {json.dumps(call.input)}",
            evidence={"sent": call.input, "echoed": f"Bearer {BEARER}"},
        )


@pytest.fixture
def secret_tools(agent: Agent) -> Iterator[None]:
    for cls in (SecretEcho, SecretFailure):
        register(cls)
    try:
        tools_sync()
        for row in ToolRow.objects.filter(name__in=[SecretEcho.name, SecretFailure.name]):
            assign_perm("executor.use_tool", agent.user, row)
        with dispatch.publishing(dispatch.dropping_publisher):
            yield
    finally:
        for cls in (SecretEcho, SecretFailure):
            unregister(cls.name)


def leaks(text: str) -> list[str]:
    return [secret for secret in SECRETS if secret in text]


# --- the function -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["password", "DB_PASSWORD", "passwd", "client_secret", "access_token", "X-Api-Key",
     "apikey", "Authorization", "Set-Cookie", "private_key", "credentials"],
)  # fmt: skip
def test_keys_that_look_like_secrets_are_secret(key: str) -> None:
    assert is_secret_key(key)


@pytest.mark.parametrize("key", ["title", "url", "ticket_id", "author", "keyword"])
def test_ordinary_keys_are_not(key: str) -> None:
    assert not is_secret_key(key)


def test_redact_replaces_secrets_at_every_level_and_leaves_the_rest() -> None:
    shown = redact(SECRET_INPUT, fields=frozenset({"pin"}))

    assert shown == {
        "auth": {"password": REDACTED, "api_key": REDACTED},
        "headers": [{"Authorization": REDACTED}, {"Accept": "application/json"}],
        "session": {"jar": [{"Set-Cookie": REDACTED}]},
        "account": {"pin": REDACTED},
        "title": "renew the certificate",
    }
    assert SECRET_INPUT["auth"]["password"] == PASSWORD  # a copy: the input is untouched


def test_a_redactor_scrubs_its_inputs_secrets_out_of_any_text() -> None:
    redactor = Redactor.for_input(SECRET_INPUT, {"pin"})

    text = redactor.text(f"refused {json.dumps(SECRET_INPUT)} with token {BEARER}")

    assert leaks(text) == []
    assert "renew the certificate" in text
    assert scrub("nothing secret here", redactor.secrets) == "nothing secret here"


# --- every surface ----------------------------------------------------------------------------


def surfaces(
    api: ApiClient, run: Run, steps: list[Step], reviewer: User, owner: User
) -> dict[str, str]:
    """Everything any surface shows of these steps, by surface."""
    shown: dict[str, str] = {}
    shown["api: run"] = api.get(f"/api/v1/runs/{run.pk}").content.decode()
    shown["api: steps"] = api.get(f"/api/v1/runs/{run.pk}/steps").content.decode()
    shown["api: report"] = api.get(f"/api/v1/runs/{run.pk}/report").content.decode()
    console = Client()
    console.force_login(reviewer)
    shown["console: inbox"] = console.get(reverse("inbox")).content.decode()
    shown["console: run"] = console.get(reverse("run", args=[run.pk])).content.decode()
    admin = Client()
    admin.force_login(owner)
    for step in steps:
        shown[f"api: step {step.key}"] = api.get(f"/api/v1/steps/{step.pk}").content.decode()
        shown[f"console: step {step.key}"] = console.get(
            reverse("step", args=[step.pk])
        ).content.decode()
        shown[f"admin: step {step.key}"] = admin.get(
            reverse("admin:executor_step_change", args=[step.pk])
        ).content.decode()
        for attempt in Attempt.objects.filter(step=step):
            shown[f"admin: attempt {attempt.pk}"] = admin.get(
                reverse("admin:executor_attempt_change", args=[attempt.pk])
            ).content.decode()
        for event in Event.objects.filter(step=step):
            shown[f"admin: event {event.pk}"] = admin.get(
                reverse("admin:executor_event_change", args=[event.pk])
            ).content.decode()
    for name in ("step", "attempt", "event", "approval"):
        shown[f"admin: {name} list"] = admin.get(
            reverse(f"admin:executor_{name}_changelist")
        ).content.decode()
    # The ledger's own columns, all but the raw input (the one place a secret is kept).
    rows = [*Attempt.objects.all(), *Event.objects.all(), *Approval.objects.all()]
    shown["ledger: attempts, events, approvals"] = serializers.serialize("json", rows)
    shown["ledger: steps without input"] = serializers.serialize(
        "json", Step.objects.all(), fields=[f.name for f in Step._meta.fields if f.name != "input"]
    )
    return shown


def test_no_surface_shows_a_secret(
    api: ApiClient,
    run: Run,
    agent: Agent,
    reviewer: User,
    owner: User,
    secret_tools: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    posted = api.post(
        f"/api/v1/runs/{run.pk}/steps/batch",
        {
            "steps": [
                {"key": "echo", "tool": SecretEcho.name, "input": SECRET_INPUT},
                {"key": "fail", "tool": SecretFailure.name, "input": SECRET_INPUT},
                {
                    "key": "summarized",
                    "tool": SecretEcho.name,
                    "input": SECRET_INPUT,
                    "summary": f"log in with {PASSWORD} and {API_KEY}",
                },
            ]
        },
    )
    assert posted.status_code == 201, posted.content
    steps = [Step.objects.get(run=run, key=key) for key in ("echo", "fail", "summarized")]
    for step in steps:
        engine.process(step.pk, worker="w1")
    states = {s.key: s.state for s in Step.objects.filter(run=run)}
    assert states == {"echo": State.COMPLETED, "fail": State.FAILED, "summarized": State.COMPLETED}

    shown = surfaces(api, run, steps, reviewer, owner)
    shown["logs"] = "\n".join(record.getMessage() for record in caplog.records)
    shown["api: the post's answer"] = posted.content.decode()

    leaked = {surface: leaks(text) for surface, text in shown.items() if leaks(text)}
    assert leaked == {}
    # The surfaces did show the steps (a blank page would leak nothing either).
    assert "renew the certificate" in shown["api: step echo"]
    assert REDACTED in shown["api: step echo"]
    assert "the server refused" in shown["api: step fail"]
    assert "[redacted]" in shown["console: step fail"]
    # The raw input is kept, for the tool's call.
    assert Step.objects.get(pk=steps[0].pk).input == SECRET_INPUT
