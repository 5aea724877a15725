"""The recovery drill (DESIGN.md §5, §13), recorded as a DrillReport.

It starts its own ticket desk, sweeper and worker processes, posts steps while workers
crash at the interruption points, are SIGKILLed and restarted and the desk fails, waits
until every step has settled, and then checks each invariant of §13 against the desk's
tickets and the ledger. Every violation is named in the report's notes.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import traceback
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
from celery import Celery
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.utils import timezone

from executor import dispatch, faults, services
from executor.ledger import verify_chain
from executor.models import (
    OPEN_PHASES,
    Agent,
    Approval,
    Attempt,
    DrillReport,
    Event,
    Phase,
    Run,
    RunStatus,
    Step,
)
from executor.states import LEASED, NEEDS_REVIEW, State
from executor.tools.base import RETRYABLE, get_tool

DEFAULT_WORKER_FAULTS = "before_invoke:0.05,after_submit:0.05,before_persist:0.05"
# The latency keeps a worker inside its desk call long enough for a freeze to land there.
DEFAULT_DESK_FAULTS = "503:0.05,429:0.05,drop:0.03,latency:25"
DESK_FAULT_SETTINGS = {
    "503": "error_503_rate",
    "429": "error_429_rate",
    "drop": "drop_after_commit_rate",
}
MAX_DESK_LATENCY_MS = 10_000
BREAKS = ("lookup",)

TOOLS = ("echo", "ticketdesk.create", "ticketdesk.create_keyed")
DESK_TOOLS = frozenset({"ticketdesk.create", "ticketdesk.create_keyed"})
# The one desk tool that the desk does not deduplicate: its second submission is a second
# ticket unless something proved the first had no effect.
UNKEYED_DESK_TOOL = "ticketdesk.create"

# Nothing more happens to a step in these states without a person.
FINAL_STATES = frozenset(
    {
        State.COMPLETED,
        State.FAILED,
        State.DEAD,
        State.BLOCKED,
        State.REJECTED,
        State.CANCELLED,
        State.COMPENSATED,
    }
)
# States the ledger uses to say "no effect happened" (or "none was confirmed").
NO_EFFECT_STATES = frozenset({State.FAILED, State.DEAD, State.CANCELLED, State.REJECTED})

STARTUP_SECONDS = 60.0
STOP_SECONDS = 15.0
TICK_SECONDS = 0.05
LOOK_SECONDS = 0.5
PLAIN_PROGRESS_SECONDS = 10.0
# A worker that keeps exiting for another reason than a fault point or our kill is broken
# (bad settings, unreachable database): the drill stops rather than restart it forever.
MAX_UNEXPECTED_EXITS = 5
FREEZE_PATIENCE_SECONDS = 3.0
LOG_TAIL_LINES = 40
KILLED = -signal.SIGKILL


class DrillError(Exception):
    """The drill could not be carried out (bad options, a process that would not run)."""


# --- options ----------------------------------------------------------------------------


def parse_worker_faults(spec: str) -> dict[str, float]:
    """`before_invoke:0.05,after_submit:0.05,...` (the points of executor.faults)."""
    try:
        return faults.parse(spec)
    except ImproperlyConfigured as error:
        raise DrillError(f"--rates: {error}") from None


def parse_desk_faults(spec: str) -> dict[str, float]:
    """`503:0.05,429:0.05,drop:0.03,latency:25`: the desk's fault rates by short name, and
    the latency of its writes in milliseconds."""
    rates: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition(":")
        if not sep or (name not in DESK_FAULT_SETTINGS and name != "latency"):
            raise DrillError(
                f"--desk-faults: {item!r} is not name:value with a name of "
                f"{', '.join(DESK_FAULT_SETTINGS)}, latency"
            )
        try:
            rate = float(value)
        except ValueError:
            raise DrillError(f"--desk-faults: {value!r} is not a number") from None
        if name == "latency" and not 0 <= rate <= MAX_DESK_LATENCY_MS:
            raise DrillError(f"--desk-faults: latency must be in [0, {MAX_DESK_LATENCY_MS}] ms")
        if name != "latency" and not 0 <= rate <= 1:
            raise DrillError(f"--desk-faults: rate {rate} is outside [0, 1]")
        rates[name] = rate
    return rates


@dataclass
class DrillConfig:
    steps: int = 300
    workers: int = 2
    worker_faults: dict[str, float] = field(
        default_factory=lambda: parse_worker_faults(DEFAULT_WORKER_FAULTS)
    )
    desk_faults: dict[str, float] = field(
        default_factory=lambda: parse_desk_faults(DEFAULT_DESK_FAULTS)
    )
    # Mean seconds between two random SIGKILLs of a worker; 0 for none.
    kill_every: float = 10.0
    # Mean seconds between two freezes (SIGSTOP past the lease, then SIGCONT); 0 for none.
    # A frozen worker wakes up after its step was taken over: its writes must be refused.
    freeze_every: float = 15.0
    seed: int = field(default_factory=lambda: secrets.randbelow(2**31))
    # "" means the database this process uses.
    database_url: str = ""
    # "" means this process's broker, or a fresh embedded one when that is the default.
    broker_url: str = ""
    timeout: float = 900.0
    # Share of the desk steps that a drill reviewer compensates once they complete.
    compensate: float = 0.1
    # Short, so that crashed attempts are recovered within the drill (DESIGN.md §7).
    lease_seconds: int = 5
    sweep_seconds: float = 1.0
    redispatch_after: float = 3.0
    retry_after: int = 1
    # A deliberately broken engine (executor/tools/drill_broken.py); "" for the real one.
    break_engine: str = ""

    def validate(self) -> None:
        if self.steps < 1:
            raise DrillError("--steps must be at least 1")
        if not 1 <= self.workers <= 32:
            raise DrillError("--workers must be between 1 and 32")
        if self.kill_every < 0:
            raise DrillError("--kill-every must be 0 (no kills) or more")
        if self.freeze_every < 0:
            raise DrillError("--freeze-every must be 0 (no freezes) or more")
        if self.timeout <= 0:
            raise DrillError("--timeout must be positive")
        if not 0 <= self.compensate <= 1:
            raise DrillError("--compensate must be in [0, 1]")
        if self.break_engine and self.break_engine not in BREAKS:
            raise DrillError(f"unknown break {self.break_engine!r}")


# --- where the drill runs ---------------------------------------------------------------

EMBEDDED_BROKER = "filesystem://"


def embedded_here() -> bool:
    """Whether this process's own broker is the embedded one (a folder, no server)."""
    return "data_folder_in" in settings.CELERY_BROKER_TRANSPORT_OPTIONS


