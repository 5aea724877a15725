"""`http.get`: a read from an allow-listed host (EXECUTOR_HTTP_ALLOWED_HOSTS), checked when
the step is posted and again before the call, reading at most EXECUTOR_HTTP_MAX_RESPONSE_BYTES."""

from __future__ import annotations

import time
from typing import Any

import httpx
from django.conf import settings

from executor.contract.tool import (
    ApprovalRule,
    Effect,
    FailureClass,
    Idempotency,
    Invocation,
    RetryPolicy,
    Tool,
    ToolError,
    ToolResult,
    register,
)
from executor.tools import outbound

# The result keeps this much of the body (EXECUTOR_HTTP_MAX_RESPONSE_BYTES bounds the read).
MAX_BODY_CHARS = 20_000
READ_DEADLINE_SECONDS = 30


@register
class HttpGet(Tool):
    name = "http.get"
    description = "GET a URL on an allow-listed host; returns status and body."
    effect = Effect.READ
    idempotency = Idempotency.NONE
    requires_approval = ApprovalRule.NEVER
    compensation = ""
    retry = RetryPolicy(initial_interval=1, max_interval=30, max_attempts=5, deadline=300)
    input_schema = {
        "type": "object",
        "properties": {"url": {"type": "string", "pattern": "^https?://", "maxLength": 2000}},
        "required": ["url"],
        "additionalProperties": False,
    }

    def check_input(self, value: dict[str, Any]) -> list[str]:
        refused = outbound.refusal(value["url"])
        return [f"url: {refused}"] if refused else []

    def invoke(self, call: Invocation) -> ToolResult:
        url = _allowed(call)
        try:
            with outbound.client().stream(
                "GET", url, timeout=10, follow_redirects=False
            ) as response:
                raise_for_status(response)
                body, truncated = read_at_most(response, settings.EXECUTOR_HTTP_MAX_RESPONSE_BYTES)
        except httpx.HTTPError as error:
            raise _failure(error) from error
        return _result(response, body, truncated)

    async def ainvoke(self, call: Invocation) -> ToolResult:
        """`invoke` on the worker's event loop (DESIGN.md §16)."""
        url = _allowed(call)
        try:
            async with outbound.async_client().stream(
                "GET", url, timeout=10, follow_redirects=False
            ) as response:
                raise_for_status(response)
                body, truncated = await aread_at_most(
                    response, settings.EXECUTOR_HTTP_MAX_RESPONSE_BYTES
                )
        except httpx.HTTPError as error:
            raise _failure(error) from error
        return _result(response, body, truncated)


def _allowed(call: Invocation) -> str:
    url: str = call.input["url"]
    refused = outbound.refusal(url)
    if refused:
        # Allowed when posted, perhaps, but the allow-list has changed since.
        raise ToolError(FailureClass.POLICY_DENIED, refused)
    return url


def _failure(error: httpx.HTTPError) -> ToolError:
    if isinstance(error, httpx.ConnectError):
        return ToolError(FailureClass.TRANSIENT, f"connection failed: {error}")
    if isinstance(error, httpx.TimeoutException):
        # A read is safe to repeat, so a timeout is retryable here.
        return ToolError(FailureClass.TRANSIENT, f"timed out: {error}")
    return ToolError(FailureClass.UNAVAILABLE, str(error))


def _result(response: httpx.Response, body: bytes, truncated: bool) -> ToolResult:
    text = decoded(body, response.charset_encoding)
    return ToolResult(
        result={
            "status": response.status_code,
            "body": text[:MAX_BODY_CHARS],
            # Whether `body` is less than the whole response.
            "truncated": truncated or len(text) > MAX_BODY_CHARS,
        },
        evidence={
            "status": response.status_code,
            "bytes": len(body),
            "stopped_at_limit": truncated,
        },
    )


def decoded(body: bytes, charset: str | None) -> str:
    try:
        return body.decode(charset or "utf-8", errors="replace")
    except LookupError:
        # A charset Python does not know.
        return body.decode("utf-8", errors="replace")


def raise_for_status(response: httpx.Response) -> None:
    """An error answer as its failure class: a read is safe to repeat, so a 5xx (or 408) is
    only unavailable. A redirect is an answer like any other (redirects are not followed)."""
    status = response.status_code
    if status >= 400:
        raise outbound.failure_of(
            response, f"server answered {status}", server_error=FailureClass.UNAVAILABLE
        )


def read_at_most(response: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """The body's first `limit` bytes (decompressed), and whether there was more; stops
    reading there, and stops with a timeout once READ_DEADLINE_SECONDS have passed (a
    server may drip a body forever, each piece within the read timeout)."""
    reading = _Reading(limit)
    for chunk in response.iter_bytes():
        if reading.took(chunk):
            break
    return bytes(reading.body), reading.truncated


async def aread_at_most(response: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """`read_at_most` of a response read on an event loop."""
    reading = _Reading(limit)
    async for chunk in response.aiter_bytes():
        if reading.took(chunk):
            break
    return bytes(reading.body), reading.truncated


class _Reading:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.deadline = time.monotonic() + READ_DEADLINE_SECONDS
        self.body = bytearray()
        self.truncated = False

    def took(self, chunk: bytes) -> bool:
        """Adds a chunk; True when reading stops here (the limit reached)."""
        if len(self.body) + len(chunk) > self.limit:
            self.body += chunk[: self.limit - len(self.body)]
            self.truncated = True
            return True
        self.body += chunk
        if time.monotonic() > self.deadline:
            raise httpx.ReadTimeout(f"the body took over {READ_DEADLINE_SECONDS} s")
        return False
