"""Reviewers' decisions on steps (DESIGN.md §9, §11, §12); which decision applies when is
executor/decisions.py's table."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import TextChoices
from django.utils import timezone

from executor import dispatch, policy, progress, recovery, seals, transitions
from executor.models import (
    Approval,
    Effect,
    Event,
    Idempotency,
    Step,
    call_hash,
)
from executor.services.base import (
    AlreadyHandled,
    Conflict,
    Invalid,
    NotPermitted,
    ServiceError,
    require_perm,
    require_reason,
    user_actor,
)
from executor.services.posting import approval_rules, step_needs_person, step_policy_approval
from executor.states import State
from executor.tools.base import LookupOutcome, get_tool

# --- reviewers' decisions (DESIGN.md §9, §11, §12) ----------------------------------------
#
# Every decision names the step version the reviewer saw. The move is conditional on it,
# so of two reviewers acting on one version exactly one decision lands; the other gets
# AlreadyHandled naming who acted and when.


def already_handled(step: Step, seen_version: int | None = None) -> AlreadyHandled:
    """Names who moved the step first: the event right after the version the reviewer saw
    (the newest one could be a policy's follow-up move, such as approved → pending)."""
    events = step.events.order_by("-seq")
    if seen_version is not None:
        events = step.events.filter(seq__gt=seen_version).order_by("seq")
    latest = events.first()
    if latest is None:
        return AlreadyHandled("this step changed since you loaded it")
    return AlreadyHandled(
        f"Already handled by {latest.actor} at {latest.created_at:%Y-%m-%d %H:%M:%S} UTC "
        f"(now {latest.to_state})",
        {"actor": latest.actor, "at": latest.created_at.isoformat(), "state": latest.to_state},
    )


def _fresh(step: Step, version: int, *states: State) -> Step:
    """The step as the ledger has it now, if it is still the version the reviewer saw."""
    current = Step.objects.select_related("run", "run__workspace", "run__agent").get(pk=step.pk)
    if current.version != version or (states and current.state not in states):
        raise already_handled(current, seen_version=version)
    return current


def _decide(step: Step, target: State, *, user: User, reason: str, **kwargs: Any) -> Step:
    try:
        return transitions.move(step, target, actor=user_actor(user), reason=reason, **kwargs)
    except transitions.StaleStep:
        raise already_handled(step) from None


def _approve(step: Step, *, user: User, reason: str, now: datetime) -> Approval:
    tool = get_tool(step.tool_id)
    Approval.objects.filter(step=step, consumed_at__isnull=True, revoked_at__isnull=True).update(
        revoked_at=now
    )
    return Approval.objects.create(
        step=step,
        input_hash=step.input_hash,
        tool=step.tool_id,
        policy_version=approval_rules(step).approval_version(step.run.workspace_id, tool),
        approver=user,
        reason=reason,
        approved_at=now,
        expires_at=now + timedelta(seconds=settings.EXECUTOR_APPROVAL_MAX_AGE),
    )


approval_permission = policy.approval_permission


def step_approve(*, step: Step, user: User, version: int, reason: str) -> Step:
    """planned → approved (→ pending once dependencies are done), bound to this exact call.

    Four eyes: who requested the step (a reviewer asking for a compensation) may not also
    approve it, unless EXECUTOR_ALLOW_SELF_APPROVAL is on (a one-person team).
    """
    reason = require_reason(reason)
    step = _fresh(step, version, State.PLANNED)
    require_perm(user, approval_permission(step), step.run.workspace)
    refusal = own_request_refusal(step, user)
    if refusal:
        raise NotPermitted(refusal, {"requested_by": user_actor(user)})
    now = timezone.now()
    with transaction.atomic():
        approval = _approve(step, user=user, reason=reason, now=now)
        _decide(step, State.APPROVED, user=user, reason=reason, data=recorded(approval), now=now)
        progress.promote_ready(run_ids=[step.run_id], steps=[step], now=now)
    return step


def own_request_refusal(step: Step, user: User) -> str:
    """Why `user` may not approve `step` they asked for themselves (four eyes), or ""."""
    if settings.EXECUTOR_ALLOW_SELF_APPROVAL or requested_by(step) != user_actor(user):
        return ""
    return (
        "you requested this step yourself: another reviewer must approve it "
        "(EXECUTOR_ALLOW_SELF_APPROVAL=1 allows it for a one-person team)"
    )


def requested_by(step: Step) -> str:
    """Who asked for the step: the actor of its first Event (an agent, or a reviewer who
    requested a compensation)."""
    actor = Event.objects.filter(step=step, seq=1).values_list("actor", flat=True).first()
    return actor or ""


def check_external_id(step: Step, external_id: str) -> None:
    """A person's "it happened" names an external id of the form the tool declares and,
    where the tool can look the operation up, the one its system of record holds."""
    tool = get_tool(step.tool_id)
    if not external_id:
        raise Invalid(
            "say which effect it was: the external id is required",
            {"external_id": ["required"], "expected": tool.external_id_form()},
        )
    if not tool.external_id_fits(external_id):
        raise Invalid(
            f"{external_id!r} is not an external id of {tool.name}: "
            f"expected {tool.external_id_form()}",
            # Under the field, a person reads what it should have been.
            {
                "external_id": [f"expected {tool.external_id_form()}"],
                "expected": tool.external_id_form(),
                "given": external_id,
            },
        )
    if not tool.has_lookup():
        return
    found = recovery.look_up(step)
    if (
        found.outcome == LookupOutcome.FOUND
        and found.external_id
        and (found.external_id != external_id)
    ):
        raise Conflict(
            f"the lookup finds this operation's effect as {found.external_id!r}, not "
            f"{external_id!r}",
            {"found": found.external_id},
        )
    if found.outcome == LookupOutcome.NOT_FOUND and tool.lookup_authoritative:
        raise Conflict(
            "the lookup finds no effect of this operation: it did not happen (run it again "
            "or give up)",
            {"lookup": found.outcome},
        )


def step_reject(*, step: Step, user: User, version: int, reason: str) -> Step:
    reason = require_reason(reason)
    step = _fresh(step, version, State.PLANNED)
    require_perm(user, approval_permission(step), step.run.workspace)
    with transaction.atomic():
        _decide(step, State.REJECTED, user=user, reason=reason)
        progress.promote_ready(run_ids=[step.run_id])  # dependents of a rejected step are cancelled
    return step


class Resolution(TextChoices):
    HAPPENED = "happened", "It happened"
    RUN_AGAIN = "run_again", "It did not happen: run again"
    GIVE_UP = "give_up", "It did not happen: give up"


def run_again_allowed(step: Step) -> bool:
    """May a person send an `unknown` step again? (DESIGN.md §7)

    Where repeating is harmless (pure, read, keyed) or the tool's authoritative lookup can
    be asked. Otherwise a person's "it did not happen" could still be wrong and a second
    submission would duplicate the effect: they may only give up (failed) or confirm it.
    """
    tool = get_tool(step.tool_id)
    return (
        tool.effect in (Effect.PURE, Effect.READ)
        or tool.idempotency == Idempotency.KEY
        or (tool.has_lookup() and tool.lookup_authoritative)
    )


def step_resolve_unknown(
    *,
    step: Step,
    user: User,
    version: int,
    resolution: str,
    reason: str,
    external_id: str = "",
    evidence: str = "",
) -> Step:
    """A person's decision on an `unknown` step, with the evidence they found."""
    reason = require_reason(reason)
    step = _fresh(step, version, State.UNKNOWN)
    require_perm(user, "resolve_unknown", step.run.workspace)
    external_id = external_id.strip()
    if resolution == Resolution.HAPPENED:
        check_external_id(step, external_id)
    now = timezone.now()
    data = {"resolution": resolution, "external_id": external_id, "evidence": evidence[:2000]}
    with transaction.atomic():
        if resolution == Resolution.HAPPENED:
            _decide(
                step,
                State.COMPLETED,
                user=user,
                reason=reason,
                data=data,
                now=now,
                changes={
                    "external_id": external_id[:200],
                    "not_before": None,
                    "failure_class": "",
                    "failure_message": "",
                },
            )
            progress.step_completed(step, now=now)
        elif resolution == Resolution.RUN_AGAIN:
            if not run_again_allowed(step):
                raise Conflict(
                    f"{step.tool_id} is not safe to send again and has no authoritative "
                    "lookup: confirm that it happened, or give up"
                )
            _decide(
                step,
                State.PENDING,
                user=user,
                reason=reason,
                data=data,
                now=now,
                changes={"not_before": now, "failure_class": "", "failure_message": ""},
            )
            dispatch.execute(step.pk)
        elif resolution == Resolution.GIVE_UP:
            _decide(
                step,
                State.FAILED,
                user=user,
                reason=reason,
                data=data,
                now=now,
                changes={
                    "not_before": None,
                    "failure_class": "confirmed_no_effect",
                    "failure_message": reason,
                },
            )
            Approval.objects.filter(step=step, consumed_at__isnull=True).update(consumed_at=now)
        else:
            raise Invalid(f"unknown resolution {resolution!r}", {"resolution": Resolution.values})
    return step


def step_probe(*, step: Step, user: User, version: int, reason: str) -> str:
    """Runs the tool's lookup on an `unknown` step now ("look it up again")."""
    reason = require_reason(reason)
    step = _fresh(step, version, State.UNKNOWN)
    require_perm(user, "review_steps", step.run.workspace)
    if not get_tool(step.tool_id).has_lookup():
        raise Conflict(f"{step.tool_id} has no lookup")
    outcome = recovery.reconcile(step.pk, actor=user_actor(user), note=reason)
    if outcome == recovery.Outcome.SKIPPED:
        raise already_handled(step, seen_version=version)
    return outcome


def recorded(approval: Approval | None) -> dict[str, Any]:
    """What the Event that records a new approval says of it: the chain then covers the
    approval's content (executor/seals.py)."""
    if approval is None:
        return {}
    return {"approval": approval.pk, "approval_digest": seals.digest_of_approval(approval)}


def _replay_approval(step: Step, *, user: User, reason: str, now: datetime) -> dict[str, Any]:
    """A replay is a new execution: it needs an approval of its own, a person's or the
    policy's (recorded by the replay's Event). What that Event says of it."""
    if Approval.objects.filter(
        step=step, consumed_at__isnull=True, revoked_at__isnull=True
    ).exists():
        return {}
    if step.compensates_id or step_needs_person(step):
        require_perm(user, approval_permission(step), step.run.workspace)
        return recorded(_approve(step, user=user, reason=reason, now=now))
    return step_policy_approval(step=step)


def deadletter_replay(*, step: Step, user: User, version: int, reason: str) -> Step:
    """dead (or failed without a possible effect) → pending, same operation_id.

    The retry deadline starts again: a replay is a person's new decision.
    """
    reason = require_reason(reason)
    step = _fresh(step, version, State.DEAD, State.FAILED)
    require_perm(user, "replay_deadletter", step.run.workspace)
    if step.state == State.FAILED and step.failure_class == "ambiguous":
        raise Conflict("this step may have had an effect; it cannot be replayed")
    now = timezone.now()
    with transaction.atomic():
        approved = _replay_approval(step, user=user, reason=reason, now=now)
        _decide(
            step,
            State.PENDING,
            user=user,
            reason=reason,
            now=now,
            changes={
                "not_before": now,
                "first_scheduled_at": now,
                "failure_class": "",
                "failure_message": "",
            },
            data={"replayed_from": step.state, **approved},
        )
        dispatch.execute(step.pk)
    return step


def deadletters_replay(
    *, steps: Iterable[tuple[Step, int]], user: User, reason: str
) -> tuple[list[Step], list[tuple[Step, str]]]:
    """Replays many at once; each independently. Returns (replayed, [(step, why not)])."""
    done, refused = [], []
    for step, version in steps:
        try:
            done.append(deadletter_replay(step=step, user=user, version=version, reason=reason))
        except ServiceError as error:
            refused.append((step, error.message))
    return done, refused


def step_resume(*, step: Step, user: User, version: int, reason: str) -> Step:
    """blocked → pending once the cause is fixed; the claim rechecks everything again.

    Resuming re-approves the exact call in the resuming reviewer's name, because a blocked
    step's old approval may be the very thing that failed.
    """
    reason = require_reason(reason)
    step = _fresh(step, version, State.BLOCKED)
    require_perm(user, approval_permission(step), step.run.workspace)
    now = timezone.now()
    with transaction.atomic():
        approval = _approve(step, user=user, reason=reason, now=now)
        _decide(
            step,
            State.PENDING,
            user=user,
            reason=reason,
            now=now,
            changes={"not_before": now, "failure_message": ""},
            data=recorded(approval),
        )
        dispatch.execute(step.pk)
    return step


def open_compensation(step: Step) -> Step | None:
    """The compensation of `step` that is still under way or done, if any."""
    return (
        step.compensations.exclude(state__in=(State.REJECTED, State.CANCELLED, State.FAILED))
        .order_by("position")
        .first()
    )


def compensation_request(*, step: Step, user: User, version: int, reason: str) -> Step:
    """Creates the step that undoes a completed one; it waits `planned` for approval."""
    reason = require_reason(reason)
    step = _fresh(step, version, State.COMPLETED)
    require_perm(user, "approve_compensation", step.run.workspace)
    tool = get_tool(step.tool_id)
    if not tool.compensation:
        raise Conflict(f"{step.tool_id} is irreversible: it has no compensation")
    open_request = open_compensation(step)
    if open_request is not None:
        raise Conflict(
            f"a compensation is already {open_request.state}", {"step_id": str(open_request.pk)}
        )
    comp_tool = get_tool(tool.compensation)
    comp_input = tool.compensation_input_for(step.input, step.external_id, step.result)
    n = step.compensations.count() + 1
    key = f"{step.key}:compensation" + (f"-{n}" if n > 1 else "")
    now = timezone.now()
    compensation = Step(
        run=step.run,
        key=key[:200],
        tool_id=comp_tool.name,
        input=comp_input,
        input_hash=call_hash(comp_tool.name, comp_input),
        input_summary=f"undo {step.key}: " + comp_tool.summarize(comp_input),
        compensates=step,
    )
    transitions.insert(
        compensation, actor=user_actor(user), reason=f"compensation requested: {reason}", now=now
    )
    return compensation
