"""The MCP server's rules, whatever carries them (API.md "For agent frameworks: MCP"): which
tools an agent sees, a call posted as a durable step and waited on a bounded time, and the
answer an agent reads. `executor/mcp_server.py` puts them on the SDK's stdio and HTTP.

Every function here is synchronous and touches the database: the server runs each in a
thread of its own. Answers are redacted with the step's own secrets (executor/redaction.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.urls import reverse
from django.utils import timezone

from executor import api, selectors, services
from executor.models import Agent, Run, RunStatus, Step
from executor.redaction import Redactor, redact
from executor.schemas import storable_json, storable_text
from executor.selectors import ToolInfo
from executor.states import IN_FLIGHT, State
from executor.tools.base import find_tool

# What the common MCP clients accept as a tool's name.
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
STEP_STATUS = "step_status"
RUN_REPORT = "run_report"
# The optional arguments every tool call takes besides the tool's own input.
KEY_ARGUMENT = "key"
RUN_ARGUMENT = "run"
POLL_SECONDS = 0.2
MAX_KEY_LENGTH = 200

NEVER_AGAIN = (
    "Do not call the tool again for this: that could do it twice. Wait, then call "
    "step_status with step_id {step_id}."
)


@dataclass(frozen=True)
class Answer:
    """What a tool call answers: the text a model reads, the structured content, isError."""

    text: str
    structured: dict[str, Any] | None = None
    is_error: bool = False


def refusal(message: str) -> Answer:
    return Answer(text=message, is_error=True)


@dataclass
class Session:
    """One MCP session of one agent: its calls without a `run` argument go into one run,
    created on the first such call (idempotent by `run_key`, so a stateless transport that
    names the same key each time shares the run).
    """

    agent: Agent
    run_key: str
    run_name: str
    base_url: str = ""
    run_id: uuid.UUID | None = field(default=None)

    @classmethod
    def new(cls, agent: Agent, *, base_url: str, transport: str = "stdio") -> Session:
        key = f"mcp-{transport}-{uuid.uuid4().hex}"
        return cls(
            agent=agent, run_key=key, run_name=f"MCP session ({transport})", base_url=base_url
        )

    @classmethod
    def daily(cls, agent: Agent, *, base_url: str) -> Session:
        """Over stateless HTTP there is no session to hold a run: a call without `run` goes
        into the agent's MCP run of the day (UTC)."""
        day = timezone.now().date().isoformat()
        return cls(agent=agent, run_key=f"mcp-http-{day}", run_name=f"MCP {day}", base_url=base_url)

    def current_agent(self) -> Agent | None:
        """The agent again, still active and with the same token (a long stdio session
        must not outlive a deactivation or a rotated token)."""
        return (
            Agent.objects.select_related("workspace", "user")
            .filter(
                pk=self.agent.pk,
                token_hash=self.agent.token_hash,
                is_active=True,
                user__is_active=True,
            )
            .first()
        )

    def step_url(self, step_id: Any) -> str:
        return self.base_url.rstrip("/") + reverse("step", args=[step_id])


# --- names ------------------------------------------------------------------------------


def mcp_name(tool_name: str) -> str:
    """`ticketdesk.create` → `ticketdesk_create`: every character a client may refuse
    becomes `_`; a name too long keeps its start and a hash of the whole."""
    name = re.sub(r"[^a-zA-Z0-9_-]", "_", tool_name)
    if len(name) > 64:
        digest = hashlib.sha256(tool_name.encode()).hexdigest()[:8]
        name = f"{name[:55]}_{digest}"
    return name


def names_for(tools: list[str]) -> dict[str, str]:
    """MCP name → tool name for `tools`; two tools that would share a name (or take one of
    the server's own) get the hash of their full name, so the map goes back one to one."""
    taken = {STEP_STATUS, RUN_REPORT}
    found: dict[str, str] = {}
    for tool in sorted(tools):
        name = mcp_name(tool)
        if name in taken or name in found:
            digest = hashlib.sha256(tool.encode()).hexdigest()[:8]
            name = f"{name[:55]}_{digest}"
        found[name] = tool
    return found


# --- the tools an agent sees --------------------------------------------------------------


@dataclass(frozen=True)
class ToolSpec:
    """One tool as an MCP client lists it."""

    name: str
    description: str
    input_schema: dict[str, Any]


def control_names(schema: dict[str, Any]) -> tuple[str, str]:
    """The names of the `key` and `run` arguments for a tool: a tool whose own input already
    has such a field gets them prefixed instead."""
    own = set((schema.get("properties") or {}).keys())
    key = KEY_ARGUMENT if KEY_ARGUMENT not in own else f"stepward_{KEY_ARGUMENT}"
    run = RUN_ARGUMENT if RUN_ARGUMENT not in own else f"stepward_{RUN_ARGUMENT}"
    return key, run


