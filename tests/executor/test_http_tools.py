"""HTTP tools defined as data (API.md "Your own tools"), against the ticket desk in its own
process: `load_tools` refuses a bad file naming the tool and the field and writes nothing;
a loaded tool runs through the engine like any tool, answers map to failure classes, the
lookup reconciles a dropped connection, a `${SECRET}` is never shown, an edit is a new
policy version, and agents use only the tools granted to them."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse
from guardian.shortcuts import assign_perm

from executor import engine
from executor.common import dispatch
from executor.contract.tool import get_tool, unregister
from executor.drill.processes import DeskProcess
from executor.engine import recovery
from executor.ledger.records import Agent, Approval, Attempt, Event, HttpToolSpec, Run, Step
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import State
from executor.policy import authorization
from executor.services.accounts import agent_set_tools
from executor.services.posting import step_post
from executor.services.reviews import compensation_request, step_approve
from executor.tools import http as http_tools
from tests.support.api import ApiClient

pytestmark = pytest.mark.django_db

SECRET = "desk-secret-7d1c9a55"


@pytest.fixture(scope="module")
def desk_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeskProcess]:
    desk = DeskProcess(tmp_path_factory.mktemp("http-tools-desk"), dict(os.environ)).start()
    yield desk
    desk.stop()


@pytest.fixture
def desk(desk_process: DeskProcess, settings: Any) -> Iterator[httpx.Client]:
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{desk_process.port}"]
    client = httpx.Client(base_url=desk_process.url, timeout=10)
    client.post("/faults", json={"reset": True})
    yield client
    client.post("/faults", json={"reset": True})
    client.close()


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    with dispatch.publishing(dispatch.dropping_publisher):
        yield
    for spec in HttpToolSpec.objects.all():
        unregister(spec.name)
    http_tools._mine.clear()


@pytest.fixture(autouse=True)
def desk_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DESK_SECRET", SECRET)


def toml(desk: httpx.Client, body: str) -> str:
    return textwrap.dedent(body).replace("@DESK@", str(desk.base_url).rstrip("/"))


DESK_TOOLS = """
    [[tool]]
    name = "desk.create_ticket"
    description = "Opens a ticket; not idempotent, with an authoritative lookup"
    effect = "write"
    method = "POST"
    url = "@DESK@/tickets"
    headers = { Authorization = "Bearer ${DESK_SECRET}" }
    lookup_url = "@DESK@/tickets?client_ref={operation_id}"
    lookup_found = "count"
    external_id = "ticket_id"
    compensation = "desk.close_ticket"
    input_schema = { type = "object", required = ["title"] }
    retry = { max_attempts = 3, initial_interval = 0.01, max_interval = 0.01, deadline = 60.0 }

    [[tool]]
    name = "desk.create_ticket_keyed"
    effect = "write"
    method = "POST"
    url = "@DESK@/tickets/keyed"
    idempotency = "header"
    idempotency_header = "Idempotency-Key"
    external_id = "ticket_id"
    input_schema = { type = "object", required = ["title"] }
    retry = { max_attempts = 5, initial_interval = 0.01, max_interval = 0.01, deadline = 60.0 }

    [[tool]]
    name = "desk.close_ticket"
    effect = "write"
    method = "POST"
    url = "@DESK@/tickets/{ticket_id}/close"
    idempotency = "header"
    external_id = "ticket_id"

    [[tool]]
    name = "desk.echo"
    effect = "read"
    method = "POST"
    url = "@DESK@/echo"
    headers = { Authorization = "Bearer ${DESK_SECRET}", X-Note = "sent ${DESK_SECRET} twice" }
