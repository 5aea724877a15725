"""A stdio MCP server that writes down what each call's request carried besides its
arguments: the `_meta` Stepward's gateway sends (`stepward/operation_id`, `stepward/step_id`,
`stepward/fence`, API.md "MCP gateway"), for servers that deduplicate or fence. One tool,
`record {note}`: appends `{"note", "meta"}` as a JSON line to $STEPWARD_META_FILE.

Run as a program by the gateway (`python tests/upstreams/meta_server.py`); built on the
official SDK's server, so what it reads is what any server written with the SDK reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("stepward-meta-recorder")


@server.tool()
def record(note: str, ctx: Context) -> str:
    """Writes down the note and the request's _meta."""
    meta = dict(ctx.request_context.meta or {})
    with Path(os.environ["STEPWARD_META_FILE"]).open("a") as out:
        out.write(json.dumps({"note": note, "meta": meta}, default=str) + "\n")
    return f"recorded {note}"


if __name__ == "__main__":
    server.run()
