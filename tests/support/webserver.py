"""The web process as deployments run it: `gunicorn console.wsgi` (threads) or `gunicorn
console.asgi -k uvicorn_worker.UvicornWorker` (an event loop) on a free port, on this test
process's database, for what only a real server shows (chunked bodies, several processes,
floods)."""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

import httpx

from executor.drill.config import current_database_url
from executor.drill.processes import STARTUP_SECONDS, Child, GaveUp, wait_until
from tests.support.api import AgentAuth

# Settings of this test process that must not reach the server: it gets a broker of its own
# (nothing consumes what it publishes) and takes no limit from the caller's environment.
NOT_PASSED = ("CELERY_BROKER_URL", "CELERY_QUEUE", "CACHE_URL", "DATABASE_URL")


class WebServer(Child):
    def __init__(
        self,
        folder: Path,
        *,
        workers: int = 1,
        threads: int = 4,
        asgi: bool = False,
        env: dict[str, str],
    ) -> None:
        if asgi:
            serving = ["console.asgi", "--worker-class", "uvicorn_worker.UvicornWorker"]
        else:
            # One thread: the sync worker, which holds one request at a time.
            threaded = ["--worker-class", "gthread", "--threads", str(threads)]
            serving = ["console.wsgi", *(threaded if threads > 1 else [])]
        argv = [
            sys.executable,
            "-m",
            "gunicorn",
            serving[0],
            *serving[1:],
            "--bind",
            "127.0.0.1:0",
            "--workers",
            str(workers),
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

    def worker_pids(self) -> list[int]:
        booted = re.findall(r"Booting worker with pid: (\d+)", self.current_log())
        return [int(pid) for pid in booted]


@contextmanager
def web_server(
    folder: Path,
    *,
    workers: int = 1,
    threads: int = 4,
    asgi: bool = False,
    env: dict[str, str] | None = None,
) -> Iterator[WebServer]:
    server = WebServer(folder, workers=workers, threads=threads, asgi=asgi, env=env or {})
    server.start()
    try:
        yield server
    finally:
        server.stop()


def raw(server: WebServer, request: bytes, *, half_close: bool = False) -> tuple[int, bytes]:
    """Sends `request` as it is on a socket of its own; (status, body) of the answer.
    `half_close`: the sender stops writing (FIN) after it, as a client cut off mid-body."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        answer = b""
        while part := sock.recv(65536):
            answer += part
    head, _, body = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = dechunked(body)
    return int(head.split()[1]), body


def dechunked(body: bytes) -> bytes:
    whole = b""
    while body:
        size, _, body = body.partition(b"\r\n")
        length = int(size, 16)
        if not length:
            break
        whole, body = whole + body[:length], body[length + 2 :]
    return whole


def api_request(auth: AgentAuth, path: str, headers: str, body: bytes) -> bytes:
    return (
        f"POST /api/v1{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {auth.token}\r\n"
        f"Content-Type: application/json\r\nConnection: close\r\n{headers}\r\n"
    ).encode() + body
