"""What every script in this folder shares: the job it is given and the document it prints.

A script drives ONE agent framework against a Stepward MCP server and is run with
`.venv-clients/bin/python` (tests/clients/requirements.txt: the frameworks need the 1.x mcp
SDK, the project's venv holds the 2.x one). Its job is one JSON document, as argv[1] or on
stdin:

    {"server": {"command": "...", "args": [...], "env": {...}, "cwd": "..."}   # stdio
            or {"url": "http://.../mcp", "token": "..."},                     # streamable HTTP
     "calls": [{"tool": "echo", "arguments": {"message": "hi", "key": "k1"}}, ...]}

It prints one JSON document on stdout: the framework and its version, the tool names it
listed, and per call exactly what the framework handed on to its model (or its user) for
that call's result. Everything else (the framework's and the server's logs) goes to stderr.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from typing import Any

type Job = dict[str, Any]


def read_job() -> Job:
    raw = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "-" else sys.stdin.read()
    job = json.loads(raw)
    server = job["server"]
    if not (("command" in server) ^ ("url" in server)):
        raise SystemExit("the job's server is either a stdio command or a URL, not both")
    return job


def is_stdio(job: Job) -> bool:
    return "command" in job["server"]


def bearer(job: Job) -> dict[str, str]:
    return {"Authorization": f"Bearer {job['server']['token']}"}


def jsonable(value: Any) -> Any:
    """`value` as JSON has it: pydantic models dumped by their wire names, the rest as is."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json", by_alias=True, exclude_none=True)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def main(package: str, drive: Callable[[Job], Awaitable[dict[str, Any]]]) -> None:
    """Runs `drive` on the job and prints what it found, with the framework's version."""
    job = read_job()
    found = asyncio.run(drive(job))
    document = {"framework": package, "version": version(package), **found}
    json.dump(jsonable(document), sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
