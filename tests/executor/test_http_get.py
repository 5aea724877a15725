"""`http.get` reaches only what EXECUTOR_HTTP_ALLOWED_HOSTS names, checked when the step is
posted (422) and again before the call (policy_denied), and reads at most
EXECUTOR_HTTP_MAX_RESPONSE_BYTES of an answer."""

from __future__ import annotations

import runpy
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import pytest
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from guardian.shortcuts import assign_perm

from executor import engine
from executor.contract.tool import (
    Invocation,
    RetryPolicy,
    Tool,
    ToolResult,
    get_tool,
    register,
    unregister,
)
from executor.ledger.records import Agent, ApprovalRule, Effect, Idempotency, Run, Step
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import State
from executor.services.tools import tools_sync
from executor.tools import outbound
from executor.tools.http_get import MAX_BODY_CHARS
from tests.support.api import ApiClient, error_of

API = "/api/v1"
BIG = 2 * 1024 * 1024


class Site(BaseHTTPRequestHandler):
    """A small site: `/small`, `/big` (2 MiB) and `/endless` (chunks until the reader stops)."""

    requests: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        Site.requests.append(self.path)
        if self.path == "/small":
            self.answer(b"hello")
        elif self.path == "/big":
            self.answer(b"a" * BIG)
        elif self.path == "/endless":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"b" * 65536
            try:
                # Bounded, so that a reader that never stops fails the test, not hangs it.
                for _ in range(4000):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                return  # The reader stopped: what the test wants.
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.send_error(404)

    def answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def site() -> Iterator[str]:
    Site.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Site)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def fetch(url: str) -> ToolResult:
    call = Invocation(
        step_id="s", operation_id="o", input={"url": url}, fence=1, attempt=1, idempotency_key="o"
    )
    return get_tool("http.get").invoke(call)


def post_get(api: ApiClient, run: Run, url: str, key: str = "fetch") -> Any:
    return api.post(
        f"{API}/runs/{run.pk}/steps", {"key": key, "tool": "http.get", "input": {"url": url}}
    )


# --- the allow-list ---------------------------------------------------------------------------


def fresh_settings() -> dict[str, Any]:
    return runpy.run_path(str(Path(django_settings.BASE_DIR) / "console" / "settings.py"))


def test_the_allow_list_is_empty_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EXECUTOR_HTTP_ALLOWED_HOSTS", raising=False)
    monkeypatch.setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/stepward")

    assert fresh_settings()["EXECUTOR_HTTP_ALLOWED_HOSTS"] == []


def test_the_embedded_setup_allows_its_own_desk_and_nothing_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("EXECUTOR_HTTP_ALLOWED_HOSTS", "DATABASE_URL", "CELERY_BROKER_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TICKETDESK_PORT", "8766")

    assert fresh_settings()["EXECUTOR_HTTP_ALLOWED_HOSTS"] == ["127.0.0.1:8766"]

    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")
    assert fresh_settings()["EXECUTOR_HTTP_ALLOWED_HOSTS"] == []

    monkeypatch.delenv("CELERY_BROKER_URL")
    monkeypatch.setenv("EXECUTOR_HTTP_ALLOWED_HOSTS", "")  # set, even to nothing, it decides
    assert fresh_settings()["EXECUTOR_HTTP_ALLOWED_HOSTS"] == []


@pytest.mark.parametrize(
    ("allowed", "url", "admitted"),
    [
        ([], "http://127.0.0.1/", False),
        (["example.com"], "https://example.com/x", True),
        (["example.com"], "http://example.com/", True),
        (["example.com"], "http://example.com:80/", True),
        # A host alone is its scheme's default port only.
        (["example.com"], "http://example.com:8080/", False),
        (["example.com"], "https://example.com:80/", False),
        (["127.0.0.1"], "http://127.0.0.1:8000/admin/", False),
        (["example.com:8080"], "http://example.com:8080/", True),
        (["example.com:8080"], "http://example.com/", False),
        (["example.com:443"], "https://example.com/", True),
        (["127.0.0.1:8765"], "http://127.0.0.1:8000/admin/", False),
        # Read as the client connects: the host is after the `@`.
        (["127.0.0.1:8765"], "http://127.0.0.1:8765@evil.example/", False),
        (["example.com"], "http://example.com.evil.example/", False),
        (["Example.COM"], "http://EXAMPLE.com/", True),
        (["[::1]:8080"], "http://[::1]:8080/", True),
        (["::1"], "http://[::1]/", True),
        (["::1"], "http://[::1]:8080/", False),
        (["bücher.example"], "http://xn--bcher-kva.example/", True),
        # Names are compared, never resolved.
        (["localhost"], "http://127.0.0.1/", False),
        (["127.0.0.1"], "http://127.1/", False),
        (["example.com"], "http://[bad/", False),
        (["example.com"], "http:///nohost", False),
    ],
)
def test_the_allow_list_admits_host_on_its_default_port_or_host_port(
    settings: Any, allowed: list[str], url: str, admitted: bool
) -> None:
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = allowed

    assert (outbound.refusal(url) is None) is admitted


@pytest.mark.parametrize(
    "entry", ["example.com:http", "example.com:0", "a:99999", "[::1", "[::1]x"]
)
def test_a_malformed_allow_list_entry_is_refused_naming_it(settings: Any, entry: str) -> None:
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = ["example.com", entry]

    with pytest.raises(ImproperlyConfigured, match="EXECUTOR_HTTP_ALLOWED_HOSTS"):
        outbound.allowed_hosts()


# --- checked when the step is posted ----------------------------------------------------------


