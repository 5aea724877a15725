"""Runs: created by agents and cancelled; budgets raised and runs resumed by reviewers.
Status moves go through executor/ledger/runs.py."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from decimal import Decimal

from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.utils import timezone

from executor.common import dispatch
from executor.ledger import runs, transitions
from executor.ledger.records import (
    Agent,
    Run,
    RunEvent,
    RunStatus,
    Step,
    canonical_hash,
)
from executor.ledger.seals import run_seal
from executor.ledger.states import CANCELLABLE, State
from executor.policy import authorization
from executor.services.base import (
    AlreadyHandled,
    Conflict,
    Invalid,
    NotPermitted,
    agent_actor,
    require_perm,
    require_reason,
    user_actor,
)

# The keys of the runs the MCP server makes for each agent (executor/surfaces/mcp.py):
# `stepward-mcp`, then `stepward-mcp-2`… after a person cancels one. A run an agent creates
# may not take one, or it could stand in for (or block) that agent's MCP run.
MCP_RUN_KEY = "stepward-mcp"
MCP_RUN_KEYS = re.compile(rf"^{MCP_RUN_KEY}(-[0-9]+)?$")


def run_create(
    *,
    agent: Agent,
    name: str,
    key: str | None = None,
    max_calls: int | None = None,
    max_cost: Decimal | None = None,
    deadline_seconds: float | None = None,
    mcp: bool = False,
) -> tuple[Run, bool]:
    """Creates a run, or returns the agent's existing run with the same `key` (created=False).
    Only the MCP server (`mcp=True`) makes runs with a key of its own (MCP_RUN_KEY…)."""
    if not agent.user.has_perm("executor.submit_steps", agent.workspace):
        raise NotPermitted("this agent may not submit work in its workspace")
    if key is not None and MCP_RUN_KEYS.fullmatch(key) and not mcp:
        raise Invalid(
            f"run key {key!r} is reserved for the agent's MCP runs ({MCP_RUN_KEY!r}, "
            f"{MCP_RUN_KEY + '-2'!r}, …); choose another key"
        )
    request_hash = canonical_hash(
        {
            "name": name,
            "max_calls": max_calls,
            "max_cost": str(max_cost) if max_cost is not None else None,
            "deadline_seconds": deadline_seconds,
        }
    )
    if key is not None:
        existing = Run.objects.filter(agent=agent, key=key).first()
        if existing is not None:
            return _same_run_or_conflict(existing, request_hash), False
    now = timezone.now()
    run = Run(
        workspace_id=agent.workspace_id,
        agent=agent,
        name=name,
        key=key,
        request_hash=request_hash,
        max_calls=max_calls,
        max_cost=max_cost,
        deadline=now + timedelta(seconds=deadline_seconds) if deadline_seconds else None,
    )
    # Sealed to its budgets before it is written (DESIGN.md §15).
    run.seal = run_seal(run, "")
    try:
        with transaction.atomic():
            run.save(force_insert=True)
    except IntegrityError:
        # A concurrent request with the same key won the race: answer with its run.
        existing = Run.objects.filter(agent=agent, key=key).first()
        if existing is None:
            raise
        return _same_run_or_conflict(existing, request_hash), False
    return run, True


def _same_run_or_conflict(existing: Run, request_hash: str) -> Run:
    # A budget a reviewer extended since does not matter: the request is what is compared.
    if existing.request_hash and existing.request_hash != request_hash:
        raise Conflict(
            f"run key {existing.key!r} was already used with another name or budget",
            {"run_id": str(existing.pk)},
        )
    return existing


def run_cancel(*, run: Run, actor: Agent | str, reason: str = "") -> Run:
    """Cancels the run: nothing more starts; steps already submitted finish their attempt.

    An agent needs submit_steps on the run's workspace (NotPermitted otherwise), as it does
    to post: with it, it may cancel any run of its workspace, as it may post to any (the
    workspace is the unit of permission). A string actor (an operator's command, a drill,
    a caller that has checked a person's permission itself) is taken as is.
    """
    if isinstance(actor, Agent):
        agent = actor
        if not (
            agent.is_active
            and agent.user.is_active
            and agent.workspace_id == run.workspace_id
            and agent.user.has_perm("executor.submit_steps", agent.workspace)
        ):
            raise NotPermitted("this agent may not cancel runs in its workspace")
        actor = agent_actor(agent)
    with transaction.atomic():
        # FOR NO KEY UPDATE: a run's key never changes, and a stronger lock would hold up
        # every worker commit that inserts an Event of this run (its foreign-key check) while
        # this one waits on those workers' steps.
        locked = Run.objects.select_for_update(no_key=True).get(pk=run.pk)
        runs.cancel(locked, actor=actor, reason=reason)
        for step in Step.objects.filter(run=locked, state__in=CANCELLABLE):
            try:
                transitions.move(
                    step, State.CANCELLED, actor=actor, reason=reason or "run cancelled"
                )
            except transitions.StaleStep:
                # A worker claimed it meanwhile; its claim sees the cancelled run and stops.
                continue
    return locked


def run_extend_budget(
    *,
    run: Run,
    user: User,
    version: int,
    reason: str,
    add_calls: int = 0,
    add_cost: Decimal | None = None,
    extend_deadline_seconds: float = 0,
    resume: bool = True,
) -> Run:
    """Raises a run's budget and, when asked and the budget now suffices, resumes it."""
    reason = require_reason(reason)
    require_perm(user, "extend_budget", run.workspace)
    if add_calls < 0 or (add_cost is not None and add_cost < 0) or extend_deadline_seconds < 0:
        raise Invalid("a budget can only be extended")
    if extend_deadline_seconds > MAX_DEADLINE_EXTENSION.total_seconds():
        raise Invalid(
            f"a deadline can be extended by at most {MAX_DEADLINE_EXTENSION.days} days at a time"
        )
    now = timezone.now()
    with transaction.atomic():
        locked = Run.objects.select_for_update(no_key=True).get(pk=run.pk)
        if locked.version != version:
            raise run_already_handled(locked)
        if locked.status == RunStatus.CANCELLED:
            raise Conflict(f"the run is {locked.status}")
        before = {
            "max_calls": locked.max_calls,
            "max_cost": str(locked.max_cost),
            "deadline": locked.deadline.isoformat() if locked.deadline else None,
        }
        if add_calls and locked.max_calls is not None:
            if locked.max_calls + add_calls > MAX_CALLS:
                room = MAX_CALLS - locked.max_calls
                raise Invalid(
                    f"a run's call budget can be at most {MAX_CALLS:,}: it is "
                    f"{locked.max_calls:,}, so at most {room:,} can be added"
                )
            locked.max_calls += add_calls
        if add_cost and locked.max_cost is not None:
            if locked.max_cost + add_cost > MAX_COST:
                raise Invalid(
                    f"a run's cost budget can be at most {MAX_COST}: it is {locked.max_cost}, "
                    f"so at most {MAX_COST - locked.max_cost} can be added"
                )
            locked.max_cost += add_cost
        if extend_deadline_seconds and locked.deadline is not None:
            locked.deadline = max(locked.deadline, now) + timedelta(seconds=extend_deadline_seconds)
        locked.version += 1
        locked.save(update_fields=["max_calls", "max_cost", "deadline", "version", "updated_at"])
        runs.budget_extended(
            locked,
            actor=user_actor(user),
            reason=reason,
            data={
                "before": before,
                "add_calls": add_calls,
                "add_cost": str(add_cost or 0),
                "extend_deadline_seconds": extend_deadline_seconds,
            },
        )
        if resume and locked.status == RunStatus.PAUSED:
            problem = authorization.budget_shortfall(locked, now=now)
            if problem:
                raise Conflict(f"the run cannot resume: {problem}")
            run_resume(run=locked, actor=user_actor(user), reason=reason, now=now)
    return locked


# What the run's columns hold (a PositiveIntegerField, a DecimalField of 14 digits, 4 after
# the point), and how far one extension may move a deadline.
MAX_CALLS = 2_147_483_647
MAX_COST = Decimal("9999999999.9999")
MAX_DEADLINE_EXTENSION = timedelta(days=366)


def run_already_handled(run: Run) -> AlreadyHandled:
    latest = RunEvent.objects.filter(run=run).order_by("-created_at", "-pk").first()
    if latest is None:
        return AlreadyHandled("this run changed since you loaded it")
    return AlreadyHandled(
        f"Already handled by {latest.actor} at {latest.created_at:%Y-%m-%d %H:%M:%S} UTC "
        f"({latest.action.replace('_', ' ')}; the run is now {run.status})",
        {"actor": latest.actor, "at": latest.created_at.isoformat(), "status": run.status},
    )


def run_resume(*, run: Run, actor: str, reason: str, now: datetime | None = None) -> None:
    """paused → open, and every due step of the run is dispatched again."""
    now = now or timezone.now()
    if not runs.resume(run, actor=actor, reason=reason, now=now):
        return
    Step.objects.filter(run=run, state=State.PENDING).update(not_before=now)
    dispatch.execute_many(
        list(Step.objects.filter(run=run, state=State.PENDING).values_list("pk", flat=True))
    )
