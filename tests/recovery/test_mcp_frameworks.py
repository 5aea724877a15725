"""Agent frameworks nobody here wrote, against Stepward's MCP server (API.md "For agent
frameworks: MCP"; issue 20): LangChain's MCP adapters, pydantic-ai, the OpenAI Agents SDK and
the official SDK's 1.x client, each driven by a script in tests/clients/ run with
`.venv-clients/bin/python` (they need mcp<2, the project pins 2.3: `make
.venv-clients/.installed`), against `manage.py mcp` over stdio or `/mcp` on gunicorn, a real
worker running the steps and the ticket desk counting the effects.

The frameworks are driven with their defaults and no model: a scripted one (pydantic-ai's
FunctionModel, the Agents SDK's ScriptedModel) or direct tool invocations (LangChain), and
each script prints exactly what its framework handed on for each call. What matters:

- a key is one effect, whatever the framework does with sessions (LangChain's default client
  opens a new stdio process per call) and however many processes call;
- every answer a framework hands its model carries the step's state and the guidance (what to
  do instead of calling again), whichever of the result's parts that framework keeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from executor.contract.tool import unregister
from executor.ledger.records import Agent, Step
from executor.ledger.states import State
from executor.services.accounts import agent_set_tools
from executor.services.tools import http_tools_load, tool_policy_set
from executor.tools import http as http_tools
from tests.support.api import AgentAuth
from tests.support.cluster import Cluster
from tests.support.mcp import mcp_web_server
from tests.support.processes import Desk
from tests.support.webserver import WebServer

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "tests" / "clients"
CLIENTS_PYTHON = ROOT / ".venv-clients" / "bin" / "python"
# The tree whose `manage.py mcp` the stdio tests start: this one. Pointing it at a worktree
# of an older commit (run with this tree's venv) shows what these tests find there.
SERVER_ROOT = Path(os.environ.get("STEPWARD_MCP_SERVER_ROOT") or ROOT)
# Generous: a call answers as soon as its step settles; this only bounds a stuck step.
WAIT_SECONDS = "20"
# Bounds one script's run: a few server processes starting and a few calls answering.
SCRIPT_SECONDS = 240

FRAMEWORKS = ("langchain", "pydantic_ai", "openai_agents", "mcp_sdk")

# An HTTP tool with no lookup, not safe to repeat: a lost answer leaves it `unknown`.
UNSURE_TOOL = "desk.file_ticket"
UNSURE_MCP_NAME = "desk_file_ticket"
DROPPED = "drop-me"


# --- the clients' venv and the scripts -----------------------------------------------------


@pytest.fixture(scope="module")
def clients_python() -> Path:
    if not CLIENTS_PYTHON.is_file():
        pytest.fail(
            f"{CLIENTS_PYTHON} is missing: these tests drive agent frameworks installed there. "
            "Make it with `make .venv-clients/.installed` (`make test` does)."
        )
    return CLIENTS_PYTHON


def stdio_server(cluster: Cluster, token: str) -> dict[str, Any]:
    """`manage.py mcp` as a framework starts it: a command line with its environment."""
    return {
        "command": sys.executable,
        "args": [str(SERVER_ROOT / "manage.py"), "mcp"],
        "env": {**cluster.env, "STEPWARD_TOKEN": token, "MCP_WAIT_SECONDS": WAIT_SECONDS},
        "cwd": str(SERVER_ROOT),
    }


def http_server(web: WebServer, token: str) -> dict[str, Any]:
    return {"url": f"{web.url}/mcp", "token": token}


def call(tool: str, **arguments: Any) -> dict[str, Any]:
    return {"tool": tool, "arguments": arguments}


@dataclass
class Script:
    """One run of a framework's script: it prints what its framework handed on."""

    framework: str
    process: subprocess.Popen[str]

    def result(self, cluster: Cluster) -> dict[str, Any]:
        try:
            out, err = self.process.communicate(timeout=SCRIPT_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, err = self.process.communicate()
            pytest.fail(f"{self.framework} did not finish\n{err}\n{cluster.diagnose()}")
        if self.process.returncode != 0:
            ended = self.process.returncode
            pytest.fail(f"{self.framework} ended with {ended}\n{err}\n{cluster.diagnose()}")
        try:
            found: dict[str, Any] = json.loads(out)
        except ValueError:
            pytest.fail(f"{self.framework} printed no JSON document\n{out}\n{err}")
        found["stderr"] = err
        return found


def launch(
    python: Path, framework: str, server: dict[str, Any], calls: list[dict[str, Any]]
) -> Script:
    """Starts `framework`'s script on the job (given on stdin: it holds the token)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    process = subprocess.Popen(
        [str(python), str(CLIENTS / f"{framework}_calls.py"), "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdin is not None
    process.stdin.write(json.dumps({"server": server, "calls": calls}))
    process.stdin.close()
    process.stdin = None  # communicate() must not touch it again
    return Script(framework, process)


def drive(
    python: Path,
    framework: str,
    server: dict[str, Any],
    calls: list[dict[str, Any]],
    cluster: Cluster,
) -> dict[str, Any]:
    found = launch(python, framework, server, calls).result(cluster)
    assert len(found["answers"]) == len(calls), found
    return found


# --- what each framework hands on ------------------------------------------------------------


@dataclass(repr=False)
class Surfaced:
    """One answer as a framework handed it on: the JSON document its model reads, and whether
    the framework marked it an error (None: it keeps no such mark)."""

    document: dict[str, Any]
    error: bool | None
    raw: Any

    def __repr__(self) -> str:  # what a failed assertion shows: the answer as handed on
        return json.dumps(self.raw, indent=1)


def only_text(blocks: list[dict[str, Any]]) -> str:
    texts = [block["text"] for block in blocks if block.get("type") in ("text", "input_text")]
    assert len(texts) == len(blocks) == 1, f"not exactly one text part: {blocks}"
    return str(texts[0])


def surfaced(framework: str, answer: dict[str, Any]) -> Surfaced:
    """The document a framework's model reads for one call (see tests/clients/*.py)."""
    if framework == "mcp_sdk":
        # The result itself: exactly one text part holding the structured content's JSON.
        document = json.loads(only_text(answer["content"]))
        assert document == answer.get("structuredContent"), answer
        return Surfaced(document, bool(answer.get("isError")), answer)
    if framework == "langchain":
        # The ToolMessage's content is the text; the structured content is its artifact, which
        # the model never sees (and an error's ToolMessage has none).
        document = json.loads(only_text(answer["content"]))
        if answer["artifact"] is not None:
            assert answer["artifact"]["structured_content"] == document, answer
        return Surfaced(document, answer["status"] == "error", answer)
    if framework == "pydantic_ai":
        # A success hands the model structuredContent (every part is text); an isError answer
        # is a ModelRetry, its content the structured content's JSON as text.
        assert answer["part_kind"] == "tool-return", answer
        content = answer["content"]
        document = content if isinstance(content, dict) else json.loads(content)
        if answer["outcome"] == "success":
            assert json.loads(answer["model_text"]) == document, answer
        else:
            assert json.loads(json.loads(answer["model_text"])["error"]) == document, answer
        return Surfaced(document, answer["outcome"] != "success", answer)
    if framework == "openai_agents":
        # The function_call_output's output: the text part, and no sign of isError at all.
        return Surfaced(json.loads(only_text(answer["output"])), None, answer)
    raise AssertionError(f"no such framework: {framework}")


def assert_step(answer: Surfaced, state: str, *, error: bool) -> Step:
    """The answer names a step in `state` and says what to do about it, as the contract has."""
    document = answer.document
    assert document.get("state") == state, answer
    assert {"step_id", "run_id", "key", "tool", "console_url", "message"} <= set(document), answer
    message = document["message"].lower()
    if state == State.COMPLETED:
        assert document["message"].startswith("Completed"), answer
    elif state == State.PLANNED:
        assert "awaiting approval" in message, answer
        assert "do not call" in message, answer
    elif state == State.UNKNOWN:
        assert "outcome unknown" in message, answer
        assert "do not call" in message, answer
    else:
        assert "Failed" in document["message"], answer
    if answer.error is not None:
        assert answer.error is error, answer
    step = Step.objects.get(pk=document["step_id"])
    assert step.state == state, answer
    assert document["console_url"].endswith(f"/steps/{step.pk}/"), answer
    return step


def assert_refused(answer: Surfaced, code: str) -> None:
    """A refusal: an error with its code and a message, and no step."""
    assert answer.document.get("error") == code, answer
    assert answer.document.get("message"), answer
    assert "step_id" not in answer.document, answer
    if answer.error is not None:
        assert answer.error is True, answer


# --- the server's tools for the states a step can answer in -----------------------------------


@pytest.fixture
def desk_tool(cluster: Cluster, agent: Agent, settings: Any) -> Iterator[str]:
    """An HTTP tool at the desk that has no lookup and is not safe to repeat: a create whose
    answer is lost is `unknown`, one the desk refuses (no title: 400) `failed`. The server
    and worker processes are allowed the desk's host."""
    host = f"127.0.0.1:{cluster.desk.port}"
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = [host]
    cluster.env["EXECUTOR_HTTP_ALLOWED_HOSTS"] = host
    http_tools_load(
        tables=[
            {
                "name": UNSURE_TOOL,
                "description": "Files a ticket at the desk; no lookup, not safe to repeat",
                "effect": "write",
                "method": "POST",
                "url": f"{cluster.desk.url}/tickets",
                "idempotency": "none",
                "input_schema": {
                    "type": "object",
                    "properties": {"title": {"type": "string"}, "body": {"type": "string"}},
                },
            }
        ]
    )
    agent_set_tools(agent=agent, tools=None)
    cluster.desk.faults(title_faults={DROPPED: "drop_after_commit"})
    yield UNSURE_MCP_NAME
    unregister(UNSURE_TOOL)
    http_tools._mine.discard(UNSURE_TOOL)


REFUSED = "refused"


def every_state_calls(prefix: str) -> list[tuple[str, dict[str, Any]]]:
    """One call per state a step answers in, each with its own key, and a refused call (a
    key used again with other input)."""
    return [
        (State.COMPLETED, call("echo", message="hello", key=f"{prefix}-echo")),
        (State.PLANNED, call("ticketdesk_create", title="approve me", key=f"{prefix}-approve")),
        (
            State.UNKNOWN,
            call(UNSURE_MCP_NAME, title=f"{DROPPED}: its answer is lost", key=f"{prefix}-lost"),
        ),
        (State.FAILED, call(UNSURE_MCP_NAME, body="no title", key=f"{prefix}-no-title")),
        (REFUSED, call("echo", message="other input", key=f"{prefix}-echo")),
    ]


def assert_every_state(
    framework: str, found: dict[str, Any], calls: list[tuple[str, dict[str, Any]]], desk: Desk
) -> None:
    for (state, _), answer in zip(calls, found["answers"], strict=True):
        handed = surfaced(framework, answer)
        if state == REFUSED:
            assert_refused(handed, "conflict")
            continue
        step = assert_step(handed, state, error=state == State.FAILED)
        if state == State.FAILED:
            assert step.failure_class == handed.document["failure"]["class"] == "invalid_input"
        if step.tool_id == UNSURE_TOOL:
            # The lost answer's ticket was filed once; the refused one never.
            assert desk.count(step.operation_id) == (1 if state == State.UNKNOWN else 0)
    refused = Step.objects.filter(tool="echo", input__message="other input")
    assert not refused.exists(), "the refused call posted a step"


# --- a key is one effect ---------------------------------------------------------------------


def effects(cluster: Cluster, tickets_before: int) -> dict[str, int]:
    """What the calls did: ticketdesk.create steps in the ledger, tickets new at the desk."""
    return {
        "steps": Step.objects.filter(tool="ticketdesk.create").count(),
        "tickets": cluster.desk.stats()["tickets"] - tickets_before,
    }


def test_langchain_default_client_calling_three_times_with_one_key_files_one_ticket(
    cluster: Cluster, agent_auth: AgentAuth, clients_python: Path
) -> None:
    """Issue 20: LangChain's default client starts a new `manage.py mcp` for every call, so a
    key kept by one process only was a new ticket per call."""
    cluster.worker().start()
    tickets_before = cluster.desk.stats()["tickets"]
    calls = [
        call("ticketdesk_create", title="printer on fire", key="ticket-1"),
        call("ticketdesk_create", title="printer on fire", key="ticket-1"),
        call("ticketdesk_create", title="another title", key="ticket-1"),
    ]

    found = drive(
        clients_python, "langchain", stdio_server(cluster, agent_auth.token), calls, cluster
    )

    assert effects(cluster, tickets_before) == {"steps": 1, "tickets": 1}, found["answers"]
    first, again, other = (surfaced("langchain", answer) for answer in found["answers"])
    step = assert_step(first, State.COMPLETED, error=False)
    assert_step(again, State.COMPLETED, error=False)
    assert again.document["step_id"] == first.document["step_id"] == str(step.pk)
    assert_refused(other, "conflict")
    assert cluster.desk.count(step.operation_id) == 1


def test_a_blind_retry_without_a_key_through_langchain_is_the_same_step(
    cluster: Cluster, agent_auth: AgentAuth, clients_python: Path
) -> None:
    """A call without a key gets one from its tool and arguments: LangChain calling it again
    (in a new process) is the same step, not a second ticket."""
    cluster.worker().start()
    tickets_before = cluster.desk.stats()["tickets"]
    calls = [call("ticketdesk_create", title="retried blindly")] * 2

    found = drive(
        clients_python, "langchain", stdio_server(cluster, agent_auth.token), calls, cluster
    )

    assert effects(cluster, tickets_before) == {"steps": 1, "tickets": 1}, found["answers"]
    first, again = (surfaced("langchain", answer) for answer in found["answers"])
    step = assert_step(first, State.COMPLETED, error=False)
    assert_step(again, State.COMPLETED, error=False)
    assert again.document["step_id"] == str(step.pk)


def test_two_sdk_processes_with_one_key_file_one_ticket_and_other_input_is_refused(
    cluster: Cluster, agent_auth: AgentAuth, clients_python: Path
) -> None:
    """Two processes of one agent at once, each with its own `manage.py mcp` (the SDK's 1.x
    client), one key: one step, one ticket; a third process with other input is refused."""
    cluster.worker().start()
    tickets_before = cluster.desk.stats()["tickets"]
    server = stdio_server(cluster, agent_auth.token)
    same = [call("ticketdesk_create", title="printer on fire", key="ticket-2")]

    both = [launch(clients_python, "mcp_sdk", server, same) for _ in range(2)]
    results = [script.result(cluster)["answers"][0] for script in both]
    other = drive(
        clients_python,
        "mcp_sdk",
        server,
        [call("ticketdesk_create", title="another title", key="ticket-2")],
        cluster,
    )

    assert effects(cluster, tickets_before) == {"steps": 1, "tickets": 1}, (results, other)
    answers = [surfaced("mcp_sdk", answer) for answer in results]
    # The slower process may find the step before it completed: it answers where it is.
    final = [a for a in answers if a.document.get("state") == State.COMPLETED]
    assert final, answers
    step = assert_step(final[0], State.COMPLETED, error=False)
    assert {a.document.get("step_id") for a in answers} == {str(step.pk)}
    assert_refused(surfaced("mcp_sdk", other["answers"][0]), "conflict")
    assert cluster.desk.count(step.operation_id) == 1


# --- what each framework hands its model ------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_over_stdio_the_framework_hands_on_each_state_with_its_guidance(
    framework: str,
    cluster: Cluster,
    agent_auth: AgentAuth,
    desk_tool: str,
    clients_python: Path,
) -> None:
    tool_policy_set(
        workspace=agent_auth.agent.workspace, tool="ticketdesk.create", approval="always"
    )
    cluster.worker().start()
    calls = every_state_calls(framework)

    found = drive(
        clients_python,
        framework,
        stdio_server(cluster, agent_auth.token),
        [job for _, job in calls],
        cluster,
    )

    assert {"echo", "ticketdesk_create", desk_tool, "step_status", "run_report"} <= set(
        found["tools"]
    ), found["tools"]
    assert_every_state(framework, found, calls, cluster.desk)


