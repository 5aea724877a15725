"""The agents' Python client against a live server: safe retries, long polls, typed errors.

A small HTTP proxy in front of the live server misbehaves on request — it drops a
response after the server has committed and answered, or answers 503 itself — so the
client's retries meet real sockets. No worker runs: the tests move steps themselves, with
the engine or the transitions, while the client waits.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from executor import engine
from executor.ledger.records import Run
from executor.ledger.records import Step as StepRow
from executor.ledger.states import State
from stepward_client import client as client_module
from stepward_client.client import (
    Conflict,
    ConnectionFailed,
    InvalidRequest,
    NotFound,
    RateLimited,
    Step,
    StepSpec,
    Stepward,
    Unauthorized,
    WaitTimeout,
)
from tests.support.api import AgentAuth
from tests.support.factories import advance

pytestmark = pytest.mark.django_db(transaction=True)

# Generous: a deadline only decides when a stuck test gives up, never whether it passes.
DEADLINE_SECONDS = 30.0
API = "/api/v1"


# --- a proxy that can misbehave --------------------------------------------------------------


@dataclass
class Exchange:
    """One request through the proxy and what became of it."""

    method: str
    path: str
    query: str
    body: bytes
    action: str
    status: int | None = None
    response_body: bytes = b""


class Proxy:
    """An HTTP proxy, one request per connection, that forwards or misbehaves by rule.

    `drop` forwards the request, reads the server's whole answer (so the server has
    committed), then closes the client's connection without relaying it. `503` answers
    503 itself without forwarding.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.exchanges: list[Exchange] = []
        self.rules: list[list[Any]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []

    def misbehave(self, action: str, method: str, path: str, *, times: int = 1) -> None:
        with self.lock:
            self.rules.append([method, path, action, times])

    def seen(self, method: str, path: str) -> list[Exchange]:
        with self.lock:
            return [e for e in self.exchanges if e.method == method and e.path == path]

    def start(self) -> None:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self.threads.append(thread)

    def stop(self) -> None:
        self.stopping.set()
        for thread in list(self.threads):
            thread.join(timeout=DEADLINE_SECONDS)
        self.listener.close()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self._serve, args=(connection,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _action_for(self, method: str, path: str) -> str:
        for rule in self.rules:
            if rule[0] == method and rule[1] == path and rule[3] > 0:
                rule[3] -= 1
                return str(rule[2])
        return "forward"

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            connection.settimeout(DEADLINE_SECONDS * 2)
            request = read_request(connection)
            if request is None:
                return
            head, body = request
            method, target = head.split(b"\r\n", 1)[0].decode().split(" ")[:2]
            path, _, query = target.partition("?")
            with self.lock:
                exchange = Exchange(method, path, query, body, self._action_for(method, path))
                self.exchanges.append(exchange)
            if exchange.action == "503":
                exchange.status = 503
                connection.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
                    b"Content-Length: 11\r\nConnection: close\r\n\r\nunavailable"
                )
                return
            answer = self._forward(head, body)
            answer_head, _, answer_body = answer.partition(b"\r\n\r\n")
            exchange.status = int(answer_head.split(b" ", 2)[1])
            exchange.response_body = answer_body
            if exchange.action == "drop":
                return
            connection.sendall(with_connection_close(answer_head) + answer_body)

    def _forward(self, head: bytes, body: bytes) -> bytes:
        with socket.create_connection(self.upstream, timeout=DEADLINE_SECONDS * 2) as upstream:
            upstream.sendall(with_connection_close(head) + body)
            chunks = []
            while chunk := upstream.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


def read_request(connection: socket.socket) -> tuple[bytes, bytes] | None:
    """The head (without its blank line) and body of one request; None if the peer left."""
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = connection.recv(65536)
        if not chunk:
            return None
        buffer += chunk
    head, _, body = buffer.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = connection.recv(65536)
        if not chunk:
            return None
        body += chunk
    return head, body


def with_connection_close(head: bytes) -> bytes:
    # One exchange per connection on both sides: the proxy then never has to find where
    # an answer ends, and the client never reuses a connection the proxy is done with.
    lines = [
        line
        for line in head.split(b"\r\n")
        if line.partition(b":")[0].strip().lower() not in (b"connection", b"keep-alive")
    ]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


def wait_until(condition: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what}")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture
def proxy(live_server: Any) -> Iterator[Proxy]:
    address = urlsplit(live_server.url)
    assert address.hostname
    assert address.port
    proxy = Proxy((address.hostname, address.port))
    proxy.start()
    yield proxy
    proxy.stop()


@pytest.fixture
def stepward(live_server: Any, agent_auth: AgentAuth) -> Iterator[Stepward]:
    with Stepward(live_server.url, agent_auth.token, backoff=0.01) as client:
        yield client


@pytest.fixture
def proxied(proxy: Proxy, agent_auth: AgentAuth) -> Iterator[Stepward]:
    # The API's own URL is accepted as well as the server's root.
    with Stepward(proxy.url + API + "/", agent_auth.token, backoff=0.01) as client:
        yield client


@pytest.fixture
def waiter() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


def long_polls(proxy: Proxy, step: Step) -> list[Exchange]:
    return [e for e in proxy.seen("GET", f"{API}/steps/{step.id}") if "wait=" in e.query]


# --- standalone --------------------------------------------------------------------------------


def test_client_module_copied_alone_imports_neither_django_nor_the_project(
    tmp_path: Path,
) -> None:
    shutil.copy(client_module.__file__, tmp_path / "stepward_client.py")
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import stepward_client\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m.split('.')[0] in {'django', 'executor', 'console', 'ninja'}))\n"
        "print(stepward_client.Stepward.__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", script], capture_output=True, text=True, check=False
    )
    assert done.stdout.splitlines() == ["[]", "Stepward"], done.stderr


