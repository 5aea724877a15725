"""Writes for agents, reviewers and operators. Every state change goes through transitions."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import F, TextChoices
from django.utils import timezone
from guardian.shortcuts import assign_perm, remove_perm

from executor import dispatch, policy, progress, recovery, transitions
from executor.models import (
    AGENT_WORKSPACE_PERMISSIONS,
    REVIEWER_PERMISSIONS,
    Agent,
    Approval,
    Effect,
    Event,
    HttpToolSpec,
    Idempotency,
    Run,
    RunEvent,
    RunStatus,
    Step,
    Tool,
    ToolPolicy,
    Workspace,
    call_hash,
    canonical_hash,
)
from executor.states import CANCELLABLE, DEPENDENCY_DEAD_ENDS, State
from executor.tools import http as http_tools
from executor.tools.base import ApprovalRule, LookupOutcome, all_tools, find_tool, get_tool
from executor.tools.base import Tool as ToolContract


class ServiceError(Exception):
    """A refused request; `code` is the API's error code."""

    code = "invalid"

    def __init__(self, message: str, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class NotPermitted(ServiceError):
    code = "forbidden"


class Conflict(ServiceError):
    code = "conflict"


class Invalid(ServiceError):
    code = "invalid_body"


AGENT_NAME = re.compile(r"[A-Za-z0-9._-]{1,60}")


def agent_actor(agent: Agent) -> str:
    return f"agent:{agent.name}"


def user_actor(user: User) -> str:
    return f"user:{user.get_username()}"


# --- tools ------------------------------------------------------------------------------


def tools_sync(*, using: str = "default") -> None:
    """Mirrors the registry into the Tool table, so permissions can be granted per tool."""
    http_tools.refresh(force=True)
    registered = set()
    for tool in all_tools():
        registered.add(tool.name)
        Tool.objects.using(using).update_or_create(
            name=tool.name,
            defaults={
                "effect": tool.effect,
                "idempotency": tool.idempotency,
                "requires_approval": tool.requires_approval,
                "compensation": tool.compensation,
                "has_lookup": tool.has_lookup(),
                "policy_version": tool.policy_version(),
                "registered": True,
            },
        )
    Tool.objects.using(using).exclude(name__in=registered).update(registered=False)


@dataclass
class ToolsLoaded:
    """What `http_tools_load` did (or, checking, would do), by tool name."""

    created: list[str]
    updated: list[str]
    unchanged: list[str]
    removed: list[str]


def http_tools_load(
    *, tables: Sequence[dict[str, Any]], prune: bool = False, check: bool = False
) -> ToolsLoaded:
    """Creates or updates the HTTP tools of a TOML file's [[tool]] tables, all or nothing.

    Every table is checked first (its fields, its hosts against EXECUTOR_HTTP_ALLOWED_HOSTS,
    its schema, its compensation): any problem raises Invalid listing every one, each naming
    the tool and the field, and nothing is written. `prune` removes the HTTP tools the
    file does not name; `check` only says what loading would do. An edited tool gets a new
    policy version, so approvals of its earlier version no longer authorize anything.
    """
    existing = {spec.name: spec for spec in HttpToolSpec.objects.all()}
    in_code = http_tools.python_tool_names()
    names = [t.get("name") for t in tables]
    known = in_code | set(existing) | {n for n in names if isinstance(n, str)}
    problems: list[str] = []
    for table in tables:
        problems += http_tools.spec_errors(table, tools=known)
        name = table.get("name")
        if name in in_code:
            problems.append(f"tool {name}: field 'name': a tool of that name is defined in code")
        if isinstance(name, str) and names.count(name) > 1:
            problems.append(f"tool {name}: field 'name': the file defines it more than once")
    if problems:
        raise Invalid(
            f"{len(problems)} problem(s); nothing was loaded", {"problems": sorted(set(problems))}
        )
    report = ToolsLoaded(created=[], updated=[], unchanged=[], removed=[])
    fresh = {spec.name: spec for spec in map(http_tools.spec_from_table, tables)}
    for name, spec in fresh.items():
        old = existing.get(name)
        if old is None:
            report.created.append(name)
        elif (
            http_tools.tool_class(old).policy_version()
            != http_tools.tool_class(spec).policy_version()
            or old.description != spec.description
        ):
            report.updated.append(name)
        else:
            report.unchanged.append(name)
    if prune:
        report.removed = sorted(set(existing) - set(fresh))
    for listed in (report.created, report.updated, report.unchanged):
        listed.sort()
    if check:
        return report
    with transaction.atomic():
        for name in [*report.created, *report.updated]:
            spec = fresh[name]
            if name in existing:
                spec.pk = existing[name].pk
            spec.save()
        HttpToolSpec.objects.filter(name__in=report.removed).delete()
        tools_sync()
    return report


def tool_policy_set(
    *,
    workspace: Workspace,
    tool: str,
    approval: str,
    destructive: bool = True,
    irreversible: bool = True,
    cost_above: Decimal | None = None,
) -> ToolPolicy | None:
    """Sets whether a person approves each call of `tool` in `workspace` (issue 11);
    `approval = "default"` removes the workspace's policy, so the tool's declaration holds.

    Approvals given under the earlier policy no longer authorize anything (their policy
    version changes). Returns the policy, or None for the default.
    """
    row = Tool.objects.filter(name=tool, registered=True).first()
    if row is None:
        raise Invalid(f"no such tool: {tool}", {"tool": tool})
    if approval == "default":
        ToolPolicy.objects.filter(workspace=workspace, tool=row).delete()
        return None
    if approval not in ApprovalRule.values:
        raise Invalid(
            f"approval must be default or one of {', '.join(ApprovalRule.values)}",
            {"approval": approval},
        )
    if cost_above is not None and cost_above < 0:
        raise Invalid("cost_above must not be negative", {"cost_above": str(cost_above)})
    found, _ = ToolPolicy.objects.update_or_create(
        workspace=workspace,
        tool=row,
        defaults={
            "approval": approval,
            "destructive": destructive,
            "irreversible": irreversible,
            "cost_above": cost_above,
        },
    )
    return found


# --- workspaces, agents and reviewers ----------------------------------------------------


def workspace_get_or_create(*, slug: str, name: str = "") -> Workspace:
    workspace, _ = Workspace.objects.get_or_create(slug=slug, defaults={"name": name or slug})
    return workspace


def agent_create(
    *, workspace: Workspace, name: str, tools: Iterable[str] | None = None
) -> tuple[Agent, str]:
    """Creates an agent with `submit_steps` on its workspace and `use_tool` on `tools`
    (every registered tool when None).

    Returns the agent and its token, which is never stored and never shown again.
    """
    if not AGENT_NAME.fullmatch(name):
        raise Invalid("an agent's name is 1 to 60 letters, digits, '.', '_' or '-'", {"name": name})
    user_model = get_user_model()
    with transaction.atomic():
        tools_sync()
        username = f"agent.{workspace.slug}.{name}"
        if user_model.objects.filter(username=username).exists():
            raise Conflict(f"an agent named {name!r} already exists in {workspace.slug}")
        user = user_model.objects.create_user(username=username)
        user.set_unusable_password()
        user.save(update_fields=["password"])
        agent = Agent(workspace=workspace, name=name, user=user)
        token = agent.set_new_token()
        agent.save()
        for permission in AGENT_WORKSPACE_PERMISSIONS:
            assign_perm(f"executor.{permission}", user, workspace)
        agent_set_tools(agent=agent, tools=tools)
    return agent, token


def agent_set_tools(*, agent: Agent, tools: Iterable[str] | None) -> list[str]:
    """Makes `tools` exactly the tools the agent may use (every registered one when None).

    Returns their names. An unknown name is refused, naming it, and nothing changes.
    """
    rows = Tool.objects.filter(registered=True)
    if tools is not None:
        wanted = set(tools)
        rows = rows.filter(name__in=wanted)
        unknown = sorted(wanted - {row.name for row in rows})
        if unknown:
            raise Invalid(f"no such tool: {', '.join(unknown)}", {"tools": unknown})
    chosen = list(rows)
    user = agent.user
    with transaction.atomic():
        for row in Tool.objects.exclude(pk__in=[t.pk for t in chosen]):
            remove_perm("executor.use_tool", user, row)
        for row in chosen:
            assign_perm("executor.use_tool", user, row)
    return sorted(row.name for row in chosen)


def agent_set_active(*, agent: Agent, active: bool) -> Agent:
    """Deactivating an agent stops its work at the next claim (its steps become blocked)."""
    Agent.objects.filter(pk=agent.pk).update(is_active=active)
    agent.is_active = active
    return agent


def agent_rotate_token(*, agent: Agent) -> str:
    token = agent.set_new_token()
    agent.save(update_fields=["token_hash", "token_prefix"])
    return token


def reviewer_create(*, workspace: Workspace, username: str, password: str | None = None) -> User:
    """A console user with every reviewer permission on `workspace` (created or updated)."""
    user_model = get_user_model()
    if Agent.objects.filter(user__username=username).exists():
        raise Conflict(f"{username} is an agent's account; it cannot be a reviewer")
    with transaction.atomic():
        user, created = user_model.objects.get_or_create(username=username)
        if password:
            user.set_password(password)
            user.save(update_fields=["password"])
        elif created:
            user.set_unusable_password()
            user.save(update_fields=["password"])
        for permission in REVIEWER_PERMISSIONS:
            assign_perm(f"executor.{permission}", user, workspace)
    return user


# --- runs -------------------------------------------------------------------------------


def run_create(
    *,
    agent: Agent,
    name: str,
    key: str | None = None,
    max_calls: int | None = None,
    max_cost: Decimal | None = None,
    deadline_seconds: float | None = None,
) -> tuple[Run, bool]:
    """Creates a run, or returns the agent's existing run with the same `key` (created=False)."""
    if not agent.user.has_perm("executor.submit_steps", agent.workspace):
        raise NotPermitted("this agent may not submit work in its workspace")
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
        locked = Run.objects.select_for_update().get(pk=run.pk)
        if locked.status == RunStatus.CLOSED:
            raise Conflict("the run is closed; there is nothing left to cancel")
        if locked.status != RunStatus.CANCELLED:
            locked.status = RunStatus.CANCELLED
            locked.pause_reason = ""
            locked.version += 1
            locked.save(update_fields=["status", "pause_reason", "version", "updated_at"])
            RunEvent.objects.create(run=locked, action="cancelled", actor=actor, reason=reason)
        for step in Step.objects.filter(run=locked, state__in=CANCELLABLE):
            try:
                transitions.move(
                    step, State.CANCELLED, actor=actor, reason=reason or "run cancelled"
                )
            except transitions.StaleStep:
                # A worker claimed it meanwhile; its claim sees the cancelled run and stops.
                continue
    return locked


# --- steps ------------------------------------------------------------------------------

MAX_BATCH = 500


@dataclass(frozen=True)
class StepRequest:
    """One step an agent asks for (API.md: `{key, tool, input, summary?, depends_on?}`)."""

    key: str
    tool: str
    input: dict[str, Any]
    summary: str | None = None
    depends_on: tuple[str, ...] = ()


def _refused(error: ServiceError, index: int | None) -> ServiceError:
    """Names the batch item an error is about (`details.index`); a single post has none."""
    if index is None:
        return error
    if error.details is None:
        details: dict[str, Any] = {}
    elif isinstance(error.details, dict):
        details = error.details
    else:
        details = {"detail": error.details}
    error.details = {"index": index, **details}
    error.message = f"item {index}: {error.message}"
    error.args = (error.message,)
    return error


def step_post(
    *,
    agent: Agent,
    run: Run,
    key: str,
    tool_name: str,
    input: dict[str, Any],
    summary: str | None = None,
    depends_on: list[str] | None = None,
) -> tuple[Step, bool]:
    """Records a step the agent wants done; returns (step, created). See `steps_post`."""
    request = StepRequest(key, tool_name, input, summary, tuple(depends_on or ()))
    [step], [created] = _steps_post(agent=agent, run=run, requests=[request], batch=False)
    return step, created


def steps_post(
    *, agent: Agent, run: Run, requests: Sequence[StepRequest]
) -> tuple[list[Step], list[bool]]:
    """Records up to MAX_BATCH steps at once, all or nothing; returns them in the request's
    order, and for each whether this post created it.

    Posting is idempotent on `key`: the same key with the same call is the existing step, the
    same key with another call is a Conflict. `depends_on` may name steps already in the run
    or earlier items of the batch. A tool that needs approval leaves its step `planned`; any
    other is approved by policy and is `pending` once its dependencies are completed. The
    first refused item refuses the whole batch, its index in the error's details; nothing is
    written then. A fixed number of statements, whatever the batch's size.
    """
    if not 1 <= len(requests) <= MAX_BATCH:
        raise Invalid(f"a batch holds 1 to {MAX_BATCH} steps", {"count": len(requests)})
    return _steps_post(agent=agent, run=run, requests=requests, batch=True)


def _steps_post(
    *, agent: Agent, run: Run, requests: Sequence[StepRequest], batch: bool
) -> tuple[list[Step], list[bool]]:
    for _ in range(POST_RETRIES):
        try:
            return _steps_post_once(agent=agent, run=run, requests=requests, batch=batch)
        except IntegrityError:
            # A concurrent post of the same key won: read again, and answer its step.
            continue
    raise Conflict("the run is being posted to concurrently; try again")


# A concurrent post of one key makes the slower one read again; twice is plenty.
POST_RETRIES = 3


def _steps_post_once(
    *, agent: Agent, run: Run, requests: Sequence[StepRequest], batch: bool
) -> tuple[list[Step], list[bool]]:
    tools: list[ToolContract] = []
    for index, request in enumerate(requests):
        tool = find_tool(request.tool)
        if tool is None:
            raise _refused(
                Invalid(f"unknown tool {request.tool!r}", {"tool": request.tool}),
                index if batch else None,
            )
        tools.append(tool)
    named = {r.key for r in requests} | {k for r in requests for k in r.depends_on}
    known = {step.key: step for step in Step.objects.filter(run=run, key__in=named).defer("input")}
    grants = policy.grants(
        users=[agent.user_id], workspaces=[run.workspace_id], tools={r.tool for r in requests}
    )
    may = policy.Facts(grants=grants)

    steps: list[Step] = []
    # Each new step, the policy version that approved it (None: a person must), its history.
    new: list[tuple[Step, str | None, list[transitions.Posted]]] = []
    seen: dict[str, Step] = {}
    now = timezone.now()
    actor = agent_actor(agent)
    for index, (request, tool) in enumerate(zip(requests, tools, strict=True)):
        where = index if batch else None
        depends_on = list(request.depends_on)
        input_hash = call_hash(request.tool, request.input)
        if request.key in seen:
            raise _refused(Invalid("the batch names this key twice", {"key": request.key}), where)
        existing = known.get(request.key)
        if existing is not None:
            try:
                step = _same_step_or_conflict(existing, input_hash, depends_on)
            except Conflict as error:
                raise _refused(error, where) from None
            steps.append(step)
            seen[request.key] = step
            continue
        try:
            _check_new_step(agent, run, request, tool, may, known, seen)
        except ServiceError as error:
            raise _refused(error, where) from None
        step = Step(
            run=run,
            key=request.key,
            tool_id=request.tool,
            input=request.input,
            input_hash=input_hash,
            input_summary=summary_of(request, tool),
            depends_on=depends_on,
        )
        needs_person = may.needs_person(run.workspace_id, tool, request.input)
        version = may.approval_version(run.workspace_id, tool)
        history = _posted_history(
            step, known, seen, needs_person=needs_person, version=version, actor=actor, now=now
        )
        new.append((step, None if needs_person else version, history))
        steps.append(step)
        seen[request.key] = step
    made = {step.pk for step, _, _ in new}
    created = [step.pk in made for step in steps]
    if not new:
        return steps, created
    with transaction.atomic():
        transitions.insert_many([(step, history) for step, _, history in new], now=now)
        Approval.objects.bulk_create(
            policy_approval(step=step, version=version, now=now)
            for step, version, _ in new
            if version is not None
        )
        dispatch.execute_many([step.pk for step, _, _ in new if step.state == State.PENDING])
    return steps, created


def summary_of(request: StepRequest, tool: ToolContract) -> str:
    """What reviewers read of a call: the agent's summary or the input, never a secret."""
    if request.summary:
        return tool.redactor(request.input).text(request.summary)[:2000]
    return tool.summarize(request.input)[:2000]


def _check_new_step(
    agent: Agent,
    run: Run,
    request: StepRequest,
    tool: ToolContract,
    may: policy.Facts,
    known: dict[str, Step],
    seen: dict[str, Step],
) -> None:
    """Everything that must hold before a new step is recorded (a ServiceError if not)."""
    if run.status in (RunStatus.CANCELLED, RunStatus.CLOSED):
        raise Conflict(f"run is {run.status}; it takes no new steps")
    errors = tool.validate_input(request.input)
    if errors:
        raise Invalid(f"input does not fit the schema of {request.tool}", {"input": errors})
    depends_on = list(request.depends_on)
    if request.key in depends_on:
        raise Invalid("a step cannot depend on itself", {"depends_on": [request.key]})
    if len(set(depends_on)) != len(depends_on):
        raise Invalid("depends_on repeats a key", {"depends_on": depends_on})
    if not agent.user.is_active or not may.holds(
        agent.user_id, "submit_steps", workspace_id=run.workspace_id
    ):
        raise NotPermitted("this agent may not submit steps in its workspace")
    if not may.registered(request.tool) or not may.holds(
        agent.user_id, "use_tool", tool=request.tool
    ):
        raise NotPermitted(f"this agent may not use the tool {request.tool!r}")
    # After the permissions: what a tool may reach is no business of an agent that may not
    # use it.
    refusals = tool.check_input(request.input)
    if refusals:
        raise Invalid(f"{request.tool} refuses this input: {refusals[0]}", {"input": refusals})
    missing = [k for k in depends_on if k not in known and k not in seen]
    if missing:
        raise Invalid(
            "depends_on names steps not posted to this run (or not earlier in the batch)",
            {"depends_on": missing},
        )


def _posted_history(
    step: Step,
    known: dict[str, Step],
    seen: dict[str, Step],
    *,
    needs_person: bool,
    version: str,
    actor: str,
    now: datetime,
) -> list[transitions.Posted]:
    """The states a new step passes through as it is recorded, as separate moves would:
    posted; approved by the policy (unless a person must approve it); pending once its
    dependencies are completed, or cancelled if one never will be."""
    history = [transitions.Posted(State.PLANNED, actor, "posted by the agent")]
    if needs_person:
        return history
    history.append(
        transitions.Posted(
            State.APPROVED,
            "policy",
            "the tool's policy needs no approval",
            {"policy_version": version},
        )
    )
    states = {k: (known.get(k) or seen[k]).state for k in step.depends_on}
    dead_ends = [k for k in step.depends_on if states[k] in DEPENDENCY_DEAD_ENDS]
    if dead_ends:
        history.append(
            transitions.Posted(
                State.CANCELLED, "policy", f"dependency {', '.join(dead_ends)} will never complete"
            )
        )
    elif all(state == State.COMPLETED for state in states.values()):
        step.not_before = step.first_scheduled_at = now
        history.append(
            transitions.Posted(
                State.PENDING,
                "policy",
                "approved; dependencies completed" if step.depends_on else "approved",
            )
        )
    return history


def _same_step_or_conflict(existing: Step, input_hash: str, depends_on: list[str]) -> Step:
    if existing.input_hash == input_hash and list(existing.depends_on) == depends_on:
        return existing
    raise Conflict(
        f"step {existing.key!r} already exists with another call",
        {"step_id": str(existing.pk)},
    )


def policy_approval(*, step: Step, version: str, now: datetime) -> Approval:
    """The record that the policy (`version`) approved this exact call: no person needed."""
    return Approval(
        step=step,
        input_hash=step.input_hash,
        tool=step.tool_id,
        policy_version=version,
        approver=None,
        reason="the tool's policy needs no approval",
        approved_at=now,
    )


def step_record_policy_approval(*, step: Step, now: datetime) -> Approval:
    version = approval_rules(step).approval_version(step.run.workspace_id, get_tool(step.tool_id))
    approval = policy_approval(step=step, version=version, now=now)
    approval.save(force_insert=True)
    return approval


def approval_rules(step: Step) -> policy.Facts:
    """The workspace's approval policy for the step's tool (one query)."""
    return policy.workspace_facts(step.run.workspace_id, [step.tool_id])


def step_needs_person(step: Step) -> bool:
    """Whether a person must approve this step's call in its workspace now."""
    tool = get_tool(step.tool_id)
    return approval_rules(step).needs_person(step.run.workspace_id, tool, step.input)


# --- reviewers' decisions (DESIGN.md §9, §11, §12) ----------------------------------------
#
# Every decision names the step version the reviewer saw. The move is conditional on it,
# so of two reviewers acting on one version exactly one decision lands; the other gets
# AlreadyHandled naming who acted and when.


class AlreadyHandled(Conflict):
    code = "already_handled"


def require_perm(user: User, permission: str, workspace: Workspace) -> None:
    if not user.is_active or not user.has_perm(f"executor.{permission}", workspace):
        raise NotPermitted(f"you need the {permission} permission on {workspace.slug}")


def require_reason(reason: str) -> str:
    reason = (reason or "").strip()
    if not reason:
        raise Invalid("a decision needs a reason", {"reason": ["required"]})
    return reason[:2000]


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
        _decide(
            step, State.APPROVED, user=user, reason=reason, data={"approval": approval.pk}, now=now
        )
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


def _replay_approval(step: Step, *, user: User, reason: str, now: datetime) -> None:
    """A replay is a new execution: it needs an approval of its own."""
    if Approval.objects.filter(
        step=step, consumed_at__isnull=True, revoked_at__isnull=True
    ).exists():
        return
    if step.compensates_id or step_needs_person(step):
        require_perm(user, approval_permission(step), step.run.workspace)
        _approve(step, user=user, reason=reason, now=now)
    else:
        step_record_policy_approval(step=step, now=now)


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
        _replay_approval(step, user=user, reason=reason, now=now)
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
            data={"replayed_from": step.state},
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
        _approve(step, user=user, reason=reason, now=now)
        _decide(
            step,
            State.PENDING,
            user=user,
            reason=reason,
            now=now,
            changes={"not_before": now, "failure_message": ""},
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
    comp_input = tool.compensation_input(step.external_id, step.result)
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
    now = timezone.now()
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        if locked.version != version:
            raise run_already_handled(locked)
        if locked.status in (RunStatus.CANCELLED, RunStatus.CLOSED):
            raise Conflict(f"the run is {locked.status}")
        before = {
            "max_calls": locked.max_calls,
            "max_cost": str(locked.max_cost),
            "deadline": locked.deadline.isoformat() if locked.deadline else None,
        }
        if add_calls and locked.max_calls is not None:
            locked.max_calls += add_calls
        if add_cost and locked.max_cost is not None:
            locked.max_cost += add_cost
        if extend_deadline_seconds and locked.deadline is not None:
            locked.deadline = max(locked.deadline, now) + timedelta(seconds=extend_deadline_seconds)
        locked.version += 1
        locked.save(update_fields=["max_calls", "max_cost", "deadline", "version", "updated_at"])
        RunEvent.objects.create(
            run=locked,
            action="budget_extended",
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
            from executor import policy

            locked.status = RunStatus.OPEN  # so the check below reads the new budget
            problem = policy.budget_exhaustion(locked, now=now, fresh=False)
            if problem:
                raise Conflict(f"the run cannot resume: {problem}")
            run_resume(run=locked, actor=user_actor(user), reason=reason, now=now)
    return locked


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
    Run.objects.filter(pk=run.pk, status=RunStatus.PAUSED).update(
        status=RunStatus.OPEN, pause_reason="", version=F("version") + 1, updated_at=now
    )
    run.status, run.pause_reason = RunStatus.OPEN, ""
    RunEvent.objects.create(run=run, action="resumed", actor=actor, reason=reason)
    Step.objects.filter(run=run, state=State.PENDING).update(not_before=now)
    dispatch.execute_many(
        list(Step.objects.filter(run=run, state=State.PENDING).values_list("pk", flat=True))
    )
