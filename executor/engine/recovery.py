"""Recovery (DESIGN.md §7): what happens to a step whose worker stopped, and to a step whose
outcome is `unknown`. Both look at the ledger and the external system before acting: missing
a success response never justifies submitting again.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from executor.common import dispatch, logcontext
from executor.contract.tool import FailureClass, Lookup, LookupOutcome, Tool, find_tool, get_tool
from executor.engine import (
    Outcome,
    close_attempt,
    invocation,
    lease_seconds,
    log_fields,
    progress,
    safe_to_repeat,
)
from executor.ledger import transitions
from executor.ledger.records import Attempt, Phase, Step
from executor.ledger.states import State

logger = logging.getLogger(__name__)


def load_step(step_id: Any) -> Step | None:
    step = Step.objects.select_related("run", "run__workspace").filter(pk=step_id).first()
    if step is not None:
        logcontext.add(**log_fields(step))
    return step


def recover_expired(step_id: Any, *, actor: str = "sweeper") -> str:
    with logcontext.bound(step_id=step_id):
        return _recover_expired(step_id, actor=actor)


def _recover_expired(step_id: Any, *, actor: str) -> str:
    """Acts on a step whose lease expired, by the table of DESIGN.md §7.

    Every move here also requires the lease to be expired still (`lease_expired_by`): a
    worker that commits its `submitting` point after we read the attempt has extended its
    lease in that same commit, so our decision, made on an older phase, is refused.
    """
    step = load_step(step_id)
    now = timezone.now()
    if step is None or step.state not in (State.RUNNING, State.VERIFYING):
        return Outcome.SKIPPED
    if step.lease_expires_at is None or step.lease_expires_at > now:
        return Outcome.SKIPPED
    # A tool this process does not know is treated as the least safe kind: no repeat, no
    # lookup. Its step goes to a person rather than being guessed about.
    tool = find_tool(step.tool_id)
    repeatable = tool is not None and safe_to_repeat(tool)
    has_lookup = tool is not None and tool.has_lookup()
    attempt = Attempt.objects.filter(step=step, fence=step.fence).first()
    phase = attempt.phase if attempt else None
    why = f"lease of {step.lease_owner} expired"

    def to(target: State, reason: str, **changes: Any) -> None:
        transitions.move(
            step,
            target,
            actor=actor,
            reason=reason,
            changes=changes,
            now=now,
            lease_expired_by=now,
        )

    def abandon(message: str) -> None:
        if attempt is not None:
            close_attempt(
                attempt, Phase.ABANDONED, error_class="lease_expired", message=message, now=now
            )

    try:
        with transaction.atomic():
            if step.state == State.VERIFYING or phase == Phase.RESPONDED:
                # The response is stored: never submit again, finish the confirmation.
                to(State.COMPLETED, f"{why}; the response was stored, effect confirmed")
                progress.step_completed(step, now=now)
            elif phase != Phase.SUBMITTING:
                to(State.PENDING, f"{why}; nothing was sent", not_before=now)
                abandon(why)
            elif repeatable:
                to(
                    State.PENDING,
                    f"{why} after submission; {step.tool_id} is safe to repeat",
                    not_before=now,
                )
                abandon(f"{why} after submission")
            else:
                to(
                    State.UNKNOWN,
                    f"{why} after submission; the effect may have happened",
                    failure_class=FailureClass.AMBIGUOUS,
                    failure_message="the worker stopped after submitting",
                    not_before=now if has_lookup else None,
                )
                abandon(f"{why} after submission")
    except transitions.StaleStep:
        return Outcome.SKIPPED
    if step.state == State.PENDING:
        dispatch.execute(step.pk)
    elif step.state == State.UNKNOWN and has_lookup:
        return reconcile(step.pk, actor=actor)
    return step.state


def lookups_since_unknown(step: Step) -> int:
    """How many lookups could not tell since the step last became unknown."""
    recent = step.events.order_by("-seq").values_list("from_state", "to_state")
    count = 0
    for source, target in recent[: RECONCILE_TRIES + 1]:
        if not (source == State.UNKNOWN and target == State.UNKNOWN):
            break
        count += 1
    return count


RECONCILE_TRIES = 5
RECONCILE_INTERVAL = 30


def noted(reason: str, note: str) -> str:
    return f"{reason}: {note}" if note else reason


def look_up(step: Step, tool: Tool | None = None) -> Lookup:
    """Asks the tool's system of record whether the step's operation happened (redacted;
    an error is "cannot tell"). The tool must have a lookup."""
    tool = tool or get_tool(step.tool_id)
    redactor = tool.redactor(step.input)
    try:
        # One fence above the last attempt's: a tool that checks fences then refuses a
        # slow request of that attempt arriving after our "not found" (DESIGN.md §7).
        found = tool.lookup(invocation(step, step.fence + 1, step.attempt_count))
    except Exception as error:  # noqa: BLE001 - a failed lookup tells nothing
        why = redactor.text(str(error))[:500]
        logger.warning("lookup of %s failed: %s", step.pk, why)
        found = Lookup(LookupOutcome.CANNOT_TELL, evidence={"error": why})
    found.result = redactor(found.result)
    found.evidence = redactor(found.evidence)
    return found


def reconcile(step_id: Any, *, actor: str = "sweeper", note: str = "") -> str:
    with logcontext.bound(step_id=step_id):
        return _reconcile(step_id, actor=actor, note=note)


def _reconcile(step_id: Any, *, actor: str, note: str) -> str:
    """Asks the tool whether an `unknown` step's operation happened (DESIGN.md §7).

    found → verifying → completed; not_found from an authoritative lookup → pending with
    the same operation_id; cannot_tell → stays unknown, tried again a few times, then left
    to a person.
    """
    step = load_step(step_id)
    if step is None or step.state != State.UNKNOWN:
        return Outcome.SKIPPED
    tool = find_tool(step.tool_id)
    if tool is None or not tool.has_lookup():
        # Nothing this process can ask: stop scheduling lookups; a person has it.
        Step.objects.filter(pk=step.pk, version=step.version).update(not_before=None)
        return Outcome.SKIPPED
    found = look_up(step, tool)
    now = timezone.now()
    try:
        with transaction.atomic():
            if found.outcome == LookupOutcome.FOUND:
                transitions.move(
                    step,
                    State.VERIFYING,
                    actor=actor,
                    reason=noted("lookup found the operation", note),
                    changes={
                        "external_id": found.external_id[:200],
                        "result": found.result,
                        "lease_owner": actor,
                        "lease_expires_at": now + timedelta(seconds=lease_seconds()),
                        "not_before": None,
                    },
                    data={"lookup": found.outcome, **found.evidence},
                    now=now,
                )
                transitions.move(
                    step,
                    State.COMPLETED,
                    actor=actor,
                    reason=noted("effect confirmed by lookup", note),
                    now=now,
                )
                progress.step_completed(step, now=now)
            elif found.outcome == LookupOutcome.NOT_FOUND and tool.lookup_authoritative:
                transitions.move(
                    step,
                    State.PENDING,
                    actor=actor,
                    reason=noted(
                        "the authoritative lookup found no effect: run again, same operation", note
                    ),
                    changes={"not_before": now, "failure_class": "", "failure_message": ""},
                    data={"lookup": found.outcome, **found.evidence},
                    now=now,
                )
            else:
                tries = lookups_since_unknown(step) + 1
                give_up = tries >= RECONCILE_TRIES
                transitions.move(
                    step,
                    State.UNKNOWN,
                    actor=actor,
                    reason=noted(
                        f"lookup could not tell ({tries} of {RECONCILE_TRIES}); "
                        + ("a reviewer has it" if give_up else "will ask again"),
                        note,
                    ),
                    changes={
                        "not_before": None
                        if give_up
                        else now + timedelta(seconds=RECONCILE_INTERVAL * tries)
                    },
                    data={"lookup": found.outcome, **found.evidence},
                    now=now,
                )
    except transitions.StaleStep:
        return Outcome.SKIPPED
    if step.state == State.PENDING:
        dispatch.execute(step.pk)
    return step.state