"""


def load(tmp_path: Path, text: str, *options: str) -> list[str]:
    path = tmp_path / "tools.toml"
    path.write_text(text)
    out = StringIO()
    call_command("load_tools", str(path), *options, stdout=out, stderr=StringIO())
    return out.getvalue().splitlines()


def refused(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tools.toml"
    path.write_text(text)
    err = StringIO()
    with pytest.raises(CommandError, match="nothing was loaded"):
        call_command("load_tools", str(path), stdout=StringIO(), stderr=err)
    return err.getvalue()


@pytest.fixture
def loaded(desk: httpx.Client, tmp_path: Path, agent: Agent) -> httpx.Client:
    load(tmp_path, toml(desk, DESK_TOOLS))
    agent_set_tools(agent=agent, tools=None)
    return desk


def post(agent: Agent, run: Run, tool: str, key: str, **input: Any) -> Step:
    step, created = step_post(agent=agent, run=run, key=key, tool_name=tool, input=input)
    assert created
    return step


def tickets(desk: httpx.Client, step: Step) -> list[int]:
    answer = desk.get("/tickets", params={"client_ref": str(step.operation_id)}).json()
    return [ticket["ticket_id"] for ticket in answer["tickets"]]


# --- loading ----------------------------------------------------------------------------------


def test_load_tools_creates_the_files_tools_and_lists_them_in_the_api(
    loaded: httpx.Client, api: ApiClient
) -> None:
    listed = {tool["name"]: tool for tool in api.get("/api/v1/tools").json()}

    assert listed["desk.create_ticket"]["effect"] == "write"
    assert listed["desk.create_ticket"]["has_lookup"] is True
    assert listed["desk.create_ticket"]["compensation"] == "desk.close_ticket"
    assert listed["desk.create_ticket_keyed"]["idempotency"] == "key"
    assert listed["desk.echo"]["usable"] is True
    assert ToolRow.objects.get(name="desk.echo").registered


def test_loading_the_same_file_again_changes_nothing(loaded: httpx.Client, tmp_path: Path) -> None:
    lines = load(tmp_path, toml(loaded, DESK_TOOLS))

    assert lines[0] == (
        "4 tools were unchanged: desk.close_ticket, desk.create_ticket, desk.create_ticket_keyed, "
        "desk.echo"
    )


BAD_FILES = {
    "host outside the allow-list": (
        ('url = "@DESK@/echo"', 'url = "http://example.org/echo"'),
        "tool desk.echo: field 'url': host example.org",
    ),
    "unknown field": (
        ('effect = "read"', 'effect = "read"\n    colour = "blue"'),
        "tool desk.echo: field 'colour': unknown field",
    ),
    "bad schema": (
        ('input_schema = { type = "object", required = ["title"] }\n    retry = { max_attempts = 5',
         'input_schema = { type = "list" }\n    retry = { max_attempts = 5'),
        "tool desk.create_ticket_keyed: field 'input_schema'",
    ),
    "unknown compensation": (
        ('compensation = "desk.close_ticket"', 'compensation = "desk.nothing"'),
        "tool desk.create_ticket: field 'compensation': names no tool",
    ),
    "a name code took": (
        ('name = "desk.echo"', 'name = "echo"'),
        "tool echo: field 'name': a tool of that name is defined in code",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("change", "named"), BAD_FILES.values(), ids=BAD_FILES.keys())
def test_a_bad_file_is_refused_naming_the_tool_and_the_field_and_writes_nothing(
    desk: httpx.Client, tmp_path: Path, change: tuple[str, str], named: str
) -> None:
    text = toml(desk, DESK_TOOLS.replace(*change))

    problems = refused(tmp_path, text)

    assert named in problems
    assert HttpToolSpec.objects.count() == 0
    assert not ToolRow.objects.filter(name__startswith="desk.").exists()


def test_check_writes_nothing_and_prune_removes_what_the_file_does_not_name(
    loaded: httpx.Client, tmp_path: Path
) -> None:
    only_echo = toml(loaded, '[[tool]]\nname = "desk.echo"\neffect = "read"\nurl = "@DESK@/echo"\n')

    checked = load(tmp_path, only_echo, "--check", "--prune")

    assert any("would be removed" in line for line in checked)
    assert HttpToolSpec.objects.count() == 4
    load(tmp_path, only_echo, "--prune")
    assert list(HttpToolSpec.objects.values_list("name", flat=True)) == ["desk.echo"]
    with pytest.raises(LookupError):
        get_tool("desk.create_ticket")
    assert not ToolRow.objects.get(name="desk.create_ticket").registered


# --- running --------------------------------------------------------------------------------------


def test_a_loaded_tool_runs_through_the_engine_and_compensates(
    loaded: httpx.Client, agent: Agent, run: Run, reviewer: User, settings: Any
) -> None:
    settings.EXECUTOR_ALLOW_SELF_APPROVAL = True  # one reviewer requests and approves
    step = post(agent, run, "desk.create_ticket", "open", title="printer on fire")

    assert engine.process(step.pk, worker="w1") == State.COMPLETED

    done = Step.objects.get(pk=step.pk)
    assert tickets(loaded, step) == [int(done.external_id)]
    assert done.result["title"] == "printer on fire"
    undo = compensation_request(step=done, user=reviewer, version=done.version, reason="x")
    step_approve(step=undo, user=reviewer, version=undo.version, reason="undo it")
    assert engine.process(undo.pk, worker="w1") == State.COMPLETED
    ticket = loaded.get(f"/tickets/{done.external_id}").json()
    assert ticket["status"] == "closed"
    assert Step.objects.get(pk=step.pk).state == State.COMPENSATED


def test_a_keyed_tool_retries_through_a_503_with_one_effect(
    loaded: httpx.Client, agent: Agent, run: Run
) -> None:
    step = post(agent, run, "desk.create_ticket_keyed", "keyed", title="one ticket")
    loaded.post("/faults", json={"error_503_rate": 1.0})
    assert engine.process(step.pk, worker="w1") == State.PENDING  # ambiguous, but keyed
    loaded.post("/faults", json={"reset": True})
    Step.objects.filter(pk=step.pk).update(not_before=None)

    assert engine.process(step.pk, worker="w1") == State.COMPLETED

    assert len(tickets(loaded, step)) == 1
    errored = Attempt.objects.get(step=step, number=1)
    assert (errored.error_class, errored.response_evidence["status"]) == ("ambiguous", 503)


def test_a_dropped_connection_after_the_effect_is_unknown_then_found_by_the_lookup(
    loaded: httpx.Client, agent: Agent, run: Run
) -> None:
    step = post(agent, run, "desk.create_ticket", "dropped", title="dropped")
    loaded.post("/faults", json={"drop_after_commit_rate": 1.0})

    assert engine.process(step.pk, worker="w1") == State.UNKNOWN
    loaded.post("/faults", json={"reset": True})
    assert recovery.reconcile(step.pk) == State.COMPLETED

    done = Step.objects.get(pk=step.pk)
    assert tickets(loaded, step) == [int(done.external_id)]
    assert [a.phase for a in done.attempts.all()] == ["errored"]


def test_answers_map_to_failure_classes(loaded: httpx.Client, agent: Agent, run: Run) -> None:
    step = post(agent, run, "desk.create_ticket", "bad", title="")  # the desk answers 400

    assert engine.process(step.pk, worker="w1") == State.FAILED

    failed = Step.objects.get(pk=step.pk)
    assert failed.failure_class == "invalid_input"
    assert "400" in failed.failure_message


def test_a_host_taken_off_the_allow_list_is_refused_before_the_call(
    loaded: httpx.Client, agent: Agent, run: Run, settings: Any
) -> None:
    step = post(agent, run, "desk.echo", "echo", note="hi")
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = []

    assert engine.process(step.pk, worker="w1") == State.FAILED

    assert Step.objects.get(pk=step.pk).failure_class == "policy_denied"


# --- secrets, versions, grants ---------------------------------------------------------------


def test_a_secret_header_value_is_never_shown(
    loaded: httpx.Client, agent: Agent, run: Run, api: ApiClient, reviewer: User, owner: User
) -> None:
    step = post(agent, run, "desk.echo", "echo", note="hello")
    assert engine.process(step.pk, worker="w1") == State.COMPLETED
    done = Step.objects.get(pk=step.pk)
    assert "Authorization" in done.result["headers"]  # the desk did echo it

    console, admin = Client(), Client()
    console.force_login(reviewer)
    admin.force_login(owner)
    spec = HttpToolSpec.objects.get(name="desk.echo")
    shown = [
        api.get(f"/api/v1/steps/{step.pk}").content.decode(),
        api.get(f"/api/v1/runs/{run.pk}/report").content.decode(),
        console.get(reverse("step", args=[step.pk])).content.decode(),
        admin.get(reverse("admin:executor_step_change", args=[step.pk])).content.decode(),
        admin.get(reverse("admin:executor_httptoolspec_change", args=[spec.pk])).content.decode(),
        str(list(Attempt.objects.filter(step=step).values())),
        str(list(Event.objects.filter(step=step).values())),
        str(done.result),
        str(list(HttpToolSpec.objects.values())),
    ]
    assert [SECRET in text for text in shown] == [False] * len(shown)
    assert "Bearer ${DESK_SECRET}" in shown[4]  # the template is what is stored and shown


def test_an_edited_tool_is_a_new_policy_version_so_earlier_approvals_fail(
    loaded: httpx.Client, agent: Agent, run: Run, reviewer: User, tmp_path: Path
) -> None:
    echo = 'url = "@DESK@/echo"'
    gated = DESK_TOOLS.replace(echo, f'{echo}\n    approval = "always"')
    load(tmp_path, toml(loaded, gated))
    step = post(agent, run, "desk.echo", "gated", note="x")
    assert step.state == State.PLANNED
    step_approve(step=step, user=reviewer, version=step.version, reason="ok")
    before = get_tool("desk.echo").policy_version()

    load(tmp_path, toml(loaded, gated.replace('X-Note = "sent', 'X-Note = "now')))

    assert get_tool("desk.echo").policy_version() != before
    assert engine.process(step.pk, worker="w1") == State.BLOCKED
    assert "policy changed" in Step.objects.get(pk=step.pk).failure_message
    assert Approval.objects.get(step=step).policy_version == before


def test_a_new_tool_is_usable_only_once_granted(
    desk: httpx.Client, tmp_path: Path, agent: Agent, run: Run, api: ApiClient
) -> None:
    load(tmp_path, toml(desk, DESK_TOOLS))

    listed = {tool["name"]: tool["usable"] for tool in api.get("/api/v1/tools").json()}
    assert listed["desk.echo"] is False
    refused_post = api.post(
        f"/api/v1/runs/{run.pk}/steps", {"key": "k", "tool": "desk.echo", "input": {}}
    )
    assert refused_post.status_code == 403

    assign_perm("executor.use_tool", agent.user, ToolRow.objects.get(name="desk.echo"))

    assert {t["name"]: t["usable"] for t in api.get("/api/v1/tools").json()}["desk.echo"]


def test_create_agent_grants_only_the_tools_named(desk: httpx.Client, tmp_path: Path) -> None:
    load(tmp_path, toml(desk, DESK_TOOLS))
    out = StringIO()

    call_command("create_agent", "picky", workspace="acme", tools="echo,desk.echo", stdout=out)

    agent = Agent.objects.get(name="picky")
    usable = authorization.grants(
        users=[agent.user_id], workspaces=[], tools=["echo", "desk.echo", "http.get"]
    )
    assert {tool for _, codename, _, tool in usable if codename == "use_tool"} == {
        "echo",
        "desk.echo",
    }
    assert "use_tool on: desk.echo, echo" in out.getvalue()
    with pytest.raises(CommandError, match="no such tool: nope"):
        call_command("create_agent", "other", workspace="acme", tools="nope", stdout=StringIO())
