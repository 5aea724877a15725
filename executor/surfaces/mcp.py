"""The MCP server's rules, whatever carries them (API.md "For agent frameworks: MCP"): which
tools an agent sees, a call posted as a durable step and waited on a bounded time, and the
answer an agent reads. `executor/surfaces/mcp_server.py` puts them on the SDK's stdio and HTTP.

A key is one effect whatever the client does: every call of an agent without `run` goes into
that agent's MCP run (the same for every stdio process, every HTTP request, every day; after
a person cancels it, a new one, whose keys are checked against the earlier runs' too), so a
`key` names the same step forever; a write without one gets a key derived from the tool
and its arguments within MCP_DEDUP_SECONDS, so a framework's blind retry is the same step (a
read without one is a new step each time: repeating it is harmless, its answer may change).

Every answer is one JSON object (`Answer.structured`, with a plain-language `message`), sent
both as structured content and as the text part, so a framework that keeps only one of them
loses nothing. Every function here is synchronous and touches the database: the server runs
each in a thread of its own. Answers are redacted with the step's own secrets.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.urls import reverse
from django.utils import timezone

from executor.common.redaction import Redactor, redact
from executor.contract.tool import Effect, find_tool
from executor.ledger import selectors
from executor.ledger.records import Agent, Run, RunStatus, Step, call_hash
from executor.ledger.selectors import ToolInfo
from executor.ledger.states import IN_FLIGHT, REPORT_SECTIONS, State
from executor.services.base import Conflict, Invalid, ServiceError
from executor.services.posting import step_post
from executor.services.runs import MCP_RUN_KEY, MCP_RUN_KEYS, run_create
from executor.surfaces import api
from executor.surfaces.schemas import storable_json, storable_text

# What the common MCP clients accept as a tool's name.
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
STEP_STATUS = "step_status"
RUN_REPORT = "run_report"
# The optional arguments every tool call takes besides the tool's own input.
KEY_ARGUMENT = "key"
RUN_ARGUMENT = "run"
POLL_SECONDS = 0.2
MAX_KEY_LENGTH = 200
# The most steps of each section a run_report answer lists (the latest ones).
REPORT_ENTRIES = 50

# Every call of an agent that names no run goes into this run of that agent's (API.md): one
# per agent, made race-free by the unique (agent, key) of runs; the key is reserved (an
# agent's own runs may not take it). After a person cancels it: `stepward-mcp-2`, …
MCP_RUN_NAME = "MCP calls"
DERIVED_KEY_PREFIX = "mcp-auto-"

NEVER_AGAIN = (
    "Do not call the tool again for this: that could do it twice. Wait, then call "
    "step_status with step_id {step_id}."
)


@dataclass(frozen=True)
class Answer:
    """What a tool call answers: one JSON object (always with a `message` a model can act
    on), sent as structured content and as the text part; isError when nothing happened."""

    structured: dict[str, Any]
    is_error: bool = False

    @property
    def text(self) -> str:
        return json.dumps(self.structured, ensure_ascii=False)

    @property
    def message(self) -> str:
        return str(self.structured.get("message", ""))


def refusal(code: str, message: str) -> Answer:
    """A call that was refused: nothing was posted."""
    return Answer(structured={"error": code, "message": message}, is_error=True)


@dataclass
class Session:
    """The agent an MCP connection (a stdio process, or one HTTP request) serves, and where
    its answers link to. It holds no run: the agent's MCP run is found by its key."""

    agent: Agent
    base_url: str = ""

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
    # MCP tool annotations (hints a client may use, e.g. to run read-only tools unasked).
    read_only: bool = False
    destructive: bool = False


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
            "description": "Idempotency key: every call of this agent with this key is the "
            "same step, from any session, forever; it never runs twice. Give one to every "
            "call with an effect. Without one, the same write again within a few minutes is "
            "taken for a retry of the first.",
        },
        run: {
            "type": "string",
            "description": "A run id to post into (default: this agent's MCP run; a key is "
            "then scoped to that run).",
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
            read_only=info.effect in (Effect.PURE, Effect.READ),
            destructive=info.effect == Effect.DESTRUCTIVE,
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
            read_only=True,
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
                    "run": {
                        "type": "string",
                        "description": "A run id (default: this agent's MCP run).",
                    }
                },
            },
            read_only=True,
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
        return refusal(
            "unauthorized", "This agent's token is no longer valid (deactivated or rotated)."
        )
    arguments = dict(arguments or {})
    if name == STEP_STATUS:
        return step_status(session, agent, arguments, sleep=sleep)
    if name == RUN_REPORT:
        return run_report(session, agent, arguments)
    info = usable_tools(agent).get(name)
    if info is None:
        return refusal(
            "unknown_tool", f"There is no tool {name!r} for this agent (list the tools again)."
        )
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
    try:
        if key is not None and (not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_LENGTH):
            raise Invalid(f"`{key_name}` must be a string of 1 to 200 characters")
        storable_json(arguments)
        run = call_run(agent, run_id)
        if key is None and info.effect in (Effect.WRITE, Effect.DESTRUCTIVE):
            key = derived_key(run, info.name, arguments, now=timezone.now())
        elif key is None:
            # A read repeated is harmless and may answer otherwise now: a step of its own.
            key = f"mcp-{uuid.uuid4().hex}"
        storable_text(key)
        earlier = earlier_step(agent, run, key, info.name, arguments) if run_id is None else None
        if earlier is not None:
            step = earlier
        else:
            step, _ = step_post(agent=agent, run=run, key=key, tool_name=info.name, input=arguments)
    except ServiceError as error:
        return refusal(error.code, redactor.text(f"Refused: {_refused_because(error, run_id)}"))
    except ValueError as error:
        return refusal("invalid_body", redactor.text(f"Refused: the input {error}"))
    return step_answer(session, wait_settled(agent, step, sleep=sleep))


