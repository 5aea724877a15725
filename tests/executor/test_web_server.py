"""What only a real web server shows: chunked request bodies read (up to the size limit) under
gunicorn, and the long-poll limit held across web processes that share a Redis cache."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from executor.drill.processes import wait_until
from executor.ledger import transitions
from executor.ledger.records import Run, Step
from executor.ledger.states import State
from executor.services.accounts import agent_create
from executor.services.runs import run_create
from executor.surfaces.api import long_polls_held
from tests.support.api import AgentAuth
from tests.support.factories import new_step
from tests.support.webserver import WebServer, api_request, raw, web_server

pytestmark = pytest.mark.django_db(transaction=True)


def chunks(body: bytes, size: int = 1000) -> Iterator[bytes]:
    """A generator body: httpx sends it chunked, with no Content-Length."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[WebServer]:
    with web_server(tmp_path, env={"API_MAX_BODY_BYTES": "4096"}) as running:
        yield running


def post_chunked(server: WebServer, auth: AgentAuth, path: str, body: bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {auth.token}", "Content-Type": "application/json"}
    request = httpx.Request(
        "POST", f"{server.url}/api/v1{path}", headers=headers, content=chunks(body)
    )
    assert request.headers["Transfer-Encoding"] == "chunked"
    assert "Content-Length" not in request.headers
    with httpx.Client(timeout=30) as client:
        return client.send(request)


def test_a_chunked_body_is_read(server: WebServer, agent_auth: AgentAuth) -> None:
    # Several chunks, under the limit of 4096 bytes.
    body = b'{"name": "sent in chunks"' + b" " * 3500 + b"}"

    response = post_chunked(server, agent_auth, "/runs", body)

    assert response.status_code == 201, response.text
    assert Run.objects.get(pk=response.json()["id"]).name == "sent in chunks"


def test_a_chunked_body_over_the_limit_answers_413(
    server: WebServer, agent_auth: AgentAuth
) -> None:
    response = post_chunked(server, agent_auth, "/runs", b'{"name": "big"' + b" " * 5000 + b"}")

    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"
    assert response.json()["error"]["details"] == {"limit": 4096}
    assert not Run.objects.exists()


def test_a_chunked_batch_has_the_batch_limit(server: WebServer, agent_auth: AgentAuth) -> None:
    run, _ = run_create(agent=agent_auth.agent, name="batch")
    items = [{"key": f"s{n}", "tool": "echo", "input": {"n": n}} for n in range(100)]
    body = httpx.Request("POST", "/", json={"steps": items}).content
    assert len(body) > 4096

    response = post_chunked(server, agent_auth, f"/runs/{run.pk}/steps/batch", body)

    assert response.status_code == 201, response.text
    assert Step.objects.filter(run=run).count() == 100


# --- bodies that cannot be acted on ------------------------------------------------------------


def test_a_malformed_chunked_body_is_a_400_in_the_apis_shape(
    server: WebServer, agent_auth: AgentAuth
) -> None:
    request = api_request(
        agent_auth, "/runs", "Transfer-Encoding: chunked\r\n", b'zz\r\n{"name": "x"}\r\n0\r\n\r\n'
    )

    status, body = raw(server, request)

    assert status == 400, body
    error = json.loads(body)["error"]
    assert error["code"] == "bad_request"
    assert "could not be read" in error["message"]
    assert not Run.objects.exists()


def test_a_body_shorter_than_its_content_length_is_refused_not_acted_on(
    server: WebServer, agent_auth: AgentAuth
) -> None:
    body = b'{"name": "cut off"}'
    request = api_request(agent_auth, "/runs", f"Content-Length: {len(body) + 40}\r\n", body)

    status, answer = raw(server, request, half_close=True)

    assert status == 400, answer
    assert "cut off: 19 of the 59 bytes" in json.loads(answer)["error"]["message"]
    assert not Run.objects.exists()


def test_the_consoles_forms_refuse_a_malformed_chunked_body_with_a_400(
    server: WebServer,
) -> None:
    request = (
        b"POST /accounts/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: application/x-www-form-urlencoded\r\nTransfer-Encoding: chunked\r\n"
        b"\r\nzz\r\nusername=a\r\n0\r\n\r\n"
    )

    status, body = raw(server, request)

    assert status == 400, body
    assert b"could not be read" in body


# --- the long-poll limit across processes ----------------------------------------------------


def redis_url() -> str:
    """A Redis for the cache: STEPWARD_TEST_REDIS, else the broker's when it is Redis."""
    url = os.environ.get("STEPWARD_TEST_REDIS") or os.environ.get("CELERY_BROKER_URL", "")
    if not url.startswith("redis://"):
        pytest.skip("no Redis (STEPWARD_TEST_REDIS or a redis:// CELERY_BROKER_URL)")
    return url


def test_the_long_poll_limit_holds_across_web_processes(
    tmp_path: Path, agent_auth: AgentAuth, run: Run, settings: Any
) -> None:
    # Three single-threaded processes: while two hold a wait each, the third request can only
    # be served by the third process, which knows of the two waits through Redis alone.
    url = redis_url()
    # This process reads the same cache to see the waits held (the keys are the agent's own).
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": url}
    }
    agent = agent_auth.agent
    watched = new_step(run, key="watched")
    headers = {"Authorization": f"Bearer {agent_auth.token}"}
    env = {"CACHE_URL": url, "API_MAX_WAITS_PER_AGENT": "2"}
    with web_server(tmp_path, workers=3, threads=1, env=env) as server:
        step_url = f"{server.url}/api/v1/steps/{watched.pk}"

        def hold() -> httpx.Response:
            return httpx.get(step_url, params={"wait": 25}, headers=headers, timeout=60)

        with ThreadPoolExecutor(max_workers=2) as pool:
            waits = [pool.submit(hold) for _ in range(2)]
            wait_until(lambda: long_polls_held(agent) == 2, seconds=30, what="two waits held")
            third = httpx.get(step_url, params={"wait": 25}, headers=headers, timeout=60)
            transitions.move(Step.objects.get(pk=watched.pk), State.CANCELLED, actor="test")
            answers = [wait.result(timeout=60) for wait in waits]

        held_after = long_polls_held(agent)
        again = httpx.get(step_url, params={"wait": 1}, headers=headers, timeout=60)

    assert third.status_code == 429, third.text
    assert third.json()["error"]["details"]["limit"] == 2
    assert 1 <= int(third.headers["Retry-After"]) <= 25
    assert [answer.status_code for answer in answers] == [200, 200]
    assert all(answer.json()["state"] == "cancelled" for answer in answers)
    assert held_after == 0
    assert again.status_code == 200


