"""Posting steps: one or a batch, idempotent by key, in a fixed number of statements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import IntegrityError
from django.utils import timezone

from executor.common import dispatch
from executor.contract.tool import FailureClass, find_tool, get_tool
from executor.contract.tool import Tool as ToolContract
from executor.ledger import runs, transitions
from executor.ledger.records import (
    Agent,
    Run,
    RunStatus,
    Step,
    call_hash,
)
from executor.ledger.states import DEPENDENCY_DEAD_ENDS, UNFINISHED, State
from executor.policy import authorization
from executor.services.base import Conflict, Invalid, NotPermitted, ServiceError, agent_actor

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
    # Most posts name new keys and depend on nothing: they are first tried as if none of
    # their keys were in the run, without reading its steps. A key already there (the insert
    # collides and changes nothing) or any refusal sends the post down the reading path,
    # which answers exactly as if it had been taken first: an existing step is answered
    # whatever would refuse a new one.
    optimistic = not any(request.depends_on for request in requests)
    for _ in range(POST_RETRIES):
        try:
            return _steps_post_once(
                agent=agent, run=run, requests=requests, batch=batch, read=not optimistic
            )
        except IntegrityError:
            # A key is taken, maybe by a concurrent post: read, and answer its step.
            optimistic = False
        except ServiceError:
            if not optimistic:
                raise
            optimistic = False
    raise Conflict("the run is being posted to concurrently; try again")


# A concurrent post of one key makes the slower one read again; twice is plenty (and one
# more for a post tried without reading first).
POST_RETRIES = 4


def _steps_post_once(
    *, agent: Agent, run: Run, requests: Sequence[StepRequest], batch: bool, read: bool
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
    known: dict[str, Step] = {}
    if read:
        named = {r.key for r in requests} | {k for r in requests for k in r.depends_on}
        # Unordered: the model's order would join the run for nothing.
        known = {
            step.key: step
            for step in Step.objects.filter(run=run, key__in=named).defer("input").order_by()
        }
    grants = authorization.grants(
        users=[agent.user_id], workspaces=[run.workspace_id], tools={r.tool for r in requests}
    )
    may = authorization.Facts(grants=grants)

    steps: list[Step] = []
    # Each new step and its history.
    new: list[tuple[Step, list[transitions.Posted]]] = []
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
        requirement = may.requirement(
            run.workspace_id,
            tool,
            authorization.rule_variables(
                input=request.input, tool=tool, agent_name=agent.name, run=run
            ),
        )
        needs_none = requirement.need == authorization.Need.NONE and not requirement.refused
        version = may.approval_version(run.workspace_id, tool) if needs_none else None
        history = _posted_history(step, known, seen, policy_version=version, actor=actor, now=now)
        if requirement.refused:
            history.append(_refused_by_rule(step, requirement))
        new.append((step, history))
        steps.append(step)
        seen[request.key] = step
    made = {step.pk for step, _ in new}
    created = [step.pk in made for step in steps]
    if not new:
        return steps, created
    with transitions.for_insert_many():
        transitions.insert_many(new, now=now)
        dispatch.execute_many([step.pk for step, _ in new if step.state == State.PENDING])
    if run.status == RunStatus.CLOSED and any(step.state in UNFINISHED for step, _ in new):
        # After the steps' commit: a run the sweeper closes meanwhile is opened again by it.
        runs.reopen(run, actor=actor, reason="a step was posted", now=now)
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
    may: authorization.Facts,
    known: dict[str, Step],
    seen: dict[str, Step],
) -> None:
    """Everything that must hold before a new step is recorded (a ServiceError if not)."""
    if run.status == RunStatus.CANCELLED:
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
    policy_version: str | None,
    actor: str,
    now: datetime,
) -> list[transitions.Posted]:
    """The states a new step passes through as it is recorded, each allowed as a separate
    move would be: posted; approved by the policy (`policy_version`; None: a person must
    approve it); pending once its dependencies are completed, or cancelled if one never will
    be. `insert_many` records them as one Event."""
    history = [transitions.Posted(State.PLANNED, actor, "posted by the agent")]
    if policy_version is None:
        return history
    history.append(
        transitions.Posted(
            State.APPROVED, "policy", POLICY_APPROVES, policy_approved(policy_version)
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


def _refused_by_rule(step: Step, requirement: authorization.Requirement) -> transitions.Posted:
    """A call an approval rule refuses is recorded, and fails at once as policy_denied."""
    reason = requirement.reason or requirement.describe()
    step.failure_class = FailureClass.POLICY_DENIED
    step.failure_message = reason[:2000]
    return transitions.Posted(
        State.FAILED,
        "policy",
        f"refused by an approval rule: {reason}",
        {"rule": requirement.rule.id if requirement.rule else None},
    )


def _same_step_or_conflict(existing: Step, input_hash: str, depends_on: list[str]) -> Step:
    if existing.input_hash == input_hash and list(existing.depends_on) == depends_on:
        return existing
    raise Conflict(
        f"step {existing.key!r} already exists with another call",
        {"step_id": str(existing.pk)},
    )


def policy_approved(version: str) -> dict[str, str]:
    """What the Event that records the policy's approval of a call says: the policy version.

    No Approval row is written for it (issue 25: one for every step, most of them needing no
    person, was a sixth of the ledger). The Event, keyed and chained, is the record; each
    claim decides again that the policy needs no person for this exact call, as it checked a
    policy approval's version before (DESIGN.md §9).
    """
    return {"policy_version": version}


POLICY_APPROVES = "the tool's policy needs no approval"


def step_policy_approval(*, step: Step) -> dict[str, str]:
    """The policy's approval of the step's call as it stands now (what its Event records)."""
    version = approval_rules(step).approval_version(step.run.workspace_id, get_tool(step.tool_id))
    return policy_approved(version)


def approval_rules(step: Step) -> authorization.Facts:
    """The workspace's approval policy for the step's tool (one query)."""
    return authorization.workspace_facts(step.run.workspace_id, [step.tool_id])


def step_requirement(step: Step) -> authorization.Requirement:
    """What the approval rules (or the tool's policy) ask of this step's call now."""
    tool = get_tool(step.tool_id)
    return approval_rules(step).requirement(
        step.run.workspace_id, tool, authorization.call_variables(step, tool)
    )


def step_needs_person(step: Step) -> bool:
    """Whether a person must approve this step's call in its workspace now."""
    return step_requirement(step).need > authorization.Need.NONE
