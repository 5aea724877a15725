"""What every seam of the engine shares: a claim, its identity in logs and the ledger, and
the small writes every commit point may make (an attempt closed, a write fenced out)."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from functools import cached_property
from typing import Any

from django.conf import settings
from django.utils import timezone

from executor.common.redaction import Redactor
from executor.contract.tool import Invocation, Tool, ToolResult
from executor.ledger.records import OPEN_PHASES, Attempt, Effect, Idempotency, Phase, Run, Step
from executor.policy import authorization

logger = logging.getLogger(__name__)


MAX_MESSAGE = 2000


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def lease_seconds() -> int:
    return settings.EXECUTOR_LEASE_SECONDS


def executor_actor(worker: str) -> str:
    return f"executor:{worker}"


def is_light(tool: Tool) -> bool:
    """Pure and read tools are safe to repeat and have nothing to verify."""
    return tool.effect in (Effect.PURE, Effect.READ)


def safe_to_repeat(tool: Tool) -> bool:
    """May a submission that might have happened be sent again? (DESIGN.md §7)"""
    return is_light(tool) or tool.idempotency == Idempotency.KEY


def invocation(step: Step, fence: int, attempt: int) -> Invocation:
    return Invocation(
        step_id=str(step.pk),
        operation_id=str(step.operation_id),
        input=step.input,
        fence=fence,
        attempt=attempt,
        idempotency_key=str(step.operation_id),
    )


def call_of(claim: Claim) -> Invocation:
    return invocation(claim.step, claim.fence, claim.attempt.number)


def log_fields(step: Step, attempt: Attempt | None = None) -> dict[str, Any]:
    """What a log line about this step carries (executor/common/logcontext.py)."""
    workspace: Any = None
    if Step.run.is_cached(step):
        run = step.run
        workspace = run.workspace.slug if Run.workspace.is_cached(run) else run.workspace_id
    return {
        "step_id": step.pk,
        "run_id": step.run_id,
        "workspace": workspace,
        "attempt": attempt.number if attempt is not None else None,
    }


@dataclass
class Claim:
    step: Step
    attempt: Attempt
    tool: Tool
    worker: str
    # Set by the lease keeper when another worker has taken the step over.
    lost: bool = False

    @property
    def fence(self) -> int:
        return self.step.fence

    @cached_property
    def redactor(self) -> Redactor:
        """What of this call must never be stored or shown (DESIGN.md §15)."""
        return self.tool.redactor(self.step.input)


class Outcome:
    """What happened to one step when it was looked at, for logs and tests."""

    SKIPPED = "skipped"  # the step was not claimable (moved on, not due, paused run)
    FENCED_OUT = "fenced_out"


def request_evidence(tool: Tool, step: Step) -> dict[str, Any]:
    return {"tool": tool.name, "input": tool.redacted(step.input), **tool.request_details()}


def response_evidence(claim: Claim, result: ToolResult) -> dict[str, Any]:
    """What the tool answered, as evidence: redacted before it is written."""
    evidence: dict[str, Any] = claim.redactor(
        {"external_id": result.external_id, **result.evidence}
    )
    return evidence


def responded_move(claim: Claim, result: ToolResult) -> dict[str, Any]:
    """The move to `verifying` that stores a write's response: what it writes and says."""
    return {
        "actor": executor_actor(claim.worker),
        "reason": "response stored",
        "changes": {
            "external_id": result.external_id[:200],
            "result": claim.redactor(result.result),
        },
        "data": {"external_id": result.external_id} if result.external_id else None,
    }


def record_fenced_out(attempt: Attempt, write: str, **evidence: Any) -> str:
    """Notes on the attempt that its worker's write was refused by the fence."""
    fields: dict[str, Any] = {"fenced_out_at": timezone.now(), "fenced_out_write": write}
    if evidence:
        fields["fenced_out_evidence"] = evidence
    Attempt.objects.filter(pk=attempt.pk).update(**fields)
    logger.warning("attempt %s was fenced out at %s", attempt.pk, write)
    return Outcome.FENCED_OUT


def close_attempt(
    attempt: Attempt,
    phase: Phase,
    *,
    error_class: str = "",
    message: str = "",
    response: dict[str, Any] | None = None,
    cost: Decimal | None = None,
    now: datetime | None = None,
) -> None:
    fields = closing_fields(
        phase, error_class=error_class, message=message, response=response, cost=cost, now=now
    )
    Attempt.objects.filter(pk=attempt.pk, phase__in=OPEN_PHASES).update(**fields)


def closing_fields(
    phase: Phase,
    *,
    error_class: str = "",
    message: str = "",
    response: dict[str, Any] | None = None,
    cost: Decimal | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """What closing an attempt in `phase` writes (`close_attempt`, the responded statement)."""
    fields: dict[str, Any] = {
        "phase": phase,
        "error_class": error_class,
        "error_message": message[:MAX_MESSAGE],
        "finished_at": now or timezone.now(),
    }
    if response is not None:
        fields["response_evidence"] = response
    if cost is not None:
        fields["cost"] = cost
    return fields


def pause_if_over_cost(run_id: Any, *, now: datetime) -> None:
    fresh = Run.objects.get(pk=run_id)
    if fresh.max_cost is not None and fresh.used_cost >= fresh.max_cost:
        authorization.run_pause(
            fresh, reason=f"max_cost reached ({fresh.used_cost} of {fresh.max_cost})", now=now
        )
