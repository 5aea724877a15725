"""What puts the records beside the step Events in the chain (DESIGN.md §15).

- An **approval** is named, in the data of the step Event that recorded it, by the digest of
  its content (`approval_digest`): its approver, reason, input hash, tool, policy version and
  times. The Event is keyed, so an approval edited or deleted afterwards no longer matches
  what its step's chain holds, and one added behind the application's back is named by no
  event.
- An **attempt** is named by number in the data of the claim Event that opened it, and once
  closed (its evidence, error and cost never change again) its digest (`attempt_digest`) is
  signed by the next checkpoint.
- **Run events** are chained per run like step Events, and the run's `seal` is an HMAC over
  its budgets and its newest run event's hash (`run_seal`): an actor or reason edited, a run
  event deleted or the budget raised by hand shows.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from decimal import Decimal
from typing import Any

from executor.ledger.transitions import _CANONICAL_WITH_STR, event_hash

COST_PLACES = Decimal("0.0001")


def approval_digest(
    *,
    step_id: Any,
    input_hash: str,
    tool: str,
    policy_version: str,
    approver_id: Any,
    reason: str,
    approved_at: datetime,
    expires_at: datetime | None,
) -> str:
    """A digest of what an approval says (its consumption and revocation are step moves)."""
    return _digest(
        {
            "step": str(step_id),
            "input_hash": input_hash,
            "tool": tool,
            "policy_version": policy_version,
            "approver": approver_id,
            "reason": reason,
            "approved_at": approved_at.isoformat(),
            "expires_at": expires_at.isoformat() if expires_at else None,
        }
    )


def digest_of_approval(approval: Any) -> str:
    return approval_digest(
        step_id=approval.step_id,
        input_hash=approval.input_hash,
        tool=approval.tool,
        policy_version=approval.policy_version,
        approver_id=approval.approver_id,
        reason=approval.reason,
        approved_at=approval.approved_at,
        expires_at=approval.expires_at,
    )


def attempt_digest(attempt: Any) -> str:
    """A digest of a closed attempt: who made it under which fence, what it sent and got,
    its error and cost. (What a fenced-out worker tried to write later is a note beside it.)"""
    return _digest(
        {
            "step": str(attempt.step_id),
            "number": attempt.number,
            "fence": attempt.fence,
            "worker": attempt.worker,
            "phase": str(attempt.phase),
            "request": attempt.request_evidence,
            "response": attempt.response_evidence,
            "error_class": attempt.error_class,
            "error_message": attempt.error_message,
            "cost": _cost(attempt.cost),
        }
    )


def run_seal(run: Any, head: str) -> str:
    """The HMAC over a run's budgets and the hash of its newest run event ("" for none)."""
    return event_hash(
        {
            "run": str(run.pk),
            "max_calls": run.max_calls,
            "max_cost": _cost(run.max_cost),
            "deadline": run.deadline.isoformat() if run.deadline else None,
            "head": head,
        }
    )


def _cost(value: Decimal | None) -> str | None:
    # Written as it reads back from the column (4 places), whatever was assigned.
    return None if value is None else format(Decimal(value).quantize(COST_PLACES), "f")


def content_digest(content: dict[str, Any]) -> str:
    """SHA-256 of `content`'s canonical JSON (not keyed: what a signed record then names)."""
    return _digest(content)


def _digest(content: dict[str, Any]) -> str:
    return hashlib.sha256(_CANONICAL_WITH_STR.encode(content).encode()).hexdigest()
