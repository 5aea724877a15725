"""The ticket desk as a real process for tests, and a client of it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

BASE_DIR = Path(__file__).resolve().parents[2]
STARTUP_SECONDS = 30.0
POLL_SECONDS = 15.0


def wait_for[T](probe: Callable[[], T | None], *, seconds: float, what: str) -> T:
    """Polls `probe` until it returns something other than None, or fails at the deadline."""
    deadline = time.monotonic() + seconds
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.02)


@dataclass
class DeskProcess:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    db_path: Path


def start_desk(tmp: Path) -> DeskProcess:
    log_path = tmp / "desk.log"
    db_path = tmp / "desk.sqlite3"
    with log_path.open("wb") as log:
        # Port 0: the desk binds a free port and prints it, so there is no race for one.
        process = subprocess.Popen(
            [sys.executable, "manage.py", "ticketdesk", "--port", "0", "--db", str(db_path)],
            cwd=BASE_DIR,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "STEPWARD_VAR_DIR": str(tmp)},
        )

    def listening_url() -> str | None:
        if process.poll() is not None:
            pytest.fail(f"the desk exited with {process.returncode}: {log_path.read_text()}")
        match = re.search(r"listening on (http://\S+)", log_path.read_text())
        return match.group(1) if match else None

    url = wait_for(listening_url, seconds=STARTUP_SECONDS, what="the desk's listening line")

    def healthy() -> bool | None:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200 or None
        except httpx.HTTPError:
            return None

    wait_for(healthy, seconds=STARTUP_SECONDS, what="the desk's /health")
    return DeskProcess(url=url, process=process, log_path=log_path, db_path=db_path)


def stop_desk(desk: DeskProcess) -> int:
    if desk.process.poll() is None:
        desk.process.send_signal(signal.SIGTERM)
        try:
            return desk.process.wait(timeout=STARTUP_SECONDS)
        except subprocess.TimeoutExpired:
            desk.process.kill()
            desk.process.wait()
    return desk.process.returncode


@dataclass
class Desk:
    """A client of the running desk; each test gets fresh faults and its own client refs."""

    url: str
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, timeout=10)

    def post(self, path: str, body: Any = None, **headers: str) -> httpx.Response:
        return self.client.post(path, json=body, headers=headers)

    def get(self, path: str, **params: str) -> httpx.Response:
        return self.client.get(path, params=params)

    def stats(self) -> dict[str, Any]:
        return self.get("/stats").json()

    def count(self, client_ref: str) -> int:
        return int(self.stats()["by_client_ref"].get(client_ref, 0))

    def faults(self, **faults: Any) -> dict[str, Any]:
        response = self.post("/faults", faults)
        assert response.status_code == 200, response.text
        return response.json()

    def create(self, client_ref: str, title: str = "printer on fire") -> dict[str, Any]:
        response = self.post("/tickets", {"title": title, "client_ref": client_ref})
        assert response.status_code == 201, response.text
        return response.json()