def _refused_because(error: ServiceError, run_id: Any) -> str:
    """The refusal's message, with what the agent can do about it."""
    if isinstance(error, Conflict) and "run is cancelled" in error.message:
        return f"{error.message}; pass another run, or none for this agent's MCP run"
    if isinstance(error, Conflict) and "another call" in error.message:
        return f"{error.message}: a key names one call; use a new key for a new call"
    return error.message


class NoSuchRun(Invalid):
    code = "not_found"


def call_run(agent: Agent, run_id: Any) -> Run:
    """The run named by the call's `run` argument, or the agent's MCP run (made now if it
    has none, or a new one if a person cancelled it)."""
    if run_id is not None:
        run = _visible_run(agent, run_id)
        if run is None:
            raise NoSuchRun(f"no such run: {str(run_id)[:80]}")
        return run
    latest = mcp_run(agent)
    if latest is not None and latest.status != RunStatus.CANCELLED:
        return latest
    # The first, or the next after a cancelled one: numbered, so that two calls making it
    # at once make one (a run's key is unique per agent); after the highest number, whatever
    # runs were removed since.
    keys = _mcp_runs(agent).values_list("key", flat=True)
    number = max((_run_number(key) for key in keys), default=0) + 1
    run, _ = run_create(
        agent=agent,
        name=MCP_RUN_NAME if number == 1 else f"{MCP_RUN_NAME} ({number})",
        key=MCP_RUN_KEY if number == 1 else f"{MCP_RUN_KEY}-{number}",
        mcp=True,
    )
    return run


def _run_number(key: str) -> int:
    """`stepward-mcp` → 1, `stepward-mcp-7` → 7."""
    tail = key.removeprefix(MCP_RUN_KEY).removeprefix("-")
    return int(tail) if tail else 1


def _mcp_runs(agent: Agent) -> Any:
    return Run.objects.filter(agent=agent, key__regex=MCP_RUN_KEYS.pattern).order_by("created_at")


def mcp_run(agent: Agent) -> Run | None:
    """The agent's MCP run now (the newest), if it has made one (nothing is created)."""
    return _mcp_runs(agent).last()


def earlier_step(
    agent: Agent, run: Run, key: str, tool: str, arguments: dict[str, Any]
) -> Step | None:
    """The step an earlier MCP run of the agent's (cancelled since) holds under this key:
    a key names one effect across them all. Another call under that key is refused as
    posting refuses it within a run."""
    found = (
        Step.objects.select_related("run")
        .filter(run__in=_mcp_runs(agent).exclude(pk=run.pk), key=key)
        .order_by("-created_at")
        .first()
    )
    if found is not None and found.input_hash != call_hash(tool, arguments):
        raise Conflict(f"step {key!r} already exists with another call")
    return found