# --- idempotent creates and safe retries -------------------------------------------------------


def test_same_run_key_answers_the_existing_run(stepward: Stepward) -> None:
    first = stepward.run("nightly triage", key="triage-1")
    again = stepward.run("nightly triage", key="triage-1")

    assert first.created
    assert not again.created
    assert again.id == first.id
    assert Run.objects.filter(key="triage-1").count() == 1


def test_run_without_a_key_gets_one_so_it_can_be_retried(stepward: Stepward) -> None:
    run = stepward.run("ad hoc")

    assert run.created
    assert run.key
    assert Run.objects.get(pk=run.id).key == run.key


def test_run_create_retried_after_a_dropped_response_creates_one_run(
    proxy: Proxy, proxied: Stepward
) -> None:
    proxy.misbehave("drop", "POST", f"{API}/runs")

    run = proxied.run("nightly triage")

    dropped, retried = proxy.seen("POST", f"{API}/runs")
    assert (dropped.action, dropped.status) == ("drop", 201)
    assert json.loads(dropped.response_body)["id"] == run.id
    assert retried.body == dropped.body, "the retry must send the same generated key"
    assert (retried.status, run.created) == (200, False)
    assert Run.objects.count() == 1


def test_step_post_retried_after_a_dropped_response_creates_one_step(
    proxy: Proxy, proxied: Stepward
) -> None:
    run = proxied.run("nightly triage", key="triage-2")
    proxy.misbehave("drop", "POST", f"{API}/runs/{run.id}/steps")

    step = run.step("greet:alice", "echo", {"hello": "alice"})

    dropped, retried = proxy.seen("POST", f"{API}/runs/{run.id}/steps")
    assert (dropped.status, retried.status) == (201, 200)
    assert json.loads(dropped.response_body)["id"] == step.id
    assert not step.created
    assert list(StepRow.objects.filter(run_id=run.id).values_list("key", flat=True)) == [
        "greet:alice"
    ]


def test_503_is_retried_and_then_succeeds(proxy: Proxy, proxied: Stepward) -> None:
    proxy.misbehave("503", "GET", f"{API}/tools", times=2)
    proxy.misbehave("503", "POST", f"{API}/runs")

    tools = proxied.tools()
    run = proxied.run("after an outage", key="outage-1")

    assert "echo" in {tool["name"] for tool in tools}
    assert [e.status for e in proxy.seen("GET", f"{API}/tools")] == [503, 503, 200]
    assert [e.status for e in proxy.seen("POST", f"{API}/runs")] == [503, 201]
    assert run.created
    assert Run.objects.filter(key="outage-1").count() == 1


def test_429_is_retried_after_its_retry_after(
    proxy: Proxy, proxied: Stepward, settings: Any
) -> None:
    settings.API_RATE_LIMIT = "1/s"

    proxied.tools()
    tools = proxied.tools()

    assert "echo" in {tool["name"] for tool in tools}
    statuses = [e.status for e in proxy.seen("GET", f"{API}/tools")]
    assert statuses[0] == 200
    assert statuses[-1] == 200
    assert 429 in statuses


