"""`manage.py up` as `make run` starts it: its ports, its children, and the demo it runs.

Real processes throughout: `up` itself, and the gunicorn, Celery worker, beat, ticket desk
and demo agent it starts, on this test's database and broker.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.conf import settings

from executor.drill.config import current_database_url
from executor.ledger import selectors
from executor.ledger.records import Run, RunStatus, Step, Workspace
from executor.ledger.states import State
from tests.support.cluster import broker_env
from tests.support.processes import describe_ledger, wait_until

MANAGE = str(settings.BASE_DIR / "manage.py")
# Refusing a busy port happens before anything starts (a Django start, a few seconds on a
# quiet machine): this only bounds a broken test, generously for a loaded one.
REFUSAL_SECONDS = 60
# The demo's dead letter takes its retries' backoff, about 15 s, after the start.
DEMO_SECONDS = 300.0
# What up's environment must not inherit from whoever runs the tests: up decides these.
DECIDED_BY_UP = ("TICKETDESK_URL", "EXECUTOR_HTTP_ALLOWED_HOSTS", "PORT", "TICKETDESK_PORT")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    """A port held by a server that is not Stepward."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held


def up_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in DECIDED_BY_UP}
    return {**env, "STEPWARD_VAR_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1", **extra}


def run_up(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, MANAGE, "up", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=REFUSAL_SECONDS,
        check=False,
    )


def test_up_on_a_busy_port_exits_at_once_naming_it(
    listening: socket.socket, tmp_path: Path
) -> None:
    port = listening.getsockname()[1]

    done = run_up("--port", str(port), "--desk-port", str(free_port()), env=up_env(tmp_path))

    assert done.returncode != 0
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr
    suggested = re.search(r"choose another port: PORT=(\d+) make run", done.stderr)
    assert suggested, done.stderr
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", int(suggested.group(1))))  # the port it suggests is free
    assert "nothing was started" in done.stderr
    assert "Stepward is up" not in done.stdout
    assert not (tmp_path / "log").exists(), "no child was started"


def test_up_refuses_a_busy_desk_port_too(listening: socket.socket, tmp_path: Path) -> None:
    desk_port = listening.getsockname()[1]

    done = run_up("--port", str(free_port()), "--desk-port", str(desk_port), env=up_env(tmp_path))

    assert done.returncode != 0
    assert f"the ticket desk's port {desk_port}" in done.stderr
    assert re.search(r"choose another port: TICKETDESK_PORT=(\d+) make run", done.stderr)


def test_port_comes_from_the_environment(listening: socket.socket, tmp_path: Path) -> None:
    port = listening.getsockname()[1]

    done = run_up(env=up_env(tmp_path, PORT=str(port), TICKETDESK_PORT=str(free_port())))

    assert done.returncode != 0
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr


def test_a_port_that_is_not_a_number_is_a_clear_error(tmp_path: Path) -> None:
    done = run_up(env=up_env(tmp_path, PORT="eighty"))

    assert done.returncode != 0
    assert "PORT must be a whole number, not 'eighty'" in done.stderr


@pytest.fixture
def up_process_env(recovery_queue: str, transactional_db: Any, tmp_path: Path) -> dict[str, str]:
    """Where up's children meet this test: its database and its broker queue."""
    return up_env(
        tmp_path,
        **broker_env(),
        DATABASE_URL=current_database_url(),
        DJANGO_SETTINGS_MODULE="console.settings",
    )