def derived_key(run: Run, tool: str, arguments: dict[str, Any], *, now: datetime) -> str:
    """The key of a call that brought none: the same for the same tool and arguments within
    MCP_DEDUP_SECONDS of the first such call, so a blind retry is the same step.

    Keys are numbered by window (`…-<n>`); a call looks at the window before its own too,
    and takes that key while its step is younger than the window. Two identical calls sent
    at the same instant across a window's edge can still make two steps; a retry, which
    comes after the call it repeats, cannot.
    """
    window = settings.MCP_DEDUP_SECONDS
    if window <= 0:
        return f"mcp-{uuid.uuid4().hex}"
    digest = call_hash(tool, arguments)[:32]
    number = int(now.timestamp() // window)
    earlier = f"{DERIVED_KEY_PREFIX}{digest}-{number - 1}"
    if Step.objects.filter(
        run=run, key=earlier, created_at__gte=now - timedelta(seconds=window)
    ).exists():
        return earlier
    return f"{DERIVED_KEY_PREFIX}{digest}-{number}"


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
        return refusal("not_found", "There is no such step for this agent.")
    return step_answer(session, wait_settled(agent, step, sleep=sleep))


def run_report(session: Session, agent: Agent, arguments: dict[str, Any]) -> Answer:
    named = arguments.get("run")
    run = _visible_run(agent, named) if named else mcp_run(agent)
    if run is None and named:
        return refusal("not_found", "There is no such run for this agent.")
    if run is None:
        return Answer(
            structured={
                "run_id": None,
                "message": "This agent has made no MCP call yet, so its MCP run is empty.",
            }
        )
    report = redact(selectors.run_report(run=run))
    report["run_id"] = str(run.pk)
    # An agent's MCP run only grows: an answer lists the latest steps of each section.
    cut = {}
    for section in REPORT_SECTIONS:
        entries = report[section]
        if len(entries) > REPORT_ENTRIES:
            cut[section] = len(entries)
            report[section] = entries[-REPORT_ENTRIES:]
    report["message"] = f"Run {run.pk}: {report['summary']}"
    if cut:
        report["listed_of"] = cut
        report["message"] += (
            f" Each section lists its latest {REPORT_ENTRIES} steps (totals in listed_of); "
            "ask step_status for any other."
        )
    return Answer(structured=_jsonable(report))


# --- a step as an answer --------------------------------------------------------------------


def step_answer(session: Session, step: Step) -> Answer:
    """What the agent reads of a step: its state, its result, and a `message` saying what it
    waits for and what to do; isError only when it ended without its effect. Redacted."""
    found = find_tool(step.tool_id)
    redactor = Redactor.for_input(step.input, found.redact if found else ())
    message, is_error = _describe(step)
    facts: dict[str, Any] = {
        "step_id": str(step.pk),
        "run_id": str(step.run_id),
        "key": step.key,
        "tool": step.tool_id,
        "state": step.state,
        "console_url": session.step_url(step.pk),
        "message": message,
    }
    if step.state in (State.COMPLETED, State.COMPENSATED):
        facts["result"] = step.result
        facts["external_id"] = step.external_id
    if step.failure_class:
        facts["failure"] = {"class": step.failure_class, "message": step.failure_message}
    structured = _jsonable(redactor(facts))
    structured["message"] = redactor.text(structured["message"])
    return Answer(structured=structured, is_error=is_error)


def _describe(step: Step) -> tuple[str, bool]:
    """The guidance a model acts on, and whether the call ended without its effect."""
    state = State(step.state)
    again = NEVER_AGAIN.format(step_id=step.pk)
    failure = f"{step.failure_class or 'failed'}: {step.failure_message}".strip()
    if state == State.COMPLETED:
        return (
            "Completed: it happened, once; its result is in `result`. Calling again with the "
            "same key answers this same step.",
            False,
        )
    if state == State.COMPENSATED:
        return "It happened and was undone since (compensated).", False
    if state == State.UNKNOWN:
        return (
            "Outcome unknown: the call may or may not have happened, and Stepward will not "
            "guess. A reviewer has it (and the tool's system is asked where it can be). "
            f"{again}",
            False,
        )
    if state == State.BLOCKED:
        return (
            "Blocked: the executor would not run it as things stand (a permission or an "
            f"approval no longer holds); a reviewer has it. {again}",
            False,
        )
    if state == State.PLANNED:
        return (
            f"Awaiting approval by a person: it runs once a reviewer approves it. {again}",
            False,
        )
    if state in IN_FLIGHT and step.run.status == RunStatus.PAUSED:
        reason = step.run.pause_reason or "paused"
        return (
            f"Paused: its run is paused ({reason}); it runs when a reviewer resumes the run. "
            f"{again}",
            False,
        )
    if state in IN_FLIGHT:
        return f"Still running ({state}): the executor will finish it. {again}", False
    if state == State.DEAD:
        return f"Failed after every retry ({failure}). A reviewer may replay it.", True
    if state == State.REJECTED:
        return "Rejected by a reviewer: it did not run.", True
    if state == State.CANCELLED:
        return "Cancelled: it did not run.", True
    return f"Failed ({failure}); it is not retried.", True


def _jsonable(value: Any) -> dict[str, Any]:
    """A JSON object: what structured content must be (dates and ids as text)."""
    loaded = json.loads(json.dumps(value, default=str))
    return loaded if isinstance(loaded, dict) else {"value": loaded}