def with_controls(schema: dict[str, Any]) -> dict[str, Any]:
    """The tool's input schema with the optional `key` and `run` arguments added."""
    schema = dict(schema) if schema.get("type") == "object" else {"type": "object"}
    key, run = control_names(schema)
    schema["properties"] = {
        **(schema.get("properties") or {}),
        key: {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_KEY_LENGTH,
            "description": "Idempotency key within the run: a call with a key already used "
            "answers that step, it never runs again. Give one to every call with an effect.",
        },
        run: {
            "type": "string",
            "description": "A run id to post into (default: this session's run).",
        },
    }
    return schema


def usable_tools(agent: Agent) -> dict[str, ToolInfo]:
    """The tools the agent holds use_tool on, by MCP name (one query)."""
    infos = {
        info.name: info
        for info in selectors.tool_infos(workspace_id=agent.workspace_id, user_id=agent.user_id)
        if info.usable
    }
    return {name: infos[tool] for name, tool in names_for(list(infos)).items()}


def tools_list(session: Session) -> list[ToolSpec]:
    agent = session.current_agent()
    if agent is None:
        return []
    specs = [
        ToolSpec(
            name=name,
            description=(
                f"{info.description or info.name} (Stepward tool `{info.name}`"
                + (", needs a reviewer's approval" if info.needs_approval else "")
                + "). Runs once as a durable step; an answer that is not a result says what "
                "to do instead of calling again."
            ),
            input_schema=with_controls(info.input_schema),
        )
        for name, info in usable_tools(agent).items()
    ]
    specs.append(
        ToolSpec(
            name=STEP_STATUS,
            description="Where a step is now (posted by a call that answered a step id): its "
            "result when completed, else what it waits for. Waits a few seconds for a step "
            "still running.",
            input_schema={
                "type": "object",
                "properties": {"step_id": {"type": "string", "description": "The step's id."}},
                "required": ["step_id"],
            },
        )
    )
    specs.append(
        ToolSpec(
            name=RUN_REPORT,
            description="What a run did: completed (with evidence), uncertain, failed, "
            "compensated and pending steps, and its usage.",
            input_schema={
                "type": "object",
                "properties": {
                    "run": {"type": "string", "description": "A run id (default: this session's)."}
                },
            },
        )
    )
    return specs


# --- calls ----------------------------------------------------------------------------------


