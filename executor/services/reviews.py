"""Reviewers' decisions on steps (DESIGN.md §9, §11, §12); which decision applies when is
executor/services/decisions.py's table."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import TextChoices
from django.utils import timezone

from executor.common import dispatch
from executor.contract.tool import LookupOutcome, get_tool
from executor.engine import progress, recovery
from executor.ledger import runs, seals, transitions
from executor.ledger.records import (
    Approval,
    Effect,
    Event,
    Idempotency,
    RunStatus,
    Signoff,
    Step,
    call_hash,
)
from executor.ledger.states import State
from executor.policy import authorization
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
from executor.services.posting import (
    approval_rules,
    step_needs_person,
    step_policy_approval,
    step_requirement,
)

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


def _approve(
    step: Step, *, user: User, reason: str, now: datetime, version: str | None = None
) -> Approval:
    tool = get_tool(step.tool_id)
    Approval.objects.filter(step=step, consumed_at__isnull=True, revoked_at__isnull=True).update(
        revoked_at=now
    )
    return Approval.objects.create(
        step=step,
        input_hash=step.input_hash,
        tool=step.tool_id,
        policy_version=version
        or approval_rules(step).approval_version(step.run.workspace_id, tool),
        approver=user,
        reason=reason,
        approved_at=now,
        expires_at=now + timedelta(seconds=settings.EXECUTOR_APPROVAL_MAX_AGE),
    )


approval_permission = authorization.approval_permission


class ApprovalOutcome(TextChoices):
    """What a reviewer's approval of one step came to (each step on its own, also in bulk)."""

    APPROVED = "approved", "approved"
    WAITING = "waiting", "waiting for a second approver"
    REFUSED = "refused", "refused"


@dataclass(frozen=True)
class ApprovalResult:
    """One step's outcome of an approval: what it came to, a sentence that says so, who has
    approved it under the current rules and how many more reviewers it still needs."""

    step: Step
    outcome: ApprovalOutcome
    message: str
    approvers: tuple[str, ...] = ()
    still_needed: int = 0
    code: str = ""


def _valid_signoffs(step: Step, version: str, now: datetime) -> list[Signoff]:
    """Signoffs of this exact call under the current policy version, not yet used, recent,
    one per reviewer (the earliest), by reviewers who still hold the permission."""
    max_age = timedelta(seconds=settings.EXECUTOR_APPROVAL_MAX_AGE)
    permission = approval_permission(step)
    seen: dict[int, Signoff] = {}
    for signoff in Signoff.objects.select_related("approver").filter(
        step=step,
        approval__isnull=True,
        input_hash=step.input_hash,
        policy_version=version,
        signed_at__gte=now - max_age,
    ):
        approver = signoff.approver
        if approver.pk in seen or not approver.is_active:
            continue
        if not approver.has_perm(f"executor.{permission}", step.run.workspace):
            continue
        seen[approver.pk] = signoff
    return list(seen.values())


def _sign_off(
    step: Step, *, user: User, version: int, policy_version: str, reason: str, now: datetime
) -> list[Signoff]:
    """Records `user`'s approval of a call that a rule gives to two reviewers; returns the
    valid signoffs, this one last. Taken under the step's row lock, so two reviewers signing
    at once are counted in turn: the second sees the first."""
    if Step.objects.select_for_update().filter(pk=step.pk, version=version).first() is None:
        raise already_handled(step, seen_version=version)
    signoffs = _valid_signoffs(step, policy_version, now)
    if any(signoff.approver_id == user.pk for signoff in signoffs):
        raise NotPermitted(
            "you have already approved this step: a rule asks for a second, different reviewer",
            {"approvers": [s.approver.get_username() for s in signoffs]},
        )
    signoffs.append(
        Signoff.objects.create(
            step=step,
            approver=user,
            input_hash=step.input_hash,
            policy_version=policy_version,
            reason=reason,
            signed_at=now,
        )
    )
    return signoffs


def step_approval_status(step: Step) -> dict[str, Any]:
    """Who has approved the step toward what its rule asks, and how many more it needs
    (the step page's "approved by … · still needed"). `need` is 0 when no person is needed."""
    if step.state not in (State.PLANNED, State.BLOCKED):
        return {"need": 0, "approvers": [], "still_needed": 0, "rule": ""}
    requirement = step_requirement(step)
    tool = get_tool(step.tool_id)
    version = approval_rules(step).approval_version(step.run.workspace_id, tool)
    approvers = [
        signoff.approver.get_username()
        for signoff in _valid_signoffs(step, version, timezone.now())
    ]
    need = 0 if requirement.refused else int(requirement.need)
    return {
        "need": need,
        "approvers": approvers if need == 2 else [],
        "still_needed": max(0, need - len(approvers)) if need == 2 else need,
        "rule": requirement.describe() if requirement.rule is not None else "",
        "refused": requirement.refused,
    }


def second_approval_refusal(step: Step, user: User) -> str:
    """Why `user` may not approve `step` again ("" if they may): a rule asks for two
    different reviewers and they are already one of them."""
    if step.state not in (State.PLANNED, State.BLOCKED):
        return ""
    if not Signoff.objects.filter(step=step, approver=user, approval__isnull=True).exists():
        return ""
    if step_requirement(step).need != authorization.Need.TWO:
        return ""
    tool = get_tool(step.tool_id)
    version = approval_rules(step).approval_version(step.run.workspace_id, tool)
    if any(s.approver_id == user.pk for s in _valid_signoffs(step, version, timezone.now())):
        return "you have already approved this step: a second, different reviewer must approve it"
    return ""


