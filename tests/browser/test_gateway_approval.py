"""An approval-gated write through the MCP gateway, in Chromium (issue 20): a `git_commit` of
the real `mcp-server-git`, behind Stepward with `approval = "always"`, waits; a reviewer
sees the exact call in the console and approves it there; it then happens once, and no
automatic path makes it happen again.

The upstream runs as a child process of this test, started by the engine in this process;
the repository is the test's own, so its commits are what the external system says. The
same for an npm server (`@modelcontextprotocol/server-memory`, installed under tests/upstreams):
its graph file is what the external system says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Page, expect

from executor import engine
from executor.ledger import selectors
from executor.ledger.records import Agent, Approval, Run
from executor.ledger.states import State
from executor.services.accounts import agent_set_tools
from executor.services.tools import tools_load
from tests.support.browser import (
    WORKER,
    decide,
    events_by,
    execute,
    fresh,
    inbox_row,
    open_page,
    post,
)
from tests.support.tooling import run_every_automatic_path
from tests.support.upstreams import GitRepo, Upstream, git_upstream_table, node_server

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

MESSAGE = "Fix the invoice rounding (approved in the console)"


@pytest.fixture
def gated_git(agent: Agent, up: Upstream, repo: GitRepo, fresh_sessions: None) -> None:
    """mcp-server-git behind Stepward as `git`, each git_commit waiting for a person."""
    report = tools_load(
        tables=[],
        upstreams=[git_upstream_table(up, repo, tools={"git_commit": {"approval": "always"}})],
    )
    agent_set_tools(agent=agent, tools=None)
    assert report.listed[0].error == ""
    assert "git.git_commit" in report.listed[0].tools


def test_an_approval_gated_write_waits_is_approved_in_the_console_and_happens_once(
    gated_git: None,
    bob_page: Page,
    live_server: Any,
    reviewer: User,
    agent: Agent,
    run: Run,
    repo: GitRepo,
) -> None:
    page = bob_page
    step = post(
        agent,
        run,
        "git.git_commit",
        "commit-invoice-fix",
        {"repo_path": str(repo.path), "message": MESSAGE},
    )
    assert step.state == State.PLANNED

    # Nothing runs it before a person has decided: no path of the engine, no commit.
    assert engine.process(step.pk, worker=WORKER) == engine.Outcome.SKIPPED
    run_every_automatic_path()
    assert fresh(step).state == State.PLANNED
    assert repo.commits_with(MESSAGE) == 0

    # The reviewer finds it in the inbox, among the approvals.
    open_page(page, live_server.url, "/")
    page.get_by_test_id("tab-approval").click()
    expect(page.get_by_test_id("tab-approval")).to_have_attribute("aria-current", "page")
    row = inbox_row(page, step)
    expect(row).to_have_attribute("data-kind", "approval")
    expect(row).to_contain_text("git.git_commit")
    row.get_by_role("link", name=step.key).click()

    # The step page: the call, to which tool, and what an approval approves.
    expect(page.get_by_test_id("step-state")).to_have_text("planned")
    expect(page.get_by_test_id("asked-by")).to_have_text("What the agent asked")
    expect(page.get_by_test_id("tool-declarations")).to_contain_text("git.git_commit")
    # Where an approved call goes: which upstream, its own tool, and how it is reached.
    goes_to = page.get_by_test_id("goes-to")
    expect(goes_to).to_contain_text("MCP upstream git, its tool git_commit")
    expect(goes_to).to_contain_text(f"--repository {repo.path}")
    expect(page.get_by_test_id("approval-rule")).to_contain_text("needed")
    approving = page.get_by_test_id("approving")
    expect(approving).to_contain_text("git.git_commit")
    expect(page.get_by_test_id("approving-input")).to_contain_text(f'"message": "{MESSAGE}"')
    expect(page.get_by_test_id("approving-input")).to_contain_text(f'"repo_path": "{repo.path}"')
    tool = selectors.tool_info(name="git.git_commit", workspace_id=run.workspace_id)
    assert tool.approval_rule == "always"
    expect(page.get_by_test_id("approving-policy")).to_have_text(tool.policy_version)

    decide(page, "decision-approve", "Approve this call", "The rounding fix was reviewed.")
    expect(page.get_by_test_id("decision-notice")).to_have_text("Approved.")
    expect(page.get_by_test_id("step-state")).to_have_text("pending")
    approval = Approval.objects.get(step_id=step.pk)
    assert approval.approver == reviewer
    assert approval.policy_version == tool.policy_version
    assert approval.input_hash == step.input_hash
    assert repo.commits_with(MESSAGE) == 0

    # The engine runs it, in this process as a worker would: it happens once.
    done = execute(step)
    assert done.state == State.COMPLETED
    assert repo.commits_with(MESSAGE) == 1
    approval.refresh_from_db()
    assert approval.consumed_at is not None
    assert [(e.from_state, e.to_state) for e in events_by(step, "user:bob")] == [
        (State.PLANNED, State.APPROVED)
    ]

    # Every automatic path once more: nothing sends it a second time.
    run_every_automatic_path()
    assert fresh(step).state == State.COMPLETED
    assert repo.commits_with(MESSAGE) == 1

    # The page, reloaded, says so.
    open_page(page, live_server.url, f"/steps/{step.pk}/")
    expect(page.get_by_test_id("step-state")).to_have_text("completed")
    expect(page.get_by_test_id("approving")).to_have_count(0)
    expect(page.get_by_test_id("decision-approve")).to_have_count(0)
    expect(
        page.get_by_test_id("timeline-event")
        .filter(has_text="user:bob")
        .filter(has_text="approved")
    ).to_be_visible()
    summary = page.get_by_test_id("step-summary")
    summary.get_by_text("Result", exact=True).click()
    expect(summary).to_contain_text("Changes committed successfully")
    attempt = page.get_by_test_id("timeline-attempt")
    expect(attempt).to_have_count(1)
    expect(attempt).to_contain_text("responded")
    attempt.get_by_text("Request evidence", exact=True).click()
    expect(attempt).to_contain_text('"upstream": "git"')


# --- an npm server: @modelcontextprotocol/server-memory ---------------------------------------


def memory_entities(graph: Path) -> list[str]:
    if not graph.exists():
        return []
    return [
        json.loads(line)["name"]
        for line in graph.read_text().splitlines()
        if json.loads(line).get("type") == "entity"
    ]


@pytest.mark.npm
def test_an_npm_servers_write_waits_is_approved_in_the_console_and_happens_once(
    bob_page: Page,
    live_server: Any,
    reviewer: User,
    agent: Agent,
    run: Run,
    tmp_path: Path,
    fresh_sessions: None,
) -> None:
    """The reference memory server (npm), its create_entities a write a person approves."""
    graph = tmp_path / "memory.jsonl"
    report = tools_load(
        tables=[],
        upstreams=[
            {
                "name": "memory",
                "command": [node_server("mcp-server-memory")],
                "env": {"MEMORY_FILE_PATH": str(graph)},
                "trust_annotations": True,
                "tools": {"create_entities": {"approval": "always"}},
            }
        ],
    )
    assert report.listed[0].error == ""
    agent_set_tools(agent=agent, tools=None)
    entity = {"name": "ada", "entityType": "person", "observations": ["wrote the first program"]}
    step = post(agent, run, "memory.create_entities", "remember-ada", {"entities": [entity]})
    assert step.state == State.PLANNED
    run_every_automatic_path()
    assert fresh(step).state == State.PLANNED
    assert memory_entities(graph) == []

    page = bob_page
    open_page(page, live_server.url, f"/steps/{step.pk}/")
    expect(page.get_by_test_id("step-state")).to_have_text("planned")
    goes_to = page.get_by_test_id("goes-to")
    expect(goes_to).to_contain_text("MCP upstream memory, its tool create_entities")
    expect(goes_to).to_contain_text("mcp-server-memory")
    expect(page.get_by_test_id("approving-input")).to_contain_text("wrote the first program")
    decide(page, "decision-approve", "Approve this call", "Ada may be remembered.")
    expect(page.get_by_test_id("decision-notice")).to_have_text("Approved.")
    assert memory_entities(graph) == []

    done = execute(step)
    assert done.state == State.COMPLETED
    assert done.result["structured"]["entities"][0]["name"] == "ada"
    run_every_automatic_path()
    assert fresh(step).state == State.COMPLETED
    assert memory_entities(graph) == ["ada"]
    open_page(page, live_server.url, f"/steps/{step.pk}/")
    expect(page.get_by_test_id("step-state")).to_have_text("completed")