def test_another_port_of_an_allowed_host_is_refused_at_post(
    api: ApiClient, run: Run, settings: Any, live_server: Any
) -> None:
    # The desk's port is allowed; the web process's own admin is on another port of the host.
    desk_port = urlsplit(settings.TICKETDESK_URL).port
    web_port = urlsplit(live_server.url).port
    assert desk_port != web_port
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{desk_port}"]

    response = post_get(api, run, f"http://127.0.0.1:{web_port}/admin/login/")

    assert response.status_code == 422
    error = error_of(response)
    assert error["code"] == "invalid_body"
    refusal = f"url: host 127.0.0.1:{web_port} is not in EXECUTOR_HTTP_ALLOWED_HOSTS"
    assert error["details"] == {"input": [refusal]}
    assert f"127.0.0.1:{web_port}" in error["message"]
    assert not Step.objects.filter(run=run).exists()


def test_with_the_port_allowed_the_admin_page_is_read_back(
    api: ApiClient, run: Run, settings: Any, live_server: Any
) -> None:
    # What the allow-list stands between: allowed, the read happens.
    web_port = urlsplit(live_server.url).port
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{web_port}"]

    posted = post_get(api, run, f"http://127.0.0.1:{web_port}/admin/login/")
    assert posted.status_code == 201, posted.content
    outcome = engine.process(posted.json()["id"], worker="w1")

    step = Step.objects.get(pk=posted.json()["id"])
    assert outcome == State.COMPLETED
    assert step.result["status"] == 200
    assert "csrfmiddlewaretoken" in step.result["body"]


def test_a_host_dropped_from_the_allow_list_after_posting_is_refused_before_the_call(
    api: ApiClient, run: Run, settings: Any, site: str
) -> None:
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = [urlsplit(site).netloc]
    posted = post_get(api, run, f"{site}/small")
    assert posted.status_code == 201
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = []

    outcome = engine.process(posted.json()["id"], worker="w1")

    step = Step.objects.get(pk=posted.json()["id"])
    assert outcome == State.FAILED
    assert step.failure_class == "policy_denied"
    assert "is not in EXECUTOR_HTTP_ALLOWED_HOSTS" in step.failure_message
    assert Site.requests == []


class PickyTool(Tool):
    name = "test.picky"
    description = "A test tool that refuses some inputs that fit its schema."
    effect = Effect.PURE
    idempotency = Idempotency.NONE
    requires_approval = ApprovalRule.NEVER
    compensation = ""
    retry = RetryPolicy()
    input_schema: ClassVar[dict[str, Any]] = {"type": "object"}

    def check_input(self, value: dict[str, Any]) -> list[str]:
        return ["colour: blue is not allowed here"] if value.get("colour") == "blue" else []

    def invoke(self, call: Invocation) -> ToolResult:
        return ToolResult(result=call.input)


@pytest.fixture
def picky(agent: Agent) -> Iterator[str]:
    register(PickyTool)
    try:
        tools_sync()
        assign_perm("executor.use_tool", agent.user, ToolRow.objects.get(name=PickyTool.name))
        yield PickyTool.name
    finally:
        unregister(PickyTool.name)


def test_any_tool_may_refuse_input_at_post_through_check_input(
    api: ApiClient, run: Run, picky: str
) -> None:
    url = f"{API}/runs/{run.pk}/steps"
    refused = api.post(url, {"key": "a", "tool": picky, "input": {"colour": "blue"}})
    batch = api.post(
        f"{url}/batch",
        {
            "steps": [
                {"key": "b", "tool": picky, "input": {"colour": "red"}},
                {"key": "c", "tool": picky, "input": {"colour": "blue"}},
            ]
        },
    )
    accepted = api.post(url, {"key": "d", "tool": picky, "input": {"colour": "red"}})

    assert refused.status_code == 422
    assert error_of(refused)["details"] == {"input": ["colour: blue is not allowed here"]}
    assert batch.status_code == 422
    assert error_of(batch)["details"]["index"] == 1
    assert accepted.status_code == 201
    assert list(Step.objects.filter(run=run).values_list("key", flat=True)) == ["d"]


def test_the_contract_refuses_nothing_by_default() -> None:
    assert get_tool("echo").check_input({"anything": "at all"}) == []


# --- how much of an answer is read ------------------------------------------------------------


@pytest.fixture
def allowed_site(site: str, settings: Any) -> str:
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = [urlsplit(site).netloc]
    settings.EXECUTOR_HTTP_MAX_RESPONSE_BYTES = 64 * 1024
    return site


def test_a_small_answer_is_read_whole(allowed_site: str) -> None:
    result = fetch(f"{allowed_site}/small")

    assert result.result == {"status": 200, "body": "hello", "truncated": False}
    assert result.evidence == {"status": 200, "bytes": 5, "stopped_at_limit": False}


@pytest.mark.parametrize("path", ["/big", "/endless"])
def test_a_large_answer_is_read_up_to_the_limit_and_said_to_be_cut(
    allowed_site: str, path: str
) -> None:
    result = fetch(f"{allowed_site}{path}")

    assert result.evidence == {"status": 200, "bytes": 64 * 1024, "stopped_at_limit": True}
    assert result.result["truncated"] is True
    assert len(result.result["body"]) == MAX_BODY_CHARS


def test_an_answer_over_the_result_size_but_under_the_read_limit_is_said_to_be_cut(
    allowed_site: str, settings: Any
) -> None:
    settings.EXECUTOR_HTTP_MAX_RESPONSE_BYTES = 4 * BIG

    result = fetch(f"{allowed_site}/big")

    assert result.evidence == {"status": 200, "bytes": BIG, "stopped_at_limit": False}
    assert result.result["truncated"] is True