def test_a_flood_of_long_polls_from_many_agents_leaves_threads_for_everyone_else(
    tmp_path: Path, workspace: Any, run: Run
) -> None:
    """40 agents each try 2 waits (each within its own per-agent limit) on one process of 8
    threads: it holds API_MAX_WAITS_PER_PROCESS (4) and refuses the rest at once with 429
    and Retry-After; meanwhile another agent's request and a console page are answered.
    Before the cap, the flood held every thread: another agent's GET /tools took 80 s."""
    flooders = [agent_create(workspace=workspace, name=f"flood-{n}") for n in range(40)]
    _, other_token = agent_create(workspace=workspace, name="bystander")
    watched = new_step(run, key="watched")
    env = {"API_MAX_WAITS_PER_PROCESS": "4", "API_MAX_WAITS_PER_AGENT": "2"}
    with web_server(tmp_path, workers=1, threads=8, env=env) as server:
        step_url = f"{server.url}/api/v1/steps/{watched.pk}"

        def hold(token: str) -> httpx.Response:
            headers = {"Authorization": f"Bearer {token}"}
            return httpx.get(step_url, params={"wait": 20}, headers=headers, timeout=60)

        with ThreadPoolExecutor(max_workers=80) as pool:
            waits = [pool.submit(hold, token) for _, token in flooders for _ in range(2)]
            # The 76 refused come back at once; the 4 held stay.
            wait_until(lambda: sum(w.done() for w in waits) >= 76, seconds=30, what="refusals")
            bystander = httpx.get(
                f"{server.url}/api/v1/tools",
                headers={"Authorization": f"Bearer {other_token}"},
                timeout=5,
            )
            sign_in_page = httpx.get(f"{server.url}/accounts/login/", timeout=5)
            still_held = sum(not w.done() for w in waits)
            transitions.move(Step.objects.get(pk=watched.pk), State.CANCELLED, actor="test")
            answers = [w.result(timeout=60) for w in waits]

    statuses = sorted(a.status_code for a in answers)
    assert bystander.status_code == 200
    assert sign_in_page.status_code == 200
    assert still_held == 4
    assert statuses == [200] * 4 + [429] * 76
    refusals = [a for a in answers if a.status_code == 429]
    assert {a.json()["error"]["details"]["scope"] for a in refusals} == {"process"}
    assert all(1 <= int(a.headers["Retry-After"]) <= 20 for a in refusals)
    assert all(a.json()["state"] == "cancelled" for a in answers if a.status_code == 200)
