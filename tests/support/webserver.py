"""The web process as deployments run it: `gunicorn console.wsgi` on a free port, on this test
process's database, for what only a real server shows (chunked bodies, several processes)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

import httpx

from executor.drill.config import current_database_url
from executor.drill.processes import STARTUP_SECONDS, Child, GaveUp, wait_until

# Settings of this test process that must not reach the server: it gets a broker of its own
# (nothing consumes what it publishes) and takes no limit from the caller's environment.
NOT_PASSED = ("CELERY_BROKER_URL", "CELERY_QUEUE", "CACHE_URL", "DATABASE_URL")


class WebServer(Child):
    def __init__(
        self, folder: Path, *, workers: int = 1, threads: int = 4, env: dict[str, str]
    ) -> None:
        argv = [
            sys.executable,
            "-m",
            "gunicorn",
            "console.wsgi",
            "--bind",
            "127.0.0.1:0",
            "--workers",
            str(workers),
            # One thread: the sync worker, which holds one request at a time.
            *(["--worker-class", "gthread", "--threads", str(threads)] if threads > 1 else []),
            "--timeout",
            "120",
            "--access-logfile",
            "-",
        ]
        inherited = {k: v for k, v in os.environ.items() if k not in NOT_PASSED}
        (folder / "broker").mkdir(parents=True, exist_ok=True)
        base = {
            **inherited,
            "DATABASE_URL": current_database_url(),
            "STEPWARD_VAR_DIR": str(folder),
            "STEPWARD_BROKER_DIR": str(folder / "broker"),
        }
        super().__init__("web", argv, {**base, **env}, folder / "web.log")
        self.workers = workers
        self.url = ""

    def start(self, **env: str) -> Self:
        super().start(**env)
        listening = self.wait_for_log(r"Listening at: (http://\S+)", what="gunicorn's address")
        self.url = listening.group(1)

        def booted() -> bool:
            if not self.alive:
                raise GaveUp(f"gunicorn ended before it answered\n{self.describe()}")
            return self.current_log().count("Booting worker") >= self.workers and self.answers()

        wait_until(
            booted, seconds=STARTUP_SECONDS, what="gunicorn to answer", diagnose=self.describe
        )
        return self

    def answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/api/v1/openapi.json", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False


@contextmanager
def web_server(
    folder: Path, *, workers: int = 1, threads: int = 4, env: dict[str, str] | None = None
) -> Iterator[WebServer]:
    server = WebServer(folder, workers=workers, threads=threads, env=env or {})
    server.start()
    try:
        yield server
    finally:
        server.stop()
