"""The official MCP SDK's 1.x client (`mcp`, as the frameworks in this venv use it):
`mcp.ClientSession` over `mcp.client.stdio.stdio_client` (one process of `manage.py mcp` for
this run of the script) or `mcp.client.streamable_http.streamablehttp_client`, all the job's
calls in one session.

Per call: the CallToolResult as the SDK parsed it, by its wire names (`content`,
`structuredContent`, `isError`). See _common.py for the job and the output.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

from _common import Job, bearer, is_stdio, main
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamablehttp_client


def transport(job: Job) -> AbstractAsyncContextManager[Any]:
    server = job["server"]
    if is_stdio(job):
        return stdio_client(
            StdioServerParameters(
                command=server["command"],
                args=server["args"],
                env=server["env"],
                cwd=server["cwd"],
            )
        )
    return streamablehttp_client(server["url"], headers=bearer(job))


async def drive(job: Job) -> dict[str, Any]:
    async with transport(job) as streams, ClientSession(streams[0], streams[1]) as session:
        await session.initialize()
        listed = sorted(tool.name for tool in (await session.list_tools()).tools)
        answers = [
            (await session.call_tool(call["tool"], call["arguments"])).model_dump(
                mode="json", by_alias=True, exclude_none=True
            )
            for call in job["calls"]
        ]
    return {"tools": listed, "answers": answers}


if __name__ == "__main__":
    main("mcp", drive)
