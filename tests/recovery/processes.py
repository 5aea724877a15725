"""Real processes for the recovery suites: the ticket desk, Celery workers and a sweeper.

Each is a child process with its own log file; a worker can be killed (SIGKILL), stopped
(SIGSTOP), continued and restarted, and every generation of it writes to the same log.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from executor.drill.processes import in_call_to
from executor.models import Step

BASE_DIR = Path(__file__).resolve().parents[2]
BIN_DIR = Path(sys.executable).parent
STARTUP_SECONDS = 60.0
POLL_SECONDS = 0.02
LOG_TAIL_LINES = 120


def wait_until[T](
    probe: Callable[[], T],
    *,
    seconds: float,
    what: str,
    diagnose: Callable[[], str] | None = None,
) -> T:
    """Polls `probe` until it returns something truthy; fails at the deadline.

    On failure the message carries `diagnose()`, so a red run says what the processes and
    the ledger looked like when it gave up.
    """
    deadline = time.monotonic() + seconds
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = diagnose() if diagnose is not None else ""
            pytest.fail(f"gave up after {seconds:g}s waiting for {what}\n{detail}")
        time.sleep(POLL_SECONDS)


def tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


# --- child processes ---------------------------------------------------------------------


class ManagedProcess:
    """One named child process that can be started again after it ends."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.generation = 0
        # How each earlier generation ended (negative: killed by that signal).
        self.exit_codes: list[int] = []
        self._log_start = 0

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was never started"
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, **env: str) -> ManagedProcess:
        assert not self.alive, f"{self.name} is already running"
        if self.process is not None:
            self.exit_codes.append(self.process.returncode)
        self.generation += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {self.name} start {self.generation} {env} ===\n".encode())
            log.flush()
            self._log_start = log.tell()
            self.process = subprocess.Popen(
                self.argv,
                cwd=BASE_DIR,
                env={**self.env, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def log(self) -> str:
        """Everything every generation wrote."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def current_log(self) -> str:
        """What the running (or last) generation wrote."""
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as log:
            log.seek(self._log_start)
            return log.read().decode(errors="replace")

    def signal(self, signum: int) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signum)

    def kill(self) -> int:
        """SIGKILL: no cleanup, no acknowledgement, no rollback hook."""
        self.signal(signal.SIGKILL)
        return self.wait_dead(seconds=STARTUP_SECONDS)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def wait_dead(self, *, seconds: float, diagnose: Callable[[], str] | None = None) -> int:
        process = self.process
        assert process is not None
        wait_until(
            lambda: process.poll() is not None,
            seconds=seconds,
            what=f"{self.name} (pid {process.pid}) to end",
            diagnose=diagnose or self.describe,
        )
        return process.returncode

    def stop(self) -> None:
        """Ends the process whatever state it is in (used at teardown)."""
        if self.alive:
            assert self.process is not None
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=STARTUP_SECONDS)

    def describe(self) -> str:
        ended = self.process.returncode if self.process and not self.alive else "alive"
        state = f"now {ended}, earlier generations ended {self.exit_codes}"
        return f"--- {self.name} ({state}) log tail ---\n{tail(self.log())}"


class Worker(ManagedProcess):
    """`celery -A console worker --pool solo`: one process, so a kill ends the whole worker."""

    def __init__(self, name: str, env: dict[str, str], log_path: Path, queue: str) -> None:
        argv = [
            str(BIN_DIR / "celery"),
            "-A",
            "console",
            "worker",
            "--pool",
            "solo",
            "--concurrency",
            "1",
            "-n",
            f"{name}@%h",
            "--loglevel",
            "INFO",
            "-Q",
            queue,
            # No broadcast chatter between workers: faster starts, and nothing but the
            # queue connects them.
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        super().__init__(name, argv, env, log_path)

    def start(self, *, faults: str = "", wait: bool = True, **env: str) -> Worker:
        super().start(EXECUTOR_FAULTS=faults, **env)
        if wait:
            self.wait_ready()
        return self

    def restart(self, *, faults: str = "", **env: str) -> Worker:
        self.stop()
        return self.start(faults=faults, **env)

    def wait_ready(self) -> None:
        def ready() -> bool:
            if not self.alive:
                pytest.fail(f"{self.name} ended while starting\n{self.describe()}")
            return re.search(r"@\S+ ready\.", self.current_log()) is not None

        wait_until(ready, seconds=STARTUP_SECONDS, what=f"{self.name} to be ready")

    @property
    def actor(self) -> str:
        """The ledger's actor for this generation (engine.worker_name())."""
        return f"executor:{socket.gethostname()}:{self.pid}"

    def task_outcomes(self) -> dict[str, str]:
        """What each execute_step message returned, by task id, over every generation."""
        pattern = r"Task stepward\.execute_step\[(\S+)\] succeeded in \S+: '(\w+)'"
        return dict(re.findall(pattern, self.log()))


class Sweeper(ManagedProcess):
    """`manage.py sweep --loop`: the sweeper as its own process."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        argv = [sys.executable, "manage.py", "sweep", "--loop"]
        super().__init__("sweeper", argv, env, log_path)

    def passes(self) -> int:
        return len(re.findall(r"^recovered=", self.log(), flags=re.MULTILINE))

    def redispatched(self) -> int:
        return sum(int(n) for n in re.findall(r"redispatched=(\d+)", self.log()))


# The drill watches for the same moment: one implementation serves both.
tcp_connected = in_call_to


# --- the ticket desk ---------------------------------------------------------------------


@dataclass
class DeskProcess:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


def start_desk(tmp: Path) -> DeskProcess:
    log_path = tmp / "desk.log"
    with log_path.open("wb") as log:
        # Port 0: the desk binds a free port and prints it, so there is no race for one.
        process = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "ticketdesk",
                "--port",
                "0",
                "--db",
                str(tmp / "desk.sqlite3"),
                "--quiet",
            ],
            cwd=BASE_DIR,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "STEPWARD_VAR_DIR": str(tmp), "PYTHONUNBUFFERED": "1"},
        )

    def listening_url() -> str | None:
        if process.poll() is not None:
            pytest.fail(f"the desk exited with {process.returncode}: {log_path.read_text()}")
        match = re.search(r"listening on (http://\S+)", log_path.read_text())
        return match.group(1) if match else None

    url = wait_until(listening_url, seconds=STARTUP_SECONDS, what="the desk's listening line")

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, seconds=STARTUP_SECONDS, what="the desk's /health")
    return DeskProcess(url=url, process=process, log_path=log_path)


def stop_desk(desk: DeskProcess) -> None:
    if desk.process.poll() is None:
        desk.process.send_signal(signal.SIGTERM)
        try:
            desk.process.wait(timeout=STARTUP_SECONDS)
        except subprocess.TimeoutExpired:
            desk.process.kill()
            desk.process.wait()


@dataclass
class Desk:
    """A client of the running desk: the external truth about tickets."""

    url: str
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, timeout=30)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stats(self) -> dict[str, Any]:
        response = self.client.get("/stats")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def count(self, client_ref: Any) -> int:
        return int(self.stats()["by_client_ref"].get(str(client_ref), 0))

    def ticket_ids(self, client_ref: Any) -> list[int]:
        response = self.client.get("/tickets", params={"client_ref": str(client_ref)})
        assert response.status_code == 200, response.text
        return [int(ticket["ticket_id"]) for ticket in response.json()["tickets"]]

    def tickets_by_ref(self) -> dict[str, list[int]]:
        response = self.client.get("/tickets")
        assert response.status_code == 200, response.text
        found: dict[str, list[int]] = {}
        for ticket in response.json()["tickets"]:
            found.setdefault(ticket["client_ref"], []).append(int(ticket["ticket_id"]))
        return found

    def faults(self, **faults: Any) -> dict[str, Any]:
        response = self.client.post("/faults", json=faults)
        assert response.status_code == 200, response.text
        return dict(response.json())


# --- the ledger, for people reading a failure --------------------------------------------


def describe_ledger(step_ids: Iterable[Any] | None = None, *, limit: int = 40) -> str:
    steps = Step.objects.order_by("created_at")
    if step_ids is not None:
        steps = steps.filter(pk__in=list(step_ids))
    lines = []
    for step in steps.prefetch_related("attempts", "events")[:limit]:
        lines.append(
            f"step {step.key} {step.tool_id} op={step.operation_id} state={step.state} "
            f"v{step.version} fence={step.fence} lease={step.lease_owner or '-'} "
            f"until={step.lease_expires_at} not_before={step.not_before} "
            f"external_id={step.external_id!r} failure={step.failure_class}: "
            f"{step.failure_message[:200]}"
        )
        for attempt in step.attempts.all():
            lines.append(
                f"  attempt {attempt.number} fence={attempt.fence} {attempt.phase} "
                f"worker={attempt.worker} error={attempt.error_class} "
                f"fenced_out={attempt.fenced_out_at} {attempt.fenced_out_write} "
                f"response={attempt.response_evidence}"
            )
        for event in step.events.all():
            lines.append(
                f"  event {event.seq} {event.from_state or '-'} -> {event.to_state} "
                f"by {event.actor}: {event.reason}"
            )
    return "--- ledger ---\n" + "\n".join(lines)