def test_other_client_errors_are_not_retried(proxy: Proxy, proxied: Stepward) -> None:
    run = proxied.run("conflicts", key="conflicts-1")
    run.step("a", "echo", {"n": 1})

    with pytest.raises(Conflict):
        run.step("a", "echo", {"n": 2})

    assert [e.status for e in proxy.seen("POST", f"{API}/runs/{run.id}/steps")] == [201, 409]


# --- long polls --------------------------------------------------------------------------------


def test_wait_returns_the_state_a_step_reaches_after_the_wait_started(
    proxy: Proxy, proxied: Stepward, waiter: ThreadPoolExecutor
) -> None:
    step = proxied.run("echoes", key="echoes-1").step("echo:1", "echo", {"n": 1})
    assert step.state == State.PENDING

    waiting = waiter.submit(step.wait, timeout=DEADLINE_SECONDS)
    wait_until(lambda: long_polls(proxy, step), "the client's long poll")
    assert engine.process(step.id, worker="test-worker") == State.COMPLETED

    done = waiting.result(timeout=DEADLINE_SECONDS)
    assert done is step
    assert (done.state, done.result) == ("completed", {"n": 1})
    assert done.attempt_count == 1


def test_wait_keeps_waiting_through_running_and_returns_unknown(
    proxy: Proxy, proxied: Stepward, waiter: ThreadPoolExecutor
) -> None:
    step = proxied.run("uncertain", key="uncertain-1").step("echo:1", "echo", {"n": 1})
    row = StepRow.objects.get(pk=step.id)

    waiting = waiter.submit(step.wait, timeout=DEADLINE_SECONDS)
    wait_until(lambda: len(long_polls(proxy, step)) == 1, "the first long poll")
    advance(row, State.RUNNING)
    # A second long poll means the client saw `running` and chose to keep waiting.
    wait_until(lambda: len(long_polls(proxy, step)) == 2, "the second long poll")
    advance(row, State.UNKNOWN)

    done = waiting.result(timeout=DEADLINE_SECONDS)
    assert done.state == "unknown"
    assert done.version == row.version


def test_wait_until_takes_states_or_a_predicate(
    proxy: Proxy, proxied: Stepward, waiter: ThreadPoolExecutor
) -> None:
    step = proxied.run("until", key="until-1").step("echo:1", "echo", {"n": 1})
    row = StepRow.objects.get(pk=step.id)

    waiting = waiter.submit(step.wait, timeout=DEADLINE_SECONDS, until={"running"})
    wait_until(lambda: long_polls(proxy, step), "the long poll")
    advance(row, State.RUNNING)
    assert waiting.result(timeout=DEADLINE_SECONDS).state == "running"

    advance(row, State.VERIFYING)
    moved = step.wait(timeout=DEADLINE_SECONDS, until=lambda s: s.state == "verifying")
    assert moved.state == "verifying"

    with pytest.raises(ValueError, match="no such state"):
        step.wait(until={"done"})


def test_wait_raises_wait_timeout_when_nothing_changes(stepward: Stepward) -> None:
    step = stepward.run("idle", key="idle-1").step("echo:1", "echo", {"n": 1})

    with pytest.raises(WaitTimeout) as raised:
        step.wait(timeout=1)

    assert raised.value.step.state == "pending"
    assert StepRow.objects.get(pk=step.id).state == State.PENDING


def test_wait_on_a_settled_step_reads_it_and_returns(stepward: Stepward) -> None:
    step = stepward.run("settled", key="settled-1").step("echo:1", "echo", {"n": 1})
    engine.process(step.id, worker="test-worker")

    first = step.wait(timeout=DEADLINE_SECONDS)
    again = step.wait(timeout=DEADLINE_SECONDS)

    assert first.state == again.state == "completed"


# --- the rest of the API -----------------------------------------------------------------------


