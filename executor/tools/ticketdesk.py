"""The ticket desk's tools: `ticketdesk.create`, `ticketdesk.create_keyed`, `ticketdesk.close`.

The desk is an external system (executor/desk/ticketdesk.py); what matters here is telling,
for every way a call can end, whether a ticket may exist (DESIGN.md §8).
"""

from __future__ import annotations

from typing import Any, ClassVar

import httpx
from django.conf import settings

from executor.contract.tool import (
    ApprovalRule,
    Effect,
    FailureClass,
    Idempotency,
    Invocation,
    Lookup,
    LookupOutcome,
    RetryPolicy,
    Tool,
    ToolError,
    ToolResult,
    register,
)
from executor.tools import outbound

DEFAULT_TIMEOUT_SECONDS = 10.0
CONNECT_TIMEOUT_SECONDS = 2.0
EVIDENCE_BODY_CHARS = 500


def _timeout() -> httpx.Timeout:
    seconds = float(getattr(settings, "TICKETDESK_TIMEOUT_SECONDS", DEFAULT_TIMEOUT_SECONDS))
    return httpx.Timeout(seconds, connect=min(seconds, CONNECT_TIMEOUT_SECONDS))


def _url(path: str) -> str:
    return settings.TICKETDESK_URL.rstrip("/") + path


