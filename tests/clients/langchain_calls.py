"""LangChain's MCP adapters (`langchain-mcp-adapters`) with their defaults: a
`MultiServerMCPClient`, `get_tools()`, then each call as LangChain's agents make it — the tool
invoked with a tool call, which answers the `ToolMessage` the model reads. The default client
keeps no session: every `get_tools()` and every tool call opens a session of its own (over
stdio: a new `manage.py mcp` process each time).

Per call: the ToolMessage's `content` (what the model reads), `artifact` (kept beside it, not
shown to the model: the structured content) and `status` ("error" for an isError result).
See _common.py for the job and the output.
"""

from __future__ import annotations

from typing import Any

from _common import Job, bearer, is_stdio, main
from langchain_mcp_adapters.client import MultiServerMCPClient


def connection(job: Job) -> dict[str, Any]:
    server = job["server"]
    if is_stdio(job):
        return {
            "transport": "stdio",
            "command": server["command"],
            "args": server["args"],
            "env": server["env"],
            "cwd": server["cwd"],
        }
    return {"transport": "streamable_http", "url": server["url"], "headers": bearer(job)}


async def drive(job: Job) -> dict[str, Any]:
    client = MultiServerMCPClient({"stepward": connection(job)})
    tools = {tool.name: tool for tool in await client.get_tools()}
    answers = []
    for number, call in enumerate(job["calls"]):
        message = await tools[call["tool"]].ainvoke(
            {
                "type": "tool_call",
                "id": f"call-{number}",
                "name": call["tool"],
                "args": call["arguments"],
            }
        )
        answers.append(
            {"content": message.content, "artifact": message.artifact, "status": message.status}
        )
    return {"tools": sorted(tools), "answers": answers}


if __name__ == "__main__":
    main("langchain-mcp-adapters", drive)