def test_steps_report_and_cancel(stepward: Stepward) -> None:
    run = stepward.run("a plan", key="plan-1")
    first = run.step("echo:1", "echo", {"n": 1}, summary="the first echo")
    second = run.step("echo:2", "echo", {"n": 2}, depends_on=["echo:1"])
    engine.process(first.id, worker="test-worker")

    assert [(s.key, s.state) for s in run.steps()] == [
        ("echo:1", "completed"),
        ("echo:2", "pending"),
    ]
    assert stepward.get_step(first.id).input_summary == "the first echo"
    report = run.report()
    assert [e.key for e in report.completed] == ["echo:1"]
    assert [e.key for e in report.pending] == ["echo:2"]
    assert report.summary == "1 completed, 1 pending."

    run.cancel("the plan changed")

    assert run.status == "cancelled"
    assert second.refresh().state == "cancelled"
    assert stepward.get_run(run.id).refresh().counts == {"completed": 1, "cancelled": 1}


def test_steps_posts_a_batch_all_or_nothing_and_is_safe_to_repeat(stepward: Stepward) -> None:
    run = stepward.run("a batch", key="batch-1")
    items = [
        StepSpec("fetch", "echo", {"n": 1}),
        {"key": "use", "tool": "echo", "input": {"n": 2}, "depends_on": ["fetch"]},
    ]

    first = run.steps(items)
    again = run.steps(items)

    assert [(s.key, s.state, s.created) for s in first] == [
        ("fetch", "pending", True),
        ("use", "approved", True),
    ]
    assert [s.id for s in again] == [s.id for s in first]
    assert [s.created for s in again] == [False, False]
    with pytest.raises(InvalidRequest) as refused:
        run.steps([StepSpec("more", "echo", {"n": 3}), StepSpec("bad", "no.such.tool", {})])
    assert refused.value.details["index"] == 1
    assert [s.key for s in run.steps()] == ["fetch", "use"]


# --- typed errors ------------------------------------------------------------------------------


def test_a_bad_token_raises_unauthorized(live_server: Any, agent_auth: AgentAuth) -> None:
    with (
        Stepward(live_server.url, "not-a-token") as client,
        pytest.raises(Unauthorized) as raised,
    ):
        client.tools()

    assert (raised.value.status, raised.value.code) == (401, "unauthorized")


def test_an_unknown_run_or_step_raises_not_found(stepward: Stepward) -> None:
    with pytest.raises(NotFound) as raised:
        stepward.get_run(str(uuid.uuid4()))
    with pytest.raises(NotFound):
        stepward.get_step(str(uuid.uuid4()))

    assert (raised.value.status, raised.value.code) == (404, "not_found")


def test_same_step_key_with_another_input_raises_conflict(stepward: Stepward) -> None:
    run = stepward.run("conflict", key="conflict-1")
    step = run.step("ticket:1", "echo", {"title": "one"})

    with pytest.raises(Conflict) as raised:
        run.step("ticket:1", "echo", {"title": "two"})

    assert (raised.value.status, raised.value.code) == (409, "conflict")
    assert raised.value.details == {"step_id": step.id}


def test_an_unknown_tool_or_bad_input_raises_invalid_request(stepward: Stepward) -> None:
    run = stepward.run("invalid", key="invalid-1")

    with pytest.raises(InvalidRequest) as unknown_tool:
        run.step("x", "no.such.tool", {})
    with pytest.raises(InvalidRequest) as bad_input:
        run.step("y", "ticketdesk.create", {"body": "no title"})

    assert unknown_tool.value.status == 422
    assert unknown_tool.value.details == {"tool": "no.such.tool"}
    assert "input" in bad_input.value.details
    assert not StepRow.objects.filter(run_id=run.id).exists()


def test_rate_limit_raises_rate_limited_once_retries_are_spent(
    live_server: Any, agent_auth: AgentAuth, settings: Any
) -> None:
    settings.API_RATE_LIMIT = "2/min"
    with Stepward(live_server.url, agent_auth.token, retries=0) as client:
        client.tools()
        client.tools()
        with pytest.raises(RateLimited) as raised:
            client.tools()

    assert (raised.value.status, raised.value.code) == (429, "rate_limited")
    assert raised.value.retry_after is not None
    assert raised.value.retry_after > 0


def test_no_server_listening_raises_connection_failed_after_the_retries() -> None:
    with (
        Stepward(f"http://127.0.0.1:{closed_port()}", "token", retries=1, backoff=0.01) as client,
        pytest.raises(ConnectionFailed) as raised,
    ):
        client.tools()

    assert raised.value.attempts == 2
    assert raised.value.status is None
