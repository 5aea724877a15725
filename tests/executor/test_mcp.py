"""The MCP rules without a transport (executor/mcp.py): names, schemas, what each state
answers, refusals. The SDK's clients against real processes are in tests/recovery/test_mcp.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from executor import mcp, services
from executor.models import Agent, Run, RunStatus, Step
from executor.states import State
from tests.support.factories import step_in

SECRET = "sk-live-0123456789abcdef"


@pytest.fixture
def session(agent: Agent, settings: Any) -> mcp.Session:
    settings.MCP_WAIT_SECONDS = 0  # nothing runs the steps here: answer at once
    return mcp.Session.new(agent, base_url="https://stepward.example.com")


def test_names_are_ones_every_client_accepts_and_map_back_one_to_one() -> None:
    names = mcp.names_for(["ticketdesk.create", "ticketdesk_create", "step.status", "x" * 80])
    assert all(mcp.NAME_PATTERN.fullmatch(name) for name in names)
    assert sorted(names.values()) == sorted(
        ["ticketdesk.create", "ticketdesk_create", "step.status", "x" * 80]
    )
    assert "step_status" not in names  # the server's own tool keeps its name
    assert mcp.mcp_name("ticketdesk.create") == "ticketdesk_create"


def test_key_and_run_are_added_without_hiding_a_tools_own_fields() -> None:
    plain = mcp.with_controls({"type": "object", "properties": {"title": {"type": "string"}}})
    assert set(plain["properties"]) == {"title", "key", "run"}
    schema = {"type": "object", "properties": {"key": {"type": "integer"}}}
    own = mcp.with_controls(schema)
    assert own["properties"]["key"] == {"type": "integer"}
    assert {"stepward_key", "run"} <= set(own["properties"])
    assert mcp.control_names(schema) == ("stepward_key", "run")


def test_the_tools_listed_are_the_ones_the_agent_may_use(session: mcp.Session) -> None:
    services.agent_set_tools(agent=session.agent, tools=["echo"])
    names = {spec.name for spec in mcp.tools_list(session)}
    assert names == {"echo", "step_status", "run_report"}


def test_a_completed_step_answers_its_result(session: mcp.Session, run: Run) -> None:
    step = step_in(run, State.COMPLETED)
    Step.objects.filter(pk=step.pk).update(result={"ticket_id": 7})
    answer = mcp.step_answer(session, Step.objects.select_related("run").get(pk=step.pk))
    assert not answer.is_error
    assert answer.structured is not None
    assert answer.structured["result"] == {"ticket_id": 7}
    assert answer.structured["console_url"] == (f"https://stepward.example.com/steps/{step.pk}/")
    assert '"ticket_id": 7' in answer.text


@pytest.mark.parametrize(
    ("state", "words"),
    [
        (State.UNKNOWN, "Outcome unknown"),
        (State.BLOCKED, "Blocked"),
        (State.PLANNED, "Awaiting approval"),
        (State.PENDING, "Still running"),
    ],
)
def test_a_step_waiting_answers_what_to_do_never_an_error(
    session: mcp.Session, run: Run, state: State, words: str
) -> None:
    step = step_in(run, state)
    answer = mcp.step_answer(session, Step.objects.select_related("run").get(pk=step.pk))
    assert not answer.is_error
    assert words in answer.text
    assert str(step.pk) in answer.text
    assert "Do not call the tool again" in answer.text
    assert f"/steps/{step.pk}/" in answer.text


def test_a_step_of_a_paused_run_says_paused(session: mcp.Session, run: Run) -> None:
    step = step_in(run, State.PENDING)
    Run.objects.filter(pk=run.pk).update(status=RunStatus.PAUSED, pause_reason="budget: calls")
    answer = mcp.step_answer(session, Step.objects.select_related("run").get(pk=step.pk))
    assert not answer.is_error
    assert "Paused" in answer.text
    assert "budget: calls" in answer.text


@pytest.mark.parametrize("state", [State.FAILED, State.DEAD])
def test_a_failed_step_is_an_error_with_its_failure_class(
    session: mcp.Session, run: Run, state: State
) -> None:
    step = step_in(run, state)
    answer = mcp.step_answer(session, Step.objects.select_related("run").get(pk=step.pk))
    assert answer.is_error
    assert step.failure_class in answer.text
    assert answer.structured is not None
    assert answer.structured["failure"]["class"] == step.failure_class


def test_secrets_of_the_input_never_come_back(session: mcp.Session) -> None:
    answer = mcp.tools_call(
        session, "echo", {"message": f"my token is {SECRET}", "api_token": SECRET}
    )
    step = Step.objects.get(pk=answer.structured["step_id"])  # type: ignore[index]
    Step.objects.filter(pk=step.pk).update(
        state=State.FAILED, failure_class="permanent", failure_message=f"refused {SECRET}"
    )
    failed = mcp.step_answer(session, Step.objects.select_related("run").get(pk=step.pk))
    assert SECRET not in failed.text
    assert SECRET not in str(failed.structured)
    assert "[redacted]" in failed.text


def test_the_same_key_is_the_same_step_and_another_call_under_it_is_refused(
    session: mcp.Session,
) -> None:
    first = mcp.tools_call(session, "echo", {"message": "a", "key": "k"})
    again = mcp.tools_call(session, "echo", {"message": "a", "key": "k"})
    other = mcp.tools_call(session, "echo", {"message": "b", "key": "k"})
    assert first.structured is not None
    assert again.structured is not None
    assert first.structured["step_id"] == again.structured["step_id"]
    assert other.is_error
    assert Step.objects.filter(key="k").count() == 1
    # The session's run was created on the first call, once.
    assert Run.objects.filter(key=session.run_key).count() == 1


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("no_such_tool", {}),
        ("echo", {"key": ""}),
        ("echo", {"key": 5}),
        ("echo", {"run": "not-a-run"}),
        ("echo", {"message": "nul \x00 inside"}),
        ("ticketdesk_create", {"body": "no title"}),
        ("step_status", {"step_id": "nope"}),
        ("run_report", {"run": "00000000-0000-0000-0000-000000000000"}),
    ],
)
def test_bad_calls_answer_a_clear_error_and_post_nothing(
    session: mcp.Session, name: str, arguments: dict[str, Any]
) -> None:
    answer = mcp.tools_call(session, name, arguments)
    assert answer.is_error
    assert answer.text
    assert not Step.objects.exists()


def test_a_deactivated_agent_is_refused_mid_session(session: mcp.Session) -> None:
    services.agent_set_active(agent=session.agent, active=False)
    answer = mcp.tools_call(session, "echo", {"message": "hi"})
    assert answer.is_error
    assert mcp.tools_list(session) == []
    assert not Step.objects.exists()


def test_run_report_answers_the_sessions_run(session: mcp.Session) -> None:
    assert not mcp.tools_call(session, "run_report", {}).is_error
    mcp.tools_call(session, "echo", {"message": "hi", "key": "one"})
    report = mcp.tools_call(session, "run_report", {})
    assert not report.is_error
    assert report.structured is not None
    assert report.structured["run_id"] == str(session.run_id)
    assert [entry["key"] for entry in report.structured["pending"]] == ["one"]


# The server reads the ledger in threads of its own: they must see what the test wrote.
@pytest.mark.django_db(transaction=True)
def test_http_answers_a_plain_json_rpc_post(api: Any, agent_auth: Any) -> None:
    """What the README's curl line does: one POST, one JSON answer, no session."""
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    answer = api.post("/mcp", listing, HTTP_ACCEPT="application/json, text/event-stream")
    assert answer.status_code == 200, answer.content
    names = {tool["name"] for tool in answer.json()["result"]["tools"]}
    assert {"echo", "ticketdesk_create", "step_status", "run_report"} <= names


def test_http_refuses_a_body_over_the_limit(api: Any, settings: Any) -> None:
    settings.API_MAX_BODY_BYTES = 100
    big = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"x": "y" * 200}}
    assert api.post("/mcp", big).status_code == 413
