"""What one client may hold or try: long-polls per agent, requests without a valid token per
address (the limits live in Django's cache; tests/executor/test_web_server.py shows them
across processes)."""

from __future__ import annotations

import os
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.test import Client

from executor.drill.processes import wait_until
from executor.ledger import transitions
from executor.ledger.records import Run, Step
from executor.ledger.states import State
from executor.surfaces import limits
from executor.surfaces.api import long_polls_held
from tests.support.api import AgentAuth, ApiClient, error_of
from tests.support.factories import new_step

API = "/api/v1"


# --- long-polls --------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_one_agent_holds_at_most_n_long_polls_while_others_are_served(
    agent_auth: AgentAuth, other_agent_auth: AgentAuth, run: Run, settings: Any
) -> None:
    settings.API_MAX_WAITS_PER_AGENT = 2
    agent = agent_auth.agent
    # Made without the API: a posted step would be dispatched to the broker on commit.
    watched = new_step(run, key="watched")
    their_run = Run.objects.create(
        workspace=other_agent_auth.agent.workspace, agent=other_agent_auth.agent, name="theirs"
    )
    theirs = new_step(their_run, key="theirs")
    url = f"{API}/steps/{watched.pk}?wait=30"

    def hold() -> Any:
        try:
            return ApiClient(agent_auth).get(url)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        waits = [pool.submit(hold) for _ in range(2)]
        wait_until(lambda: long_polls_held(agent) == 2, seconds=30, what="two waits held")
        third = ApiClient(agent_auth).get(url)
        others_tools = ApiClient(other_agent_auth).get(f"{API}/tools")
        others_wait = ApiClient(other_agent_auth).get(f"{API}/steps/{theirs.pk}?wait=0.2")
        # Served while the first agent's two waits were still held.
        held_meanwhile = [wait.done() for wait in waits]
        transitions.move(Step.objects.get(pk=watched.pk), State.CANCELLED, actor="test")
        answers = [wait.result(timeout=60) for wait in waits]

    assert third.status_code == 429
    error = error_of(third)
    assert error["code"] == "rate_limited"
    assert error["details"]["limit"] == 2
    assert 1 <= int(third["Retry-After"]) <= 30
    assert error["details"]["retry_after_seconds"] == int(third["Retry-After"])
    assert others_tools.status_code == 200
    assert others_wait.status_code == 200
    assert held_meanwhile == [False, False]
    assert [answer.status_code for answer in answers] == [200, 200]
    assert all(answer.json()["state"] == "cancelled" for answer in answers)
    # The waits ended: their slots are free, and a new wait is accepted.
    assert long_polls_held(agent) == 0
    fresh = new_step(run, key="fresh")
    assert ApiClient(agent_auth).get(f"{API}/steps/{fresh.pk}?wait=0.2").status_code == 200


def test_only_a_wait_that_waits_counts_as_a_long_poll(
    api: ApiClient, run: Run, settings: Any
) -> None:
    settings.API_MAX_WAITS_PER_AGENT = 0
    step = new_step(run, key="read")

    plain = api.get(f"{API}/steps/{step.pk}")
    # The step has moved on since `version`: the answer comes at once, holding nothing.
    moved_on = api.get(f"{API}/steps/{step.pk}?wait=30&version={step.version + 1}")
    waiting = api.get(f"{API}/steps/{step.pk}?wait=30")

    assert plain.status_code == 200
    assert moved_on.status_code == 200
    assert waiting.status_code == 429


