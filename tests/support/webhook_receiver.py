"""A webhook receiver for the notification tests: a real HTTP server in its own process that
answers every POST with 204 and appends what it got to a file, one JSON object a line:
`{"path", "headers": {name: value}, "body": text}`.

Run it as a program: `python tests/support/webhook_receiver.py --port P --out FILE` prints
`listening on P` once it accepts connections. Only the standard library.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def serve(port: int, out: Path) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length).decode()
            record = {"path": self.path, "headers": dict(self.headers.items()), "body": body}
            with out.open("a") as file:
                file.write(json.dumps(record) + "\n")
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()


class Receiver:
    """The receiver as a child process of the test, on a port the test chose."""

    def __init__(self, port: int, out: Path) -> None:
        self.port = port
        self.out = out
        self.process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"json://127.0.0.1:{self.port}/hooks/stepward"

    def start(self) -> Receiver:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--port", str(self.port), "--out", str(self.out)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.startswith("listening on"), line
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def received(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines() if line]

    def wait_for(self, count: int, seconds: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + seconds
        while True:
            got = self.received()
            if len(got) >= count or time.monotonic() > deadline:
                return got
            time.sleep(0.02)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    arguments = parser.parse_args()
    serve(arguments.port, arguments.out)
