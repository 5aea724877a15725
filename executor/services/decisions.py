"""The reviewers' decisions on a step, as one table (STYLE.md "Patterns for what grows").

Each row says in which states a decision applies, which permission it takes, what the
reviewer fills in, which service acts, and what the console says; the console offers what
this table offers and one view carries any of them out. A new decision is one row, its
service and its test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth.models import User
from django.db.models import TextChoices

from executor.ledger.records import Step
from executor.ledger.selectors import ToolInfo
from executor.ledger.states import State
from executor.services.base import AlreadyHandled, Invalid, NotPermitted, ServiceError
from executor.services.reviews import (
    Resolution,
    approval_permission,
    compensation_request,
    deadletter_replay,
    open_compensation,
    own_request_refusal,
    run_again_allowed,
    second_approval_refusal,
    step_approve_outcome,
    step_probe,
    step_reject,
    step_resolve_unknown,
    step_resume,
)

# What each decision carries besides the version the reviewer saw and a reason.
REASON = ("reason",)
EVIDENCE = ("external_id", "evidence", "reason")


@dataclass(frozen=True)
class Decision:
    """One decision a reviewer can take on a step."""

    name: str
    states: frozenset[State]
    title: str
    button: str
    # The permission on the step's workspace, for this step.
    permission: Callable[[Step], str]
    # The service call: (step, user, form data) → what the reviewer is told.
    act: Callable[[Step, User, dict[str, Any]], str]
    fields: tuple[str, ...] = REASON
    tone: str = ""
    help: str = ""
    # Whether it applies to this step (None) or why not (a note the page shows; "" hides it).
    applies: Callable[[Step, ToolInfo], str | None] = field(default=lambda step, tool: None)
    # Why this reviewer may not take it although they hold the permission ("" if they may).
    refuses: Callable[[Step, User], str] = field(default=lambda step, user: "")

    def button_for(self, step: Step) -> str:
        return self.button.format(what="compensation" if step.compensates_id else "call")


def _always(permission: str) -> Callable[[Step], str]:
    return lambda step: permission


def _resolve(resolution: str, notice: str) -> Callable[[Step, User, dict[str, Any]], str]:
    def act(step: Step, user: User, data: dict[str, Any]) -> str:
        step_resolve_unknown(
            step=step,
            user=user,
            version=data["version"],
            resolution=resolution,
            reason=data["reason"],
            external_id=data.get("external_id", ""),
            evidence=data.get("evidence", ""),
        )
        return notice

    return act


def _approve(step: Step, user: User, data: dict[str, Any]) -> str:
    result = step_approve_outcome(
        step=step, user=user, version=data["version"], reason=data["reason"]
    )
    return result.message


def _approve_refuses(step: Step, user: User) -> str:
    """Four eyes: not who asked for the step, and not one reviewer twice where a rule asks
    for two."""
    return own_request_refusal(step, user) or second_approval_refusal(step, user)


def _reject(step: Step, user: User, data: dict[str, Any]) -> str:
    step_reject(step=step, user=user, version=data["version"], reason=data["reason"])
    return "Rejected."


def _probe(step: Step, user: User, data: dict[str, Any]) -> str:
    outcome = step_probe(step=step, user=user, version=data["version"], reason=data["reason"])
    return f"Looked it up again: {outcome}."


def _replay(step: Step, user: User, data: dict[str, Any]) -> str:
    deadletter_replay(step=step, user=user, version=data["version"], reason=data["reason"])
    return "Replayed: the step is pending again."


def _resume(step: Step, user: User, data: dict[str, Any]) -> str:
    resumed = step_resume(step=step, user=user, version=data["version"], reason=data["reason"])
    if resumed.state == State.BLOCKED:
        return "Approved: a rule asks for two reviewers, so the step waits for a second one."
    return "Resumed: the step is pending again."


def _compensate(step: Step, user: User, data: dict[str, Any]) -> str:
    compensation = compensation_request(
        step=step, user=user, version=data["version"], reason=data["reason"]
    )
    return f"Compensation requested: {compensation.key} waits for another reviewer's approval."


def _run_again_applies(step: Step, tool: ToolInfo) -> str | None:
    if run_again_allowed(step):
        return None
    return (
        f"Running it again is not offered: {tool.name} is not safe to repeat and has no "
        "authoritative lookup, so a second call could duplicate the effect."
    )


def _probe_applies(step: Step, tool: ToolInfo) -> str | None:
    return None if tool.has_lookup else ""


def _compensate_applies(step: Step, tool: ToolInfo) -> str | None:
    if not tool.compensation:
        return f"Irreversible: {tool.name} declares no compensation."
    open_request = open_compensation(step)
    if open_request is not None:
        return f"A compensation is already {open_request.state}."
    return None


def _replay_applies(step: Step, tool: ToolInfo) -> str | None:
    # A failed step is replayed only where nothing can have happened: a compensation that
    # failed (its original still stands) or a step whose failure proves no effect.
    if step.state == State.FAILED and (
        step.failure_class == "ambiguous" or not step.compensates_id
    ):
        return ""
    return None


DECISIONS: tuple[Decision, ...] = (
    Decision(
        "resolve-happened",
        frozenset({State.UNKNOWN}),
        "It happened",
        "Mark as completed",
        _always("resolve_unknown"),
        _resolve(Resolution.HAPPENED, "Marked as completed."),
        fields=EVIDENCE,
        help="You found the effect in the other system: record which one (its external id).",
    ),
    Decision(
        "resolve-run-again",
        frozenset({State.UNKNOWN}),
        "It did not happen: run again",
        "Run it again",
        _always("resolve_unknown"),
        _resolve(Resolution.RUN_AGAIN, "Sent to run again."),
        help="Sends the same operation again (same operation id).",
        applies=_run_again_applies,
    ),
    Decision(
        "resolve-give-up",
        frozenset({State.UNKNOWN}),
        "It did not happen: give up",
        "Give up",
        _always("resolve_unknown"),
        _resolve(Resolution.GIVE_UP, "Given up: the step is failed."),
        tone="danger",
        help="The step becomes failed; nothing is sent again.",
    ),
    Decision(
        "probe",
        frozenset({State.UNKNOWN}),
        "Look it up again",
        "Look it up again",
        _always("review_steps"),
        _probe,
        help="Asks the other system now whether this operation happened.",
        applies=_probe_applies,
    ),
    Decision(
        "approve",
        frozenset({State.PLANNED}),
        "Approve",
        "Approve this {what}",
        approval_permission,
        _approve,
        refuses=_approve_refuses,
    ),
    Decision(
        "reject",
        frozenset({State.PLANNED}),
        "Reject",
        "Reject this {what}",
        approval_permission,
        _reject,
        tone="danger",
    ),
    Decision(
        "compensate",
        frozenset({State.COMPLETED}),
        "Request compensation",
        "Request compensation",
        # DESIGN.md §11: requesting one takes approve_compensation, as approving it does.
        _always("approve_compensation"),
        _compensate,
        help="Creates the step that undoes this one; another reviewer approves it.",
        applies=_compensate_applies,
    ),
    Decision(
        "replay",
        frozenset({State.DEAD, State.FAILED}),
        "Replay",
        "Replay it",
        _always("replay_deadletter"),
        _replay,
        help="Sends it again with the same operation id; retries start afresh.",
        applies=_replay_applies,
    ),
    Decision(
        "resume",
        frozenset({State.BLOCKED}),
        "Resume",
        "Resume this step",
        approval_permission,
        _resume,
        help="Re-approves this exact call in your name; every check runs again.",
        refuses=second_approval_refusal,
    ),
)
BY_NAME = {decision.name: decision for decision in DECISIONS}


def offered(step: Step, tool: ToolInfo) -> tuple[list[Decision], list[str]]:
    """The decisions that apply to the step as it is, and notes on those that do not."""
    decisions, notes = [], []
    for decision in DECISIONS:
        if step.state not in decision.states:
            continue
        why_not = decision.applies(step, tool)
        if why_not is None:
            decisions.append(decision)
        elif why_not:
            notes.append(why_not)
    if not decisions and not notes:
        notes.append(f"Nothing to decide while the step is {step.state}.")
    return decisions, notes


# --- many steps, one decision (the inbox's bulk approve and reject) -----------------------


class BulkOutcome(TextChoices):
    """What one step of a bulk decision came to. Only APPROVED and REJECTED are decided."""

    APPROVED = "approved", "approved"
    REJECTED = "rejected", "rejected"
    WAITING = "waiting", "waiting for a second approver"
    REFUSED = "refused", "refused by a rule"
    STALE = "stale", "already decided or changed"
    NOT_PERMITTED = "not_permitted", "not permitted"
    INVALID = "invalid", "not decided"


# The decisions a reviewer may take on many steps at once.
BULK = ("approve", "reject")


@dataclass(frozen=True)
class BulkResult:
    step: Step
    outcome: BulkOutcome
    # What the service said, as it said it (its notice, or why it refused).
    message: str

    @property
    def landed(self) -> bool:
        return self.outcome in (BulkOutcome.APPROVED, BulkOutcome.REJECTED)


def _outcome_after(name: str, state: str) -> BulkOutcome:
    """What the step's state after the service acted says the decision came to: an
    approval that left the step planned waits for another approver; one that ended it
    (rejected, failed, cancelled) was refused by a rule. Never counted as approved."""
    if name == "reject":
        return BulkOutcome.REJECTED if state == State.REJECTED else BulkOutcome.REFUSED
    if state == State.PLANNED:
        return BulkOutcome.WAITING
    if state in (State.REJECTED, State.FAILED, State.CANCELLED):
        return BulkOutcome.REFUSED
    return BulkOutcome.APPROVED


def decide_many(
    *, name: str, steps: list[tuple[Step, int]], user: User, reason: str
) -> list[BulkResult]:
    """Takes decision `name` on each step at the version the reviewer saw, each on its own:
    its own permission, four eyes, rules and version check, in its own transaction. One
    refusal stops nothing else; each step's result is reported as the service gave it."""
    decision = BY_NAME[name]
    results = []
    for step, version in steps:
        data = {"version": version, "reason": reason}
        try:
            notice = decision.act(step, user, data)
        except NotPermitted as error:
            results.append(BulkResult(step, BulkOutcome.NOT_PERMITTED, error.message))
            continue
        except AlreadyHandled as error:
            results.append(BulkResult(step, BulkOutcome.STALE, error.message))
            continue
        except Invalid as error:
            results.append(BulkResult(step, BulkOutcome.INVALID, error.message))
            continue
        except ServiceError as error:
            results.append(BulkResult(step, BulkOutcome.REFUSED, error.message))
            continue
        state = Step.objects.filter(pk=step.pk).values_list("state", flat=True).get()
        results.append(BulkResult(step, _outcome_after(name, state), notice))
    return results