def _send(
    method: str,
    path: str,
    *,
    json: dict[str, Any] | None = None,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """One request on a fresh connection (see `outbound`); transport errors leave as
    classified ToolErrors."""
    try:
        return outbound.client().request(
            method, _url(path), json=json, params=params, headers=headers, timeout=_timeout()
        )
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as error:
        raise ToolError(
            FailureClass.TRANSIENT,
            f"ticket desk unreachable, nothing was sent: {type(error).__name__}: {error}",
            evidence={"error": type(error).__name__},
        ) from error
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as error:
        # TICKETDESK_URL is wrong: nothing left this process, and retrying will not help
        # until someone fixes it, which is what `unavailable` then `dead` say.
        raise ToolError(
            FailureClass.UNAVAILABLE,
            f"bad TICKETDESK_URL: {error}",
            evidence={"error": type(error).__name__},
        ) from error
    except httpx.HTTPError as error:
        # ReadTimeout, ReadError, RemoteProtocolError, WriteError...: the request may have
        # reached the desk and taken effect before the connection failed.
        raise ToolError(
            FailureClass.AMBIGUOUS,
            f"no reliable answer after sending: {type(error).__name__}: {error}",
            evidence={"error": type(error).__name__},
        ) from error


def _error_text(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"])
    except (ValueError, KeyError, TypeError):
        return response.text[:EVIDENCE_BODY_CHARS]


def _raise_for_status(response: httpx.Response) -> None:
    status = response.status_code
    if 200 <= status < 300:
        return
    message = f"ticket desk answered {status}: {_error_text(response)}"
    evidence = {"status": status, "body": response.text[:EVIDENCE_BODY_CHARS]}
    if status < 400:
        # An unexpected redirect may come after the desk committed.
        raise ToolError(FailureClass.AMBIGUOUS, message, evidence=evidence)
    # The desk answers 503 before committing anything, validates before committing (a 4xx
    # means it refused the request; a 409 is a stale fence: a newer lease holder owns the
    # step), and any other 5xx may come after it committed.
    raise outbound.failure_of(response, message, evidence=evidence, before_effect=(503,))


def _ticket_from(response: httpx.Response) -> dict[str, Any]:
    try:
        ticket = response.json()
        ticket_id = ticket["ticket_id"]
    except (ValueError, KeyError, TypeError) as error:
        raise ToolError(
            FailureClass.AMBIGUOUS,
            "the desk accepted the request but its answer is unreadable; the ticket may exist",
            evidence={"status": response.status_code, "body": response.text[:EVIDENCE_BODY_CHARS]},
        ) from error
    if not isinstance(ticket_id, int) or isinstance(ticket_id, bool):
        raise ToolError(
            FailureClass.AMBIGUOUS,
            f"the desk answered a ticket id that is not an integer: {ticket_id!r}",
            evidence={"status": response.status_code, "body": response.text[:EVIDENCE_BODY_CHARS]},
        )
    return dict(ticket)


def _check_input(tool: Tool, call: Invocation) -> None:
    # The API validates input on the way in; checking again here keeps a malformed call
    # from leaving as a KeyError, which the engine would have to treat as ambiguous.
    errors = tool.validate_input(call.input)
    if errors:
        raise ToolError(FailureClass.INVALID_INPUT, "; ".join(errors))


class _CreateTicket(Tool):
    """Shared by both create tools; only the route and the headers differ."""

    effect = Effect.WRITE
    requires_approval = ApprovalRule.NEVER
    compensation = "ticketdesk.close"
    retry = RetryPolicy(initial_interval=1, max_interval=30, max_attempts=5, deadline=300)
    input_schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 1, "maxLength": 200},
            "body": {"type": "string", "maxLength": 20_000},
        },
        "required": ["title"],
        "additionalProperties": False,
    }
    # The desk stores client_ref with the ticket in the same commit and lists by it, so an
    # empty answer means no ticket exists for this operation.
    lookup_authoritative = True
    accepts_fence = True
    # The desk numbers its tickets.
    external_id_pattern = r"[1-9][0-9]{0,18}"
    external_id_example = "4211"
    path: ClassVar[str]

    def headers(self, call: Invocation) -> dict[str, str]:
        return {"X-Fence-Token": str(call.fence)}

    def invoke(self, call: Invocation) -> ToolResult:
        _check_input(self, call)
        payload = {
            "title": call.input["title"],
            "body": call.input.get("body", ""),
            "client_ref": call.operation_id,
        }
        response = _send("POST", self.path, json=payload, headers=self.headers(call))
        _raise_for_status(response)
        ticket = _ticket_from(response)
        return ToolResult(
            result={"ticket_id": ticket["ticket_id"]},
            external_id=str(ticket["ticket_id"]),
            evidence={
                "status": response.status_code,
                "ticket_id": ticket["ticket_id"],
                "client_ref": ticket.get("client_ref"),
                "ticket_status": ticket.get("status"),
                "replayed": response.headers.get("Idempotent-Replayed") == "true",
            },
        )

    def compensation_input(self, external_id: str, result: Any) -> dict[str, Any]:
        return {"ticket_id": external_id}

    def effects_counted(self, operation_ids: list[str]) -> dict[str, int] | None:
        # The desk's own count of tickets per client reference (= our operation id).
        try:
            response = outbound.client().get(_url("/stats"), timeout=_timeout())
            response.raise_for_status()
            by_ref = response.json()["by_client_ref"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        return {op: int(by_ref.get(op, 0)) for op in operation_ids}

    def lookup(self, call: Invocation) -> Lookup:
        # Sending our fence makes the desk refuse a slower request from an older lease
        # that has not committed yet, so `not_found` stays true after we answer it.
        try:
            response = outbound.client().get(
                _url("/tickets"),
                params={"client_ref": call.operation_id},
                headers={"X-Fence-Token": str(call.fence)},
                timeout=_timeout(),
            )
        except (httpx.HTTPError, httpx.InvalidURL) as error:
            return Lookup(
                LookupOutcome.CANNOT_TELL,
                evidence={"error": f"{type(error).__name__}: {error}"},
            )
        if response.status_code != 200:
            return Lookup(
                LookupOutcome.CANNOT_TELL,
                evidence={
                    "status": response.status_code,
                    "body": response.text[:EVIDENCE_BODY_CHARS],
                },
            )
        try:
            ticket_ids = sorted(int(ticket["ticket_id"]) for ticket in response.json()["tickets"])
        except (ValueError, KeyError, TypeError):
            return Lookup(
                LookupOutcome.CANNOT_TELL,
                evidence={"status": 200, "body": response.text[:EVIDENCE_BODY_CHARS]},
            )
        evidence = {"client_ref": call.operation_id, "ticket_ids": ticket_ids}
        if not ticket_ids:
            return Lookup(LookupOutcome.NOT_FOUND, evidence=evidence)
        # Duplicates (more than one id) stay visible in the evidence for a reviewer.
        first = ticket_ids[0]
        return Lookup(
            LookupOutcome.FOUND,
            external_id=str(first),
            result={"ticket_id": first},
            evidence=evidence,
        )


@register
class TicketCreate(_CreateTicket):
    name = "ticketdesk.create"
    description = "Opens a ticket at the ticket desk. Not idempotent; found again by lookup."
    idempotency = Idempotency.NONE
    path = "/tickets"


@register
class TicketCreateKeyed(_CreateTicket):
    name = "ticketdesk.create_keyed"
    description = "Opens a ticket at the ticket desk, deduplicated by an Idempotency-Key."
    # The desk's keyed route answers the original ticket for a key it has seen.
    idempotency = Idempotency.KEY
    path = "/tickets/keyed"

    def headers(self, call: Invocation) -> dict[str, str]:
        return {**super().headers(call), "Idempotency-Key": call.idempotency_key}


@register
class TicketClose(Tool):
    name = "ticketdesk.close"
    description = "Closes a ticket at the ticket desk (undoes ticketdesk.create)."
    effect = Effect.WRITE
    # Closing is naturally idempotent: the ticket id is the key the desk deduplicates on,
    # and closing a closed ticket changes nothing and answers 200, so repeating a close
    # whose answer was lost cannot do anything twice.
    idempotency = Idempotency.KEY
    requires_approval = ApprovalRule.NEVER
    compensation = ""
    retry = RetryPolicy(initial_interval=1, max_interval=30, max_attempts=5, deadline=300)
    input_schema = {
        "type": "object",
        "properties": {
            # A compensation step gets the original's external_id, which is a string.
            "ticket_id": {
                "oneOf": [
                    {"type": "integer", "minimum": 1},
                    {"type": "string", "pattern": "^[0-9]{1,18}$"},
                ]
            }
        },
        "required": ["ticket_id"],
        "additionalProperties": False,
    }
    accepts_fence = True

    def invoke(self, call: Invocation) -> ToolResult:
        _check_input(self, call)
        ticket_id = int(call.input["ticket_id"])
        response = _send(
            "POST",
            f"/tickets/{ticket_id}/close",
            json={"client_ref": call.operation_id},
            headers={"X-Fence-Token": str(call.fence)},
        )
        _raise_for_status(response)
        ticket = _ticket_from(response)
        return ToolResult(
            result={"ticket_id": ticket["ticket_id"], "status": ticket.get("status")},
            external_id=str(ticket["ticket_id"]),
            evidence={
                "status": response.status_code,
                "ticket_id": ticket["ticket_id"],
                "ticket_status": ticket.get("status"),
                "closed_at": ticket.get("closed_at"),
            },
        )