def current_database_url() -> str:
    """The URL of the database this process uses, for worker processes to use too."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{Path(db['NAME']).resolve()}"
    if connection.vendor == "postgresql":
        auth = quote(db.get("USER") or "", safe="")
        if db.get("PASSWORD"):
            auth += ":" + quote(db["PASSWORD"], safe="")
        host = db.get("HOST") or "127.0.0.1"
        port = db.get("PORT") or 5432
        return f"postgres://{auth}@{host}:{port}/{db['NAME']}"
    raise DrillError(f"the drill cannot hand a {connection.vendor} database to its workers")


def same_database(url: str) -> bool:
    import dj_database_url

    wanted = dj_database_url.parse(url)
    current = connection.settings_dict
    keys = ("ENGINE", "NAME", "HOST", "PORT", "USER")
    if wanted["ENGINE"] == "django.db.backends.sqlite3":
        return (
            current["ENGINE"] == wanted["ENGINE"]
            and Path(str(current["NAME"])).resolve() == Path(str(wanted["NAME"])).resolve()
        )
    return all(str(wanted.get(key) or "") == str(current.get(key) or "") for key in keys)


def redact_url(url: str) -> str:
    """The URL without its password, for reports and output."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def tested_version() -> str:
    """The package version, plus the git commit (and "-dirty") when there is a checkout."""
    try:
        version = importlib.metadata.version("stepward")
    except importlib.metadata.PackageNotFoundError:
        try:
            with (Path(settings.BASE_DIR) / "pyproject.toml").open("rb") as file:
                version = str(tomllib.load(file)["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            version = "unknown"
    git = shutil.which("git")
    if git is None:
        return version
    try:
        commit = subprocess.run(  # noqa: S603 - git, fixed arguments
            [git, "rev-parse", "--short", "HEAD"],
            cwd=settings.BASE_DIR,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        # --no-optional-locks: reading the state must not rewrite the index.
        changes = subprocess.run(  # noqa: S603 - git, fixed arguments
            [git, "--no-optional-locks", "status", "--porcelain"],
            cwd=settings.BASE_DIR,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return version
    return f"{version} ({commit}{'-dirty' if changes else ''})"


# --- child processes --------------------------------------------------------------------


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def continue_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)


class Child:
    """One named child process that can be started again; every generation logs to one file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.generation = 0
        self.exit_codes: list[int] = []
        self.killed_by_drill = False
        # When a frozen (SIGSTOPped) generation is to be continued.
        self.frozen_until: float | None = None
        self.thaw_timer: threading.Timer | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        self.generation += 1
        self.killed_by_drill = False
        self.thaw()
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {self.name} generation {self.generation} ===\n".encode())
            log.flush()
            self.process = subprocess.Popen(  # noqa: S603 - our own interpreter, fixed argv
                self.argv,
                cwd=settings.BASE_DIR,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def reap(self) -> int | None:
        """The exit status of a generation that ended since the last call, or None."""
        if self.process is None or self.process.poll() is None:
            return None
        code = self.process.returncode
        self.exit_codes.append(code)
        self.process = None
        return code

    def kill(self) -> None:
        """SIGKILL: no cleanup, no acknowledgement, no rollback hook."""
        if self.process is not None and self.process.poll() is None:
            self.killed_by_drill = True
            self.process.kill()
            self.note(f"SIGKILL pid {self.process.pid}")
            self.process.wait(timeout=STARTUP_SECONDS)

    def note(self, text: str) -> None:
        """Marks what the drill did to this process in its log, where it happened."""
        with self.log_path.open("ab") as log:
            log.write(f"=== drill: {text} ===\n".encode())

    def freeze(self, seconds: float) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGSTOP)
        self.frozen_until = time.monotonic() + seconds
        self.note(f"SIGSTOP pid {process.pid} for {seconds:g}s")
        # On a timer of its own: the drill's loop may be the one waiting for a lock that
        # the frozen worker holds (SQLite's write lock, a row on PostgreSQL).
        self.thaw_timer = threading.Timer(seconds, continue_process, args=(process,))
        self.thaw_timer.daemon = True
        self.thaw_timer.start()

    def thaw(self) -> None:
        if self.frozen_until is not None and self.process is not None:
            continue_process(self.process)
            self.note(f"SIGCONT pid {self.process.pid}")
        if self.thaw_timer is not None:
            self.thaw_timer.cancel()
        self.thaw_timer = None
        self.frozen_until = None

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.thaw()
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STARTUP_SECONDS)
        # A worker finishing its last task on SIGTERM may still end at a fault point.
        self.exit_codes.append(self.process.returncode)
        self.process = None

    @property
    def crashes(self) -> int:
        """Generations that ended at an interruption point (executor.faults)."""
        return self.exit_codes.count(faults.CRASH_EXIT_STATUS)


class DeskClient:
    """The drill's ticket desk, over HTTP: the external truth about tickets."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=30)

    def healthy(self) -> bool:
        try:
            return self.client.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def set_faults(self, **faults: Any) -> dict[str, Any]:
        response = self.client.post("/faults", json={"reset": True, **faults})
        response.raise_for_status()
        return dict(response.json())

    def stats(self) -> dict[str, Any]:
        response = self.client.get("/stats")
        response.raise_for_status()
        return dict(response.json())

    def tickets(self) -> list[dict[str, Any]]:
        response = self.client.get("/tickets")
        response.raise_for_status()
        return list(response.json()["tickets"])

    def close(self) -> None:
        self.client.close()


class Publisher:
    """Sends "look at step X" to the drill's broker and queue, whatever this process's
    own Celery settings are (the workers are told the same broker and queue)."""

    def __init__(self, broker_url: str, transport_options: dict[str, Any], *, queue: str) -> None:
        self.app = Celery("stepward-drill", broker=broker_url, set_as_current=False)
        self.app.conf.broker_transport_options = transport_options
        self.app.conf.task_default_queue = queue
        self.app.conf.broker_connection_retry_on_startup = True
        self.failed = 0

    def send(self, step_id: Any) -> None:
        try:
            self.app.send_task("stepward.execute_step", args=[str(step_id)])
        except Exception:  # noqa: BLE001 - a lost hint only delays: the sweeper resends it
            self.failed += 1

    def close(self) -> None:
        self.app.close()


# --- progress ---------------------------------------------------------------------------


class Progress:
    """A progress bar on a terminal, a plain line every few seconds otherwise."""

    def __init__(self, write: Callable[[str], object], *, interactive: bool) -> None:
        self.write = write
        self.interactive = interactive
        self.bar_shown = False
        self.next_plain = 0.0

    def line(self, text: str) -> None:
        self.end_bar()
        self.write(text + "\n")

    def update(self, settled: int, total: int, detail: str, *, force: bool = False) -> None:
        if self.interactive:
            width = 30
            done = width * settled // max(total, 1)
            bar = "#" * done + "." * (width - done)
            self.write(f"\r[{bar}] {settled}/{total} settled  {detail}\x1b[K")
            self.bar_shown = True
            return
        now = time.monotonic()
        if force or now >= self.next_plain:
            self.write(f"drill: {settled}/{total} settled; {detail}\n")
            self.next_plain = now + PLAIN_PROGRESS_SECONDS

    def end_bar(self) -> None:
        if self.bar_shown:
            self.write("\n")
            self.bar_shown = False


def in_call_to(pid: int, port: int) -> bool:
    """Whether process `pid` has an established TCP connection to local `port` (Linux /proc;
    False where that cannot be read). The desk tools open a fresh connection per call."""
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    except OSError:
        return False
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            # State 01 is ESTABLISHED; the remote port is the hex after the colon.
            if inode in inodes and state == "01" and int(remote.rsplit(":", 1)[1], 16) == port:
                return True
    return False


# --- the checks of DESIGN.md §13 ----------------------------------------------------------


def is_settled(state: str, not_before: datetime | None) -> bool:
    """Final, or `unknown` with no lookup due: waiting visibly for a person."""
    if state == State.UNKNOWN:
        return not_before is None
    return state in FINAL_STATES


@dataclass
class Verdict:
    violations: list[str] = field(default_factory=list)
    duplicates: int = 0
    lost: int = 0
    left_for_review: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    waiting: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.violations


def _label(step: Step) -> str:
    return f"step {step.key} ({step.tool_id}, {step.state}, {step.pk})"


def check_invariants(
    *, run: Run, posted: Iterable[uuid.UUID], tickets: list[dict[str, Any]]
) -> Verdict:
    """Checks every invariant of DESIGN.md §13 for the steps of `run` against the desk's
    tickets. Returns the verdict; each violation names the step and what is wrong."""
    verdict = Verdict()
    steps = {step.pk: step for step in Step.objects.filter(run=run).order_by("position")}
    attempts: dict[uuid.UUID, list[Attempt]] = defaultdict(list)
    for attempt in Attempt.objects.filter(step__run=run).order_by("step_id", "number"):
        attempts[attempt.step_id].append(attempt)
    events: dict[uuid.UUID, list[Event]] = defaultdict(list)
    for event in Event.objects.filter(run=run).order_by("step_id", "seq"):
        events[event.step_id].append(event)
    approvals: dict[uuid.UUID, list[Approval]] = defaultdict(list)
    for approval in Approval.objects.filter(step__run=run):
        approvals[approval.step_id].append(approval)
    tickets_by_ref: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for ticket in tickets:
        tickets_by_ref[str(ticket["client_ref"])].append(ticket)

    verdict.counts = dict(sorted(Counter(step.state for step in steps.values()).items()))
    violations = verdict.violations

    # 1. No step is lost.
    for step_id in posted:
        if step_id not in steps:
            verdict.lost += 1
            violations.append(f"§13.1 lost: posted step {step_id} is not in the ledger")
    for step in steps.values():
        if not is_settled(step.state, step.not_before):
            verdict.lost += 1
            why = "a lookup is still due" if step.state == State.UNKNOWN else "not settled"
            violations.append(f"§13.1 lost: {_label(step)} was left {step.state}: {why}")
        elif any(attempt.phase in OPEN_PHASES for attempt in attempts[step.pk]):
            violations.append(f"§13.1 {_label(step)} settled with an attempt still open")
        if step.state in NEEDS_REVIEW:
            verdict.left_for_review += 1
            verdict.waiting.append(
                f"{_label(step)}: {step.failure_class or '-'}: {step.failure_message[:200]}"
            )

    # 2 and 3. No confirmed work repeated, no non-idempotent write submitted twice.
    operations = {str(step.operation_id): step for step in steps.values()}
    for step in steps.values():
        violations.extend(_repeated_work(step, attempts[step.pk], events[step.pk]))
        if step.tool_id == "echo" and step.state == State.COMPLETED and step.result != step.input:
            violations.append(f"§13.2 {_label(step)} returned {step.result!r}, not its input")
        if step.tool_id not in DESK_TOOLS:
            continue
        found = tickets_by_ref.get(str(step.operation_id), [])
        ids = [int(ticket["ticket_id"]) for ticket in found]
        if len(found) > 1:
            verdict.duplicates += 1
            violations.append(
                f"§13.3 duplicate: {_label(step)} has {len(found)} tickets at the desk for "
                f"operation {step.operation_id}: {ids}"
            )
        if step.state in (State.COMPLETED, State.COMPENSATED) and ids != [
            _as_int(step.external_id)
        ]:
            violations.append(
                f"§13.2 {_label(step)} names ticket {step.external_id!r}, the desk has {ids}"
            )
        if step.state == State.COMPENSATED and any(t["status"] != "closed" for t in found):
            violations.append(f"§11 {_label(step)} is compensated but its ticket is open")
        if step.tool_id == UNKEYED_DESK_TOOL and step.state in NO_EFFECT_STATES and found:
            violations.append(
                f"§13.2 {_label(step)}: the ledger records no effect, the desk has tickets {ids}"
            )
    for ref, found in tickets_by_ref.items():
        if ref not in operations:
            violations.append(
                f"§13.3 the desk has tickets {[t['ticket_id'] for t in found]} for {ref}, "
                "which is no drill step's operation"
            )

    # 4. No two workers act on one step at once; stale fences write nothing.
    for step in steps.values():
        violations.extend(_fence_violations(step, attempts[step.pk], events[step.pk]))

    # 5. Nothing executed without a valid authorization and a budget.
    submitted = 0
    for step in steps.values():
        for attempt in attempts[step.pk]:
            if attempt.submitted_at is None:
                continue
            submitted += 1
            if not _authorized(step, attempt, approvals[step.pk]):
                violations.append(
                    f"§13.5 {_label(step)}: attempt {attempt.number} was submitted at "
                    f"{attempt.submitted_at.isoformat()} without a valid approval of this call"
                )
    run.refresh_from_db(fields=["used_calls"])
    if run.used_calls != submitted:
        violations.append(
            f"§13.5 the run counted {run.used_calls} calls, its attempts made {submitted}"
        )

    # 6. Every state change has its Event.
    chain = verify_chain(step_ids=list(steps))
    violations.extend(f"§13.6 {finding}" for finding in chain.findings)
    for step in steps.values():
        if len(events[step.pk]) != step.version:
            violations.append(
                f"§13.6 {_label(step)} is at version {step.version} with "
                f"{len(events[step.pk])} events"
            )
    return verdict


def _as_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _repeated_work(step: Step, attempts: list[Attempt], events: list[Event]) -> list[str]:
    """A stored response is never followed by another submission (§13.2), and an
    unkeyed desk write is submitted again only after evidence that it had no effect (§13.3).
    """
    found: list[str] = []
    responded = [a for a in attempts if a.phase == Phase.RESPONDED]
    if len(responded) > 1:
        numbers = [a.number for a in responded]
        found.append(f"§13.2 {_label(step)} has responses stored by attempts {numbers}")
    if responded:
        first = responded[0]
        later = [a.number for a in attempts if a.number > first.number and a.submitted_at]
        if later:
            found.append(
                f"§13.2 {_label(step)} was submitted again (attempts {later}) after attempt "
                f"{first.number} stored its response"
            )
    if step.tool_id != UNKEYED_DESK_TOOL:
        return found
    sent = [a for a in attempts if a.submitted_at is not None]
    for before, after in itertools.pairwise(sent):
        assert before.submitted_at is not None
        assert after.submitted_at is not None
        # The desk answers 503 and 429 before committing: a retryable class means no ticket.
        if before.error_class in RETRYABLE:
            continue
        window = [e for e in events if before.submitted_at <= e.created_at <= after.submitted_at]
        proven = any(
            e.data.get("lookup") == "not_found" or e.actor.startswith("user:") for e in window
        )
        if not proven:
            found.append(
                f"§13.3 {_label(step)}: attempt {after.number} was submitted although nothing "
                f"showed that attempt {before.number} ({before.phase}, "
                f"{before.error_class or 'no error'}) had no effect"
            )
    return found


def _fence_violations(step: Step, attempts: list[Attempt], events: list[Event]) -> list[str]:
    """Every move a worker made was made while it held the step's lease (§13.4).

    Walks the step's events: a worker's claim (pending → running) makes it the holder;
    any move to a state without a lease, or any move by someone else, ends the holding.
    A worker's move at any other time is a stale write that the fence should have refused.
    """
    found: list[str] = []
    fences = Counter(a.fence for a in attempts)
    for fence, count in fences.items():
        if count > 1:
            found.append(f"§13.4 {_label(step)} has {count} attempts with fence {fence}")
    workers_by_fence = {a.fence: a.worker for a in attempts}
    holder: str | None = None
    last_fence = 0
    for event in events:
        actor = event.actor
        is_worker = actor.startswith("executor:")
        worker = actor.removeprefix("executor:")
        if is_worker and event.from_state == State.PENDING and event.to_state == State.RUNNING:
            fence = int(event.data.get("fence", 0))
            if fence <= last_fence:
                found.append(
                    f"§13.4 {_label(step)}: claim at seq {event.seq} took fence {fence}, "
                    f"not above {last_fence}"
                )
            if workers_by_fence.get(fence) != worker:
                found.append(
                    f"§13.4 {_label(step)}: claim at seq {event.seq} by {worker} has no "
                    f"attempt of that worker with fence {fence}"
                )
            last_fence = max(last_fence, fence)
            holder = worker
            continue
        if is_worker and (holder != worker or event.from_state not in LEASED):
            found.append(
                f"§13.4 {_label(step)}: {event.from_state} → {event.to_state} at seq "
                f"{event.seq} was written by {worker}, which did not hold the lease "
                f"(holder: {holder or 'nobody'})"
            )
        if not is_worker or event.to_state not in LEASED:
            holder = None
    return found


def _authorized(step: Step, attempt: Attempt, approvals: list[Approval]) -> bool:
    """An approval of this exact call was live when the attempt was submitted (§9)."""
    at = attempt.submitted_at
    assert at is not None
    try:
        policy_version = get_tool(step.tool_id).policy_version()
    except LookupError:
        return False
    return any(
        approval.input_hash == step.input_hash
        and approval.tool == step.tool_id
        and approval.policy_version == policy_version
        and approval.approved_at <= at
        and (approval.revoked_at is None or approval.revoked_at > at)
        and (approval.consumed_at is None or approval.consumed_at >= at)
        and (approval.expires_at is None or approval.expires_at > at)
        for approval in approvals
    )


# --- the drill --------------------------------------------------------------------------


@dataclass
class Snapshot:
    states: Counter[str]
    settled: int
    total: int
    completed_ids: set[uuid.UUID]

    @property
    def quiet(self) -> bool:
        return self.settled == self.total


class Drill:
    """One drill. `run()` carries it out and returns its saved DrillReport."""

    def __init__(
        self,
        config: DrillConfig,
        *,
        write: Callable[[str], object] = sys.stdout.write,
        interactive: bool = False,
    ) -> None:
        config.validate()
        self.config = config
        self.progress = Progress(write, interactive=interactive)
        self.rng = random.Random(config.seed)
        self.database_url = config.database_url or current_database_url()
        # Logs, the desk's file and the embedded broker; removed when the drill passes.
        self.tmp = Path(tempfile.mkdtemp(prefix="stepward-drill-"))
        self.queue = settings.CELERY_TASK_DEFAULT_QUEUE
        self.broker_dir: Path | None = None
        # What the workers are told, in the environment's terms (API.md: unset or
        # "filesystem://" means the embedded broker).
        self.broker_url = (
            config.broker_url or os.environ.get("CELERY_BROKER_URL", "") or EMBEDDED_BROKER
        )
        if self.broker_url == EMBEDDED_BROKER or (
            embedded_here() and self.broker_url == settings.CELERY_BROKER_URL
        ):
            # A fresh folder: no worker of anything else can take the drill's messages.
            self.broker_url = EMBEDDED_BROKER
            self.broker_dir = self.tmp / "broker"
        self.desk_process: Child | None = None
        self.desk: DeskClient | None = None
        self.sweeper: Child | None = None
        self.workers: list[Child] = []
        self.publisher: Publisher | None = None
        self.kills = 0
        self.freezes = 0
        self.unexpected_exits: list[str] = []
        self.next_kill = float("inf")
        self.next_freeze = float("inf")
        self.posted: list[uuid.UUID] = []
        self.to_compensate: set[uuid.UUID] = set()
        self.compensation_requested: set[uuid.UUID] = set()
        self.run_record: Run | None = None
        self.agent: Agent | None = None
        self.reviewer: Any = None
        self.started = 0.0

    # --- the whole drill ----------------------------------------------------------------

    def run(self) -> DrillReport:
        try:
            if Step._meta.db_table not in connection.introspection.table_names():
                raise DrillError("the database has no ledger tables: run `manage.py migrate`")
            live = (
                Run.objects.exclude(workspace__slug="drill")
                .filter(status__in=(RunStatus.OPEN, RunStatus.PAUSED))
                .count()
            )
            if live:
                # The drill's workers and sweeper act on every due step in the database:
                # real work would go to the drill's desk and be crashed on purpose.
                raise DrillError(
                    f"this database holds {live} open run(s) outside the drill workspace; "
                    "run drills on a database of their own (--database URL)"
                )
            self.started = time.monotonic()
            report = DrillReport.objects.create(
                version=tested_version(),
                started_at=timezone.now(),
                parameters=self.parameters(),
                interruption_points=self.interruption_points(),
            )
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        notes: list[str] = []
        verdict = Verdict()
        quiet = aborted = False
        desk_stats: dict[str, Any] | None = None
        try:
            notes.extend(self.prepare(report))
            self.start_processes()
            self.post_steps()
            quiet = self.wait_quiet()
            self.stop_workers()
            assert self.desk is not None
            assert self.run_record is not None
            verdict = check_invariants(
                run=self.run_record, posted=self.posted, tickets=self.desk.tickets()
            )
            desk_stats = self.desk.stats()
            if not quiet:
                notes.append(
                    f"not quiet after --timeout {self.config.timeout:g}s; "
                    "the unsettled steps are listed as lost"
                )
        except DrillError as error:
            aborted = True
            notes.append(f"the drill was aborted: {error}")
        except BaseException as error:
            aborted = True
            notes.append(f"the drill was aborted by {type(error).__name__}: {error}")
            notes.append(traceback.format_exc(limit=5))
            raise
        finally:
            self.stop_all()
            report.interruption_points = self.interruption_points(desk_stats)
            notes.extend(self.unexpected_exits)
            if self.publisher is not None and self.publisher.failed:
                notes.append(
                    f"{self.publisher.failed} messages could not be sent; the sweeper resends"
                )
            passed = verdict.passed and quiet and not aborted
            if not passed:
                notes.append(f"process logs kept in {self.tmp}")
            self.save(report, verdict, notes, passed=passed)
            if passed:
                shutil.rmtree(self.tmp, ignore_errors=True)
        return report

    def parameters(self) -> dict[str, Any]:
        config = self.config
        return {
            "steps": config.steps,
            "workers": config.workers,
            "tools": list(TOOLS),
            "kill_every_seconds": config.kill_every,
            "freeze_every_seconds": config.freeze_every,
            "seed": config.seed,
            "timeout_seconds": config.timeout,
            "compensate": config.compensate,
            "database": f"{connection.vendor}: {redact_url(self.database_url)}",
            "broker": redact_url(self.broker_url)
            + (f" in {self.broker_dir}" if self.broker_dir else ""),
            "queue": self.queue,
            "lease_seconds": config.lease_seconds,
            "sweep_seconds": config.sweep_seconds,
            "redispatch_after_seconds": config.redispatch_after,
            **({"break": config.break_engine} if config.break_engine else {}),
        }

    def interruption_points(self, desk_stats: dict[str, Any] | None = None) -> dict[str, Any]:
        hits = self.fault_hits()
        points: dict[str, Any] = {
            "worker": {
                point: {"rate": self.config.worker_faults.get(point, 0.0), "hits": hits[point]}
                for point in faults.POINTS
            },
            "desk": {
                name: {"rate": self.config.desk_faults.get(name, 0.0)}
                for name in DESK_FAULT_SETTINGS
            },
            "desk_latency_ms": self.config.desk_faults.get("latency", 0.0),
            "kills": {"every_seconds": self.config.kill_every, "done": self.kills},
            "freezes": {
                "every_seconds": self.config.freeze_every,
                "seconds": self.freeze_seconds(),
                "done": self.freezes,
            },
            "worker_crashes": self.crashes(),
        }
        if desk_stats is not None:
            injected = desk_stats.get("faults_injected", {})
            points["desk"]["503"]["injected"] = injected.get("error_503", 0)
            points["desk"]["429"]["injected"] = injected.get("error_429", 0)
            points["desk"]["drop"]["injected"] = injected.get("drop_after_commit", 0)
            points["desk"]["stale_fence_refused"] = desk_stats.get("stale_fence_refused", 0)
        if self.run_record is not None:
            # Writes of woken-up workers that the ledger refused by fence (§7).
            points["fenced_out_attempts"] = Attempt.objects.filter(
                step__run=self.run_record, fenced_out_at__isnull=False
            ).count()
        return points

    def crashes(self) -> int:
        return sum(worker.crashes for worker in self.workers)

    def fault_hits(self) -> Counter[str]:
        hits: Counter[str] = Counter()
        for worker in self.workers:
            hits.update(
                re.findall(r"fault injected at (\w+)", worker.log_path.read_text(errors="replace"))
                if worker.log_path.exists()
                else []
            )
        return hits

    def save(
        self, report: DrillReport, verdict: Verdict, notes: list[str], *, passed: bool
    ) -> None:
        lines = []
        if verdict.violations:
            lines.append(f"{len(verdict.violations)} violation(s):")
            lines.extend(f"- {violation}" for violation in verdict.violations)
        else:
            lines.append("no violation found")
        if verdict.waiting:
            lines.append(f"{len(verdict.waiting)} step(s) left for review:")
            lines.extend(f"- {waiting}" for waiting in verdict.waiting)
        lines.extend(notes)
        report.finished_at = timezone.now()
        report.counts = verdict.counts
        report.duplicates = verdict.duplicates
        report.lost = verdict.lost
        report.left_for_review = verdict.left_for_review
        report.elapsed_seconds = round(time.monotonic() - self.started, 3)
        report.passed = passed
        report.notes = "\n".join(lines)
        if self.run_record is not None:
            report.parameters = {**report.parameters, "run_id": str(self.run_record.pk)}
        report.save()

    # --- setting up ---------------------------------------------------------------------

    def prepare(self, report: DrillReport) -> list[str]:
        """The drill's agent, reviewer and run; returns notes on what it found."""
        workspace = services.workspace_get_or_create(slug="drill", name="Recovery drills")
        notes = []
        # An earlier drill that timed out or was interrupted left work that this drill's
        # workers would otherwise carry to this drill's desk, as tickets of no step here.
        for leftover in Run.objects.filter(
            workspace=workspace, status__in=(RunStatus.OPEN, RunStatus.PAUSED)
        ):
            services.run_cancel(
                run=leftover, actor="drill", reason=f"recovery drill {report.pk} started"
            )
            notes.append(f"cancelled {leftover.name}, left unfinished by an earlier drill")
        agent, _token = services.agent_create(
            workspace=workspace, name=f"drill-{report.pk}-{secrets.token_hex(3)}"
        )
        self.reviewer = services.reviewer_create(workspace=workspace, username="drill-reviewer")
        self.run_record, _ = services.run_create(
            agent=agent, name=f"recovery drill {report.pk}", key=f"drill-{report.pk}"
        )
        self.agent = agent
        return notes

    def child_env(self) -> dict[str, str]:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "console.settings"),
            "DATABASE_URL": self.database_url,
            "CELERY_BROKER_URL": self.broker_url,
            "CELERY_QUEUE": self.queue,
            "EXECUTOR_ALLOW_FAULTS": "1",
            "EXECUTOR_FAULTS": "",
            "EXECUTOR_FAULTS_SEED": str(self.config.seed),
            "EXECUTOR_LEASE_SECONDS": str(self.config.lease_seconds),
            "EXECUTOR_SWEEP_SECONDS": str(self.config.sweep_seconds),
            "EXECUTOR_REDISPATCH_AFTER": str(self.config.redispatch_after),
            # The workers' events must verify under this process's key.
            "EXECUTOR_LEDGER_KEY": settings.EXECUTOR_LEDGER_KEY,
            "LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("EXECUTOR_BREAK", None)
        if self.config.break_engine:
            env["EXECUTOR_BREAK"] = self.config.break_engine
        if self.broker_dir is not None:
            env["STEPWARD_BROKER_DIR"] = str(self.broker_dir)
        if self.desk is not None:
            env["TICKETDESK_URL"] = self.desk.url
        return env

    def publisher_broker(self) -> tuple[str, dict[str, Any]]:
        """The URL and transport options that console/settings.py derives in the workers
        from the environment they are given, for this process to publish alike."""
        if self.broker_dir is None:
            if self.broker_url == settings.CELERY_BROKER_URL:
                return self.broker_url, dict(settings.CELERY_BROKER_TRANSPORT_OPTIONS)
            return self.broker_url, {}
        # The settings may map the embedded broker to a transport of their own; this
        # process uses the same settings module, so it knows which one.
        url = settings.CELERY_BROKER_URL if embedded_here() else EMBEDDED_BROKER
        options = dict(settings.CELERY_BROKER_TRANSPORT_OPTIONS) if embedded_here() else {}
        folders = {
            "data_folder_in": self.broker_dir / "messages",
            "data_folder_out": self.broker_dir / "messages",
            "processed_folder": self.broker_dir / "processed",
            "control_folder": self.broker_dir / "control",
        }
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        return url, {
            "store_processed": False,
            "polling_interval": 0.01,
            **options,
            **{key: str(folder) for key, folder in folders.items()},
        }

    def entry(self, *argv: str) -> list[str]:
        """How a child is started: the ordinary command, or through the broken engine."""
        if self.config.break_engine:
            return [sys.executable, "-m", "executor.tools.drill_broken", *argv]
        if argv[0] == "celery":
            return [sys.executable, "-m", *argv]
        return [sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), *argv]

    def start_processes(self) -> None:
        self.start_desk()
        assert self.desk is not None
        rates = self.config.desk_faults
        self.desk.set_faults(
            error_503_rate=rates.get("503", 0.0),
            error_429_rate=rates.get("429", 0.0),
            drop_after_commit_rate=rates.get("drop", 0.0),
            latency_ms=rates.get("latency", 0.0),
            retry_after=self.config.retry_after,
            seed=self.config.seed,
        )
        self.publisher = Publisher(*self.publisher_broker(), queue=self.queue)
        env = self.child_env()
        self.sweeper = Child(
            "sweeper", self.entry("sweep", "--loop"), env, self.tmp / "sweeper.log"
        )
        self.sweeper.start()
        worker_env = {**env, "EXECUTOR_FAULTS": self.worker_fault_spec()}
        for number in range(1, self.config.workers + 1):
            name = f"w{number}"
            argv = self.entry(
                "celery",
                "-A",
                "console",
                "worker",
                "--pool",
                "solo",
                "--concurrency",
                "1",
                "-n",
                f"drill-{name}@%h",
                "--loglevel",
                "INFO",
                "-Q",
                self.queue,
                # Nothing but the queue connects the workers: no broadcast chatter.
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            )
            worker = Child(name, argv, worker_env, self.tmp / f"{name}.log")
            worker.start()
            self.workers.append(worker)
        self.next_kill = self.after(self.config.kill_every)
        self.next_freeze = self.after(self.config.freeze_every)

    def worker_fault_spec(self) -> str:
        return ",".join(f"{point}:{rate}" for point, rate in self.config.worker_faults.items())

    def start_desk(self) -> None:
        log_path = self.tmp / "desk.log"
        # The desk is the external system: it is never broken, whatever the engine is.
        argv = [
            sys.executable,
            str(Path(settings.BASE_DIR) / "manage.py"),
            "ticketdesk",
            "--port",
            "0",
            "--db",
            str(self.tmp / "desk.sqlite3"),
            "--quiet",
        ]
        self.desk_process = Child("desk", argv, self.child_env(), log_path)
        self.desk_process.start()
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            match = re.search(r"listening on (http://\S+)", log_tail(log_path))
            if match:
                desk = DeskClient(match.group(1))
                if desk.healthy():
                    self.desk = desk
                    return
                desk.close()
            if not self.desk_process.alive or time.monotonic() > deadline:
                raise DrillError(f"the ticket desk did not start:\n{log_tail(log_path)}")
            time.sleep(TICK_SECONDS)

    # --- posting ------------------------------------------------------------------------

    def post_steps(self) -> None:
        assert self.run_record is not None
        assert self.publisher is not None
        assert self.agent is not None
        plan = [TOOLS[number % len(TOOLS)] for number in range(self.config.steps)]
        self.rng.shuffle(plan)
        desk_numbers = [n for n, tool in enumerate(plan) if tool in DESK_TOOLS]
        chosen = set(
            self.rng.sample(desk_numbers, k=round(self.config.compensate * len(desk_numbers)))
        )
        self.progress.line(
            f"drill: posting {len(plan)} steps for {self.config.workers} workers "
            f"(seed {self.config.seed}, logs in {self.tmp})"
        )
        for number, tool in enumerate(plan):
            tool_input: dict[str, Any] = (
                {"drill": self.run_record.name, "number": number}
                if tool == "echo"
                else {"title": f"drill ticket {number}", "body": self.run_record.name}
            )
            # This process's own Celery settings may point elsewhere: the step is announced
            # on the drill's broker below, explicitly.
            with dispatch.publishing(dispatch.dropping_publisher):
                step, _ = services.step_post(
                    agent=self.agent,
                    run=self.run_record,
                    key=f"drill-{number:05d}",
                    tool_name=tool,
                    input=tool_input,
                )
            self.posted.append(step.pk)
            if number in chosen:
                self.to_compensate.add(step.pk)
            if step.state == State.PENDING:
                self.publisher.send(step.pk)
            self.tick()

    # --- chaos --------------------------------------------------------------------------

    def after(self, every: float) -> float:
        """When the next random event of a series with this mean interval is due."""
        return time.monotonic() + self.rng.uniform(0.5, 1.5) * every if every else float("inf")

    def freeze_seconds(self) -> float:
        # Long enough for the lease to expire and the sweeper to take the step over.
        return 2 * self.config.lease_seconds + 2 * self.config.sweep_seconds

    def tick(self) -> None:
        """Restarts what ended, thaws what was frozen long enough, and kills or freezes a
        worker when one is due."""
        assert self.desk_process is not None
        assert self.sweeper is not None
        if not self.desk_process.alive:
            raise DrillError(f"the ticket desk exited:\n{log_tail(self.desk_process.log_path)}")
        now = time.monotonic()
        for child in [self.sweeper, *self.workers]:
            if child.frozen_until is not None and now >= child.frozen_until:
                child.thaw()
            killed = child.killed_by_drill
            code = child.reap()
            if code is None:
                continue
            if code != faults.CRASH_EXIT_STATUS and not (killed and code == KILLED):
                self.unexpected_exits.append(
                    f"{child.name} exited with status {code}:\n{log_tail(child.log_path, 15)}"
                )
                if len(self.unexpected_exits) > MAX_UNEXPECTED_EXITS:
                    raise DrillError(
                        f"processes keep exiting unexpectedly; last: {child.name}, status "
                        f"{code}:\n{log_tail(child.log_path)}"
                    )
            child.start()
        if now >= self.next_kill:
            # A frozen worker is left to wake up: that is what its freeze is for.
            alive = [w for w in self.workers if w.alive and w.frozen_until is None]
            if alive:
                self.rng.choice(alive).kill()
                self.kills += 1
            self.next_kill = self.after(self.config.kill_every)
        if now >= self.next_freeze:
            # Never every worker at once: another one must be awake to take over.
            awake = [w for w in self.workers if w.alive and w.frozen_until is None]
            if not (len(awake) > 1 or (awake and len(self.workers) == 1)):
                self.next_freeze = self.after(self.config.freeze_every)
                return
            # A worker frozen between two steps tests nothing: wait a little for one that
            # holds a lease and is inside its desk call, so that it wakes up with a response
            # to a step that was taken over meanwhile.
            holding = self.lease_holders(awake)
            calling = [w for w in holding if w.pid and in_call_to(w.pid, self.desk_port())]
            patience_over = now >= self.next_freeze + FREEZE_PATIENCE_SECONDS
            if calling or (patience_over and (holding or awake)):
                self.rng.choice(calling or holding or awake).freeze(self.freeze_seconds())
                self.freezes += 1
                self.next_freeze = self.after(self.config.freeze_every)

    def desk_port(self) -> int:
        assert self.desk is not None
        return urlsplit(self.desk.url).port or 80

    def lease_holders(self, workers: list[Child]) -> list[Child]:
        owners = set(
            Step.objects.filter(run=self.run_record, state__in=LEASED).values_list(
                "lease_owner", flat=True
            )
        )
        host = socket.gethostname()
        # engine.worker_name(): a solo-pool worker's steps are leased to its own pid.
        return [w for w in workers if w.pid is not None and f"{host}:{w.pid}" in owners]

    # --- waiting until quiet ------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        states: Counter[str] = Counter()
        settled = 0
        completed: set[uuid.UUID] = set()
        rows = Step.objects.filter(run=self.run_record).values_list("pk", "state", "not_before")
        for pk, state, not_before in rows:
            states[state] += 1
            settled += is_settled(state, not_before)
            if state == State.COMPLETED:
                completed.add(pk)
        return Snapshot(
            states=states, settled=settled, total=sum(states.values()), completed_ids=completed
        )

    def request_compensations(self, snapshot: Snapshot) -> int:
        """A drill reviewer undoes the chosen desk steps that completed: requested and
        approved, so that `ticketdesk.close` runs through the same machinery."""
        assert self.publisher is not None
        due = (self.to_compensate & snapshot.completed_ids) - self.compensation_requested
        for step in Step.objects.filter(pk__in=due):
            try:
                with dispatch.publishing(dispatch.dropping_publisher):
                    compensation = services.compensation_request(
                        step=step,
                        user=self.reviewer,
                        version=step.version,
                        reason="recovery drill: undo this ticket",
                    )
                    services.step_approve(
                        step=compensation,
                        user=self.reviewer,
                        version=compensation.version,
                        reason="recovery drill: approved compensation",
                    )
            except services.ServiceError:
                continue  # it moved meanwhile; looked at again next time
            self.compensation_requested.add(step.pk)
            compensation.refresh_from_db(fields=["state"])
            if compensation.state == State.PENDING:
                self.publisher.send(compensation.pk)
        return len(due)

    def wait_quiet(self) -> bool:
        """Drives the chaos until every step has settled; False at the deadline."""
        deadline = time.monotonic() + self.config.timeout
        next_look = 0.0
        while True:
            self.tick()
            now = time.monotonic()
            if now >= next_look:
                snapshot = self.snapshot()
                waiting = self.request_compensations(snapshot)
                quiet = snapshot.quiet and not waiting
                self.progress.update(
                    snapshot.settled, snapshot.total, self.describe(snapshot), force=quiet
                )
                if quiet:
                    self.progress.end_bar()
                    return True
                if now > deadline:
                    self.progress.end_bar()
                    return False
                next_look = now + LOOK_SECONDS
            time.sleep(TICK_SECONDS)

    def describe(self, snapshot: Snapshot) -> str:
        states = " ".join(f"{state}={n}" for state, n in sorted(snapshot.states.items()))
        return (
            f"{states}; crashes={self.crashes()} kills={self.kills} freezes={self.freezes} "
            f"{time.monotonic() - self.started:.0f}s"
        )

    # --- stopping -----------------------------------------------------------------------

    def stop_workers(self) -> None:
        for child in [*self.workers, self.sweeper]:
            if child is not None:
                child.stop()

    def stop_all(self) -> None:
        self.stop_workers()
        if self.desk is not None:
            self.desk.close()
        if self.desk_process is not None:
            self.desk_process.stop()
        if self.publisher is not None:
            self.publisher.close()


# --- output -----------------------------------------------------------------------------


def summary_lines(report: DrillReport) -> list[str]:
    points = report.interruption_points
    worker = points.get("worker", {})
    desk = points.get("desk", {})
    hits = " ".join(f"{point}={worker.get(point, {}).get('hits', 0)}" for point in faults.POINTS)
    injected = " ".join(
        f"{name}={desk.get(name, {}).get('injected', 0)}" for name in DESK_FAULT_SETTINGS
    )
    states = " ".join(f"{state}={n}" for state, n in sorted(report.counts.items()))
    total = sum(report.counts.values())
    lines = [
        f"drill {report.pk} of {report.version}: {total} steps in "
        f"{report.elapsed_seconds:.0f}s on {report.parameters.get('database', '?')}, "
        f"broker {report.parameters.get('broker', '?')}",
        f"  states: {states or '(none)'}",
        f"  worker crashes at fault points: {hits} "
        f"(total {points.get('worker_crashes', 0)}); "
        f"SIGKILLs: {points.get('kills', {}).get('done', 0)}; "
        f"freezes past the lease: {points.get('freezes', {}).get('done', 0)}",
        f"  desk faults injected: {injected}; stale fences refused by the desk: "
        f"{desk.get('stale_fence_refused', 0)}, by the ledger: "
        f"{points.get('fenced_out_attempts', 0)}",
        f"  duplicates {report.duplicates}, lost {report.lost}, "
        f"left for review {report.left_for_review}",
        f"  verdict: {'PASSED' if report.passed else 'FAILED'}",
    ]
    if not report.passed:
        lines.extend("  " + line for line in report.notes.splitlines()[:40])
    return lines
