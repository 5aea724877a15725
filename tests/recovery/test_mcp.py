"""MCP with real parts (API.md "For agent frameworks: MCP"): the SDK's own clients — stdio
(`manage.py mcp` as a child process) and streamable HTTP (against gunicorn) — list the
tools and call them, a real worker runs the steps, and the ticket desk supplies the faults.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp_types import CallToolResult

from executor.ledger.records import Agent, Step
from executor.ledger.states import State
from executor.services.accounts import agent_set_tools
from executor.services.posting import step_post
from executor.services.reviews import step_approve
from executor.services.runs import run_create
from executor.services.tools import tool_policy_set
from executor.surfaces import mcp
from executor.surfaces.mcp_server import run_to_completion
from tests.support.api import AgentAuth
from tests.support.cluster import Cluster, Stall
from tests.support.mcp import Work, call, mcp_web_server, over_http, over_stdio, text_of
from tests.support.webserver import WebServer

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def web(cluster: Cluster, tmp_path: Path) -> Iterator[WebServer]:
    server = mcp_web_server(cluster, tmp_path / "web")
    yield server
    server.stop()


def listed_and_called(
    tool: str, arguments: dict[str, Any]
) -> Work[tuple[dict[str, dict[str, Any]], CallToolResult]]:
    async def work(client: Client) -> tuple[dict[str, dict[str, Any]], CallToolResult]:
        listed = await client.list_tools()
        tools = {t.name: t.input_schema for t in listed.tools}
        return tools, await client.call_tool(tool, arguments)

    return work


def assert_echo_completed(
    tools: dict[str, dict[str, Any]], result: CallToolResult, cluster: Cluster
) -> None:
    assert {"echo", "ticketdesk_create", "step_status", "run_report"} <= set(tools)
    assert all(mcp.NAME_PATTERN.fullmatch(name) for name in tools)
    assert {"key", "run"} <= set(tools["echo"]["properties"])
    assert not result.is_error, text_of(result)
    structured = result.structured_content
    assert structured is not None
    assert structured["state"] == "completed", text_of(result)
    assert structured["result"] == {"message": "hello"}
    assert "Completed" in text_of(result)
    step = Step.objects.get(pk=structured["step_id"])
    assert step.state == State.COMPLETED, cluster.diagnose()
    assert structured["console_url"].endswith(f"/steps/{step.pk}/")


def test_the_stdio_client_lists_the_tools_and_echo_completes(
    cluster: Cluster, agent_auth: AgentAuth
) -> None:
    cluster.worker().start()
    tools, result = over_stdio(
        cluster, agent_auth.token, listed_and_called("echo", {"message": "hello"})
    )
    assert_echo_completed(tools, result, cluster)


def test_the_http_client_lists_the_tools_and_echo_completes(
    cluster: Cluster, web: WebServer, agent_auth: AgentAuth
) -> None:
    cluster.worker().start()
    tools, result = over_http(
        web, agent_auth.token, listed_and_called("echo", {"message": "hello"})
    )
    assert_echo_completed(tools, result, cluster)


def test_http_mcp_needs_a_valid_token_and_serves_post_only(
    web: WebServer, agent_auth: AgentAuth
) -> None:
    url = f"{web.url}/mcp"
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    assert httpx.post(url, json=listing).status_code == 401
    bad = httpx.post(url, json=listing, headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401
    assert bad.json()["error"]["code"] == "unauthorized"
    got = httpx.get(url, headers={"Authorization": f"Bearer {agent_auth.token}"})
    assert got.status_code == 405
    assert got.headers["Allow"] == "POST"


def test_stdio_refuses_to_start_without_a_valid_token(cluster: Cluster) -> None:
    import subprocess

    for token in ("", "not-a-token"):
        env = {**cluster.env, "STEPWARD_TOKEN": token}
        ended = subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "mcp"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert ended.returncode != 0
        assert "STEPWARD_TOKEN" in ended.stderr
        assert ended.stdout == ""


def test_a_dropped_create_answers_unknown_not_an_error(
    cluster: Cluster, web: WebServer, agent_auth: AgentAuth, stall: Stall
) -> None:
    cluster.desk.faults(drop_after_commit_rate=1.0)
    # The lookup would find the ticket at once: hold it, so the answer sees `unknown`.
    stall.at_lookup_found()
    cluster.worker().start()

    result = over_http(web, agent_auth.token, call("ticketdesk_create", {"title": "dropped"}))

    text = text_of(result)
    assert not result.is_error, text
    assert "Outcome unknown" in text
    assert "A reviewer has it" in text
    assert "Do not call the tool again" in text
    structured = result.structured_content
    assert structured is not None
    step = Step.objects.get(pk=structured["step_id"])
    assert str(step.pk) in text
    assert f"/steps/{step.pk}/" in text
    assert cluster.desk.count(step.operation_id) == 1  # it happened, once


def test_a_tool_needing_approval_answers_awaiting_approval_then_completes(
    cluster: Cluster, web: WebServer, agent_auth: AgentAuth, reviewer: Any
) -> None:
    tool_policy_set(
        workspace=agent_auth.agent.workspace, tool="ticketdesk.create", approval="always"
    )
    cluster.worker().start()

    first = over_http(
        web, agent_auth.token, call("ticketdesk_create", {"title": "approve me", "key": "t1"})
    )
    assert not first.is_error, text_of(first)
    assert "Awaiting approval" in text_of(first)
    assert first.structured_content is not None
    step = Step.objects.get(pk=first.structured_content["step_id"])
    assert step.state == State.PLANNED

    step_approve(step=step, user=reviewer, version=step.version, reason="fine")
    status = over_http(web, agent_auth.token, call("step_status", {"step_id": str(step.pk)}))

    assert not status.is_error, text_of(status)
    assert status.structured_content is not None
    assert status.structured_content["state"] == "completed", cluster.diagnose()
    assert cluster.desk.count(step.operation_id) == 1


def test_the_same_key_twice_is_one_step(
    cluster: Cluster, web: WebServer, agent_auth: AgentAuth
) -> None:
    cluster.worker().start()

    async def twice(client: Client) -> list[CallToolResult]:
        arguments = {"message": "once", "key": "same-key"}
        return [await client.call_tool("echo", arguments) for _ in range(2)]

    answers = over_http(web, agent_auth.token, twice)

    ids = {answer.structured_content["step_id"] for answer in answers if answer.structured_content}
    assert len(ids) == 1
    assert Step.objects.filter(key="same-key").count() == 1
    assert all(answer.structured_content["state"] == "completed" for answer in answers)  # type: ignore[index]


def test_a_session_cannot_see_or_call_what_its_token_may_not(
    cluster: Cluster, web: WebServer, agent_auth: AgentAuth, other_agent_auth: AgentAuth
) -> None:
    agent_set_tools(agent=agent_auth.agent, tools=["echo"])
    other_run, _ = run_create(agent=other_agent_auth.agent, name="theirs")
    theirs, _ = step_post(
        agent=other_agent_auth.agent,
        run=other_run,
        key="secret-step",
        tool_name="echo",
        input={"message": "not yours"},
    )

    async def probe(client: Client) -> tuple[set[str], CallToolResult, CallToolResult]:
        listed = {tool.name for tool in (await client.list_tools()).tools}
        refused = await client.call_tool("ticketdesk_create", {"title": "no"})
        hidden = await client.call_tool("step_status", {"step_id": str(theirs.pk)})
        return listed, refused, hidden

    listed, refused, hidden = over_http(web, agent_auth.token, probe)

    assert "echo" in listed
    assert "ticketdesk_create" not in listed
    assert refused.is_error
    assert hidden.is_error
    assert "not yours" not in text_of(hidden)
    assert not Step.objects.filter(tool="ticketdesk.create").exists()


def test_agent_loop_example_runs_against_a_live_server(
    cluster: Cluster, web: WebServer, agent: Agent, agent_auth: AgentAuth
) -> None:
    import subprocess

    cluster.worker().start()
    env = {
        **cluster.env,
        "STEPWARD_URL": web.url,
        "STEPWARD_TOKEN": agent_auth.token,
        "PYTHONPATH": str(ROOT),
    }
    ended = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agent_loop.py")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert ended.returncode == 0, ended.stdout + ended.stderr + cluster.diagnose()
    steps = Step.objects.filter(run__agent=agent)
    assert steps.count() >= 2, ended.stdout
    assert set(steps.values_list("state", flat=True)) == {State.COMPLETED}, cluster.diagnose()
    assert re.search(r"\d+ completed", ended.stdout), ended.stdout


def test_over_http_without_a_run_step_status_and_run_report_answer_the_agents_mcp_run(
    cluster: Cluster, web: WebServer, agent_auth: AgentAuth
) -> None:
    cluster.worker().start()
    # Posted over stdio, by another process: the same run over HTTP.
    posted = over_stdio(cluster, agent_auth.token, call("echo", {"message": "hi", "key": "k1"}))
    assert posted.structured_content is not None
    step_id = posted.structured_content["step_id"]

    status = over_http(web, agent_auth.token, call("step_status", {"step_id": step_id}))
    report = over_http(web, agent_auth.token, call("run_report", {}))

    assert not status.is_error, text_of(status)
    assert status.structured_content is not None
    assert status.structured_content["state"] == "completed", cluster.diagnose()
    assert not report.is_error, text_of(report)
    assert report.structured_content is not None
    run = mcp.mcp_run(agent_auth.agent)
    assert run is not None
    assert report.structured_content["run_id"] == str(run.pk) == posted.structured_content["run_id"]
    assert [entry["key"] for entry in report.structured_content["completed"]] == ["k1"]
    assert report.structured_content["message"].startswith(f"Run {run.pk}")


def test_the_desktop_example_runs_as_written_and_says_nothing_on_stderr(tmp_path: Path) -> None:
    """examples/mcp-desktop.json on a machine `make run` set up: the command, its arguments
    and its env as written (the checkout's path and a token filled in). Its `var/` is this
    test's (STEPWARD_VAR_DIR, the one variable added); the server must find the key there
    by itself and write nothing on stderr (no broker warnings) while a call posts a step."""
    import json
    import subprocess

    var = tmp_path / "var"
    made = {**os.environ, "STEPWARD_VAR_DIR": str(var)}
    for name in ("SECRET_KEY", "SECRET_KEY_FILE", "DATABASE_URL", "CELERY_BROKER_URL"):
        made.pop(name, None)
    subprocess.run(["make", "--no-print-directory", "secret-key"], cwd=ROOT, env=made, check=True)
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "-v0"], cwd=ROOT, env=made, check=True)
    token = subprocess.run(
        [*manage, "create_agent", "desk-bot", "--workspace", "demo"],
        cwd=ROOT,
        env=made,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()[-1]

    config = json.loads((ROOT / "examples" / "mcp-desktop.json").read_text())
    written = config["mcpServers"]["stepward"]
    server = StdioServerParameters(
        command=written["command"].replace("/path/to/stepward", str(ROOT)),
        args=[arg.replace("/path/to/stepward", str(ROOT)) for arg in written["args"]],
        env={**written["env"], "STEPWARD_TOKEN": token, "STEPWARD_VAR_DIR": str(var)},
    )
    stderr = tmp_path / "stderr.txt"

    async def session() -> CallToolResult:
        with stderr.open("w") as errlog:
            async with Client(stdio_client(server, errlog=errlog)) as client:
                return await client.call_tool("echo", {"message": "from the desktop"})

    answer = run_to_completion(session())

    assert not answer.is_error, text_of(answer)
    assert answer.structured_content is not None
    assert answer.structured_content["state"] == "pending"  # no worker here: posted, waiting
    assert stderr.read_text() == ""
