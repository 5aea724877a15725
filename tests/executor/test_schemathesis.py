"""Schemathesis fuzzes the agents' API from the schema it serves, against gunicorn, with every
check (`--checks all`): no 500, every answer in the shape and status the schema declares.

Bounded (a fixed seed and number of examples per operation) and marked slow, so it runs once,
in the PostgreSQL pass of `.ci/test-suites`. The failures accepted on purpose, each with its
reason, are in `.ci/schemathesis-baseline.json`; anything else fails the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from executor.services.runs import run_create
from tests.support.api import AgentAuth
from tests.support.webserver import web_server

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CI = Path(settings.BASE_DIR) / ".ci"
SEED = 4471
EXAMPLES = 40
SECONDS = 900


def test_the_served_schema_holds_under_schemathesis(tmp_path: Path, agent_auth: AgentAuth) -> None:
    # The agent's own rate would otherwise answer most of the run with 429s, testing nothing.
    env = {"API_RATE_LIMIT": "1000000/min"}
    agent = agent_auth.agent
    runs = {
        "STEPWARD_FUZZ_RUN": run_create(agent=agent, name="fuzzed")[0],
        "STEPWARD_FUZZ_CANCEL_RUN": run_create(agent=agent, name="to cancel")[0],
    }
    with web_server(tmp_path, workers=2, threads=4, env=env) as server:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "--config-file",
                str(CI / "schemathesis.toml"),
                "run",
                f"{server.url}/api/v1/openapi.json",
                "--checks",
                "all",
                "--header",
                f"Authorization: Bearer {agent_auth.token}",
                "--seed",
                str(SEED),
                "--max-examples",
                str(EXAMPLES),
                "--workers",
                "2",
                "--request-timeout",
                "60",
                "--generation-database",
                "none",
                "--baseline",
                str(CI / "schemathesis-baseline.json"),
                "--no-color",
                "--report",
                "junit",
                "--report-dir",
                str(tmp_path / "report"),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=SECONDS,
            check=False,
            env={**os.environ, **{name: str(run.pk) for name, run in runs.items()}},
        )
        served = server.describe(lines=40)

    output = run.stdout + run.stderr
    print(output[-6000:])  # The summary, for `pytest -rP`.
    assert run.returncode == 0, f"{output[-20000:]}\n{served}"
    assert "Tested: 9" in output, output[-5000:]
