"""Real processes for the recovery suites: the ticket desk, Celery workers and a sweeper.

They are the drill's own child processes (executor/drill/processes.py): each has its own
log file that every generation writes to, and a worker can be killed (SIGKILL), paused
(SIGSTOP), resumed and restarted. What is here reads them the way these tests do, and
fails the test, where the drill would abort, when something does not happen in time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from executor.drill import processes
from executor.drill.clients import DeskClient
from executor.drill.processes import Child, DeskProcess, command
from executor.ledger.records import Step

POLL_SECONDS = 0.02


def wait_until[T](
    probe: Callable[[], T],
    *,
    seconds: float,
    what: str,
    diagnose: Callable[[], str] | None = None,
    tick: float = POLL_SECONDS,
) -> T:
    """Polls `probe` until it returns something truthy; fails the test at the deadline.

    On failure the message carries `diagnose()`, so a red run says what the processes and
    the ledger looked like when it gave up.
    """
    try:
        return processes.wait_until(probe, seconds=seconds, what=what, diagnose=diagnose, tick=tick)
    except processes.GaveUp as error:
        gave_up = str(error)
    pytest.fail(gave_up)


# --- child processes ---------------------------------------------------------------------


class Worker(processes.Worker):
    """`celery -A console worker --pool solo`: one process, so a kill ends the whole worker."""

    def __init__(self, name: str, env: dict[str, str], log_path: Path, queue: str) -> None:
        super().__init__(name, env, log_path, queue=queue)

    def start(self, *, faults: str = "", wait: bool = True, **env: str) -> Worker:
        super().start(EXECUTOR_FAULTS=faults, **env)
        if wait:
            self.wait_ready()
        return self

    def restart(self, *, faults: str = "", **env: str) -> Worker:
        self.kill()
        return self.start(faults=faults, **env)

    def wait_dead(self, *, seconds: float, diagnose: Callable[[], str] | None = None) -> int:
        process = self.process
        assert process is not None, f"{self.name} was never started"
        wait_until(
            lambda: process.poll() is not None,
            seconds=seconds,
            what=f"{self.name} (pid {process.pid}) to end",
            diagnose=diagnose or self.describe,
        )
        return process.returncode

    @property
    def actor(self) -> str:
        """The ledger's actor for this generation (engine.worker_name())."""
        return f"executor:{self.worker_name}"

    def task_outcomes(self) -> dict[str, str]:
        """What each execute_step message returned, by task id, over every generation."""
        pattern = r"Task stepward\.execute_step\[(\S+)\] succeeded in \S+: '(\w+)'"
        return dict(re.findall(pattern, self.log()))


class Sweeper(Child):
    """`manage.py sweep --loop`: the sweeper as its own process."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        super().__init__("sweeper", command("sweep", "--loop"), env, log_path)

    def passes(self) -> int:
        return len(re.findall(r"^recovered=", self.log(), flags=re.MULTILINE))

    def redispatched(self) -> int:
        return sum(int(n) for n in re.findall(r"redispatched=(\d+)", self.log()))


# --- the ticket desk ---------------------------------------------------------------------


def start_desk(tmp: Path) -> DeskProcess:
    """The desk on a free port, its database and files in `tmp`, answering /health."""
    env = {**os.environ, "STEPWARD_VAR_DIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    return DeskProcess(tmp, env).start()


class Desk(DeskClient):
    """A client of the running desk: the external truth about tickets."""

    @property
    def port(self) -> int:
        return int(urlsplit(self.url).port or 80)

    def count(self, client_ref: Any) -> int:
        return int(self.stats()["by_client_ref"].get(str(client_ref), 0))

    def delayed(self) -> int:
        """Requests that began serving the desk's latency: read whole, their effect not yet
        decided. (A worker's open connection alone may not have sent its request yet.)"""
        return int(self.stats()["delayed"])

    def ticket_ids(self, client_ref: Any) -> list[int]:
        return [int(ticket["ticket_id"]) for ticket in self.tickets(client_ref)]

    def tickets_by_ref(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        for ticket in self.tickets():
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
