"""Logs an operator can search (issue 13): engine and API lines carry the step, run,
workspace and attempt they are about, and LOG_FORMAT=json makes each line a JSON object."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from executor import engine
from executor.common import dispatch, logcontext
from executor.contract.tool import FailureClass
from executor.engine import recovery
from executor.ledger.records import Agent, Run
from executor.ledger.states import State
from tests.support import tooling
from tests.support.api import ApiClient
from tests.support.tooling import LookupTool, post

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def engine_env(agent: Agent) -> Iterator[None]:
    with tooling.installed(agent), dispatch.publishing(dispatch.dropping_publisher):
        yield


def about(records: list[logging.LogRecord], text: str) -> logging.LogRecord:
    [record] = [r for r in records if text in r.getMessage()]
    return record


def test_engine_lines_carry_the_step_run_workspace_and_attempt(
    agent: Agent, run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    step = post(agent, run, "test.keyed")
    claim = engine.claim_step(step.pk, worker="A")
    assert isinstance(claim, engine.Claim)
    tooling.expire_lease(step)
    recovery.recover_expired(step.pk)
    engine.claim_step(step.pk, worker="B")

    assert engine.execute_claimed(claim) == engine.Outcome.FENCED_OUT

    line = about(caplog.records, "was fenced out")
    assert (line.step_id, line.run_id, line.workspace, line.attempt) == (  # type: ignore[attr-defined]
        str(step.pk),
        str(run.pk),
        "acme",
        "1",
    )


def test_recovery_lines_carry_the_step(
    agent: Agent, run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    step = post(agent, run, "test.lookup")
    LookupTool.will(FailureClass.AMBIGUOUS)
    assert engine.process(step.pk, worker="w1") == State.UNKNOWN

    def broken_lookup() -> None:
        raise ConnectionError("the system of record is down")

    LookupTool.during_lookup = broken_lookup
    recovery.reconcile(step.pk)

    line = about(caplog.records, "lookup of")
    assert (line.step_id, line.run_id, line.workspace) == (str(step.pk), str(run.pk), "acme")  # type: ignore[attr-defined]


def test_api_lines_carry_the_agent_workspace_run_and_step(
    api: ApiClient, run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="executor.surfaces.http")
    posted = api.post(f"/api/v1/runs/{run.pk}/steps", {"key": "k", "tool": "echo", "input": {}})
    step_id = posted.json()["id"]

    api.get(f"/api/v1/steps/{step_id}")

    line = about(caplog.records, f"GET /api/v1/steps/{step_id} 200")
    assert (line.agent, line.workspace, line.step_id, line.run_id) == (  # type: ignore[attr-defined]
        "alice-bot",
        "acme",
        step_id,
        str(run.pk),
    )
    post_line = about(caplog.records, f"POST /api/v1/runs/{run.pk}/steps 201")
    assert post_line.run_id == str(run.pk)  # type: ignore[attr-defined]


def test_a_line_outside_any_context_carries_nothing_extra(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with logcontext.bound(step_id="s1"):
        logging.getLogger("executor.test").info("inside")
    logging.getLogger("executor.test").info("outside")

    assert about(caplog.records, "inside").step_id == "s1"  # type: ignore[attr-defined]
    assert not hasattr(about(caplog.records, "outside"), "step_id")


def test_log_format_json_makes_each_line_a_json_object(tmp_path: Path) -> None:
    script = (
        "import logging\n"
        "from executor.common import logcontext\n"
        "with logcontext.bound(step_id='s1', run_id='r1', workspace='acme', attempt=2):\n"
        "    logging.getLogger('executor.engine').warning('attempt %s was fenced out', 7)\n"
    )
    env = {
        **os.environ,
        "LOG_FORMAT": "json",
        "STEPWARD_VAR_DIR": str(tmp_path),
        "SECRET_KEY": "a-test-key-that-is-long-enough-for-anything-0123456789",
    }
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )

    [line] = [json.loads(text) for text in done.stderr.splitlines() if text.startswith("{")]
    assert line["message"] == "attempt 7 was fenced out"
    assert (line["level"], line["logger"]) == ("WARNING", "executor.engine")
    assert (line["step_id"], line["run_id"], line["workspace"], line["attempt"]) == (
        "s1",
        "r1",
        "acme",
        "2",
    )
