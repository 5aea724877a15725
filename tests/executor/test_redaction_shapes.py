"""Secrets by value and shape (DESIGN.md §15): the shapes a key-name list missed, each through
`redact`, the one function every surface shows through, and a few through the surfaces."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from django.contrib.auth.models import User

from executor import engine
from executor.common.logcontext import JsonFormatter, PlainFormatter
from executor.common.redaction import REDACTED, Redactor, redact
from executor.ledger.records import Run, Step
from tests.executor.test_redaction import SecretEcho, SecretFailure, secret_tools, surfaces

__all__ = ["secret_tools"]  # a fixture, used by name

BEARER = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhZ2VudCJ9.c2lnbmF0dXJlLW9mLWEtand0"
SECRET = "s3cr3t-Value-9f8e7d6c"

# (name, value, the secret that must not survive)
SHAPES: list[tuple[str, Any, str]] = [
    ("header pairs", [["Authorization", f"Bearer {SECRET}"]], SECRET),
    ("header objects", [{"name": "Authorization", "value": f"Bearer {SECRET}"}], SECRET),
    ("header objects, key/value", [{"key": "X-Api-Key", "value": SECRET}], SECRET),
    ("auth: Basic", {"auth": "Basic dXNlcjpwYXNzd29yZDEyMw=="}, "dXNlcjpwYXNzd29yZDEyMw=="),
    ("a DSN's password", {"database": f"postgres://app:{SECRET}@db:5432/x"}, SECRET),
    ("an URL's password", f"see https://bob:{SECRET}@example.com/path", SECRET),
    ("api_key in a query", {"url": f"https://api.example.com/v1?q=1&api_key={SECRET}"}, SECRET),
    ("JSON in a string", {"body": json.dumps({"password": SECRET})}, SECRET),
    ("a header in free text", f"use Authorization: Bearer {SECRET} for it", SECRET),
    ("a raw header line", f"sent X-Api-Key: {SECRET}", SECRET),
    ("key pwd", {"pwd": SECRET}, SECRET),
    ("key db_pwd", {"db_pwd": SECRET}, SECRET),
    ("key passphrase", {"passphrase": SECRET}, SECRET),
    ("key stripe_key", {"stripe_key": SECRET}, SECRET),
    ("key ssh_key", {"ssh_key": SECRET}, SECRET),
    ("key session", {"session": SECRET}, SECRET),
    ("key jwt", {"jwt": SECRET}, SECRET),
    ("key aws_access_key_id", {"aws_access_key_id": SECRET}, SECRET),
    ("key signingKey", {"signingKey": SECRET}, SECRET),
    ("key license-key", {"license-key": SECRET}, SECRET),
    ("key aws_secret", {"aws_region_secret_thing": SECRET}, SECRET),
    ("an AWS access key", "key AKIAIOSFODNN7EXAMPLE in the config", "AKIAIOSFODNN7EXAMPLE"),
    (
        "a GitHub token",
        {"note": "ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"},
        "ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789",
    ),
    (
        "a Stripe key",
        "charged with sk_live_4eC39HqLyjWDarjtT1zdp7dc",
        "sk_live_4eC39HqLyjWDarjtT1zdp7dc",
    ),
    (
        "a Slack token",
        {"text": "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx"},
        "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
    ),
    ("a JWT", {"message": f"token was {BEARER}"}, BEARER),
    (
        "a PEM private key",
        {
            "blob": "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7b\n-----END RSA PRIVATE KEY-"
            "----"
        },
        "MIIEowIBAAKCAQEA7b",
    ),
    ("a password= assignment", "login failed for password=hunter2hunter2", "hunter2hunter2"),
    ("nested lists of pairs", {"headers": [["Cookie", f"sid={SECRET}"]]}, SECRET),
]


@pytest.mark.parametrize(("name", "value", "secret"), SHAPES, ids=[s[0] for s in SHAPES])
def test_a_secret_in_this_shape_is_never_shown(name: str, value: Any, secret: str) -> None:
    shown = json.dumps(redact(value))

    assert secret not in shown
    assert REDACTED in shown


@pytest.mark.parametrize(
    "value",
    [
        {"state": "completed", "key": "ticket-1", "id": "6f1d0c2e-5b1a-4c3e-9d7f-0a1b2c3d4e5f"},
        {"message": "the token validation failed: try again"},
        {"author": "Ada Lovelace", "summary": "open a ticket for the billing team"},
        {"hash": "9b2f6a0c1d3e5f7a9b2f6a0c1d3e5f7a9b2f6a0c1d3e5f7a9b2f6a0c1d3e5f7a"},
        {"url": "https://example.com/tickets?page=2&sort=created"},
        ["Content-Type", "application/json"],
        {"idempotency_key": "order-42", "monkey": "banana-bread-2026"},
    ],
)
def test_what_holds_no_secret_is_shown_as_it_is(value: Any) -> None:
    assert redact(value) == value


def test_a_redactors_text_is_searched_by_shape_too() -> None:
    redactor = Redactor.for_input({"q": "x"})

    assert SECRET not in redactor.text(f"502 from https://u:{SECRET}@api.example.com")


# --- every surface ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_no_surface_shows_a_secret_of_any_shape(
    api: Any,
    run: Run,
    reviewer: User,
    owner: User,
    secret_tools: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every shape above in one step's input, echoed by its tool into its result and evidence
    and quoted by another's error: no surface shows any of them."""
    caplog.set_level(logging.DEBUG)
    shaped = {name.replace(" ", "_"): value for name, value, _ in SHAPES}
    posted = api.post(
        f"/api/v1/runs/{run.pk}/steps/batch",
        {
            "steps": [
                {"key": "echo", "tool": SecretEcho.name, "input": shaped},
                {"key": "fail", "tool": SecretFailure.name, "input": shaped},
            ]
        },
    )
    assert posted.status_code == 201, posted.content
    steps = [Step.objects.get(run=run, key=key) for key in ("echo", "fail")]
    for step in steps:
        engine.process(step.pk, worker="w1")

    shown = surfaces(api, run, steps, reviewer, owner)
    shown["logs"] = "\n".join(record.getMessage() for record in caplog.records)
    shown["api: the post's answer"] = posted.content.decode()

    secrets = [secret for _, _, secret in SHAPES]
    leaked = {
        surface: [s for s in secrets if s in text]
        for surface, text in shown.items()
        if any(s in text for s in secrets)
    }
    assert leaked == {}
    assert REDACTED in shown["api: step echo"]
    assert Step.objects.get(pk=steps[0].pk).input == shaped  # kept raw for the call


@pytest.mark.parametrize("formatter", [PlainFormatter("%(message)s"), JsonFormatter()])
def test_every_log_line_is_redacted_by_shape_whoever_wrote_it(formatter: Any) -> None:
    record = logging.LogRecord(
        "some.library", logging.INFO, __file__, 1,
        "GET %s with %s", (f"https://u:{SECRET}@api.example.com/x?api_key={SECRET}",
                          f"Authorization: Bearer {SECRET}"), None,
    )  # fmt: skip
    try:
        raise ValueError("refused sk_live_4eC39HqLyjWDarjtT1zdp7dc")
    except ValueError:
        import sys

        record.exc_info = sys.exc_info()

    line = formatter.format(record)

    assert SECRET not in line
    assert "sk_live_4eC39HqLyjWDarjtT1zdp7dc" not in line
    assert "api.example.com" in line
    assert "ValueError" in line
