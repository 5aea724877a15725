"""Serving from an event loop, as the README's production serving does it: `gunicorn
console.asgi -k uvicorn_worker.UvicornWorker`, one process (issue 22, item 1).

Long-polls wait on the loop, holding no thread and no connection (executor/surfaces/waits.py); a
slow request body costs a coroutine until REQUEST_BODY_SECONDS end it (console/serving.py).
Under the threaded server the same floods held every thread: 40 agents x 2 waits made another
agent's GET /tools take 80 s, and 30 slow login bodies timed the sign-in page out.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.db import connection

from executor.ledger import transitions
from executor.ledger.records import Run, Step
from executor.ledger.states import State
from executor.services.accounts import agent_create
from tests.support.api import AgentAuth
from tests.support.factories import new_step
from tests.support.webserver import WebServer, api_request, raw, web_server

pytestmark = pytest.mark.django_db(transaction=True)

BODY_SECONDS = 3
POOL = 4
# The server's connections carry this name (libpq's PGAPPNAME), so the count below is the
# server's own: a worker or a server left by an earlier test in the session is not counted.
SERVER_APP = "stepward-serving-test"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[WebServer]:
    env = {
        "REQUEST_BODY_SECONDS": str(BODY_SECONDS),
        "API_MAX_BODY_BYTES": "4096",
        "DATABASE_POOL_SIZE": str(POOL),
        "PGAPPNAME": SERVER_APP,
    }
    with web_server(tmp_path, asgi=True, env=env) as running:
        yield running


def server_backends() -> int | None:
    """The database connections the server under test holds now (PostgreSQL)."""
    if connection.vendor != "postgresql":
        return None  # SQLite has no server to ask; the PostgreSQL run counts them
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = %s AND backend_type = 'client backend'",
            [SERVER_APP],
        )
        return int(cursor.fetchone()[0])


def quickest(get: Any, tries: int = 3) -> tuple[httpx.Response, float]:
    """The answer and the quickest of `tries` round trips (a loaded machine may stall one)."""
    best = float("inf")
    response = None
    for _ in range(tries):
        started = time.monotonic()
        response = get()
        best = min(best, time.monotonic() - started)
    assert response is not None
    return response, best


def test_a_hundred_long_polls_hold_no_connections_and_everyone_else_is_answered(
    server: WebServer, workspace: Any, run: Run
) -> None:
    flooders = [agent_create(workspace=workspace, name=f"flood-{n}") for n in range(50)]
    _, other_token = agent_create(workspace=workspace, name="bystander")
    watched = new_step(run, key="watched")
    step_url = f"{server.url}/api/v1/steps/{watched.pk}"

    def hold(token: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.get(step_url, params={"wait": 25}, headers=headers, timeout=60)

    with ThreadPoolExecutor(max_workers=100) as pool:
        waits = [pool.submit(hold, token) for _, token in flooders for _ in range(2)]
        time.sleep(3)  # every wait has arrived and is held (each agent within its cap of 2)
        held = sum(not w.done() for w in waits)
        backends_while_held = server_backends()
        bystander, bystander_seconds = quickest(
            lambda: httpx.get(
                f"{server.url}/api/v1/tools",
                headers={"Authorization": f"Bearer {other_token}"},
                timeout=10,
            )
        )
        page, page_seconds = quickest(
            lambda: httpx.get(f"{server.url}/accounts/login/", timeout=10)
        )
        still_held = sum(not w.done() for w in waits)
        transitions.move(Step.objects.get(pk=watched.pk), State.CANCELLED, actor="test")
        answers = [w.result(timeout=60) for w in waits]

    assert held == still_held == 100
    # A wait holds no connection: a hundred arriving together took turns at the pool's
    # four (under the threaded server, each held one of its own while it waited).
    if backends_while_held is not None:
        assert backends_while_held <= POOL, backends_while_held
    assert bystander.status_code == 200
    assert page.status_code == 200
    assert bystander_seconds < 1, bystander_seconds
    assert page_seconds < 1, page_seconds
    # The move ended every wait with the step as it is now.
    assert [a.status_code for a in answers] == [200] * 100
    assert {a.json()["state"] for a in answers} == {"cancelled"}


def test_slow_bodies_hold_nothing_and_are_cut_off_at_their_deadline(server: WebServer) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    body = b"username=someone&password=" + b"x" * 200
    head = (
        "POST /accounts/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/x-www-form-urlencoded\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    senders = []
    for _ in range(30):
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.sendall(head + body[:7])
        senders.append(sock)
    try:
        started = time.monotonic()
        # 7 bytes at a time, every half second: the whole body would take 16 s.
        for _ in range(2):
            time.sleep(0.5)
            for sock in senders:
                sock.sendall(body[7:14])
        page, page_seconds = quickest(
            lambda: httpx.get(f"{server.url}/accounts/login/", timeout=10)
        )
        answers = []
        for sock in senders:
            answer = b""
            while part := sock.recv(65536):
                answer += part
            answers.append(answer)
        cut_after = time.monotonic() - started
    finally:
        for sock in senders:
            sock.close()

    assert page.status_code == 200
    assert page_seconds < 1, page_seconds
    # Each slow sender was answered 408 at its deadline and its connection closed (recv
    # saw the end), long before its body could have arrived.
    assert [a.split(b"\r\n", 1)[0] for a in answers] == [b"HTTP/1.1 408 Request Timeout"] * 30
    assert all(b"did not arrive within 3 seconds" in a for a in answers)
    assert BODY_SECONDS - 1 < cut_after < BODY_SECONDS + 10


def test_a_body_over_the_limit_is_refused_before_it_is_read(
    server: WebServer, agent_auth: AgentAuth
) -> None:
    request = api_request(agent_auth, "/runs", "Content-Length: 999999999\r\n", b'{"na')

    status, answer = raw(server, request, half_close=True)

    assert status == 413, answer
    assert b'"body_too_large"' in answer
    assert not Run.objects.exists()


def test_a_malformed_chunked_body_is_a_400_and_nothing_is_made(
    server: WebServer, agent_auth: AgentAuth
) -> None:
    request = api_request(
        agent_auth, "/runs", "Transfer-Encoding: chunked\r\n", b'zz\r\n{"name": "x"}\r\n0\r\n\r\n'
    )

    status, answer = raw(server, request)

    assert status == 400, answer
    assert not Run.objects.exists()


def test_a_body_cut_off_before_its_content_length_is_never_acted_on(
    server: WebServer, agent_auth: AgentAuth
) -> None:
    body = b'{"name": "cut off"}'
    request = api_request(agent_auth, "/runs", f"Content-Length: {len(body) + 40}\r\n", body)
    host, port = server.url.removeprefix("http://").split(":")

    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)  # the sender is gone mid-body
        answer = b""
        while part := sock.recv(65536):
            answer += part

    # The server sees the client leave before the body is whole: the request is dropped
    # unanswered (there is no one to answer), and no view ever ran on the part that came.
    assert answer == b"" or answer.startswith(b"HTTP/1.1 4"), answer
    assert not Run.objects.exists()


def test_the_api_console_and_chunked_bodies_work_on_the_event_loop(
    server: WebServer, agent_auth: AgentAuth
) -> None:
    headers = {"Authorization": f"Bearer {agent_auth.token}"}

    created = httpx.post(
        f"{server.url}/api/v1/runs", json={"name": "on the loop"}, headers=headers, timeout=30
    )
    chunked = httpx.post(
        f"{server.url}/api/v1/runs",
        content=iter([b'{"name": ', b'"in chunks"}']),
        headers={**headers, "Content-Type": "application/json"},
        timeout=30,
    )
    too_big = httpx.post(
        f"{server.url}/api/v1/runs",
        content=iter([b'{"name": "big"', b" " * 5000, b"}"]),
        headers={**headers, "Content-Type": "application/json"},
        timeout=30,
    )
    page = httpx.get(f"{server.url}/accounts/login/", timeout=30)
    waited = httpx.get(
        f"{server.url}/api/v1/steps/{new_step(Run.objects.get(name='on the loop')).pk}",
        params={"wait": 0.5},
        headers=headers,
        timeout=30,
    )

    assert created.status_code == 201, created.text
    assert chunked.status_code == 201, chunked.text
    assert too_big.status_code == 413
    assert too_big.json()["error"]["details"] == {"limit": 4096}
    assert page.status_code == 200
    assert page.headers["Cache-Control"].startswith("max-age=0")
    assert waited.status_code == 200
    assert sorted(Run.objects.values_list("name", flat=True)) == ["in chunks", "on the loop"]
