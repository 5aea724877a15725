"""The official MCP SDK's clients against Stepward's MCP server, as real processes: stdio
(`manage.py mcp` as a child process) and streamable HTTP (against a web server)."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult

from executor.surfaces.mcp_server import run_to_completion
from tests.support.cluster import Cluster
from tests.support.webserver import WebServer

ROOT = Path(__file__).resolve().parents[2]
# Generous: the call answers as soon as its step settles; this only bounds a stuck test.
WAIT_SECONDS = "20"

type Work[T] = Callable[[Client], Awaitable[T]]


def over_http[T](web: WebServer, token: str, work: Work[T]) -> T:
    """Runs `work` with the SDK's streamable HTTP client connected to `/mcp` as the agent."""

    async def session() -> T:
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx2.AsyncClient(headers=headers, timeout=60) as http:
            transport = streamable_http_client(f"{web.url}/mcp", http_client=http)
            async with Client(transport) as client:
                return await work(client)

    return run_to_completion(session())


def over_stdio[T](cluster: Cluster, token: str, work: Work[T]) -> T:
    """Runs `work` with the SDK's stdio client talking to `manage.py mcp` as the agent."""
    env = {**cluster.env, "STEPWARD_TOKEN": token, "MCP_WAIT_SECONDS": WAIT_SECONDS}
    server = StdioServerParameters(
        command=sys.executable, args=[str(ROOT / "manage.py"), "mcp"], env=env, cwd=str(ROOT)
    )

    async def session() -> T:
        async with Client(server) as client:
            return await work(client)

    return run_to_completion(session())


def text_of(result: CallToolResult) -> str:
    return "\n".join(getattr(block, "text", "") for block in result.content)


def call(tool: str, arguments: dict[str, Any]) -> Work[CallToolResult]:
    async def work(client: Client) -> CallToolResult:
        return await client.call_tool(tool, arguments)

    return work


def mcp_web_server(cluster: Cluster, folder: Path) -> WebServer:
    """gunicorn on the cluster's database and broker, as deployments run it, started (its
    MCP calls wait WAIT_SECONDS for their steps); the cluster stops it with the rest."""
    folder.mkdir()
    server = WebServer(folder, env={**cluster.env, "MCP_WAIT_SECONDS": WAIT_SECONDS})
    cluster.processes.append(server)
    server.start()
    return server