@pytest.fixture
def web(cluster: Cluster, desk_tool: str, tmp_path: Path) -> Iterator[WebServer]:
    """Started after desk_tool allowed the desk's host."""
    server = mcp_web_server(cluster, tmp_path / "web")
    yield server
    server.stop()


def test_over_http_every_framework_hands_on_each_state_with_its_guidance(
    cluster: Cluster,
    agent_auth: AgentAuth,
    desk_tool: str,
    web: WebServer,
    clients_python: Path,
) -> None:
    tool_policy_set(
        workspace=agent_auth.agent.workspace, tool="ticketdesk.create", approval="always"
    )
    cluster.worker().start()
    server = http_server(web, agent_auth.token)
    calls = {framework: every_state_calls(f"http-{framework}") for framework in FRAMEWORKS}

    # One after the other: a call's wait holds one of the agent's few long-poll slots
    # (API_MAX_WAITS_PER_AGENT), and a call finding none free answers before its step settles.
    found = {
        framework: drive(
            clients_python, framework, server, [job for _, job in calls[framework]], cluster
        )
        for framework in FRAMEWORKS
    }

    for framework in FRAMEWORKS:
        assert desk_tool in found[framework]["tools"], found[framework]
        assert_every_state(framework, found[framework], calls[framework], cluster.desk)
    # Over HTTP every call without `run` goes into the agent's one MCP run.
    assert Step.objects.values("run").distinct().count() == 1
