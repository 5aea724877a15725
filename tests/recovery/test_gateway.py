"""The MCP gateway with real processes (API.md "MCP gateway"): a Celery worker and the
sweeper reach `mcp-server-git` themselves (nobody else ever started it), agents call its
tools through Stepward's own MCP server from separate stdio processes, and the upstream is
SIGKILLed mid-call inside the worker's session.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from mcp import Client
from mcp_types import CallToolResult

from executor.contract.tool import unregister
from executor.gateway.connections import gateway
from executor.gateway.tools import upstream_tool_names
from executor.ledger.records import Agent, McpUpstream, Step
from executor.ledger.states import State
from executor.services.accounts import agent_set_tools
from executor.services.posting import step_post
from executor.services.tools import tools_load, tools_sync
from tests.support.api import AgentAuth
from tests.support.cluster import Cluster
from tests.support.mcp import call, over_stdio, text_of
from tests.support.upstreams import GitRepo, Upstream, git_upstream_table

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def loaded_for_the_workers(
    cluster: Cluster, agent: Agent, up: Upstream, repo: GitRepo
) -> Iterator[McpUpstream]:
    """The upstream loaded without listing it here: the workers' sweeper lists its tools."""
    report = tools_load(tables=[], upstreams=[git_upstream_table(up, repo)], connect=False)
    assert report.upstreams_created == ["git"]
    cluster.worker().start()
    cluster.sweeper().start()
    row = cluster.wait_for(
        lambda: McpUpstream.objects.filter(name="git").exclude(listed_tools=[]).first(),
        what="the sweeper to list the upstream's tools",
    )
    tools_sync()
    agent_set_tools(agent=agent, tools=None)
    yield row
    gateway().close()
    for name in upstream_tool_names():
        unregister(name)


def test_the_workers_list_the_upstream_and_agents_reach_its_tools_through_stepwards_mcp(
    loaded_for_the_workers: McpUpstream,
    cluster: Cluster,
    agent_auth: AgentAuth,
    repo: GitRepo,
) -> None:
    assert loaded_for_the_workers.server_info["name"] == "mcp-git"
    assert loaded_for_the_workers.list_error == ""
    arguments = {"repo_path": str(repo.path), "message": "through stepward", "key": "commit-1"}

    async def list_and_commit(client: Client) -> tuple[set[str], CallToolResult]:
        names = {tool.name for tool in (await client.list_tools()).tools}
        return names, await client.call_tool("git_git_commit", arguments)

    names, first = over_stdio(cluster, agent_auth.token, list_and_commit)
    # Another process of the same agent, as a framework's next session would be.
    again = over_stdio(cluster, agent_auth.token, call("git_git_commit", arguments))
    status = over_stdio(
        cluster, agent_auth.token, call("git_git_status", {"repo_path": str(repo.path)})
    )

    assert {"git_git_commit", "git_git_status", "git_git_log"} <= names
    for answer in (first, again):
        assert not answer.is_error, text_of(answer)
        assert answer.structured_content is not None
        assert answer.structured_content["state"] == "completed", cluster.diagnose()
    assert first.structured_content["step_id"] == again.structured_content["step_id"]  # type: ignore[index]
    assert repo.commits_with("through stepward") == 1
    assert status.structured_content is not None
    assert "On branch" in status.structured_content["result"]["text"]


def test_an_upstream_killed_inside_the_workers_call_leaves_the_write_unknown_and_one_commit(
    loaded_for_the_workers: McpUpstream,
    cluster: Cluster,
    agent: Agent,
    run: Any,
    up: Upstream,
    repo: GitRepo,
) -> None:
    up.set("slow")  # the hook holds the call after its commit
    step, _ = step_post(
        agent=agent,
        run=run,
        key="killed",
        tool_name="git.git_commit",
        input={"repo_path": str(repo.path), "message": "killed mid-call"},
    )
    up.kill_the_one_in_the_hook()
    up.set("slow", on=False)

    lost = cluster.wait_state(step, State.UNKNOWN)
    assert "no answer came" in lost.failure_message, cluster.diagnose()
    # The sweeper goes on sweeping; nothing sends it again.
    passes = cluster.processes[-1].passes()  # type: ignore[attr-defined]
    cluster.wait_for(
        lambda: cluster.processes[-1].passes() > passes + 2,  # type: ignore[attr-defined]
        what="three more sweeps",
    )
    assert Step.objects.get(pk=step.pk).state == State.UNKNOWN
    assert repo.commits_with("killed mid-call") == 1

    # The worker starts the upstream again for the next call.
    after, _ = step_post(
        agent=agent,
        run=run,
        key="after",
        tool_name="git.git_commit",
        input={"repo_path": str(repo.path), "message": "after the kill"},
    )
    assert cluster.wait_state(after, State.COMPLETED).state == State.COMPLETED
    assert repo.commits_with("after the kill") == 1
