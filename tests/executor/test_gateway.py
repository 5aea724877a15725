"""The MCP gateway against real upstreams nobody here wrote (API.md "MCP gateway"):
`mcp-server-git` on a repository of the test's own, started by the engine in this process,
each step driven through the real engine (claim, submitting, the call, its outcome).

The upstream runs as a real child process; a test kills it mid-call with SIGKILL, makes it
exit at start or hang, and counts the commits in the repository: never a second one.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from executor import engine
from executor.contract.tool import find_tool
from executor.gateway.connections import Unreachable, gateway
from executor.gateway.tools import target_for
from executor.ledger.records import Agent, Attempt, McpUpstream, Run, RunStatus, Step
from executor.ledger.states import State
from executor.services.accounts import agent_set_tools
from executor.services.reviews import step_approve
from executor.services.runs import run_create
from executor.services.tools import ToolsLoaded, tools_load
from executor.surfaces import mcp
from executor.tools.files import read_tool_file
from tests.support.api import ApiClient
from tests.support.tooling import make_due, post, reload, run_every_automatic_path
from tests.support.upstreams import (
    EverythingServer,
    GitRepo,
    Upstream,
    git_repo,
    git_upstream_table,
    node_server,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]


def load(agent: Agent, *tables: dict[str, Any]) -> ToolsLoaded:
    report = tools_load(tables=[], upstreams=list(tables))
    agent_set_tools(agent=agent, tools=None)
    return report


@pytest.fixture
def git(agent: Agent, up: Upstream, repo: GitRepo, fresh_sessions: None) -> ToolsLoaded:
    report = load(agent, git_upstream_table(up, repo))
    assert [listed.error for listed in report.listed] == [""]
    return report


def commit(agent: Agent, run: Run, repo: GitRepo, message: str) -> Step:
    return post(
        agent, run, "git.git_commit", input={"repo_path": str(repo.path), "message": message}
    )


def test_the_upstreams_tools_are_stepward_tools_with_their_schemas(
    git: ToolsLoaded, api: ApiClient
) -> None:
    assert "git.git_status" in git.listed[0].tools
    listed = {tool["name"]: tool for tool in api.get("/api/v1/tools").json()}
    status, commit_tool, reset = (
        listed["git.git_status"],
        listed["git.git_commit"],
        listed["git.git_reset"],
    )
    assert "repo_path" in status["input_schema"]["properties"]
    assert set(commit_tool["input_schema"]["required"]) == {"repo_path", "message"}
    # The annotations are trusted here: read-only is a read, destructive needs a person.
    assert (status["effect"], status["usable"]) == ("read", True)
    assert (commit_tool["effect"], commit_tool["requires_approval"]) == ("write", False)
    assert (reset["effect"], reset["requires_approval"]) == ("destructive", True)
    assert McpUpstream.objects.get(name="git").server_info["name"] == "mcp-git"


def test_a_read_is_answered(git: ToolsLoaded, agent: Agent, run: Run, repo: GitRepo) -> None:
    step = post(agent, run, "git.git_status", input={"repo_path": str(repo.path)})

    assert engine.process(step.pk) == State.COMPLETED
    done = reload(step)
    assert "On branch" in done.result["text"]
    assert done.attempts.get().response_evidence["name"] == "mcp-git"


def test_a_write_happens_once(git: ToolsLoaded, agent: Agent, run: Run, repo: GitRepo) -> None:
    step = commit(agent, run, repo, "the first write")

    assert engine.process(step.pk) == State.COMPLETED
    assert "committed" in reload(step).result["text"].lower()
    assert repo.commits_with("the first write") == 1
    run_every_automatic_path()
    assert repo.commits_with("the first write") == 1


def test_calls_in_flight_reach_the_upstream_from_the_call_loop(
    git: ToolsLoaded, agent: Agent, run: Run, repo: GitRepo, settings: Any
) -> None:
    # A worker's drain awaits the upstream's tools (`ainvoke`) on its call loop: the sessions'
    # own loop makes each call, and no thread waits for it.
    settings.EXECUTOR_MAX_IN_FLIGHT = 16
    steps = [commit(agent, run, repo, f"in flight {i}") for i in range(4)]

    assert engine.drain(worker="w1") == 4

    assert {reload(s).state for s in steps} == {State.COMPLETED}
    assert [repo.commits_with(f"in flight {i}") for i in range(4)] == [1, 1, 1, 1]


def test_the_effects_id_can_be_read_from_the_answers_text(
    agent: Agent, run: Run, up: Upstream, repo: GitRepo, fresh_sessions: None
) -> None:
    entry = {"external_id_from_text": "hash ([0-9a-f]{40})"}
    load(agent, git_upstream_table(up, repo, tools={"git_commit": entry}))
    step = commit(agent, run, repo, "with its hash")

    assert engine.process(step.pk) == State.COMPLETED
    head = subprocess.run(
        ["git", "-C", str(repo.path), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    assert reload(step).external_id == head.stdout.strip()


def test_an_approval_gated_write_waits_then_happens_once(
    agent: Agent, run: Run, up: Upstream, repo: GitRepo, reviewer: Any, fresh_sessions: None
) -> None:
    load(agent, git_upstream_table(up, repo, tools={"git_commit": {"approval": "always"}}))
    step = commit(agent, run, repo, "approve me")
    assert step.state == State.PLANNED
    assert engine.process(step.pk) != State.COMPLETED
    assert repo.commits_with("approve me") == 0

    step_approve(step=reload(step), user=reviewer, version=reload(step).version, reason="ok")
    run_every_automatic_path()

    assert reload(step).state == State.COMPLETED
    assert repo.commits_with("approve me") == 1


def test_an_error_the_upstream_answers_is_classified_and_not_retried(
    git: ToolsLoaded, agent: Agent, run: Run, repo: GitRepo, tmp_path: Path
) -> None:
    outside = post(agent, run, "git.git_status", input={"repo_path": str(tmp_path)})
    missing = post(
        agent,
        run,
        "git.git_checkout",
        input={"repo_path": str(repo.path), "branch_name": "no-such-branch"},
    )

    assert engine.process(outside.pk) == State.FAILED
    assert engine.process(missing.pk) == State.FAILED
    assert reload(outside).failure_class == "permission_denied"
    assert "outside the allowed repository" in reload(outside).failure_message
    assert reload(missing).failure_class == "conflict"
    assert reload(missing).attempts.count() == 1


def test_a_write_whose_upstream_is_killed_mid_call_is_unknown_and_never_sent_again(
    git: ToolsLoaded,
    agent: Agent,
    run: Run,
    up: Upstream,
    repo: GitRepo,
    client: Client,
    reviewer: Any,
) -> None:
    step = commit(agent, run, repo, "killed while answering")
    up.set("slow")  # the hook holds the call after the commit

    def kill_in_the_hook() -> None:
        up.kill_the_one_in_the_hook()
        up.set("slow", on=False)

    killer = threading.Thread(target=kill_in_the_hook)
    killer.start()
    ended = engine.process(step.pk)
    killer.join()

    assert ended == State.UNKNOWN
    lost = reload(step)
    assert lost.failure_class == "ambiguous"
    assert "no answer came" in lost.failure_message
    evidence = lost.attempts.get().response_evidence
    assert evidence["upstream"] == "git"
    assert evidence["name"] == "mcp-git"
    # Nobody may send it again but a person: the sweeper leaves it for review.
    run_every_automatic_path()
    assert reload(step).state == State.UNKNOWN
    assert repo.commits_with("killed while answering") == 1
    # It waits in a reviewer's inbox, whose step page shows what was sent to which upstream
    # and what the upstream said of itself.
    client.force_login(reviewer)
    inbox = client.get(reverse("inbox")).content.decode()
    assert str(step.pk) in inbox
    page = client.get(reverse("step", args=[step.pk])).content.decode()
    assert "Request evidence" in page
    assert "Response evidence" in page
    assert "killed while answering" in page
    assert "mcp-git" in page
    assert "no answer came" in page
    # The next call starts the upstream again.
    after = commit(agent, run, repo, "after the restart")
    assert engine.process(after.pk) == State.COMPLETED
    assert repo.commits_with("after the restart") == 1


def test_a_read_whose_upstream_is_killed_mid_call_is_retried(
    git: ToolsLoaded, agent: Agent, run: Run, up: Upstream, repo: GitRepo
) -> None:
    # A read's effect is nothing: a lost answer is simply asked again.
    step = commit(agent, run, repo, "to be read")
    assert engine.process(step.pk) == State.COMPLETED
    read = post(agent, run, "git.git_log", input={"repo_path": str(repo.path)})
    up.kill()  # between calls: dead before the read is sent, which nobody knows yet

    assert engine.process(read.pk) in (State.PENDING, State.COMPLETED)
    if reload(read).state == State.PENDING:
        assert reload(read).attempts.get().error_class in ("unavailable", "ambiguous")
        make_due(read)
        assert engine.process(read.pk) == State.COMPLETED
    assert "to be read" in reload(read).result["text"]


@pytest.mark.parametrize("fault", ["down", "hang"])
def test_an_upstream_that_is_down_or_hangs_is_unavailable_and_retried(
    git: ToolsLoaded,
    agent: Agent,
    run: Run,
    up: Upstream,
    repo: GitRepo,
    settings: Any,
    fault: str,
) -> None:
    settings.EXECUTOR_UPSTREAM_START_SECONDS = 2
    gateway().close()  # the next call starts it again, and finds it down or hung
    up.set(fault)
    step = commit(agent, run, repo, f"while {fault}")

    assert engine.process(step.pk) == State.PENDING
    attempt = reload(step).attempts.get()
    assert attempt.error_class == "unavailable"
    assert "nothing was sent" in attempt.error_message
    if fault == "down":
        assert "down for maintenance" in "\n".join(attempt.response_evidence["stderr_tail"])
    assert repo.commits_with(f"while {fault}") == 0

    up.set(fault, on=False)
    # Time enough for a real start on a loaded machine (the short limit only made the hang
    # quick to see).
    settings.EXECUTOR_UPSTREAM_START_SECONDS = 30
    make_due(step)
    assert engine.process(step.pk) == State.COMPLETED
    assert repo.commits_with(f"while {fault}") == 1


def test_a_listing_that_changes_makes_a_new_policy_version(
    git: ToolsLoaded, agent: Agent, up: Upstream, repo: GitRepo
) -> None:
    tool = find_tool("git.git_commit")
    assert tool is not None
    before = tool.policy_version()
    load(agent, git_upstream_table(up, repo, tools={"git_commit": {"redact": ["message"]}}))
    after = find_tool("git.git_commit")
    assert after is not None
    assert after.policy_version() != before


# --- an npm server over stdio: @modelcontextprotocol/server-memory ---------------------------


@pytest.fixture
def memory(agent: Agent, tmp_path: Path, fresh_sessions: None) -> Path:
    graph = tmp_path / "memory.jsonl"
    report = load(
        agent,
        {
            "name": "memory",
            "command": [node_server("mcp-server-memory")],
            "env": {"MEMORY_FILE_PATH": str(graph)},
            "trust_annotations": True,
            "defaults": {"approval": "never"},
        },
    )
    assert [listed.error for listed in report.listed] == [""]
    return graph


def entities(graph: Path) -> list[str]:
    if not graph.exists():
        return []
    return [
        json.loads(line)["name"]
        for line in graph.read_text().splitlines()
        if json.loads(line).get("type") == "entity"
    ]


@pytest.mark.npm
def test_an_npm_server_lists_reads_writes_once_and_its_destructive_tool_waits(
    memory: Path, agent: Agent, run: Run, api: ApiClient, reviewer: Any
) -> None:
    listed = {tool["name"]: tool for tool in api.get("/api/v1/tools").json()}
    assert listed["memory.read_graph"]["effect"] == "read"
    assert listed["memory.create_entities"]["effect"] == "write"
    assert "entities" in listed["memory.create_entities"]["input_schema"]["properties"]
    assert listed["memory.delete_entities"]["requires_approval"] is True

    created = post(
        agent,
        run,
        "memory.create_entities",
        input={"entities": [{"name": "ada", "entityType": "person", "observations": ["x"]}]},
    )
    assert engine.process(created.pk) == State.COMPLETED
    assert reload(created).result["structured"]["entities"][0]["name"] == "ada"
    read = post(agent, run, "memory.read_graph", input={})
    assert engine.process(read.pk) == State.COMPLETED
    assert "ada" in reload(read).result["text"]
    assert entities(memory) == ["ada"]

    delete = post(agent, run, "memory.delete_entities", input={"entityNames": ["ada"]})
    assert delete.state == State.PLANNED
    run_every_automatic_path()
    assert entities(memory) == ["ada"]
    step_approve(step=reload(delete), user=reviewer, version=reload(delete).version, reason="ok")
    run_every_automatic_path()
    assert reload(delete).state == State.COMPLETED
    assert entities(memory) == []


# --- a server over streamable HTTP: @modelcontextprotocol/server-everything --------------------


@pytest.fixture
def everything(
    agent: Agent, tmp_path: Path, settings: Any, fresh_sessions: None
) -> Iterator[EverythingServer]:
    server = EverythingServer(tmp_path).start()
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = [server.host]
    report = load(
        agent,
        {
            "name": "everything",
            "url": server.url,
            "trust_annotations": True,
            "defaults": {"approval": "never"},
            "tools": {"trigger-long-running-operation": {"timeout": 6}},
        },
    )
    assert [listed.error for listed in report.listed] == [""]
    yield server
    server.kill()


@pytest.mark.npm
def test_an_http_upstream_is_listed_and_answers(
    everything: EverythingServer, agent: Agent, run: Run, api: ApiClient
) -> None:
    listed = {tool["name"]: tool for tool in api.get("/api/v1/tools").json()}
    assert set(listed["everything.get-sum"]["input_schema"]["required"]) == {"a", "b"}
    assert listed["everything.echo"]["usable"] is True
    names = {spec.name for spec in mcp.tools_list(mcp.Session(agent))}
    assert {"everything_echo", "everything_get-sum"} <= names
    step = post(agent, run, "everything.echo", input={"message": "over http"})
    assert engine.process(step.pk) == State.COMPLETED
    assert reload(step).result["text"] == "Echo: over http"
    total = post(agent, run, "everything.get-sum", input={"a": 2, "b": 3})
    assert engine.process(total.pk) == State.COMPLETED
    assert "5" in reload(total).result["text"]


@pytest.mark.npm
def test_an_http_upstream_that_answers_too_late_or_dies_is_retried_not_wedged(
    everything: EverythingServer, agent: Agent, run: Run
) -> None:
    slow = post(
        agent, run, "everything.trigger-long-running-operation", input={"duration": 30, "steps": 2}
    )
    assert engine.process(slow.pk) == State.PENDING
    assert "did not answer" in reload(slow).attempts.get().error_message

    everything.kill()
    echo = post(agent, run, "everything.echo", input={"message": "while down"})
    assert engine.process(echo.pk) == State.PENDING
    assert reload(echo).attempts.get().error_class in ("unavailable", "ambiguous")

    everything.start()
    make_due(echo)
    assert engine.process(echo.pk) == State.COMPLETED


@pytest.mark.npm
def test_an_http_upstream_killed_during_a_call_is_retried_and_answers_once_back(
    everything: EverythingServer, agent: Agent, run: Run
) -> None:
    step = post(
        agent, run, "everything.trigger-long-running-operation", input={"duration": 3, "steps": 1}
    )

    def kill_once_submitted() -> None:
        wait_until(
            lambda: Attempt.objects.filter(step_id=step.pk, phase="submitting").exists(),
            30,
            "the call to be submitted",
        )
        everything.kill()

    killer = threading.Thread(target=kill_once_submitted)
    killer.start()
    assert engine.process(step.pk) == State.PENDING
    killer.join()
    # Sent or not, a read's lost answer is simply asked again.
    assert reload(step).attempts.get().error_class in ("unavailable", "ambiguous")

    everything.start()
    make_due(step)
    assert engine.process(step.pk) == State.COMPLETED, [
        (a.error_class, a.error_message) for a in reload(step).attempts.all()
    ]
    assert "Long running operation completed" in reload(step).result["text"]


@pytest.mark.npm
def test_an_npm_server_that_died_between_calls_is_started_again_and_the_write_happens_once(
    agent: Agent, run: Run, up: Upstream, tmp_path: Path, fresh_sessions: None
) -> None:
    graph = tmp_path / "memory.jsonl"
    load(
        agent,
        {
            "name": "memory",
            "command": up.command(node_server("mcp-server-memory")),
            "env": up.env(MEMORY_FILE_PATH=str(graph)),
            "defaults": {"approval": "never"},
        },
    )
    up.kill()
    wait_until(lambda: "memory" not in gateway().open_sessions(), 30, "the session to end")

    entity = {"name": "grace", "entityType": "person", "observations": ["x"]}
    step = post(agent, run, "memory.create_entities", input={"entities": [entity]})

    assert engine.process(step.pk) == State.COMPLETED
    assert reload(step).attempts.count() == 1
    assert entities(graph) == ["grace"]


@pytest.mark.npm
def test_an_http_upstream_whose_host_is_no_longer_allowed_is_refused_before_connecting(
    everything: EverythingServer, agent: Agent, run: Run, settings: Any
) -> None:
    step = post(agent, run, "everything.echo", input={"message": "not allowed now"})
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = []
    assert engine.process(step.pk) == State.FAILED
    assert reload(step).failure_class == "policy_denied"


# --- admin edits the same records ----------------------------------------------------------


def test_admin_shows_what_the_upstream_lists_and_checks_an_edit_like_load_tools(
    git: ToolsLoaded, client: Client, owner: Any
) -> None:
    client.force_login(owner)
    row = McpUpstream.objects.get(name="git")
    url = reverse("admin:executor_mcpupstream_change", args=[row.pk])
    page = client.get(url).content.decode()
    assert "git.git_commit" in page
    assert "effect from annotations" in page
    assert "mcp-git" in page

    def form(**changes: str) -> dict[str, str]:
        fields = {
            "name": row.name,
            "description": "",
            "command": json.dumps(row.command),
            "cwd": "",
            "env": json.dumps(row.env),
            "url": "",
            "headers": "{}",
            "trust_annotations": "on",
            "defaults": json.dumps(row.defaults),
            "tool_settings": "{}",
            "timeout_seconds": "20",
        }
        return {**fields, **changes}

    bad = client.post(url, form(tool_settings='{"git_commit": {"approval": "maybe"}}'))
    assert bad.status_code == 200
    assert "tools.git_commit.approval" in bad.content.decode()
    assert McpUpstream.objects.get(pk=row.pk).tool_settings == {}

    good = client.post(url, form(tool_settings='{"git_commit": {"approval": "always"}}'))
    assert good.status_code == 302
    tool = find_tool("git.git_commit")
    assert tool is not None
    assert tool.needs_approval()


def test_a_write_declared_to_fail_after_acting_leaves_an_unread_error_to_a_person(
    agent: Agent, run: Run, up: Upstream, repo: GitRepo, fresh_sessions: None
) -> None:
    load(agent, git_upstream_table(up, repo, tools={"git_checkout": {"on_error": "unknown"}}))
    step = post(
        agent,
        run,
        "git.git_checkout",
        input={"repo_path": str(repo.path), "branch_name": "no-such-branch"},
    )
    assert engine.process(step.pk) == State.UNKNOWN
    assert reload(step).failure_class == "ambiguous"


# --- the README's example --------------------------------------------------------------------

EXAMPLE = ROOT / "examples" / "git-upstream.toml"


def test_the_readmes_upstream_is_the_example_file_word_for_word() -> None:
    example = EXAMPLE.read_text().strip()
    for page in (ROOT / "README.md", ROOT / "docs" / "mcp.md"):
        assert f"```toml\n{example}\n```" in page.read_text(), page


def test_the_example_file_loads_and_lists_the_git_tools(
    agent: Agent, tmp_path: Path, fresh_sessions: None
) -> None:
    repo = git_repo(tmp_path, tmp_path)
    file = read_tool_file(EXAMPLE)
    [table] = file.upstreams
    table["command"] = [
        str(repo.path) if part.startswith("/tmp/") else part for part in table["command"]
    ]
    report = tools_load(tables=file.tools, upstreams=file.upstreams)
    assert report.listed[0].error == ""
    assert {"git.git_status", "git.git_commit", "git.git_reset"} <= set(report.listed[0].tools)
    commit = find_tool("git.git_commit")
    assert commit is not None
    assert commit.needs_approval()


def test_a_forked_child_opens_sessions_of_its_own(
    up: Upstream, repo: GitRepo, fresh_sessions: None
) -> None:
    """Celery's pool forks its processes: a child inherits the gateway, not its loop."""
    target = target_for(
        "git", {**git_upstream_table(up, repo), "cwd": "", "url": "", "headers": {}}
    )
    assert gateway().list_tools(target, timeout=20).tools  # the parent's loop and session
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's outcome is its exit status
        try:
            listed = gateway().list_tools(target, timeout=20)
            os._exit(0 if any(tool.name == "git_commit" for tool in listed.tools) else 1)
        except BaseException:  # noqa: BLE001
            os._exit(2)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gateway().list_tools(target, timeout=20).tools  # the parent's still works


