"""POST /api/v1/runs/{id}/steps/batch (API.md, DESIGN.md §14): all or nothing, idempotent by
key, `depends_on` inside the batch, the size limits, and a fixed number of statements."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from guardian.shortcuts import remove_perm

from executor import engine
from executor.common import dispatch
from executor.contract.tool import get_tool
from executor.ledger import chain
from executor.ledger.records import Agent, Approval, Event, Run, Step, call_hash
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import State
from executor.services.posting import StepRequest, step_post, steps_post
from executor.services.runs import run_cancel
from tests.support.api import ApiClient

pytestmark = pytest.mark.django_db

API = "/api/v1"


def batch_url(run: Run) -> str:
    return f"{API}/runs/{run.pk}/steps/batch"


def echo(key: str, **extra: Any) -> dict[str, Any]:
    return {"key": key, "tool": "echo", "input": {"key": key}, **extra}


def ledger_size(run: Run) -> tuple[int, int, int]:
    return (
        Step.objects.filter(run=run).count(),
        Event.objects.filter(run=run).count(),
        Approval.objects.filter(step__run=run).count(),
    )


def sql_statements(queries: CaptureQueriesContext) -> list[str]:
    """The statements a request ran, without the savepoints the test's transaction adds
    (in production the service's atomic block is a plain BEGIN/COMMIT, not logged)."""
    return [
        q["sql"]
        for q in queries.captured_queries
        if not q["sql"].startswith(("SAVEPOINT", "RELEASE SAVEPOINT"))
    ]


# --- what a batch writes ------------------------------------------------------------------


def test_batch_creates_every_step_in_the_request_order(api: ApiClient, run: Run) -> None:
    response = api.post(batch_url(run), {"steps": [echo("a"), echo("b"), echo("c")]})

    assert response.status_code == 201
    steps = response.json()["steps"]
    assert [s["key"] for s in steps] == ["a", "b", "c"]
    assert [s["state"] for s in steps] == [State.PENDING] * 3
    assert [s["created"] for s in steps] == [True] * 3
    assert [s["position"] for s in steps] == [1, 2, 3]
    listed = api.get(f"{API}/runs/{run.pk}/steps").json()
    assert [s["key"] for s in listed] == ["a", "b", "c"]


def test_batch_steps_have_the_same_history_as_single_posts(
    api: ApiClient, run: Run, agent: Agent
) -> None:
    api.post(batch_url(run), {"steps": [echo("batched")]})
    step_post(agent=agent, run=run, key="single", tool_name="echo", input={"k": 1})

    def history(key: str) -> list[tuple[str, str, str]]:
        return list(
            Event.objects.filter(step__run=run, step__key=key)
            .order_by("seq")
            .values_list("from_state", "to_state", "actor")
        )

    assert history("batched") == history("single") == [("", State.PENDING, "agent:alice-bot")]
    step = Step.objects.get(run=run, key="batched")
    assert step.version == 1
    # The policy's approval is the Event that records it (its version), not a row: the post,
    # which passed through planned and approved as it was recorded.
    assert not step.approvals.exists()
    [posted] = Event.objects.filter(step=step)
    assert posted.data == {
        "policy_version": get_tool("echo").policy_version(),
        "through": ["planned", "approved"],
    }
    assert posted.reason == "posted by the agent; the tool's policy needs no approval; approved"


def test_the_same_batch_again_answers_the_same_steps_and_writes_nothing(
    api: ApiClient, run: Run
) -> None:
    body = {"steps": [echo("a"), echo("b", depends_on=["a"])]}
    first = api.post(batch_url(run), body).json()["steps"]
    before = ledger_size(run)

    again = api.post(batch_url(run), body)

    assert again.status_code == 200
    assert [s["id"] for s in again.json()["steps"]] == [s["id"] for s in first]
    assert [s["created"] for s in again.json()["steps"]] == [False, False]
    assert ledger_size(run) == before


def test_inputs_equal_in_python_but_not_in_json_are_each_stored_as_sent(
    api: ApiClient, run: Run
) -> None:
    # 1 == True == 1.0 in Python; three different inputs (and hashes) to an agent.
    inputs = [{"v": 1}, {"v": True}, {"v": 1.0}, {"v": 1}]
    response = api.post(
        batch_url(run),
        {"steps": [{"key": f"k{i}", "tool": "echo", "input": v} for i, v in enumerate(inputs)]},
    )

    assert response.status_code == 201
    stored = {s.key: s for s in Step.objects.filter(run=run)}
    for index, sent in enumerate(inputs):
        step = stored[f"k{index}"]
        assert step.input == sent
        assert type(step.input["v"]) is type(sent["v"])
        assert step.input_hash == call_hash("echo", sent)
    assert chain.verify_chain(step_ids=[s.pk for s in stored.values()]).ok


def test_a_repost_tried_without_reading_first_writes_nothing_and_leaves_no_gap(
    api: ApiClient, run: Run
) -> None:
    # No dependency: the post is tried as new, collides with the key, then reads and answers.
    first = api.post(f"{API}/runs/{run.pk}/steps", echo("a")).json()
    before = ledger_size(run)

    again = api.post(f"{API}/runs/{run.pk}/steps", echo("a"))
    other = api.post(f"{API}/runs/{run.pk}/steps", echo("a", input={"other": 1}))

    assert (again.status_code, again.json()["id"]) == (200, first["id"])
    assert other.status_code == 409
    assert ledger_size(run) == before
    # The collided insert moved no counter: the next step takes the next position.
    api.post(f"{API}/runs/{run.pk}/steps", echo("b"))
    assert list(
        Step.objects.filter(run=run).order_by("position").values_list("key", "position")
    ) == [
        ("a", 1),
        ("b", 2),
    ]


def test_a_posted_step_is_answered_even_where_a_new_one_would_be_refused(
    api: ApiClient, run: Run, agent: Agent
) -> None:
    first = api.post(f"{API}/runs/{run.pk}/steps", echo("a")).json()
    run_cancel(run=run, actor=agent)

    again = api.post(f"{API}/runs/{run.pk}/steps", echo("a"))
    new = api.post(f"{API}/runs/{run.pk}/steps", echo("b"))

    assert (again.status_code, again.json()["id"]) == (200, first["id"])
    assert new.status_code == 409


def test_a_batch_mixing_posted_and_new_keys_creates_only_the_new(api: ApiClient, run: Run) -> None:
    [old] = api.post(batch_url(run), {"steps": [echo("old")]}).json()["steps"]

    response = api.post(batch_url(run), {"steps": [echo("old"), echo("new")]})

    assert response.status_code == 201
    steps = response.json()["steps"]
    assert steps[0]["id"] == old["id"]
    assert [s["created"] for s in steps] == [False, True]
    assert Step.objects.filter(run=run).count() == 2


def test_depends_on_may_name_an_earlier_item_of_the_batch(api: ApiClient, run: Run) -> None:
    response = api.post(
        batch_url(run), {"steps": [echo("first"), echo("second", depends_on=["first"])]}
    )

    first, second = response.json()["steps"]
    assert (first["state"], second["state"]) == (State.PENDING, State.APPROVED)

    engine.process(first["id"], worker="w1")

    assert Step.objects.get(pk=second["id"]).state == State.PENDING


def test_depends_on_may_name_a_step_already_in_the_run(api: ApiClient, run: Run) -> None:
    [done] = api.post(batch_url(run), {"steps": [echo("done")]}).json()["steps"]
    engine.process(done["id"], worker="w1")

    response = api.post(batch_url(run), {"steps": [echo("after", depends_on=["done"])]})

    assert response.json()["steps"][0]["state"] == State.PENDING


# --- all or nothing ---------------------------------------------------------------------------


def refused(response: Any, status: int, index: int) -> dict[str, Any]:
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert error["details"]["index"] == index
    assert f"item {index}" in error["message"]
    return error


def test_one_item_that_does_not_fit_its_schema_refuses_the_whole_batch(
    api: ApiClient, run: Run
) -> None:
    before = ledger_size(run)
    items = [
        echo("a"),
        echo("b"),
        {"key": "c", "tool": "ticketdesk.create", "input": {"title": ""}},
        echo("d"),
    ]

    error = refused(api.post(batch_url(run), {"steps": items}), 422, 2)

    assert "ticketdesk.create" in error["message"]
    assert "input" in error["details"]
    assert ledger_size(run) == before


def test_an_unknown_tool_refuses_the_batch_naming_the_item(api: ApiClient, run: Run) -> None:
    items = [echo("a"), {"key": "b", "tool": "no.such.tool", "input": {}}]

    refused(api.post(batch_url(run), {"steps": items}), 422, 1)

    assert ledger_size(run) == (0, 0, 0)


def test_a_key_posted_before_with_another_call_is_a_conflict_for_the_batch(
    api: ApiClient, run: Run
) -> None:
    api.post(batch_url(run), {"steps": [echo("taken")]})
    before = ledger_size(run)
    items = [echo("fresh"), {"key": "taken", "tool": "echo", "input": {"other": True}}]

    error = refused(api.post(batch_url(run), {"steps": items}), 409, 1)

    assert "step_id" in error["details"]
    assert ledger_size(run) == before


def test_a_key_twice_in_one_batch_is_refused(api: ApiClient, run: Run) -> None:
    refused(api.post(batch_url(run), {"steps": [echo("a"), echo("b"), echo("a")]}), 422, 2)
    assert ledger_size(run) == (0, 0, 0)


def test_depends_on_naming_a_later_item_is_refused(api: ApiClient, run: Run) -> None:
    items = [echo("a", depends_on=["b"]), echo("b")]

    error = refused(api.post(batch_url(run), {"steps": items}), 422, 0)

    assert error["details"]["depends_on"] == ["b"]
    assert ledger_size(run) == (0, 0, 0)


def test_a_tool_the_agent_may_not_use_refuses_the_batch(
    api: ApiClient, run: Run, agent: Agent, settings: Any
) -> None:
    # The read itself would be allowed: only the permission is missing.
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = ["127.0.0.1"]
    remove_perm("executor.use_tool", agent.user, ToolRow.objects.get(name="http.get"))
    items = [echo("a"), {"key": "b", "tool": "http.get", "input": {"url": "http://127.0.0.1/"}}]

    refused(api.post(batch_url(run), {"steps": items}), 403, 1)

    assert ledger_size(run) == (0, 0, 0)


def test_a_cancelled_run_takes_no_new_batch(api: ApiClient, run: Run) -> None:
    api.post(f"{API}/runs/{run.pk}/cancel", {})

    refused(api.post(batch_url(run), {"steps": [echo("a")]}), 409, 0)


def test_another_workspaces_run_is_not_found(other_api: ApiClient, run: Run) -> None:
    response = other_api.post(batch_url(run), {"steps": [echo("a")]})

    assert response.status_code == 404
    assert ledger_size(run) == (0, 0, 0)


# --- the size limits ------------------------------------------------------------------------


def test_more_than_500_items_answer_413(api: ApiClient, run: Run) -> None:
    response = api.post(batch_url(run), {"steps": [echo(f"k{i}") for i in range(501)]})

    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"
    assert ledger_size(run) == (0, 0, 0)


def test_500_items_are_one_batch(api: ApiClient, run: Run) -> None:
    response = api.post(batch_url(run), {"steps": [echo(f"k{i}") for i in range(500)]})

    assert response.status_code == 201
    assert Step.objects.filter(run=run, state=State.PENDING).count() == 500


def test_a_body_over_the_batch_limit_answers_413(api: ApiClient, run: Run, settings: Any) -> None:
    settings.API_MAX_BATCH_BODY_BYTES = 2000

    response = api.post(batch_url(run), {"steps": [echo(f"k{i}") for i in range(50)]})

    assert response.status_code == 413
    assert response.json()["error"]["details"] == {"limit": 2000}
    assert ledger_size(run) == (0, 0, 0)


def test_a_batch_may_be_larger_than_a_single_posts_limit(
    api: ApiClient, run: Run, settings: Any
) -> None:
    settings.API_MAX_BODY_BYTES = 2000
    response = api.post(batch_url(run), {"steps": [echo(f"k{i}") for i in range(50)]})

    assert response.status_code == 201


def test_an_empty_batch_is_invalid(api: ApiClient, run: Run) -> None:
    response = api.post(batch_url(run), {"steps": []})

    assert response.status_code == 422


# --- messages and statements ----------------------------------------------------------------


def test_a_batch_wakes_one_worker_per_claimable_batch_not_one_per_step(
    api: ApiClient, run: Run, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    settings.EXECUTOR_BATCH_SIZE = 40
    sent: list[str] = []
    with (
        dispatch.publishing(lambda task, step_id, eta: sent.append(task)),
        django_capture_on_commit_callbacks(execute=True),
    ):
        api.post(batch_url(run), {"steps": [echo(f"k{i}") for i in range(100)]})

    assert sent == [dispatch.EXECUTE] * math.ceil(100 / 40)


@pytest.mark.parametrize("size", [1, 200])
def test_a_batch_costs_the_same_statements_whatever_its_size(
    api: ApiClient, run: Run, size: int
) -> None:
    api.post(batch_url(run), {"steps": [echo("warm")]})  # the agent's last_seen is written

    with CaptureQueriesContext(connection) as queries:
        response = api.post(batch_url(run), {"steps": [echo(f"k{i}") for i in range(size)]})

    assert response.status_code == 201
    assert len(sql_statements(queries)) == POST_STATEMENTS[connection.vendor]


@pytest.mark.postgres
def test_a_batchs_write_is_one_text_with_one_parameter_a_column_whatever_its_size(
    api: ApiClient, run: Run
) -> None:
    # The same text for every size: prepared once on a connection, parsed in no time, and
    # never near the protocol's 65,535 parameters (each column's values are one array).
    written: list[tuple[str, int]] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        # The batch's write (a claim that runs meanwhile is a WITH too, and writes nothing).
        if sql.startswith("WITH") and "INSERT INTO" in sql:
            written.append((sql, len(params)))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        for size, prefix in ((2, "small"), (500, "large")):
            response = api.post(
                batch_url(run), {"steps": [echo(f"{prefix}{i}") for i in range(size)]}
            )
            assert response.status_code == 201

    (small_sql, small_params), (large_sql, large_params) = written
    assert small_sql == large_sql
    assert small_params == large_params < 200
    assert Step.objects.filter(run=run).count() == 502


# The token, the run, the grants; then on PostgreSQL one statement that moves the run's step
# counter and inserts the steps and their events; elsewhere the counter,
# then an INSERT a table. A post that names a dependency reads the run's steps first.
POST_STATEMENTS = {"postgresql": 4, "sqlite": 6}
READING_THE_RUNS_STEPS = 1


def test_a_single_post_costs_a_fixed_number_of_statements(api: ApiClient, run: Run) -> None:
    api.post(f"{API}/runs/{run.pk}/steps", echo("warm"))

    with CaptureQueriesContext(connection) as queries:
        response = api.post(f"{API}/runs/{run.pk}/steps", echo("counted", depends_on=["warm"]))

    assert response.status_code == 201
    statements = sql_statements(queries)
    assert len(statements) == POST_STATEMENTS[connection.vendor] + READING_THE_RUNS_STEPS, (
        "\n".join(statements)
    )
    assert not any("FOR UPDATE" in sql for sql in statements), "posting locks nothing"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_post_outside_a_transaction_is_one_write_statement_and_no_begin(
    api: ApiClient, run: Run
) -> None:
    api.post(f"{API}/runs/{run.pk}/steps", echo("warm"))

    with CaptureQueriesContext(connection) as queries:
        response = api.post(f"{API}/runs/{run.pk}/steps", echo("counted"))

    assert response.status_code == 201
    statements = [q["sql"] for q in queries.captured_queries]
    assert len(statements) == 4, "\n".join(statements)
    assert [s.split()[0] for s in statements] == ["SELECT"] * 3 + ["WITH"]
    step = Step.objects.get(run=run, key="counted")
    assert (step.position, step.state, step.version) == (2, State.PENDING, 1)
    assert Event.objects.filter(step=step).count() == 1
    assert not Approval.objects.filter(step=step).exists()


@pytest.mark.django_db(transaction=True)
def test_concurrent_posts_to_one_run_all_land_numbered_without_gaps(agent: Agent, run: Run) -> None:
    errors: list[BaseException] = []

    def post_from_thread(thread: int) -> None:
        try:
            for n in range(10):
                step_post(
                    agent=agent, run=run, key=f"t{thread}-{n}", tool_name="echo", input={"n": n}
                )
            steps_post(
                agent=agent,
                run=run,
                requests=[StepRequest(f"t{thread}-b{n}", "echo", {"n": n}) for n in range(5)],
            )
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=post_from_thread, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert errors == []
    positions = sorted(Step.objects.filter(run=run).values_list("position", flat=True))
    assert positions == list(range(1, 8 * 15 + 1))
