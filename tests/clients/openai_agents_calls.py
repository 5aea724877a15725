"""The OpenAI Agents SDK (`openai-agents`): `agents.mcp.MCPServerStdio` or
`MCPServerStreamableHttp` as an `Agent`'s MCP server, run by `Runner.run` with the SDK's own
`agents.testing.ScriptedModel`, which calls the job's tools one turn after the other and then
answers "done". The SDK turns each CallToolResult into the tool's output
(`MCPUtil.invoke_mcp_tool`) and that into the `function_call_output` item the next model turn
is given; those items are read from the model's last call.

Per call: `output`, exactly the `function_call_output` item's output. The server's defaults are
kept (`use_structured_content=False`) but for the session timeout: its default is 5 seconds,
shorter than a call may wait for its step here (MCP_WAIT_SECONDS).
See _common.py for the job and the output.
"""

from __future__ import annotations

from typing import Any

from _common import Job, bearer, is_stdio, main
from agents import Agent, RunConfig, Runner
from agents.mcp import MCPServer, MCPServerStdio, MCPServerStreamableHttp
from agents.testing import ScriptedModel, assistant_message, function_call

SESSION_TIMEOUT_SECONDS = 120


def mcp_server(job: Job) -> MCPServer:
    server = job["server"]
    if is_stdio(job):
        return MCPServerStdio(
            params={
                "command": server["command"],
                "args": server["args"],
                "env": server["env"],
                "cwd": server["cwd"],
            },
            name="stepward",
            client_session_timeout_seconds=SESSION_TIMEOUT_SECONDS,
        )
    return MCPServerStreamableHttp(
        params={"url": server["url"], "headers": bearer(job), "timeout": SESSION_TIMEOUT_SECONDS},
        name="stepward",
        client_session_timeout_seconds=SESSION_TIMEOUT_SECONDS,
    )


async def drive(job: Job) -> dict[str, Any]:
    calls = job["calls"]
    turns: list[Any] = [
        [function_call(call["tool"], call["arguments"], call_id=f"call-{number}")]
        for number, call in enumerate(calls)
    ]
    model = ScriptedModel([*turns, [assistant_message("done")]])
    async with mcp_server(job) as server:
        listed = sorted(tool.name for tool in await server.list_tools())
        agent = Agent(name="stepward-test", model=model, mcp_servers=[server])
        result = await Runner.run(
            agent,
            "Make the calls.",
            max_turns=len(calls) + 2,
            run_config=RunConfig(tracing_disabled=True),
        )
    model.assert_complete()
    assert model.last_call is not None
    outputs = {
        item["call_id"]: item["output"]
        for item in model.last_call.input
        if isinstance(item, dict) and item.get("type") == "function_call_output"
    }
    answers = [{"output": outputs.get(f"call-{number}")} for number in range(len(calls))]
    return {"tools": listed, "answers": answers, "output": result.final_output}


if __name__ == "__main__":
    main("openai-agents", drive)
