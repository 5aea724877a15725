"""pydantic-ai (`pydantic-ai-slim[mcp]`): an `Agent` whose toolset is `pydantic_ai.mcp.MCPToolset`
(on FastMCP's client: a stdio transport, or the server's URL with a bearer header), driven by a
`FunctionModel` that calls the job's tools one after the other and then answers "done".

Per call: the part the model received for it, as pydantic-ai built it — `part_kind`, `outcome`
("success", or "retried" when the tool answered isError: the toolset's default
`tool_error_behavior="retry"` makes that a ModelRetry), `content` as it is in the part, and
`model_text`, the text a text-only provider sends the model (`model_response_str()`).
See _common.py for the job and the output.
"""

from __future__ import annotations

from typing import Any

from _common import Job, bearer, is_stdio, main
from fastmcp.client.transports import StdioTransport
from pydantic_ai import Agent
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel


def toolset(job: Job) -> MCPToolset[None]:
    server = job["server"]
    if is_stdio(job):
        transport = StdioTransport(
            command=server["command"],
            args=server["args"],
            env=server["env"],
            cwd=server["cwd"],
            keep_alive=False,
        )
        return MCPToolset(transport)
    return MCPToolset(server["url"], headers=bearer(job))


def received(part: Any) -> dict[str, Any]:
    return {
        "part_kind": part.part_kind,
        "tool_name": getattr(part, "tool_name", None),
        "outcome": getattr(part, "outcome", None),
        "content": part.content,
        "model_text": (
            part.model_response_str() if isinstance(part, ToolReturnPart) else part.model_response()
        ),
    }


async def drive(job: Job) -> dict[str, Any]:
    calls = job["calls"]
    answers: list[dict[str, Any]] = []
    listed: list[str] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        listed[:] = sorted(tool.name for tool in info.function_tools)
        last = messages[-1]
        if isinstance(last, ModelRequest):
            # What this model turn was handed: the answer to the call it made last.
            answers.extend(
                received(part)
                for part in last.parts
                if part.part_kind in ("tool-return", "retry-prompt", "retry-feedback")
            )
        made = sum(
            isinstance(part, ToolCallPart)
            for message in messages
            if isinstance(message, ModelResponse)
            for part in message.parts
        )
        if made < len(calls):
            call = calls[made]
            return ModelResponse(
                parts=[ToolCallPart(call["tool"], call["arguments"], tool_call_id=f"call-{made}")]
            )
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(FunctionModel(model), toolsets=[toolset(job)])
    result = await agent.run("Make the calls.")
    return {"tools": listed, "answers": answers, "output": result.output}


if __name__ == "__main__":
    main("pydantic-ai-slim", drive)
