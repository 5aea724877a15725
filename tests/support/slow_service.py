"""A neutral slow HTTP service (DESIGN.md §16's tests and bench/): every POST answers after
`--latency` seconds, as a real API would, and the service counts what it saw.

- `POST /effects` (any path but /stats and /reset): one effect, unless the request carries an
  `Idempotency-Key` it has seen: then the first answer again, and no new effect. Answers
  `{"id": ..., "key": ...}` with 201 (200 for a repeat).
- `GET /stats`: `{"requests", "effects", "in_flight", "peak_in_flight",
  "requests_by_operation": {X-Stepward-Operation: n}, "effects_by_key": {key: n},
  "fences_by_operation": {X-Stepward-Operation: [X-Stepward-Fence, …]},
  "arrivals": [the service's monotonic clock at each request]}`.
- `POST /reset`: forgets everything.

asyncio only (the standard library), so it holds thousands of requests at once on one core
and is never the limit it measures. Run it as a program: `python tests/support/slow_service.py
--port 0 --latency 0.25` prints `listening on PORT` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import httpx


class Service:
    def __init__(self, latency: float) -> None:
        self.latency = latency
        self.reset()

    def reset(self) -> None:
        self.requests = 0
        self.effects = 0
        self.in_flight = 0
        self.peak = 0
        self.by_operation: Counter[str] = Counter()
        self.by_key: Counter[str] = Counter()
        # The X-Stepward-Fence of each request, by operation, in the order they arrived.
        self.fences: dict[str, list[str]] = {}
        self.answers: dict[str, dict[str, Any]] = {}
        # When each request arrived (time.monotonic()), for rates.
        self.arrivals: list[float] = []

    def stats(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "effects": self.effects,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak,
            "requests_by_operation": dict(self.by_operation),
            "effects_by_key": dict(self.by_key),
            "fences_by_operation": self.fences,
            "arrivals": self.arrivals,
        }

    async def effect(self, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
        self.requests += 1
        self.arrivals.append(time.monotonic())
        self.by_operation[headers.get("x-stepward-operation", "")] += 1
        operation = headers.get("x-stepward-operation", "")
        self.fences.setdefault(operation, []).append(headers.get("x-stepward-fence", ""))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.latency)
        finally:
            self.in_flight -= 1
        key = headers.get("idempotency-key", "")
        if key and key in self.answers:
            return 200, self.answers[key]
        self.effects += 1
        answer = {"id": f"e-{self.effects}", "key": key}
        if key:
            self.by_key[key] += 1
            self.answers[key] = answer
        return 201, answer

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {
                name.strip().lower(): value.strip()
                for name, _, value in (line.partition(":") for line in lines[1:] if line)
            }
            length = int(headers.get("content-length", "0") or 0)
            if length:
                await reader.readexactly(length)
            if path == "/stats":
                status, body = 200, self.stats()
            elif path == "/reset" and method == "POST":
                self.reset()
                status, body = 200, {}
            elif method == "POST":
                status, body = await self.effect(headers)
            else:
                status, body = 405, {"error": "POST, please"}
            data = json.dumps(body).encode()
            writer.write(
                f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
                + data
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass  # the client went away (a killed worker's calls): nothing to answer
        finally:
            writer.close()


async def serve(port: int, latency: float) -> None:
    service = Service(latency)
    server = await asyncio.start_server(service.handle, "127.0.0.1", port, backlog=4096)
    print(f"listening on {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


class Running:
    """The service as a child process of a test or the bench (`start`)."""

    def __init__(self, latency: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--port", "0", "--latency", str(latency)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith("listening on "):
            self.process.kill()
            raise RuntimeError(f"the slow service did not start: {line!r}")
        self.port = int(line.split()[-1])
        self.url = f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, Any]:
        answer: dict[str, Any] = httpx.get(f"{self.url}/stats", timeout=30).json()
        return answer

    def reset(self) -> None:
        httpx.post(f"{self.url}/reset", timeout=30).raise_for_status()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(10)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.25)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.port, args.latency))


if __name__ == "__main__":
    main(sys.argv[1:])