def step_approve(*, step: Step, user: User, version: int, reason: str) -> Step:
    """A reviewer's approval; see `step_approve_outcome`. Raises when refused."""
    return step_approve_outcome(step=step, user=user, version=version, reason=reason).step


def step_approve_outcome(*, step: Step, user: User, version: int, reason: str) -> ApprovalResult:
    """planned → approved (→ pending once dependencies are done), bound to this exact call;
    or, where an approval rule asks for two reviewers and this is the first, the approval is
    recorded and the step waits for a second, different reviewer (ApprovalOutcome.WAITING).

    Four eyes: who requested the step (a reviewer asking for a compensation) may not also
    approve it, unless EXECUTOR_ALLOW_SELF_APPROVAL is on (a one-person team); nor may one
    reviewer be both of two. A call the rules now refuse cannot be approved. A refusal
    raises its ServiceError; `step_approval_try` answers it as an outcome instead.
    """
    reason = require_reason(reason)
    step = _fresh(step, version, State.PLANNED)
    require_perm(user, approval_permission(step), step.run.workspace)
    refusal = own_request_refusal(step, user)
    if refusal:
        raise NotPermitted(refusal, {"requested_by": user_actor(user)})
    requirement = step_requirement(step)
    if requirement.refused:
        raise NotPermitted(
            f"an approval rule refuses this call: {requirement.reason or requirement.describe()}",
            {"rule": requirement.rule.id if requirement.rule else None},
        )
    now = timezone.now()
    tool = get_tool(step.tool_id)
    policy_version = approval_rules(step).approval_version(step.run.workspace_id, tool)
    with transaction.atomic():
        signoffs: list[Signoff] = []
        if requirement.need == authorization.Need.TWO:
            signoffs = _sign_off(
                step,
                user=user,
                version=version,
                policy_version=policy_version,
                reason=reason,
                now=now,
            )
            names = tuple(s.approver.get_username() for s in signoffs)
            if len(signoffs) < 2:
                return ApprovalResult(
                    step,
                    ApprovalOutcome.WAITING,
                    f"Approved by {', '.join(names)}: a rule asks for two reviewers, so the "
                    "step waits for a second, different approver.",
                    approvers=names,
                    still_needed=2 - len(signoffs),
                )
        approval = _approve(step, user=user, reason=reason, now=now, version=policy_version)
        data = recorded(approval)
        if signoffs:
            Signoff.objects.filter(pk__in=[s.pk for s in signoffs]).update(approval=approval)
            data["approvers"] = [user_actor(s.approver) for s in signoffs]
        _decide(step, State.APPROVED, user=user, reason=reason, data=data, now=now)
        progress.promote_ready(run_ids=[step.run_id], steps=[step], now=now)
    if not signoffs:
        return ApprovalResult(
            step, ApprovalOutcome.APPROVED, "Approved.", approvers=(user.get_username(),)
        )
    names = tuple(s.approver.get_username() for s in signoffs)
    return ApprovalResult(
        step,
        ApprovalOutcome.APPROVED,
        f"Approved by {' and '.join(names)}: both approvals are given.",
        approvers=names,
    )


def steps_approve(
    *, steps: Iterable[tuple[Step, int]], user: User, reason: str
) -> list[ApprovalResult]:
    """Approves many steps with one reason, each on its own (its version, the permission,
    four eyes, the rules): one outcome per step, in order, none raised."""
    return [
        step_approval_try(step=step, user=user, version=version, reason=reason)
        for step, version in steps
    ]


def step_approval_try(*, step: Step, user: User, version: int, reason: str) -> ApprovalResult:
    """`step_approve_outcome` for callers that report each step of many (bulk decisions):
    a refusal is an outcome (REFUSED, with the reason and the error's code), not an error."""
    try:
        return step_approve_outcome(step=step, user=user, version=version, reason=reason)
    except ServiceError as error:
        return ApprovalResult(step, ApprovalOutcome.REFUSED, error.message, code=error.code)


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
    approval's content (executor/ledger/seals.py)."""
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
        _reopen_run(step, actor=user_actor(user), reason="a step was replayed", now=now)
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
    requirement = step_requirement(step)
    if requirement.refused:
        raise NotPermitted(
            f"an approval rule refuses this call: {requirement.reason or requirement.describe()}"
        )
    now = timezone.now()
    tool = get_tool(step.tool_id)
    policy_version = approval_rules(step).approval_version(step.run.workspace_id, tool)
    with transaction.atomic():
        signoffs: list[Signoff] = []
        if requirement.need == authorization.Need.TWO:
            # As for a planned step: two different reviewers, each recorded; the first waits.
            refusal = own_request_refusal(step, user)
            if refusal:
                raise NotPermitted(refusal)
            signoffs = _sign_off(
                step,
                user=user,
                version=version,
                policy_version=policy_version,
                reason=reason,
                now=now,
            )
            if len(signoffs) < 2:
                return step
        approval = _approve(step, user=user, reason=reason, now=now, version=policy_version)
        if signoffs:
            Signoff.objects.filter(pk__in=[s.pk for s in signoffs]).update(approval=approval)
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
    actor = user_actor(user)
    transitions.insert(
        compensation, actor=actor, reason=f"compensation requested: {reason}", now=now
    )
    _reopen_run(step, actor=actor, reason="a compensation was requested", now=now)
    return compensation


def _reopen_run(step: Step, *, actor: str, reason: str, now: datetime) -> None:
    """A person gave a closed run work again (a replay, a compensation): it is opened now,
    not at the sweeper's next look. `reopen` checks the status again in its UPDATE."""
    if step.run.status == RunStatus.CLOSED:
        runs.reopen(step.run, actor=actor, reason=reason, now=now)