def test_calls_queued_behind_a_hung_start_are_all_unsent_and_leave_no_process(
    up: Upstream, repo: GitRepo, settings: Any, fresh_sessions: None
) -> None:
    settings.EXECUTOR_UPSTREAM_START_SECONDS = 2
    up.set("hang")
    table = {**git_upstream_table(up, repo), "cwd": "", "url": "", "headers": {}}
    target = target_for("git", table)
    outcomes: list[BaseException | None] = []

    def call() -> None:
        try:
            gateway().call(target, "git_commit", {"repo_path": "x", "message": "m"}, timeout=1)
            outcomes.append(None)
        except BaseException as error:  # noqa: BLE001 - what each call ended with is the point
            outcomes.append(error)

    threads = [threading.Thread(target=call) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # Nothing was sent, so none of them may pass for a lost answer (a write would go to a
    # person for a call that never ran); one start was tried for them all.
    assert [type(outcome) for outcome in outcomes] == [Unreachable] * 6
    hung = up.pid()
    wait_until(lambda: not alive(hung), 30, "the hung upstream to be ended")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of an ended child counts as gone.
    with contextlib.suppress(OSError):
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    return False


@pytest.mark.npm
def test_a_write_to_an_http_upstream_that_restarted_or_is_down_is_unsent_not_unknown(
    everything: EverythingServer, agent: Agent, run: Run
) -> None:
    # toggle-simulated-logging is a write that is not idempotent (its annotations say so).
    first = post(agent, run, "everything.toggle-simulated-logging", input={})
    assert engine.process(first.pk) == State.COMPLETED

    everything.kill()
    everything.start()  # same port, a new process: it knows nothing of our session
    after_restart = post(agent, run, "everything.toggle-simulated-logging", input={})
    assert engine.process(after_restart.pk) == State.PENDING
    attempt = reload(after_restart).attempts.get()
    assert attempt.error_class == "unavailable", attempt.error_message
    assert "was not delivered" in attempt.error_message

    everything.kill()
    while_down = post(agent, run, "everything.toggle-simulated-logging", input={})
    assert engine.process(while_down.pk) == State.PENDING
    assert reload(while_down).attempts.get().error_class == "unavailable"

    everything.start()
    make_due(after_restart)
    assert engine.process(after_restart.pk) == State.COMPLETED


# --- the whole contract, on an upstream's tools too ---------------------------------------


def test_the_upstream_is_started_once_and_kept_warm_between_calls(
    git: ToolsLoaded, agent: Agent, run: Run, up: Upstream, repo: GitRepo
) -> None:
    """One session per upstream per worker process, kept between calls: every start of the
    upstream writes its pid, so the same pid after many calls means no new process."""
    first = commit(agent, run, repo, "warm 0")
    assert engine.process(first.pk) == State.COMPLETED
    started = up.pid()
    for number in range(1, 4):
        step = commit(agent, run, repo, f"warm {number}")
        assert engine.process(step.pk) == State.COMPLETED
    read = post(agent, run, "git.git_status", input={"repo_path": str(repo.path)})
    assert engine.process(read.pk) == State.COMPLETED

    assert up.pid() == started
    assert alive(started)
    assert [repo.commits_with(f"warm {n}") for n in range(4)] == [1, 1, 1, 1]


def test_a_runs_budget_stops_the_calls_to_the_upstream_beyond_it(
    git: ToolsLoaded, agent: Agent, repo: GitRepo
) -> None:
    capped, _ = run_create(agent=agent, name="two commits at most", max_calls=2)
    steps = [commit(agent, capped, repo, f"budgeted {n}") for n in range(4)]

    engine.drain(worker="w1")
    run_every_automatic_path()

    fresh = Run.objects.get(pk=capped.pk)
    assert (fresh.status, fresh.used_calls) == (RunStatus.PAUSED, 2)
    assert sorted(reload(s).state for s in steps) == sorted(
        [State.COMPLETED] * 2 + [State.PENDING] * 2
    )
    assert sum(repo.commits_with(f"budgeted {n}") for n in range(4)) == 2
    # The steps beyond the budget were never sent: no attempt reached the upstream.
    for step in steps:
        if reload(step).state == State.PENDING:
            assert not reload(step).attempts.exclude(request_evidence=None).exists()


def test_a_redacted_field_reaches_the_upstream_and_no_surface_shows_it(
    agent: Agent,
    run: Run,
    up: Upstream,
    repo: GitRepo,
    api: ApiClient,
    reviewer: Any,
    owner: Any,
    fresh_sessions: None,
) -> None:
    from tests.executor.test_redaction import surfaces

    load(agent, git_upstream_table(up, repo, tools={"git_commit": {"redact": ["message"]}}))
    message = "Rotate the vault token 7f3c9e1a-never-shown"
    step = commit(agent, run, repo, message)

    assert engine.process(step.pk) == State.COMPLETED
    # The upstream got the real message: it is the commit's.
    assert repo.commits_with(message) == 1

    shown = surfaces(api, run, [reload(step)], reviewer, owner)
    leaked = [surface for surface, text in shown.items() if "7f3c9e1a" in text]
    assert leaked == []
    assert "committed" in shown[f"api: step {step.key}"].lower()
    evidence = reload(step).attempts.get().request_evidence
    assert evidence["upstream"] == "git"
    assert "7f3c9e1a" not in json.dumps(evidence)


def test_a_worker_whose_lease_was_taken_over_never_sends_the_write(
    git: ToolsLoaded, agent: Agent, run: Run, repo: GitRepo
) -> None:
    step = commit(agent, run, repo, "fenced before sending")
    claims = engine.claim(worker="A", writes=10).claims
    assert [c.step.pk for c in claims] == [step.pk]
    Step.objects.filter(pk=step.pk).update(fence=step.fence + 5)  # another worker's now

    ready, stopped = engine.submit_many(claims, now=timezone.now())

    assert ready == []
    assert stopped == {step.pk: engine.Outcome.FENCED_OUT}
    assert Attempt.objects.get(step=step, worker="A").fenced_out_write == "submitting"
    assert repo.commits_with("fenced before sending") == 0


def test_a_stale_workers_answer_from_the_upstream_is_refused_by_the_fence(
    git: ToolsLoaded, agent: Agent, run: Run, up: Upstream, repo: GitRepo
) -> None:
    """The commit happened while another worker took the step over: the stale worker's
    answer moves nothing (its evidence is kept on its attempt), and nothing sends it again."""
    step = commit(agent, run, repo, "answered too late")
    up.set("slow")  # the hook holds the call after the commit

    def take_over_meanwhile() -> None:
        up.wait_for("in-hook")
        taken = Step.objects.get(pk=step.pk)
        Step.objects.filter(pk=step.pk).update(fence=taken.fence + 5)
        up.set("slow", on=False)

    other = threading.Thread(target=take_over_meanwhile)
    other.start()
    ended = engine.process(step.pk, worker="A")
    other.join()

    assert ended == engine.Outcome.FENCED_OUT
    after = reload(step)
    assert after.state == State.RUNNING  # the other worker's to move, not A's
    assert not after.events.filter(to_state=State.COMPLETED).exists()
    attempt = after.attempts.get(worker="A")
    assert attempt.fenced_out_write == "responded"
    assert repo.commits_with("answered too late") == 1


def test_each_call_tells_the_upstream_its_operation_step_and_fence(
    agent: Agent, run: Run, tmp_path: Path, fresh_sessions: None
) -> None:
    """`_meta` on the call (API.md "MCP gateway"), for servers that deduplicate or fence:
    read by a server built on the official SDK."""
    recorded = tmp_path / "meta.jsonl"
    report = load(
        agent,
        {
            "name": "meta",
            "command": [sys.executable, str(ROOT / "tests" / "upstreams" / "meta_server.py")],
            "env": {"STEPWARD_META_FILE": str(recorded)},
            "defaults": {"approval": "never", "effect": "write", "idempotency": "idempotent"},
        },
    )
    assert [listed.error for listed in report.listed] == [""]
    step = post(agent, run, "meta.record", input={"note": "hello"})

    assert engine.process(step.pk) == State.COMPLETED

    done = reload(step)
    assert done.result["text"] == "recorded hello"
    [line] = recorded.read_text().splitlines()
    seen = json.loads(line)
    assert seen["note"] == "hello"
    assert seen["meta"]["stepward/operation_id"] == str(done.operation_id)
    assert seen["meta"]["stepward/step_id"] == str(done.pk)
    assert seen["meta"]["stepward/fence"] == done.attempts.get().fence


def test_an_upstreams_tools_are_granted_per_agent_like_any_other(
    agent: Agent, run: Run, up: Upstream, repo: GitRepo, api: ApiClient, fresh_sessions: None
) -> None:
    """A new upstream tool is usable by no agent until granted; this one gets git_status only,
    and the commit is neither listed to it over MCP nor callable, by MCP or by the API."""
    report = tools_load(tables=[], upstreams=[git_upstream_table(up, repo)])
    assert [listed.error for listed in report.listed] == [""]
    agent_set_tools(agent=agent, tools=["echo", "git.git_status"])

    listed = {tool["name"]: tool for tool in api.get("/api/v1/tools").json()}
    assert listed["git.git_status"]["usable"] is True
    assert listed["git.git_commit"]["usable"] is False
    session = mcp.Session(agent)
    names = {spec.name for spec in mcp.tools_list(session)}
    assert "git_git_status" in names
    assert "git_git_commit" not in names

    arguments = {"repo_path": str(repo.path), "message": "not granted"}
    refused = mcp.tools_call(session, "git_git_commit", {**arguments, "key": "c"})
    assert refused.is_error
    assert refused.structured["error"] == "unknown_tool"
    posted = api.post(
        f"/api/v1/runs/{run.pk}/steps", {"key": "c", "tool": "git.git_commit", "input": arguments}
    )
    assert posted.status_code == 403, posted.content
    assert not Step.objects.filter(tool_id="git.git_commit").exists()
    assert repo.commits_with("not granted") == 0