def tools_call(
    session: Session,
    name: str,
    arguments: dict[str, Any] | None,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> Answer:
    """Carries out one `tools/call`: never raises for anything the agent sent."""
    agent = session.current_agent()
    if agent is None:
        return refusal("This agent's token is no longer valid (deactivated or rotated).")
    arguments = dict(arguments or {})
    if name == STEP_STATUS:
        return step_status(session, agent, arguments, sleep=sleep)
    if name == RUN_REPORT:
        return run_report(session, agent, arguments)
    info = usable_tools(agent).get(name)
    if info is None:
        return refusal(f"There is no tool {name!r} for this agent (list the tools again).")
    return post_and_wait(session, agent, info, arguments, sleep=sleep)


def post_and_wait(
    session: Session,
    agent: Agent,
    info: ToolInfo,
    arguments: dict[str, Any],
    *,
    sleep: Callable[[float], None],
) -> Answer:
    key_name, run_name = control_names(info.input_schema)
    key = arguments.pop(key_name, None)
    run_id = arguments.pop(run_name, None)
    found = find_tool(info.name)
    redactor = Redactor.for_input(arguments, found.redact if found else ())
    if key is None:
        key = f"mcp-{uuid.uuid4().hex}"
    try:
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_LENGTH:
            raise services.Invalid(f"`{key_name}` must be a string of 1 to 200 characters")
        storable_text(key)
        storable_json(arguments)
        run = session_run(session, agent, run_id)
        step, _ = services.step_post(
            agent=agent, run=run, key=key, tool_name=info.name, input=arguments
        )
    except services.ServiceError as error:
        return refusal(redactor.text(f"Refused: {error.message}"))
    except ValueError as error:
        return refusal(redactor.text(f"Refused: the input {error}"))
    return step_answer(session, wait_settled(agent, step, sleep=sleep))


class NoSuchRun(services.Invalid):
    pass


def session_run(session: Session, agent: Agent, run_id: Any) -> Run:
    """The run named by the call's `run` argument, or the session's (created now if not)."""
    if run_id is not None:
        run = _visible_run(agent, run_id)
        if run is None:
            raise NoSuchRun(f"no such run: {str(run_id)[:80]}")
        return run
    run, _ = services.run_create(agent=agent, name=session.run_name, key=session.run_key)
    session.run_id = run.pk
    return run


def _visible_run(agent: Agent, run_id: Any) -> Run | None:
    pk = _parse_id(run_id)
    return selectors.runs_for_agent(agent=agent).filter(pk=pk).first() if pk else None


def _parse_id(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


def wait_settled(agent: Agent, step: Step, *, sleep: Callable[[float], None]) -> Step:
    """The step once the engine no longer moves it on by itself, or as it is after
    MCP_WAIT_SECONDS. The wait holds one of the agent's long-poll slots (as `?wait=` does);
    with none free, the step is answered as it is."""
    step = _fresh(step.pk)
    seconds = settings.MCP_WAIT_SECONDS
    if step.state not in IN_FLIGHT or seconds <= 0:
        return step
    try:
        with api.long_poll_slot(agent, seconds):
            deadline = time.monotonic() + seconds
            while step.state in IN_FLIGHT and (remaining := deadline - time.monotonic()) > 0:
                sleep(min(POLL_SECONDS, remaining))
                step = _fresh(step.pk)
    except api.Refused:
        pass  # every slot is held: the step as it is now
    return step


def _fresh(step_id: Any) -> Step:
    return Step.objects.select_related("run").get(pk=step_id)


def step_status(
    session: Session, agent: Agent, arguments: dict[str, Any], *, sleep: Callable[[float], None]
) -> Answer:
    pk = _parse_id(arguments.get("step_id", ""))
    step = selectors.steps_for_agent(agent=agent).filter(pk=pk).first() if pk else None
    if step is None:
        # Another workspace's step answers exactly like one that does not exist.
        return refusal("There is no such step for this agent.")
    return step_answer(session, wait_settled(agent, step, sleep=sleep))


def run_report(session: Session, agent: Agent, arguments: dict[str, Any]) -> Answer:
    run_id = arguments.get("run") or session.run_id
    if run_id is None:
        return Answer(text="This session has posted no step yet, so it has no run.")
    run = _visible_run(agent, run_id)
    if run is None:
        return refusal("There is no such run for this agent.")
    report = redact(selectors.run_report(run=run))
    report["run_id"] = str(run.pk)
    return Answer(text=f"Run {run.pk}: {report['summary']}", structured=_jsonable(report))


# --- a step as an answer --------------------------------------------------------------------


def step_answer(session: Session, step: Step) -> Answer:
    """What the agent reads of a step: its result, or a clear text of what it waits for and
    what to do; isError only when it ended without its effect. Redacted throughout."""
    found = find_tool(step.tool_id)
    redactor = Redactor.for_input(step.input, found.redact if found else ())
    url = session.step_url(step.pk)
    facts: dict[str, Any] = {
        "step_id": str(step.pk),
        "run_id": str(step.run_id),
        "key": step.key,
        "tool": step.tool_id,
        "state": step.state,
        "console_url": url,
    }
    text, is_error = _describe(step, url)
    if step.state in (State.COMPLETED, State.COMPENSATED):
        facts["result"] = step.result
        facts["external_id"] = step.external_id
    if step.failure_class:
        facts["failure"] = {"class": step.failure_class, "message": step.failure_message}
    structured = _jsonable(redactor(facts))
    return Answer(text=redactor.text(text), structured=structured, is_error=is_error)


def _describe(step: Step, url: str) -> tuple[str, bool]:
    state = State(step.state)
    where = f"Step {step.pk} ({step.tool_id}, key {step.key!r}); console: {url}."
    again = NEVER_AGAIN.format(step_id=step.pk)
    failure = f"{step.failure_class or 'failed'}: {step.failure_message}".strip()
    if state == State.COMPLETED:
        result = json.dumps(redact(step.result), default=str)
        return f"Completed. Result: {result}\n{where}", False
    if state == State.COMPENSATED:
        return f"It happened and was undone since (compensated). {where}", False
    if state == State.UNKNOWN:
        return (
            "Outcome unknown: the call may or may not have happened, and Stepward will not "
            "guess. A reviewer has it (and the tool's system is asked where it can be). "
            f"{where} {again}",
            False,
        )
    if state == State.BLOCKED:
        return (
            "Blocked: the executor would not run it as things stand (a permission or an "
            f"approval no longer holds); a reviewer has it. {where} {again}",
            False,
        )
    if state == State.PLANNED:
        return (
            f"Awaiting approval: a reviewer must approve this call before it runs. {where} {again}",
            False,
        )
    if state in IN_FLIGHT and step.run.status == RunStatus.PAUSED:
        reason = step.run.pause_reason or "paused"
        return (
            f"Paused: its run is paused ({reason}); it runs when a reviewer resumes the run. "
            f"{where} {again}",
            False,
        )
    if state in IN_FLIGHT:
        return f"Still running ({state}): the executor will finish it. {where} {again}", False
    if state == State.DEAD:
        return (
            f"Failed after every retry ({failure}). A reviewer may replay it. {where}",
            True,
        )
    if state == State.REJECTED:
        return f"Rejected by a reviewer: it did not run. {where}", True
    if state == State.CANCELLED:
        return f"Cancelled: it did not run. {where}", True
    return f"Failed ({failure}). {where}", True


def _jsonable(value: Any) -> dict[str, Any]:
    """A JSON object: what structured content must be (dates and ids as text)."""
    loaded = json.loads(json.dumps(value, default=str))
    return loaded if isinstance(loaded, dict) else {"value": loaded}