def stop(process: subprocess.Popen[str]) -> None:
    """SIGTERM to up, as a supervisor would; then nothing of its group may be left."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def test_a_child_that_cannot_start_stops_everything(
    up_process_env: dict[str, str], tmp_path: Path
) -> None:
    # gunicorn refuses this at once, as it would any setting it cannot read.
    env = {**up_process_env, "GUNICORN_CMD_ARGS": "--workers=notanumber"}
    up = subprocess.Popen(
        [sys.executable, MANAGE, "up", "--port", str(free_port()), "--no-desk", "--no-demo"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = up.communicate(timeout=90)
    finally:
        stop(up)

    assert up.returncode != 0
    log = tmp_path / "log" / "web.log"
    assert "web could not start: it exited 4 times within 10 s of starting" in err
    assert f"Its log: {log}" in err
    assert "invalid int value: 'notanumber'" in err, "the end of the log is shown"
    assert err.count("web exited with 2; restarting it") == 3
    assert "Stepward is up" not in out
    assert log.read_text().count("invalid int value") == 4


def test_the_demo_leaves_every_reviewer_job(up_process_env: dict[str, str], tmp_path: Path) -> None:
    port, desk_port = free_port(), free_port()
    up_log = tmp_path / "up.out"
    with up_log.open("w") as output:
        up = subprocess.Popen(
            [sys.executable, MANAGE, "up", "--port", str(port), "--desk-port", str(desk_port)],
            env=up_process_env,
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    demo_log = tmp_path / "log" / "demo.log"

    def diagnose() -> str:
        parts = [f"--- up ---\n{up_log.read_text()}"]
        parts.append(describe_ledger())
        return "\n".join(parts)

    try:
        wait_until(
            lambda: demo_log.exists() and "demo: done" in demo_log.read_text(),
            seconds=DEMO_SECONDS,
            what="the demo to finish",
            diagnose=diagnose,
            tick=0.5,
        )
        # ticket-1's lookup settles it by itself, at its due time after the demo's calls.
        wait_until(
            lambda: Step.objects.filter(
                key="ticket-1", run__workspace__slug="demo", state=State.COMPLETED
            ).exists(),
            seconds=120,
            what="ticket-1's lookup to settle it",
            diagnose=diagnose,
            tick=0.5,
        )
        workspace = Workspace.objects.get(slug="demo")
        counts = selectors.inbox_counts(inbox=selectors.InboxFilter(workspace_ids=(workspace.pk,)))[
            "all"
        ]
        paused = selectors.paused_runs(workspace_ids=(workspace.pk,))
        steps = {step.key: step for step in Step.objects.filter(run__workspace=workspace)}

        # An unknown outcome from a real dropped connection: the desk has the ticket.
        assert counts[selectors.InboxKind.UNKNOWN] == 1, diagnose()
        unknown = steps["note-alan"]
        assert (unknown.state, unknown.tool_id) == (State.UNKNOWN, "demo.open_ticket")
        assert "Server disconnected" in unknown.failure_message
        tickets = httpx.get(
            f"http://127.0.0.1:{desk_port}/tickets", params={"client_ref": unknown.operation_id}
        ).json()
        assert tickets["count"] == 1
        # The same fault on a tool with a lookup settled by itself.
        assert steps["ticket-1"].state == State.COMPLETED
        assert steps["ticket-1"].events.filter(to_state=State.UNKNOWN).exists()

        # An approval.
        assert counts[selectors.InboxKind.APPROVAL] == 1
        assert (steps["email-ada"].state, steps["email-ada"].tool_id) == (
            State.PLANNED,
            "email.send",
        )

        # A dead letter, with the reason, that a replay can now fix: the desk is healed.
        assert counts[selectors.InboxKind.DEAD] == 1
        dead = steps["escalate-4471"]
        assert dead.state == State.DEAD
        assert "503" in dead.failure_message
        assert httpx.get(f"http://127.0.0.1:{desk_port}/faults").json()["title_faults"] == {}

        # A paused run over its budget.
        assert [run.name.split(" 2")[0] for run in paused] == ["Nightly digest"]
        assert "max_calls" in paused[0].pause_reason
        assert Run.objects.filter(workspace=workspace, status=RunStatus.PAUSED).count() == 1

        # Nothing else went wrong: no failure a newcomer did not ask for.
        assert counts[selectors.InboxKind.BLOCKED] == 0
        assert not Step.objects.filter(run__workspace=workspace, state=State.FAILED).exists()
        assert "refused" not in demo_log.read_text()
    finally:
        stop(up)
    assert up.returncode is not None
