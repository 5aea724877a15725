"""The MCP rules without a transport (executor/surfaces/mcp.py): names, schemas, what each state
answers, refusals. The SDK's clients against real processes are in tests/recovery/test_mcp.py.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from executor.ledger.records import Agent, Run, RunStatus, Step
from executor.ledger.states import State
from executor.services import runs
from executor.services.accounts import agent_set_active, agent_set_tools
from executor.services.posting import step_post
from executor.services.runs import run_cancel, run_create
from executor.surfaces import mcp
from tests.support.factories import step_in

SECRET = "sk-live-0123456789abcdef"


@pytest.fixture
def session(agent: Agent, settings: Any) -> mcp.Session:
    settings.MCP_WAIT_SECONDS = 0  # nothing runs the steps here: answer at once
    return mcp.Session(agent, base_url="https://stepward.example.com")


def assert_readable_by_every_framework(answer: mcp.Answer) -> None:
    """One JSON object with a message, as structured content and as the text alike."""
    assert answer.structured["message"]
    assert json.loads(answer.text) == answer.structured


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
    agent_set_tools(agent=session.agent, tools=["echo"])
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
    assert answer.message.startswith("Completed")
    assert_readable_by_every_framework(answer)


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
    assert words in answer.message
    assert str(step.pk) in answer.message
    assert "Do not call the tool again" in answer.message
    assert answer.structured["state"] == state
    assert answer.structured["console_url"].endswith(f"/steps/{step.pk}/")
    assert_readable_by_every_framework(answer)


def test_a_step_of_a_paused_run_says_paused(session: mcp.Session, run: Run) -> None:
    step = step_in(run, State.PENDING)
    Run.objects.filter(pk=run.pk).update(status=RunStatus.PAUSED, pause_reason="budget: calls")
    answer = mcp.step_answer(session, Step.objects.select_related("run").get(pk=step.pk))
    assert not answer.is_error
    assert "Paused" in answer.message
    assert "budget: calls" in answer.message


@pytest.mark.parametrize("state", [State.FAILED, State.DEAD])
def test_a_failed_step_is_an_error_with_its_failure_class(
    session: mcp.Session, run: Run, state: State
) -> None:
    step = step_in(run, state)
    answer = mcp.step_answer(session, Step.objects.select_related("run").get(pk=step.pk))
    assert answer.is_error
    assert step.failure_class in answer.message
    assert answer.message.startswith("Failed")
    assert answer.structured["failure"]["class"] == step.failure_class
    assert_readable_by_every_framework(answer)


def test_secrets_of_the_input_never_come_back(session: mcp.Session) -> None:
    answer = mcp.tools_call(
        session, "echo", {"message": f"my token is {SECRET}", "api_token": SECRET}
    )
    step = Step.objects.get(pk=answer.structured["step_id"])
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
    # Another session of the same agent: another stdio process, or an HTTP request.
    elsewhere = mcp.Session(session.agent, base_url="http://other")
    again = mcp.tools_call(elsewhere, "echo", {"message": "a", "key": "k"})
    other = mcp.tools_call(elsewhere, "echo", {"message": "b", "key": "k"})
    assert first.structured["step_id"] == again.structured["step_id"]
    assert other.is_error
    assert other.structured["error"] == "conflict"
    assert "use a new key for a new call" in other.message
    assert_readable_by_every_framework(other)
    assert Step.objects.filter(key="k").count() == 1
    # The agent's MCP run was created on the first call, once.
    assert Run.objects.filter(key=mcp.MCP_RUN_KEY).count() == 1


def test_writes_without_a_key_are_one_step_for_the_same_call_within_the_window(
    session: mcp.Session, settings: Any
) -> None:
    settings.MCP_DEDUP_SECONDS = 600
    first = mcp.tools_call(session, "ticketdesk_create", {"title": "a"})
    retry = mcp.tools_call(mcp.Session(session.agent), "ticketdesk_create", {"title": "a"})
    other = mcp.tools_call(session, "ticketdesk_create", {"title": "b"})
    assert first.structured["step_id"] == retry.structured["step_id"]
    assert other.structured["step_id"] != first.structured["step_id"]
    assert Step.objects.count() == 2


def test_reads_without_a_key_are_a_new_step_each_time(session: mcp.Session) -> None:
    # Repeating a read is harmless, and its answer may have changed (a status after a write).
    first = mcp.tools_call(session, "echo", {"message": "a"})
    again = mcp.tools_call(session, "echo", {"message": "a"})
    assert first.structured["step_id"] != again.structured["step_id"]


def test_a_derived_key_holds_for_the_window_from_the_first_call_and_no_longer(
    run: Run, settings: Any
) -> None:
    settings.MCP_DEDUP_SECONDS = 600
    edge = timezone.now().replace(microsecond=0)
    edge -= timedelta(seconds=int(edge.timestamp()) % 600)  # where a window starts
    first_at = edge - timedelta(seconds=1)
    call = {"title": "x"}
    before = mcp.derived_key(run, "ticketdesk.create", call, now=first_at)
    step_post(agent=run.agent, run=run, key=before, tool_name="ticketdesk.create", input=call)
    Step.objects.filter(key=before).update(created_at=first_at)
    # In the next window, but less than a window after the first call: the same call.
    assert mcp.derived_key(run, "ticketdesk.create", call, now=edge) == before
    late = edge + timedelta(seconds=598)
    assert mcp.derived_key(run, "ticketdesk.create", call, now=late) == before
    # Other arguments are another call.
    assert mcp.derived_key(run, "ticketdesk.create", {"title": "y"}, now=edge) != before
    # A window after the first call, in the same window number: a new one.
    just_over = edge + timedelta(seconds=599.5)
    assert mcp.derived_key(run, "ticketdesk.create", call, now=just_over) != before


def test_without_a_window_every_call_without_a_key_is_a_new_step(
    session: mcp.Session, settings: Any
) -> None:
    settings.MCP_DEDUP_SECONDS = 0
    mcp.tools_call(session, "echo", {"message": "a"})
    mcp.tools_call(session, "echo", {"message": "a"})
    assert Step.objects.count() == 2


def test_after_a_person_cancels_the_mcp_run_calls_go_to_a_new_one_and_keys_still_hold(
    session: mcp.Session,
) -> None:
    done = mcp.tools_call(session, "ticketdesk_create", {"title": "a", "key": "before"})
    first = mcp.mcp_run(session.agent)
    assert first is not None
    run_cancel(run=first, actor="user:alice", reason="stop what it queued")

    again = mcp.tools_call(session, "ticketdesk_create", {"title": "a", "key": "before"})
    other = mcp.tools_call(session, "ticketdesk_create", {"title": "b", "key": "before"})
    new = mcp.tools_call(session, "ticketdesk_create", {"title": "c", "key": "after"})

    # The key still names the step of the cancelled run (now cancelled: it did not run)...
    assert again.structured["step_id"] == done.structured["step_id"]
    assert again.structured["state"] == "cancelled"
    # ...another call under it is refused...
    assert other.is_error
    assert other.structured["error"] == "conflict"
    # ...and a new key goes into a new MCP run, which the report now answers.
    second = mcp.mcp_run(session.agent)
    assert second is not None
    assert second.pk != first.pk
    assert new.structured["run_id"] == str(second.pk)
    assert Step.objects.filter(key="before").count() == 1
    report = mcp.tools_call(session, "run_report", {})
    assert report.structured["run_id"] == str(second.pk)


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
    assert answer.structured["error"]
    assert_readable_by_every_framework(answer)
    assert not Step.objects.exists()


def test_a_deactivated_agent_is_refused_mid_session(session: mcp.Session) -> None:
    agent_set_active(agent=session.agent, active=False)
    answer = mcp.tools_call(session, "echo", {"message": "hi"})
    assert answer.is_error
    assert mcp.tools_list(session) == []
    assert not Step.objects.exists()


def test_run_report_answers_the_agents_mcp_run_from_any_session(session: mcp.Session) -> None:
    empty = mcp.tools_call(session, "run_report", {})
    assert not empty.is_error
    assert "no MCP call yet" in empty.message
    mcp.tools_call(session, "echo", {"message": "hi", "key": "one"})
    report = mcp.tools_call(mcp.Session(session.agent), "run_report", {})
    assert not report.is_error
    run = mcp.mcp_run(session.agent)
    assert run is not None
    assert report.structured["run_id"] == str(run.pk)
    assert [entry["key"] for entry in report.structured["pending"]] == ["one"]
    assert_readable_by_every_framework(report)


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


def test_run_report_of_a_long_mcp_run_lists_the_latest_steps_of_each_section(
    session: mcp.Session, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mcp, "REPORT_ENTRIES", 3)
    for number in range(5):
        mcp.tools_call(session, "echo", {"message": "hi", "key": f"k{number}"})
    report = mcp.tools_call(session, "run_report", {})
    assert [entry["key"] for entry in report.structured["pending"]] == ["k2", "k3", "k4"]
    assert report.structured["listed_of"] == {"pending": 5}
    assert "latest 3 steps" in report.message


def test_secrets_of_every_shape_never_come_back_over_mcp(session: mcp.Session) -> None:
    """The 29 shapes of tests/executor/test_redaction_shapes.py, echoed by the tool into its
    result: the MCP answer (text and structuredContent) shows none of them."""
    from tests.executor.test_redaction_shapes import SHAPES

    shaped = {name.replace(" ", "_"): value for name, value, _ in SHAPES}
    answer = mcp.tools_call(session, "echo", {"message": json.dumps(shaped)})
    step = Step.objects.select_related("run").get(pk=answer.structured["step_id"])
    Step.objects.filter(pk=step.pk).update(
        state=State.COMPLETED, result={"echo": shaped, "said": json.dumps(shaped)}
    )
    shown = mcp.step_answer(session, Step.objects.select_related("run").get(pk=step.pk))

    for text in (
        answer.text,
        json.dumps(answer.structured),
        shown.text,
        json.dumps(shown.structured),
    ):
        leaked = [secret for _, _, secret in SHAPES if secret in text]
        assert leaked == []
    assert "[redacted]" in shown.text


# --- one MCP run per agent, whatever races and whatever the date ----------------------------


@pytest.mark.django_db(transaction=True)
def test_two_processes_making_the_agents_mcp_run_at_once_make_one(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both looked, found no MCP run and insert at once (a barrier holds each after its look,
    before its insert, until the other has looked too): the unique (agent, key) of runs lets
    one in, and the other call takes that run. Threads each have a database connection of
    their own."""
    barrier = threading.Barrier(2, timeout=10)
    seal = runs.run_seal

    def seal_when_both_looked(run: Run, previous: str) -> str:
        if run.key == mcp.MCP_RUN_KEY:
            barrier.wait()
        return seal(run, previous)

    monkeypatch.setattr(runs, "run_seal", seal_when_both_looked)
    answers: list[mcp.Answer] = []

    def call(key: str) -> None:
        try:
            session = mcp.Session(agent)
            answers.append(mcp.tools_call(session, "ticketdesk_create", {"title": key, "key": key}))
        finally:
            connection.close()

    threads = [threading.Thread(target=call, args=(f"k{n}",)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert [answer.is_error for answer in answers] == [False, False], answers
    assert Run.objects.filter(agent=agent).count() == 1
    run = Run.objects.get(agent=agent)
    assert (run.key, run.name) == (mcp.MCP_RUN_KEY, mcp.MCP_RUN_NAME)
    assert {answer.structured["run_id"] for answer in answers} == {str(run.pk)}


def test_a_key_names_the_same_step_next_week(session: mcp.Session) -> None:
    """Nothing of a key's scope depends on the date: the MCP run is not a run of the day."""
    first = mcp.tools_call(session, "ticketdesk_create", {"title": "a", "key": "weekly"})
    week_ago = timezone.now() - timedelta(days=7, hours=3)
    Run.objects.filter(pk=first.structured["run_id"]).update(created_at=week_ago)
    Step.objects.filter(pk=first.structured["step_id"]).update(created_at=week_ago)

    again = mcp.tools_call(
        mcp.Session(session.agent), "ticketdesk_create", {"title": "a", "key": "weekly"}
    )
    other = mcp.tools_call(session, "ticketdesk_create", {"title": "b", "key": "weekly"})

    assert again.structured["step_id"] == first.structured["step_id"]
    assert other.is_error
    assert other.structured["error"] == "conflict"
    assert Run.objects.count() == 1
    assert Step.objects.count() == 1


def test_an_agents_own_run_may_not_take_the_mcp_runs_key(api: Any, agent: Agent) -> None:
    """Else it could stand in for the agent's MCP run, or block it (another name, a conflict)."""
    for key in (mcp.MCP_RUN_KEY, f"{mcp.MCP_RUN_KEY}-2", f"{mcp.MCP_RUN_KEY}-17"):
        answer = api.post("/api/v1/runs", {"name": "mine", "key": key})
        assert answer.status_code == 422, answer.content
        assert "is reserved for the agent's MCP runs" in answer.content.decode()
    assert not Run.objects.exists()
    # Keys that only resemble them are fine, and name no MCP run.
    for key in ("stepward-mcpx", "stepward-mcp-mine", "stepward-mcp-2-b"):
        assert api.post("/api/v1/runs", {"name": "mine", "key": key}).status_code == 201
    assert mcp.mcp_run(agent) is None
    mcp.tools_call(mcp.Session(agent), "echo", {"message": "hi", "key": "k"})
    made = mcp.mcp_run(agent)
    assert made is not None
    assert made.key == mcp.MCP_RUN_KEY


def test_the_next_mcp_run_is_numbered_after_the_highest_whatever_was_removed(
    session: mcp.Session,
) -> None:
    """Only "MCP calls (2)" is left, cancelled (the first was removed since): the next calls
    go into a new run "MCP calls (3)", not back into the cancelled one."""
    left, _ = run_create(
        agent=session.agent, name="MCP calls (2)", key=f"{mcp.MCP_RUN_KEY}-2", mcp=True
    )
    run_cancel(run=left, actor="user:alice", reason="stop it")

    answer = mcp.tools_call(session, "ticketdesk_create", {"title": "a", "key": "after"})

    assert not answer.is_error, answer.structured
    made = mcp.mcp_run(session.agent)
    assert made is not None
    assert (made.key, made.name) == (f"{mcp.MCP_RUN_KEY}-3", "MCP calls (3)")
    assert answer.structured["run_id"] == str(made.pk)