def redis_cache() -> dict[str, Any]:
    url = os.environ.get("STEPWARD_TEST_REDIS") or os.environ.get("CELERY_BROKER_URL", "")
    if not url.startswith("redis://"):
        pytest.skip("no Redis (STEPWARD_TEST_REDIS or a redis:// CELERY_BROKER_URL)")
    return {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": url}


@pytest.mark.parametrize("backend", ["locmem", "redis"])
def test_a_slot_whose_holder_died_frees_itself_at_its_ttl(settings: Any, backend: str) -> None:
    if backend == "redis":
        settings.CACHES = {"default": redis_cache()}
    slots = limits.ConcurrencyLimit("test")
    holder = uuid.uuid4().hex

    # Taken and never released: the process holding it was killed.
    first = slots.acquire(holder, limit=1, hold_seconds=1, ttl=1)
    refused = slots.acquire(holder, limit=1, hold_seconds=1, ttl=1)
    freed = wait_until(
        lambda: slots.acquire(holder, limit=1, hold_seconds=1, ttl=1),
        seconds=10,
        what="the slot to expire",
    )

    assert first is not None
    assert refused is None
    assert freed is not None
    slots.release(freed)
    assert slots.held(holder, limit=1) == 0


def test_releasing_an_expired_slot_leaves_its_new_holders_alone() -> None:
    slots = limits.ConcurrencyLimit("test")
    holder = uuid.uuid4().hex
    stale = slots.acquire(holder, limit=1, hold_seconds=1, ttl=1)
    assert stale is not None
    fresh = wait_until(
        lambda: slots.acquire(holder, limit=1, hold_seconds=30, ttl=60),
        seconds=10,
        what="the slot to expire",
    )

    slots.release(stale)

    assert fresh is not None
    assert slots.held(holder, limit=1) == 1


# --- requests without a valid token ----------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [None, "Bearer sw_not-a-real-token", "Basic dXNlcjpwYXNz"],
    ids=["missing", "unknown", "other-scheme"],
)
def test_requests_without_a_valid_token_are_limited_per_address(
    api: ApiClient, settings: Any, header: str | None
) -> None:
    settings.API_BAD_TOKEN_RATE = "3/min"
    stranger = Client()
    extra = {"HTTP_AUTHORIZATION": header} if header else {}

    answers = [stranger.get(f"{API}/tools", **extra).status_code for _ in range(3)]
    refused = stranger.get(f"{API}/tools", **extra)

    assert answers == [401, 401, 401]
    assert refused.status_code == 429
    error = error_of(refused)
    assert error["code"] == "rate_limited"
    retry_after = int(refused["Retry-After"])
    assert 1 <= retry_after <= 60
    assert error["details"] == {"retry_after_seconds": retry_after, "limit": "3/min"}
    # A valid token from the same address is still served: agents share addresses.
    assert api.get(f"{API}/tools").status_code == 200
    # Another address has its own count.
    assert stranger.get(f"{API}/tools", REMOTE_ADDR="10.0.0.9", **extra).status_code == 401


def test_a_refused_bad_token_stores_nothing(run: Run, settings: Any) -> None:
    settings.API_BAD_TOKEN_RATE = "1/min"
    stranger = ApiClient(None)
    stranger.headers = {"HTTP_AUTHORIZATION": "Bearer sw_guess"}
    assert stranger.post(f"{API}/runs", {"name": "first"}).status_code == 401

    response = stranger.post(
        f"{API}/runs/{run.pk}/steps", {"key": "k", "tool": "echo", "input": {}}
    )

    assert response.status_code == 429
    assert not Step.objects.filter(run=run).exists()


def test_behind_a_proxy_the_address_is_the_last_entry_of_its_header(db: Any, settings: Any) -> None:
    settings.API_BAD_TOKEN_RATE = "2/min"
    settings.API_CLIENT_ADDRESS_HEADER = "X-Forwarded-For"
    # Every request comes from the proxy's own address (REMOTE_ADDR 127.0.0.1).
    client = Client()

    def bad(forwarded: str) -> int:
        return client.get(
            f"{API}/tools", HTTP_AUTHORIZATION="Bearer sw_nope", HTTP_X_FORWARDED_FOR=forwarded
        ).status_code

    first = [bad("203.0.113.7"), bad("203.0.113.7")]
    over = bad("203.0.113.7")
    # What the client wrote itself comes before what the proxy appended: it changes nothing.
    forged = bad("198.51.100.1, 203.0.113.7")
    neighbour = bad("203.0.113.8")

    assert first == [401, 401]
    assert over == 429
    assert forged == 429
    assert neighbour == 401


def test_without_the_setting_a_forwarded_header_is_not_believed(db: Any, settings: Any) -> None:
    settings.API_BAD_TOKEN_RATE = "2/min"
    settings.API_CLIENT_ADDRESS_HEADER = ""
    client = Client()

    answers = [
        client.get(
            f"{API}/tools", HTTP_AUTHORIZATION="Bearer sw_nope", HTTP_X_FORWARDED_FOR=f"10.1.1.{n}"
        ).status_code
        for n in range(3)
    ]

    assert answers == [401, 401, 429]


def test_the_bad_token_limit_can_be_turned_off(db: Any, settings: Any) -> None:
    settings.API_BAD_TOKEN_RATE = "off"
    client = Client()

    answers = {client.get(f"{API}/tools").status_code for _ in range(40)}

    assert answers == {401}


@pytest.mark.parametrize(
    ("rate", "parsed"),
    [("30/min", (30, 60)), ("5/s", (5, 1)), ("100/h", (100, 3600)), ("off", None), ("", None)],
)
def test_rates_are_read_as_count_per_period(rate: str, parsed: Any) -> None:
    assert limits.parse_rate(rate) == parsed


@pytest.mark.parametrize("rate", ["30", "x/min", "30/fortnight", "0/min", "-1/s"])
def test_a_malformed_rate_is_refused_with_its_value(rate: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=re.escape(repr(rate))):
        limits.parse_rate(rate)
