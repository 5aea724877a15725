"""`http.get`: a read from an allow-listed host (EXECUTOR_HTTP_ALLOWED_HOSTS)."""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx
from django.conf import settings

from executor.tools import outbound
from executor.tools.base import (
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

MAX_BODY_CHARS = 20_000


def retry_after_seconds(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


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

    def invoke(self, call: Invocation) -> ToolResult:
        url = call.input["url"]
        host = urlsplit(url).hostname or ""
        if host not in settings.EXECUTOR_HTTP_ALLOWED_HOSTS:
            raise ToolError(FailureClass.POLICY_DENIED, f"host {host!r} is not allow-listed")
        try:
            response = outbound.client().get(url, timeout=10, follow_redirects=False)
        except httpx.ConnectError as error:
            raise ToolError(FailureClass.TRANSIENT, f"connection failed: {error}") from error
        except httpx.TimeoutException as error:
            # A read is safe to repeat, so a timeout is retryable here.
            raise ToolError(FailureClass.TRANSIENT, f"timed out: {error}") from error
        except httpx.HTTPError as error:
            raise ToolError(FailureClass.UNAVAILABLE, str(error)) from error
        status = response.status_code
        if status == 429:
            raise ToolError(
                FailureClass.RATE_LIMITED, "429", retry_after=retry_after_seconds(response)
            )
        if status >= 500:
            raise ToolError(FailureClass.UNAVAILABLE, f"server answered {status}")
        if status in (401, 403):
            raise ToolError(FailureClass.PERMISSION_DENIED, f"server answered {status}")
        if status >= 400:
            raise ToolError(FailureClass.INVALID_INPUT, f"server answered {status}")
        return ToolResult(
            result={"status": status, "body": response.text[:MAX_BODY_CHARS]},
            evidence={"status": status, "bytes": len(response.content)},
        )
