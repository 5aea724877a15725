"""The agents' API answers as API.md promises: shapes, idempotency, visibility and errors.

Why one module of about 1,000 lines: one test or more per operation of API.md, sharing
the API client fixtures.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from guardian.shortcuts import assign_perm, remove_perm

from executor.contract.tool import (
    Invocation,
    RetryPolicy,
    ToolResult,
    all_tools,
    get_tool,
    register,
    unregister,
)
from executor.contract.tool import Tool as ToolBase
from executor.ledger import transitions
from executor.ledger.records import (
    Agent,
    ApprovalRule,
    Effect,
    Event,
    Idempotency,
    Run,
    RunEvent,
    Step,
    Tool,
)
from executor.ledger.states import State
from executor.services.accounts import agent_create
from executor.services.tools import tools_sync
from tests.support.api import AgentAuth, ApiClient, error_of
from tests.support.factories import advance, new_step, step_in

API = "/api/v1"
RUN_KEYS = {
    "id",
    "name",
    "key",
    "status",
    "pause_reason",
    "budget",
    "usage",
    "counts",
    "created_at",
}
STEP_KEYS = {
    "id",
    "run_id",
    "key",
    "tool",
    "state",
    "input_summary",
    "operation_id",
    "attempt_count",
    "external_id",
    "result",
    "failure",
    "created_at",
    "updated_at",
    # Extensions to API.md's shape.
    "version",
    "position",
    "depends_on",
    "compensates",
}
TOOL_KEYS = {
    "name",
    "effect",
    "idempotency",
    "has_lookup",
    "compensation",
    "requires_approval",
    "retry",
    # Extensions to API.md's shape.
    "description",
    "approval_rule",
    "input_schema",
    "usable",
}
SECRET = "hunter2-correct-horse"


def post_raw(api: ApiClient, path: str, body: str | bytes) -> Any:
    return api.client.post(path, data=body, content_type="application/json", **api.headers)


def post_step(api: ApiClient, run_id: Any, **body: Any) -> Any:
    body.setdefault("tool", "echo")
    body.setdefault("input", {"message": "hello"})
    return api.post(f"{API}/runs/{run_id}/steps", body)


# --- tools ----------------------------------------------------------------------------------


def test_tools_lists_every_registered_tool_with_its_declarations(api: ApiClient) -> None:
    response = api.get(f"{API}/tools")

    assert response.status_code == 200
    tools = {entry["name"]: entry for entry in response.json()}
    assert set(tools) == {tool.name for tool in all_tools()}
    assert all(set(entry) == TOOL_KEYS for entry in tools.values())
    echo = get_tool("echo")
    assert tools["echo"] == {
        "name": "echo",
        "description": echo.description,
        "effect": "pure",
        "idempotency": "none",
        "has_lookup": False,
        "compensation": "",
        "requires_approval": False,
        "approval_rule": "never",
        "retry": echo.retry.as_dict(),
        "input_schema": {"type": "object"},
        "usable": True,
    }
    assert tools["http.get"]["effect"] == "read"
    assert tools["http.get"]["input_schema"]["required"] == ["url"]


def test_tools_shows_a_tool_without_use_tool_as_not_usable(api: ApiClient, agent: Agent) -> None:
    remove_perm("executor.use_tool", agent.user, Tool.objects.get(name="http.get"))

    tools = {entry["name"]: entry for entry in api.get(f"{API}/tools").json()}

    assert tools["http.get"]["usable"] is False
    assert tools["echo"]["usable"] is True


# --- runs -----------------------------------------------------------------------------------


def test_creating_a_run_answers_201_with_the_run(api: ApiClient) -> None:
    response = api.post(
        f"{API}/runs",
        {
            "name": "triage inbox",
            "key": "triage-1",
            "budget": {"max_calls": 10, "max_cost": 2.5, "deadline_seconds": 3600},
        },
    )

    assert response.status_code == 201
    run = response.json()
    assert set(run) == RUN_KEYS
    uuid.UUID(run["id"])
    assert run["name"] == "triage inbox"
    assert run["key"] == "triage-1"
    assert run["status"] == "open"
    assert run["pause_reason"] == ""
    assert run["budget"]["max_calls"] == 10
    assert run["budget"]["max_cost"] == 2.5
    assert run["budget"]["deadline"] is not None
    assert run["usage"]["calls"] == 0
    assert run["usage"]["cost"] == 0
    assert run["usage"]["elapsed_seconds"] >= 0
    assert run["counts"] == {}


def test_a_run_without_budget_has_no_limits(api: ApiClient) -> None:
    run = api.post(f"{API}/runs", {"name": "plain"}).json()

    assert run["key"] is None
    assert run["budget"] == {"max_calls": None, "max_cost": None, "deadline": None}


def test_repeating_a_run_key_answers_200_with_the_same_run(api: ApiClient) -> None:
    first = api.post(f"{API}/runs", {"name": "nightly", "key": "nightly-2024-01-01"})
    again = api.post(f"{API}/runs", {"name": "nightly", "key": "nightly-2024-01-01"})

    assert first.status_code == 201
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]


@pytest.mark.parametrize(
    "changed",
    [{"name": "weekly"}, {"budget": {"max_calls": 5}}, {"budget": {"deadline_seconds": 60}}],
    ids=["name", "max_calls", "deadline"],
)
def test_repeating_a_run_key_with_another_name_or_budget_is_a_conflict(
    api: ApiClient, changed: dict[str, Any]
) -> None:
    body = {"name": "nightly", "key": "nightly-2024-01-02", "budget": {"max_calls": 3}}
    first = api.post(f"{API}/runs", body)
    again = api.post(f"{API}/runs", {**body, **changed})

    assert first.status_code == 201
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "conflict"
    assert again.json()["error"]["details"] == {"run_id": first.json()["id"]}
    assert Run.objects.filter(key="nightly-2024-01-02").count() == 1


def test_reading_a_run_counts_its_steps_by_state(api: ApiClient, run: Any) -> None:
    post_step(api, run.pk, key="a")
    post_step(api, run.pk, key="b")
    step = Step.objects.get(run=run, key="b")
    transitions.move(step, State.CANCELLED, actor="test")

    response = api.get(f"{API}/runs/{run.pk}")

    assert response.status_code == 200
    body = response.json()
    assert set(body) == RUN_KEYS
    assert body["id"] == str(run.pk)
    assert body["counts"] == {"pending": 1, "cancelled": 1}


def test_an_agent_without_submit_steps_may_not_create_runs(api: ApiClient, agent: Agent) -> None:
    remove_perm("executor.submit_steps", agent.user, agent.workspace)

    response = api.post(f"{API}/runs", {"name": "refused"})

    assert response.status_code == 403
    assert error_of(response)["code"] == "forbidden"


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"name": ""},
        {"name": "x" * 201},
        {"name": 5},
        {"name": "ok", "key": ""},
        {"name": "ok", "key": "k" * 201},
        {"name": "ok", "budget": {"max_calls": 0}},
        {"name": "ok", "budget": {"max_calls": 10**30}},
        {"name": "ok", "budget": {"max_calls": True}},
        {"name": "ok", "budget": {"max_calls": 1.5}},
        {"name": "ok", "budget": {"max_cost": -1}},
        {"name": "ok", "budget": {"max_cost": 0.00001}},
        {"name": "ok", "budget": {"max_cost": 10**12}},
        {"name": "ok", "budget": {"max_cost": "lots"}},
        {"name": "ok", "budget": {"max_cost": "1e3"}},
        {"name": "ok", "budget": {"max_cost": "-1"}},
        {"name": "ok", "budget": {"max_cost": "1.23456"}},
        {"name": "ok", "budget": {"max_cost": "NaN"}},
        {"name": "ok", "budget": {"max_cost": " 1"}},
        {"name": "ok", "budget": {"max_cost": "12345678901"}},
        {"name": "ok", "budget": {"max_cost": True}},
        {"name": "ok", "budget": {"deadline_seconds": 0}},
        {"name": "ok", "budget": {"deadline_seconds": -5}},
        {"name": "ok", "budget": {"deadline_seconds": 10**12}},
        {"name": "ok", "budget": "lots"},
        {"name": "ok", "unknown_field": 1},
        {"name": "nul\u0000byte"},
    ],
    ids=lambda body: json.dumps(body)[:60],
)
def test_an_invalid_run_body_answers_422_with_the_field_errors(
    api: ApiClient, body: dict[str, Any]
) -> None:
    response = api.post(f"{API}/runs", body)

    assert response.status_code == 422
    error = error_of(response)
    assert error["code"] == "invalid_body"
    assert isinstance(error["details"], list)
    assert error["details"]
    assert all({"loc", "msg", "type"} <= set(detail) for detail in error["details"])
    assert all(detail["loc"][0] == "body" for detail in error["details"])
    assert all("payload" not in detail["loc"] for detail in error["details"])


def test_a_field_error_names_the_field_as_the_client_sent_it(api: ApiClient) -> None:
    response = api.post(f"{API}/runs", {"name": "ok", "budget": {"max_calls": 0}})

    assert response.status_code == 422
    [detail] = error_of(response)["details"]
    assert detail["loc"] == ["body", "budget", "max_calls"]
    assert detail["type"] == "greater_than_equal"


def test_a_run_name_may_hold_any_unicode(api: ApiClient) -> None:
    name = "Überprüfung 検査 🚀 \u202e"

    response = api.post(f"{API}/runs", {"name": name})

    assert response.status_code == 201
    assert api.get(f"{API}/runs/{response.json()['id']}").json()["name"] == name


# --- steps ----------------------------------------------------------------------------------


def test_posting_a_step_answers_201_with_the_step(api: ApiClient, run: Any) -> None:
    response = post_step(api, run.pk, key="greet", input={"message": "hi"}, summary="say hi")

    assert response.status_code == 201
    step = response.json()
    assert set(step) == STEP_KEYS
    assert step["run_id"] == str(run.pk)
    assert step["key"] == "greet"
    assert step["tool"] == "echo"
    # echo needs no approval, so the policy approves it and it is due at once.
    assert step["state"] == "pending"
    assert step["input_summary"] == "say hi"
    uuid.UUID(step["operation_id"])
    assert step["attempt_count"] == 0
    assert step["external_id"] == ""
    assert step["result"] is None
    assert step["failure"] is None
    assert step["position"] == 1
    assert step["depends_on"] == []
    assert step["compensates"] is None
    assert Step.objects.filter(pk=step["id"], run=run).exists()


def test_reposting_a_step_with_the_same_call_answers_200_with_the_same_step(
    api: ApiClient, run: Any
) -> None:
    first = post_step(api, run.pk, key="once", input={"n": 1})
    again = post_step(api, run.pk, key="once", input={"n": 1})

    assert first.status_code == 201
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert Step.objects.filter(run=run).count() == 1


def test_reposting_a_step_key_with_another_input_answers_409(api: ApiClient, run: Any) -> None:
    first = post_step(api, run.pk, key="once", input={"n": 1})

    response = post_step(api, run.pk, key="once", input={"n": 2})

    assert response.status_code == 409
    error = error_of(response)
    assert error["code"] == "conflict"
    assert error["details"] == {"step_id": first.json()["id"]}
    assert Step.objects.get(run=run, key="once").input == {"n": 1}


def test_a_step_waits_for_its_dependencies(api: ApiClient, run: Any) -> None:
    post_step(api, run.pk, key="first")

    response = post_step(api, run.pk, key="second", depends_on=["first"])

    assert response.status_code == 201
    assert response.json()["state"] == "approved"
    assert response.json()["depends_on"] == ["first"]


def test_depending_on_an_unposted_key_answers_422(api: ApiClient, run: Any) -> None:
    response = post_step(api, run.pk, key="second", depends_on=["nowhere"])

    assert response.status_code == 422
    assert error_of(response)["details"] == {"depends_on": ["nowhere"]}


def test_an_unknown_tool_answers_422(api: ApiClient, run: Any) -> None:
    response = post_step(api, run.pk, key="x", tool="no.such.tool")

    assert response.status_code == 422
    error = error_of(response)
    assert error["code"] == "invalid_body"
    assert error["details"] == {"tool": "no.such.tool"}
    assert not Step.objects.filter(run=run).exists()


@pytest.mark.parametrize(
    "tool_input",
    [{}, {"url": "ftp://example.com/"}, {"url": 5}, {"url": "http://x", "extra": 1}],
    ids=["missing-url", "wrong-scheme", "not-a-string", "extra-field"],
)
def test_input_that_fails_the_tools_schema_answers_422_with_details(
    api: ApiClient, run: Any, tool_input: dict[str, Any]
) -> None:
    response = post_step(api, run.pk, key="fetch", tool="http.get", input=tool_input)

    assert response.status_code == 422
    error = error_of(response)
    assert error["code"] == "invalid_body"
    assert error["details"]["input"]
    assert all(isinstance(message, str) for message in error["details"]["input"])
    assert not Step.objects.filter(run=run).exists()


@pytest.mark.parametrize(
    "body",
    [
        {"key": "k", "tool": "echo"},
        {"key": "k", "tool": "echo", "input": [1, 2]},
        {"key": "k", "tool": "echo", "input": "text"},
        {"key": "k", "tool": "echo", "input": None},
        {"key": "", "tool": "echo", "input": {}},
        {"key": "k" * 201, "tool": "echo", "input": {}},
        {"key": None, "tool": "echo", "input": {}},
        {"tool": "echo", "input": {}},
        {"key": "k", "tool": "", "input": {}},
        {"key": "k", "tool": "echo", "input": {}, "depends_on": "other"},
        {"key": "k", "tool": "echo", "input": {}, "depends_on": [""]},
        {"key": "k", "tool": "echo", "input": {}, "summary": "s" * 2001},
        {"key": "k", "tool": "echo", "input": {"text": "nul\u0000"}},
        {"key": "k", "tool": "echo", "input": {"nul\u0000key": 1}},
        {"key": "k", "tool": "echo", "input": {}, "inputs": {}},
    ],
    ids=lambda body: json.dumps(body)[:60],
)
def test_an_invalid_step_body_answers_422_and_stores_nothing(
    api: ApiClient, run: Any, body: dict[str, Any]
) -> None:
    response = api.post(f"{API}/runs/{run.pk}/steps", body)

    assert response.status_code == 422
    assert error_of(response)["code"] == "invalid_body"
    assert not Step.objects.filter(run=run).exists()


@pytest.mark.parametrize(
    "raw",
    [
        '{"key": "k", "tool": "echo", "input": {"n": NaN}}',
        '{"key": "k", "tool": "echo", "input": {"n": Infinity}}',
        "{",
        "",
        "not json",
        '{"key": "k",}',
        b"\xff\xfe\xfd",
    ],
    ids=["nan", "infinity", "truncated", "empty", "text", "trailing-comma", "not-utf8"],
)
def test_a_body_that_is_not_json_answers_400(api: ApiClient, run: Any, raw: str | bytes) -> None:
    response = post_raw(api, f"{API}/runs/{run.pk}/steps", raw)

    if raw == "":
        # An empty body is no body: the fields are missing.
        assert response.status_code == 422
        return
    assert response.status_code == 400
    assert error_of(response)["code"] == "malformed_json"
    assert not Step.objects.filter(run=run).exists()


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        ("[1, 2, 3]", 422),
        ('"a string"', 422),
        ("null", 422),
        ("42", 422),
        ('{"key": "k", "tool": "echo", "input": {"n": 1e400}}', 422),
        ('{"key": "k", "tool": "echo", "input": {"n": ' + "9" * 5000 + "}}", 422),
        ('{"key": "k", "tool": "echo", "input": ' + "[" * 5000 + "]" * 5000 + "}", 422),
        ('{"key": "k", "tool": "echo", "input": {"s": "\\ud800"}}', 422),
        ('{"key": "k", "tool": "echo", "input": {"deep": ' + '{"a": ' * 100 + "1" + "}" * 102, 422),
    ],
    ids=[
        "list",
        "string",
        "null",
        "number",
        "float-overflow",
        "5000-digit-int",
        "nested-5000",
        "lone-surrogate",
        "nested-100",
    ],
)
def test_json_that_cannot_be_a_step_answers_4xx_never_500(
    api: ApiClient, run: Any, raw: str, status: int
) -> None:
    response = post_raw(api, f"{API}/runs/{run.pk}/steps", raw)

    assert response.status_code == status
    assert error_of(response)["code"] == "invalid_body"
    assert not Step.objects.filter(run=run).exists()


@pytest.mark.parametrize(
    "tool_input",
    [
        {"big": 10**30, "negative": -(10**30)},
        {"unicode": "検査 🚀 Ünïcödé", "emoji_key_🚀": True},
        {"nothing": None, "list": [None, {"nested": None}]},
        {"float": 1.5e300, "tiny": 5e-324},
        {},
    ],
    ids=["huge-integers", "unicode", "nulls", "extreme-floats", "empty"],
)
def test_any_json_object_is_accepted_as_echo_input(
    api: ApiClient, run: Any, tool_input: dict[str, Any]
) -> None:
    first = post_step(api, run.pk, key="k", input=tool_input)
    again = post_step(api, run.pk, key="k", input=tool_input)

    assert first.status_code == 201
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    stored = Step.objects.get(run=run, key="k").input
    if connection.vendor == "postgresql" and "float" in tool_input:
        # jsonb keeps numbers as decimals and gives 1.5e300 back as an integer.
        assert stored["float"] == int(Decimal("1.5e300"))
        assert stored["tiny"] == tool_input["tiny"]
    else:
        assert stored == tool_input


def test_posting_to_a_cancelled_run_answers_409(api: ApiClient, run: Any) -> None:
    api.post(f"{API}/runs/{run.pk}/cancel")

    response = post_step(api, run.pk, key="late")

    assert response.status_code == 409
    assert error_of(response)["code"] == "conflict"


def test_posting_a_step_without_use_tool_answers_403(
    api: ApiClient, run: Any, agent: Agent
) -> None:
    remove_perm("executor.use_tool", agent.user, Tool.objects.get(name="echo"))

    response = post_step(api, run.pk, key="k")

    assert response.status_code == 403
    assert error_of(response)["code"] == "forbidden"


def test_listing_steps_answers_them_in_posting_order(api: ApiClient, run: Any) -> None:
    for key in ["c", "a", "b"]:
        post_step(api, run.pk, key=key)

    response = api.get(f"{API}/runs/{run.pk}/steps")

    assert response.status_code == 200
    steps = response.json()
    assert [step["key"] for step in steps] == ["c", "a", "b"]
    assert [step["position"] for step in steps] == [1, 2, 3]
    assert all(set(step) == STEP_KEYS for step in steps)


def test_listing_steps_pages_with_limit_and_after(api: ApiClient, run: Any) -> None:
    for n in range(5):
        post_step(api, run.pk, key=f"s{n}")

    first = api.get(f"{API}/runs/{run.pk}/steps?limit=2").json()
    second = api.get(f"{API}/runs/{run.pk}/steps?limit=2&after={first[-1]['position']}").json()
    last = api.get(f"{API}/runs/{run.pk}/steps?limit=2&after={second[-1]['position']}").json()

    assert [s["key"] for s in first + second + last] == ["s0", "s1", "s2", "s3", "s4"]
    assert len(last) == 1


@pytest.mark.parametrize(
    "query", ["limit=0", "limit=1001", "after=-1", "limit=x", f"after={10**40}"]
)
def test_listing_steps_refuses_a_bad_page_with_422(api: ApiClient, run: Any, query: str) -> None:
    response = api.get(f"{API}/runs/{run.pk}/steps?{query}")

    assert response.status_code == 422
    assert error_of(response)["code"] == "invalid_body"


def test_reading_a_step_answers_the_step(api: ApiClient, run: Any) -> None:
    posted = post_step(api, run.pk, key="read-me").json()

    response = api.get(f"{API}/steps/{posted['id']}")

    assert response.status_code == 200
    assert response.json() == posted


def test_a_failed_step_shows_its_failure_class_and_message(api: ApiClient, run: Any) -> None:
    step = step_in(run, State.FAILED)

    body = api.get(f"{API}/steps/{step.pk}").json()

    assert body["state"] == "failed"
    assert body["failure"] == {"class": step.failure_class, "message": step.failure_message}


@pytest.mark.django_db(transaction=True)
def test_waiting_on_a_step_answers_as_soon_as_another_process_moves_it(
    agent_auth: AgentAuth, api: ApiClient, run: Any
) -> None:
    # Made without the API: a posted step would be dispatched to the broker on commit.
    watched = new_step(run, key="watched")
    posted = api.get(f"{API}/steps/{watched.pk}").json()
    Agent.objects.filter(pk=agent_auth.agent.pk).update(last_seen_at=None)

    def move_once_the_request_is_in() -> None:
        try:
            # The request's authentication stamps last_seen_at: the request has begun. (Should
            # the move land before the handler's first read, the answer comes after the full
            # wait instead, and still shows the move.)
            deadline = time.monotonic() + 30
            while not Agent.objects.filter(
                pk=agent_auth.agent.pk, last_seen_at__isnull=False
            ).exists():
                assert time.monotonic() < deadline, "the request never arrived"
                time.sleep(0.01)
            step = Step.objects.get(pk=posted["id"])
            transitions.move(step, State.CANCELLED, actor="test", reason="moved meanwhile")
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        mover = pool.submit(move_once_the_request_is_in)
        response = api.get(f"{API}/steps/{posted['id']}?wait=30")
        mover.result(timeout=60)

    assert response.status_code == 200
    assert response.json()["state"] == "cancelled"
    assert response.json()["version"] > posted["version"]


def test_waiting_on_a_step_that_does_not_change_answers_it_unchanged(
    api: ApiClient, run: Any
) -> None:
    posted = post_step(api, run.pk, key="quiet").json()

    response = api.get(f"{API}/steps/{posted['id']}?wait=1")

    assert response.status_code == 200
    assert response.json() == posted


def test_waiting_with_an_outdated_version_answers_the_current_step_at_once(
    api: ApiClient, run: Any
) -> None:
    posted = post_step(api, run.pk, key="moved").json()
    advance(Step.objects.get(pk=posted["id"]), State.CANCELLED)

    response = api.get(f"{API}/steps/{posted['id']}?wait=30&version={posted['version']}")

    assert response.status_code == 200
    assert response.json()["state"] == "cancelled"


@pytest.mark.parametrize("query", ["wait=31", "wait=-1", "wait=nan", "wait=soon", "version=0"])
def test_a_bad_wait_answers_422(api: ApiClient, run: Any, query: str) -> None:
    posted = post_step(api, run.pk, key="k").json()

    response = api.get(f"{API}/steps/{posted['id']}?{query}")

    assert response.status_code == 422
    error = error_of(response)
    assert error["code"] == "invalid_body"
    assert error["details"][0]["loc"][0] == "query"


# --- cancel and report -----------------------------------------------------------------------


def test_cancelling_a_run_cancels_its_unsubmitted_steps(
    api: ApiClient, run: Any, agent: Agent
) -> None:
    post_step(api, run.pk, key="queued")
    post_step(api, run.pk, key="waiting", depends_on=["queued"])
    done = step_in(run, State.COMPLETED, key="done")

    response = api.post(f"{API}/runs/{run.pk}/cancel", {"reason": "no longer needed"})

    assert response.status_code == 200
    body = response.json()
    assert set(body) == RUN_KEYS
    assert body["status"] == "cancelled"
    assert body["counts"] == {"cancelled": 2, "completed": 1}
    states = dict(Step.objects.filter(run=run).values_list("key", "state"))
    assert states == {"queued": "cancelled", "waiting": "cancelled", "done": "completed"}
    event = Event.objects.filter(step__run=run, to_state=State.CANCELLED).first()
    assert event is not None
    assert event.actor == f"agent:{agent.name}"
    assert event.reason == "no longer needed"
    assert Step.objects.get(pk=done.pk).state == State.COMPLETED


def test_cancelling_needs_no_body_and_may_be_repeated(api: ApiClient, run: Any) -> None:
    first = post_raw(api, f"{API}/runs/{run.pk}/cancel", "")
    again = api.post(f"{API}/runs/{run.pk}/cancel", {})

    assert first.status_code == 200
    assert again.status_code == 200
    assert again.json()["status"] == "cancelled"


def test_cancelling_without_submit_steps_answers_403_and_cancels_nothing(
    api: ApiClient, run: Any, agent: Agent
) -> None:
    posted = post_step(api, run.pk, key="queued").json()
    remove_perm("executor.submit_steps", agent.user, agent.workspace)

    response = api.post(f"{API}/runs/{run.pk}/cancel", {"reason": "not mine to stop"})

    assert response.status_code == 403
    assert error_of(response)["code"] == "forbidden"
    assert Run.objects.get(pk=run.pk).status == "open"
    assert Step.objects.get(pk=posted["id"]).state == State.PENDING


def test_an_agent_with_submit_steps_may_cancel_another_agents_run_in_its_workspace(
    api: ApiClient, agent: Agent
) -> None:
    # The workspace is the unit of permission: as it may post to any run there, it may stop one.
    colleague, token = agent_create(workspace=agent.workspace, name="bob-bot")
    theirs = ApiClient(AgentAuth(colleague, token)).post(f"{API}/runs", {"name": "bob's"}).json()

    response = api.post(f"{API}/runs/{theirs['id']}/cancel", {"reason": "supervisor stop"})

    assert response.status_code == 200
    assert response.json()["status"] == "cancelled"


def test_cancelling_a_run_twice_answers_it_cancelled_and_records_one_cancel(
    api: ApiClient, run: Any
) -> None:
    first = api.post(f"{API}/runs/{run.pk}/cancel")
    again = api.post(f"{API}/runs/{run.pk}/cancel")

    assert (first.status_code, again.status_code) == (200, 200)
    assert first.json()["status"] == again.json()["status"] == "cancelled"
    assert list(RunEvent.objects.filter(run=run).values_list("action", flat=True)) == ["cancelled"]


def test_the_report_sorts_steps_into_sections(api: ApiClient, run: Any) -> None:
    done = step_in(run, State.COMPLETED, key="done")
    step_in(run, State.UNKNOWN, key="maybe")
    step_in(run, State.FAILED, key="broken")
    post_step(api, run.pk, key="later")

    response = api.get(f"{API}/runs/{run.pk}/report")

    assert response.status_code == 200
    report = response.json()
    assert set(report) == {
        "completed",
        "uncertain",
        "failed",
        "compensated",
        "pending",
        "usage",
        "summary",
    }
    assert [entry["key"] for entry in report["completed"]] == ["done"]
    assert [entry["key"] for entry in report["uncertain"]] == ["maybe"]
    assert [entry["key"] for entry in report["failed"]] == ["broken"]
    assert [entry["key"] for entry in report["pending"]] == ["later"]
    assert report["compensated"] == []
    assert report["completed"][0] == {
        "step_id": str(done.pk),
        "key": "done",
        "tool": "echo",
        "state": "completed",
        "external_id": "",
        "evidence": {},
    }
    assert "`maybe`" in report["summary"]
    assert {"calls", "cost", "elapsed_seconds"} <= set(report["usage"])


# --- redaction ------------------------------------------------------------------------------


class SecretLogin(ToolBase):
    name = "test.secret_login"
    description = "A test tool whose password must never be shown."
    effect = Effect.PURE
    idempotency = Idempotency.NONE
    requires_approval = ApprovalRule.NEVER
    compensation = ""
    retry = RetryPolicy()
    input_schema = {
        "type": "object",
        "properties": {"user": {"type": "string"}, "password": {"type": "string"}},
        "required": ["user", "password"],
    }
    redact = frozenset({"password"})

    def invoke(self, call: Invocation) -> ToolResult:
        return ToolResult(result={"logged_in": True})


@pytest.fixture
def secret_tool(agent: Agent) -> Iterator[str]:
    register(SecretLogin)
    try:
        tools_sync()
        assign_perm("executor.use_tool", agent.user, Tool.objects.get(name=SecretLogin.name))
        yield SecretLogin.name
    finally:
        unregister(SecretLogin.name)


def test_redacted_input_never_appears_in_any_answer(
    api: ApiClient, run: Any, secret_tool: str
) -> None:
    login = {"user": "alice", "password": SECRET}
    answers = [
        post_step(api, run.pk, key="login", tool=secret_tool, input=login),
        post_step(api, run.pk, key="login", tool=secret_tool, input=login),
    ]
    step_id = answers[0].json()["id"]
    answers += [
        api.get(f"{API}/steps/{step_id}"),
        api.get(f"{API}/runs/{run.pk}/steps"),
        api.get(f"{API}/runs/{run.pk}"),
        api.get(f"{API}/runs/{run.pk}/report"),
        api.get(f"{API}/tools"),
        api.post(f"{API}/runs/{run.pk}/cancel"),
    ]

    assert [a.status_code for a in answers] == [201, 200, 200, 200, 200, 200, 200, 200]
    for answer in answers:
        assert SECRET not in answer.content.decode()
    assert "alice" in answers[0].json()["input_summary"]
    # The ledger keeps the secret: the executor needs it.
    assert Step.objects.get(pk=step_id).input["password"] == SECRET


# --- authentication -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/tools", "/runs/00000000-0000-0000-0000-000000000000", "/steps/x"]
)
def test_a_request_without_a_token_answers_401(anonymous_api: ApiClient, path: str) -> None:
    response = anonymous_api.get(f"{API}{path}")

    assert response.status_code == 401
    assert error_of(response)["code"] == "unauthorized"
    assert response["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "header",
    ["Bearer sw_not-a-real-token", "Bearer ", "Basic dXNlcjpwYXNz", "sw_no_scheme", "Bearer \x00"],
)
def test_a_wrong_token_answers_401(db: Any, header: str) -> None:
    client = ApiClient(None)

    response = client.client.get(f"{API}/tools", HTTP_AUTHORIZATION=header)

    assert response.status_code == 401
    assert error_of(response)["code"] == "unauthorized"
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_an_inactive_agent_answers_401(api: ApiClient, agent: Agent) -> None:
    Agent.objects.filter(pk=agent.pk).update(is_active=False)

    response = api.get(f"{API}/tools")

    assert response.status_code == 401
    assert error_of(response)["code"] == "unauthorized"


def test_a_post_without_a_token_stores_nothing(anonymous_api: ApiClient, run: Any) -> None:
    response = post_step(anonymous_api, run.pk, key="sneaky")

    assert response.status_code == 401
    assert not Step.objects.filter(run=run).exists()


def test_last_seen_is_written_at_most_once_a_minute(api: ApiClient, agent: Agent) -> None:
    api.get(f"{API}/tools")
    first_seen = Agent.objects.get(pk=agent.pk).last_seen_at
    api.get(f"{API}/tools")
    assert Agent.objects.get(pk=agent.pk).last_seen_at == first_seen

    long_ago = timezone.now() - timedelta(minutes=5)
    Agent.objects.filter(pk=agent.pk).update(last_seen_at=long_ago)
    api.get(f"{API}/tools")

    assert first_seen is not None
    assert Agent.objects.get(pk=agent.pk).last_seen_at > long_ago


# --- visibility -----------------------------------------------------------------------------


def other_runs_step(other_api: ApiClient) -> tuple[str, str]:
    other_run = other_api.post(f"{API}/runs", {"name": "theirs"}).json()
    other_step = post_step(other_api, other_run["id"], key="theirs").json()
    return other_run["id"], other_step["id"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/runs/{run}"),
        ("get", "/runs/{run}/steps"),
        ("get", "/runs/{run}/report"),
        ("post", "/runs/{run}/steps"),
        ("post", "/runs/{run}/cancel"),
        ("get", "/steps/{step}"),
    ],
)
def test_another_workspaces_ids_answer_like_ids_that_do_not_exist(
    api: ApiClient, other_api: ApiClient, method: str, path: str
) -> None:
    other_run_id, other_step_id = other_runs_step(other_api)
    body = {"key": "k", "tool": "echo", "input": {}} if path.endswith("/steps") else {}

    def call(run_id: str, step_id: str) -> Any:
        url = API + path.format(run=run_id, step=step_id)
        return api.get(url) if method == "get" else api.post(url, body)

    theirs = call(other_run_id, other_step_id)
    missing = call(str(uuid.uuid4()), str(uuid.uuid4()))
    malformed = call("not-a-uuid", "not-a-uuid")

    assert theirs.status_code == missing.status_code == malformed.status_code == 404
    assert theirs.json() == missing.json() == malformed.json()
    assert error_of(theirs)["code"] == "not_found"
    assert other_run_id not in theirs.content.decode()
    assert Step.objects.filter(run_id=other_run_id).count() == 1


def test_another_workspaces_run_is_not_cancelled(api: ApiClient, other_api: ApiClient) -> None:
    other_run_id, other_step_id = other_runs_step(other_api)

    api.post(f"{API}/runs/{other_run_id}/cancel")

    assert other_api.get(f"{API}/runs/{other_run_id}").json()["status"] == "open"
    assert Step.objects.get(pk=other_step_id).state == State.PENDING


def test_a_run_key_is_per_agent(api: ApiClient, other_api: ApiClient) -> None:
    mine = api.post(f"{API}/runs", {"name": "r", "key": "shared-key"})
    theirs = other_api.post(f"{API}/runs", {"name": "r", "key": "shared-key"})

    assert mine.status_code == theirs.status_code == 201
    assert mine.json()["id"] != theirs.json()["id"]


# --- the edges: 404, 405, 413, 429 ----------------------------------------------------------


@pytest.mark.parametrize("path", ["/nothing-here", "/runs/x/y/z", "/tools/", "/"])
def test_an_unknown_path_answers_404_in_the_error_shape(api: ApiClient, path: str) -> None:
    response = api.get(f"{API}{path}")

    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("put", "/runs", "POST"),
        ("get", "/runs", "POST"),
        ("delete", "/runs/{run}", "GET"),
        ("post", "/tools", "GET"),
        ("get", "/runs/{run}/cancel", "POST"),
        ("patch", "/steps/{run}", "GET"),
    ],
)
def test_a_wrong_method_answers_405_in_the_error_shape(
    api: ApiClient, run: Any, method: str, path: str, allowed: str
) -> None:
    url = API + path.format(run=run.pk)

    response = getattr(api.client, method)(url, **api.headers)

    assert response.status_code == 405
    assert error_of(response)["code"] == "method_not_allowed"
    assert allowed in response["Allow"]


def test_a_body_over_64_kib_answers_413_and_stores_nothing(api: ApiClient, run: Any) -> None:
    body = {"key": "big", "tool": "echo", "input": {"blob": "x" * (64 * 1024)}}

    response = api.post(f"{API}/runs/{run.pk}/steps", body)

    assert response.status_code == 413
    error = error_of(response)
    assert error["code"] == "body_too_large"
    assert error["details"] == {"limit": 64 * 1024}
    assert not Step.objects.filter(run=run).exists()


def post_chunked(api: ApiClient, path: str, body: bytes, **environ: Any) -> Any:
    """A body sent chunked, as Django sees it: no Content-Length. (The test client cannot
    de-chunk: tests/executor/test_web_server.py sends real chunks to gunicorn.)"""
    return api.client.post(
        path,
        data=body,
        content_type="application/json",
        CONTENT_LENGTH="",
        HTTP_TRANSFER_ENCODING="chunked",
        **api.headers,
        **environ,
    )


def test_a_chunked_body_where_the_server_cannot_read_it_answers_411(api: ApiClient) -> None:
    # runserver hands Django the raw chunks and no length: better refused than read as empty.
    response = post_chunked(api, f"{API}/runs", b'{"name": "chunked"}')

    assert response.status_code == 411
    assert error_of(response)["code"] == "length_required"
    assert not Run.objects.exists()


def test_too_many_requests_answer_429_with_retry_after(
    api: ApiClient, other_api: ApiClient, settings: Any
) -> None:
    settings.API_RATE_LIMIT = "3/min"

    allowed = [api.get(f"{API}/tools").status_code for _ in range(3)]
    refused = api.get(f"{API}/tools")

    assert allowed == [200, 200, 200]
    assert refused.status_code == 429
    error = error_of(refused)
    assert error["code"] == "rate_limited"
    retry_after = int(refused["Retry-After"])
    assert 1 <= retry_after <= 60
    assert error["details"] == {"retry_after_seconds": retry_after}
    # The limit is per agent: another agent is not held back.
    assert other_api.get(f"{API}/tools").status_code == 200


def test_a_rate_limited_post_stores_nothing(api: ApiClient, settings: Any) -> None:
    settings.API_RATE_LIMIT = "1/min"
    assert api.get(f"{API}/tools").status_code == 200

    response = api.post(f"{API}/runs", {"name": "over the limit"})

    assert response.status_code == 429
    assert not Run.objects.filter(name="over the limit").exists()


@pytest.mark.parametrize(
    ("sent", "stored"),
    [("12.5", "12.5"), ("0.1234", "0.1234"), ("9999999999.9999", "9999999999.9999"), ("7", "7")],
)
def test_budget_max_cost_is_taken_as_a_decimal_string(
    api: ApiClient, sent: str, stored: str
) -> None:
    response = api.post(f"{API}/runs", {"name": "b", "budget": {"max_cost": sent}})

    assert response.status_code == 201
    assert Run.objects.get(pk=response.json()["id"]).max_cost == Decimal(stored)


def test_budget_max_cost_keeps_its_decimal_places(api: ApiClient) -> None:
    # A JSON number is still taken, for the clients that send one (API.md's first shape).
    body = api.post(f"{API}/runs", {"name": "b", "budget": {"max_cost": 0.1234}}).json()

    assert Run.objects.get(pk=body["id"]).max_cost == Decimal("0.1234")
