"""Child processes as the drill and the recovery and browser suites run them: a named
process that is started again, killed, frozen and stopped, every generation logging to one
file; the ticket desk and Celery workers among them; and the /proc probe of a call in flight.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self
from urllib.parse import urlsplit

import httpx
from django.conf import settings

from executor.common import faults
from executor.drill.config import DrillError

STARTUP_SECONDS = 60.0
STOP_SECONDS = 15.0
TICK_SECONDS = 0.05
LOG_TAIL_LINES = 40
# A failure's diagnosis shows more of each log than a line of the drill's report does.
DIAGNOSIS_LINES = 120
# The status Popen reports for a child that SIGKILL ended.
KILLED = -signal.SIGKILL


class GaveUp(DrillError):
    """A child process ended, or what was awaited did not happen before its deadline."""


def wait_until[T](
    probe: Callable[[], T],
    *,
    seconds: float,
    what: str,
    diagnose: Callable[[], str] | None = None,
    tick: float = TICK_SECONDS,
) -> T:
    """Polls `probe` until it returns something truthy; raises GaveUp at the deadline.

    The message carries `diagnose()`, so a failure says what the processes looked like
    when it gave up.
    """
    deadline = time.monotonic() + seconds
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = diagnose() if diagnose is not None else ""
            raise GaveUp(f"gave up after {seconds:g}s waiting for {what}\n{detail}")
        time.sleep(tick)


def tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def command(*argv: str, through: str = "") -> list[str]:
    """How a child runs `celery ...` or a `manage.py` command with this interpreter, or
    through the module `through`, which wraps either (the drill's broken engine)."""
    if through:
        return [sys.executable, "-m", through, *argv]
    if argv[0] == "celery":
        return [sys.executable, "-m", *argv]
    return [sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), *argv]


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
        # The current generation, or the last one once it has ended.
        self.process: subprocess.Popen[bytes] | None = None
        self.generation = 0
        # How the generations ended (negative: killed by that signal), as they were reaped.
        self.exit_codes: list[int] = []
        self.killed_on_purpose = False
        # When a frozen (SIGSTOPped) generation is to be continued.
        self.frozen_until: float | None = None
        self.thaw_timer: threading.Timer | None = None
        self._reaped = True
        self._log_start = 0

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was never started"
        return self.process.pid

    def start(self, **env: str) -> Self:
        """Starts a new generation, with `env` over the child's own environment."""
        assert not self.alive, f"{self.name} is already running"
        self.reap()
        self.generation += 1
        self.killed_on_purpose = False
        self.thaw()
        with self.log_path.open("ab") as log:
            overrides = f" {env}" if env else ""
            log.write(f"\n=== {self.name} generation {self.generation}{overrides} ===\n".encode())
            log.flush()
            self._log_start = log.tell()
            self.process = subprocess.Popen(  # noqa: S603 - our own interpreter, fixed argv
                self.argv,
                cwd=settings.BASE_DIR,
                env={**self.env, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._reaped = False
        return self

    def reap(self) -> int | None:
        """The exit status of a generation that ended since the last call, or None."""
        if self._reaped or self.process is None or self.process.poll() is None:
            return None
        self._reaped = True
        self.exit_codes.append(self.process.returncode)
        return self.process.returncode

    def send_signal(self, signum: int) -> None:
        """Sends `signum` to the current generation, if it is still running."""
        if self.process is not None:
            self.process.send_signal(signum)

    def pause(self) -> None:
        self.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: no cleanup, no acknowledgement, no rollback hook (a paused process too)."""
        process = self.process
        if process is not None and process.poll() is None:
            self.killed_on_purpose = True
            process.kill()
            self.note(f"SIGKILL pid {process.pid}")
            process.wait(timeout=STARTUP_SECONDS)

    def note(self, text: str) -> None:
        """Marks what was done to this process in its log, where it happened."""
        with self.log_path.open("ab") as log:
            log.write(f"=== {self.name}: {text} ===\n".encode())

    def freeze(self, seconds: float) -> None:
        """SIGSTOP now, SIGCONT in `seconds`."""
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
        if self.frozen_until is not None and self.process is not None and self.alive:
            continue_process(self.process)
            self.note(f"SIGCONT pid {self.process.pid}")
        if self.thaw_timer is not None:
            self.thaw_timer.cancel()
        self.thaw_timer = None
        self.frozen_until = None

    def stop(self) -> None:
        """SIGTERM (after SIGCONT, should it be stopped), SIGKILL after STOP_SECONDS."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            self.thaw()
            self.resume()
            process.terminate()
            try:
                process.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STARTUP_SECONDS)
        # A worker finishing its last task on SIGTERM may still end at a fault point.
        self.reap()

    @property
    def crashes(self) -> int:
        """Generations that ended at an interruption point (executor.common.faults)."""
        return self.exit_codes.count(faults.CRASH_EXIT_STATUS)

    # --- its log --------------------------------------------------------------------------

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

    def wait_for_log(
        self, pattern: str, *, what: str, seconds: float = STARTUP_SECONDS
    ) -> re.Match[str]:
        """Waits until the current generation's log matches `pattern`; GaveUp if the
        generation ends first or the deadline passes."""

        def found() -> re.Match[str] | None:
            match = re.search(pattern, self.current_log())
            if match is None and not self.alive:
                raise GaveUp(f"{self.name} ended while waiting for {what}\n{self.describe()}")
            return match

        match = wait_until(found, seconds=seconds, what=what, diagnose=self.describe)
        assert match is not None
        return match

    def describe(self, lines: int = DIAGNOSIS_LINES) -> str:
        ended = self.process.returncode if self.process and not self.alive else "alive"
        state = f"now {ended}, generations ended {self.exit_codes}"
        return f"--- {self.name} ({state}) log tail ---\n{tail(self.log(), lines)}"


# What a Celery worker logs once it consumes.
READY = r"@\S+ ready\."


class Worker(Child):
    """`celery -A console worker --pool solo`: one process, so a kill ends the whole worker."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        log_path: Path,
        *,
        queue: str,
        node: str = "",
        through: str = "",
    ) -> None:
        argv = command(
            "celery",
            "-A",
            "console",
            "worker",
            "--pool",
            "solo",
            "--concurrency",
            "1",
            "-n",
            node or f"{name}@%h",
            "--loglevel",
            "INFO",
            "-Q",
            queue,
            # Nothing but the queue connects the workers: no broadcast chatter, and
            # faster starts.
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            through=through,
        )
        super().__init__(name, argv, env, log_path)

    def wait_ready(self, seconds: float = STARTUP_SECONDS) -> None:
        self.wait_for_log(READY, what=f"{self.name} to be ready", seconds=seconds)

    @property
    def ready(self) -> bool:
        """Its current generation is up and consuming (it said so in its log)."""
        return self.alive and re.search(READY, self.current_log()) is not None

    @property
    def worker_name(self) -> str:
        """engine.worker_name() in this generation: a solo pool works in its own process."""
        return f"{socket.gethostname()}:{self.pid}"


class DeskProcess(Child):
    """The ticket desk (`manage.py ticketdesk`) on a free port, its database in `folder`."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        # Port 0: the desk binds a free port and prints it, so there is no race for one.
        argv = command("ticketdesk", "--port", "0", "--db", str(folder / "desk.sqlite3"), "--quiet")
        super().__init__("desk", argv, env, folder / "desk.log")
        self.url = ""

    def start(self, **env: str) -> Self:
        """Starts the desk and waits until it answers at the URL it printed."""
        super().start(**env)
        listening = self.wait_for_log(r"listening on (http://\S+)", what="the desk's URL")
        self.url = listening.group(1)

        def answering() -> bool:
            if not self.alive:
                raise GaveUp(f"the desk ended before it answered\n{self.describe()}")
            return self.healthy()

        wait_until(answering, seconds=STARTUP_SECONDS, what="the desk's /health")
        return self

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 80


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
