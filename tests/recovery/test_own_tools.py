"""A deployment's own tools with real processes (API.md "Your own tools"): a Python tool from
a module named in STEPWARD_TOOLS, and HTTP tools loaded from TOML, run by a real worker
against the desk, posted through the agents' HTTP API. The two examples are docs/tools.md's
own, copied from it here, so the docs cannot drift.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command

from executor.contract.tool import unregister
from executor.ledger.records import Agent, Attempt, Phase, Run, Step
from executor.ledger.states import State
from executor.services.accounts import agent_create, agent_set_tools, reviewer_create
from executor.services.posting import step_post
from executor.services.reviews import compensation_request, step_approve
from executor.services.tools import tools_sync
from executor.tools import http as http_tools
from stepward_client.client import Stepward
from tests.support.cluster import Cluster

pytestmark = pytest.mark.django_db(transaction=True)

TOOLS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "tools.md"
MAKE_RUN_DESK = "http://127.0.0.1:8765"


def readme_example(language: str) -> str:
    """The first ```language block of docs/tools.md ("Add your own tool")."""
    match = re.search(rf"```{language}\n(.*?)```", TOOLS_PAGE.read_text(), flags=re.DOTALL)
    assert match, f"no {language} example in docs/tools.md"
    return match.group(1)


@pytest.fixture
def tool_env(cluster: Cluster, tmp_path: Path, settings: Any) -> Iterator[dict[str, str]]:
    """docs/tools.md's Python example as a module on the path, and the allow-list for the desk;
    the same for the workers this test starts."""
    (tmp_path / "acme_tools.py").write_text(readme_example("python"))
    desk_host = f"127.0.0.1:{cluster.desk.port}"
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = [desk_host]
    settings.TICKETDESK_URL = cluster.desk.url
    spec = importlib.util.spec_from_file_location("acme_tools", tmp_path / "acme_tools.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["acme_tools"] = module
    spec.loader.exec_module(module)  # registers acme.escalate in this process
    yield {
        "STEPWARD_TOOLS": "executor.tools.builtins,acme_tools",
        "PYTHONPATH": str(tmp_path),
        "EXECUTOR_HTTP_ALLOWED_HOSTS": desk_host,
        "EXECUTOR_TOOL_REFRESH_SECONDS": "0.2",
        "DESK_TOKEN": "desk-token-for-the-test",
    }
    unregister("acme.escalate")
    sys.modules.pop("acme_tools", None)
    for name in ("desk.open_ticket", "desk.close_ticket"):
        unregister(name)
    http_tools._mine.clear()


@pytest.fixture
def client(live_server: Any, agent: Agent) -> Iterator[Stepward]:
    _, token = agent_create(workspace=agent.workspace, name="web-agent")
    with Stepward(live_server.url, token) as client:
        yield client


def load_readme_tools(
    cluster: Cluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    edits: tuple[tuple[str, str], ...] = (),
) -> None:
    """Loads docs/tools.md's TOML example against this test's desk; every agent may use it."""
    monkeypatch.setenv("DESK_TOKEN", "desk-token-for-the-test")
    text = readme_example("toml")
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "tools.toml"
    path.write_text(text.replace(MAKE_RUN_DESK, cluster.desk.url))
    call_command("load_tools", str(path), stdout=StringIO())
    for agent in Agent.objects.all():
        agent_set_tools(agent=agent, tools=None)


def test_a_python_tool_from_stepward_tools_completes_in_a_real_worker(
    cluster: Cluster, tool_env: dict[str, str], client: Stepward
) -> None:
    tools_sync()
    cluster.worker().start(**tool_env)
    run = client.run("escalations", key="esc-1")

    posted = run.step("printer", "acme.escalate", {"title": "printer on fire"})
    done = cluster.wait_settled(Step.objects.get(pk=posted.id))

    assert done.state == State.COMPLETED, cluster.diagnose()
    assert cluster.desk.ticket_ids(done.operation_id) == [int(done.external_id)]
    assert done.result["title"] == "URGENT printer on fire"


def test_an_http_tool_from_toml_completes_through_a_503_with_one_effect(
    cluster: Cluster,
    tool_env: dict[str, str],
    client: Stepward,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # docs/tools.md's tool, made safe to repeat: the desk's keyed route and the header.
    load_readme_tools(
        cluster,
        tmp_path,
        monkeypatch,
        edits=(
            ('/tickets"', '/tickets/keyed"'),
            ('name = "desk.open_ticket"', 'name = "desk.open_ticket"\nidempotency = "header"'),
            (
                "max_attempts = 5, initial_interval = 1.0",
                "max_attempts = 50, initial_interval = 0.1",
            ),
            ("max_interval = 60.0", "max_interval = 0.2"),
        ),
    )
    cluster.desk.faults(error_503_rate=1.0)
    cluster.worker().start(**tool_env)
    run = client.run("tickets", key="keyed-1")

    posted = run.step("t1", "desk.open_ticket", {"title": "through a 503"})
    step = Step.objects.get(pk=posted.id)
    cluster.wait_for(
        lambda: Attempt.objects.filter(step=step, phase=Phase.ERRORED).exists(),
        what="the first attempt to meet the 503",
    )
    cluster.desk.faults(reset=True)
    done = cluster.wait_settled(step)

    assert done.state == State.COMPLETED, cluster.diagnose()
    assert cluster.desk.ticket_ids(done.operation_id) == [int(done.external_id)]
    errors = set(done.attempts.exclude(phase=Phase.RESPONDED).values_list("error_class", flat=True))
    assert errors == {"ambiguous"}


def test_a_non_idempotent_http_tool_dropped_after_the_effect_is_reconciled_by_its_lookup(
    cluster: Cluster,
    tool_env: dict[str, str],
    client: Stepward,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    load_readme_tools(cluster, tmp_path, monkeypatch)
    cluster.desk.faults(drop_after_commit_rate=1.0)
    cluster.worker().start(**tool_env)
    cluster.sweeper().start(**tool_env)
    run = client.run("tickets", key="dropped-1")

    posted = run.step("t1", "desk.open_ticket", {"title": "dropped after commit"})
    done = cluster.wait_settled(Step.objects.get(pk=posted.id))

    assert done.state == State.COMPLETED, cluster.diagnose()
    states = list(done.events.order_by("seq").values_list("to_state", flat=True))
    assert states[-3:] == [State.UNKNOWN, State.VERIFYING, State.COMPLETED]
    assert cluster.desk.ticket_ids(done.operation_id) == [int(done.external_id)]
    assert [a.phase for a in done.attempts.all()] == [Phase.ERRORED]  # sent once


def test_the_readme_toml_compensates_with_its_close_tool(
    cluster: Cluster,
    tool_env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    agent: Agent,
    run: Run,
    reviewer: Any,
) -> None:
    load_readme_tools(cluster, tmp_path, monkeypatch)
    cluster.worker().start(**tool_env)
    step, _ = step_post(
        agent=agent, run=run, key="t", tool_name="desk.open_ticket", input={"title": "undo me"}
    )
    done = cluster.wait_settled(step)
    assert done.state == State.COMPLETED, cluster.diagnose()

    undo = compensation_request(step=done, user=reviewer, version=done.version, reason="x")
    # Four eyes: another reviewer approves what bob asked for.
    approver = reviewer_create(workspace=agent.workspace, username="erin")
    step_approve(step=undo, user=approver, version=undo.version, reason="undo it")

    assert cluster.wait_settled(undo).state == State.COMPLETED, cluster.diagnose()
    assert Step.objects.get(pk=step.pk).state == State.COMPENSATED
    [ticket] = cluster.desk.tickets(client_ref=str(done.operation_id))
    assert ticket["status"] == "closed"
