"""MCP on the official SDK's transports: `manage.py mcp` over stdio, and `/mcp` over
streamable HTTP, both as one agent; the rules are executor/surfaces/mcp.py's.

The web process is WSGI, where no event loop outlives a request, so `/mcp` serves the SDK's
streamable HTTP transport stateless with JSON answers: each POST is handled on its own
(`StreamableHTTPSessionManager(stateless=True, json_response=True)` run for that request),
and GET (the server-to-client stream) and DELETE (ending a session) answer 405, which the
SDK's client takes as "not offered". Any web process can then answer any request.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import mcp_types as types
from django.conf import settings
from django.db import connections
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import Server
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

from executor.ledger.records import Agent
from executor.surfaces import api, mcp
from executor.surfaces.http import error_response, refuse_large_body

SERVER_NAME = "stepward"
INSTRUCTIONS = (
    "Each tool call is a durable step that runs once. Give every call with an effect a "
    "`key`: the same key again, from any session, is the same step, never a second one. "
    "Every answer is a JSON object whose `message` says what happened and what to do. An "
    "answer that is not a result (unknown, awaiting approval, blocked, paused, still "
    "running) names a step id: do not call the tool again; wait, then ask step_status."
)


async def _in_thread[T](function: Callable[[], T]) -> T:
    """Runs `function` (which uses the database) in a worker thread, as Django requires
    outside an event loop, and closes that thread's connections afterwards."""

    def run() -> T:
        try:
            return function()
        finally:
            connections.close_all()

    return await anyio.to_thread.run_sync(run)


def build_server(session: mcp.Session) -> Server[Any]:
    """A low-level SDK server whose tools are what `session`'s agent may use."""

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        specs = await _in_thread(lambda: mcp.tools_list(session))
        return types.ListToolsResult(
            tools=[
                types.Tool(
                    name=spec.name,
                    description=spec.description,
                    input_schema=spec.input_schema,
                    annotations=types.ToolAnnotations(
                        read_only_hint=spec.read_only,
                        destructive_hint=None if spec.read_only else spec.destructive,
                    ),
                )
                for spec in specs
            ]
        )

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        answer = await _in_thread(lambda: mcp.tools_call(session, params.name, params.arguments))
        # The same JSON twice, as the specification asks: a client that keeps only the text
        # (or only the structured content) loses nothing.
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=answer.text)],
            structured_content=answer.structured,
            is_error=answer.is_error,
        )

    return Server(
        SERVER_NAME,
        version="1",
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


# --- stdio ------------------------------------------------------------------------------------


async def serve_stdio(agent: Agent) -> None:
    """Serves one MCP session on this process's stdin and stdout until the client leaves."""
    session = mcp.Session(agent, base_url=settings.STEPWARD_PUBLIC_URL)
    server = build_server(session)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


# --- streamable HTTP, bridged from a Django view ---------------------------------------------

RATE = api.AgentRateThrottle()


@csrf_exempt
def mcp_http(request: HttpRequest) -> HttpResponse:
    """`POST /mcp` with `Authorization: Bearer <agent token>`: one MCP message, answered as
    JSON. The same authentication, rate limit and permissions as the agents' API."""
    if request.method != "POST":
        response = error_response(
            405, "method_not_allowed", "this server answers MCP over POST only (stateless)"
        )
        response["Allow"] = "POST"
        return response
    too_large = refuse_large_body(request)
    if too_large is not None:
        return too_large
    agent = api.agent_for_token(_bearer(request))
    if agent is None:
        return _unauthorized(request)
    request.auth = agent  # type: ignore[attr-defined]  # what the API's throttle reads
    if not RATE.allow_request(request):
        wait = math.ceil(RATE.wait() or 1)
        response = error_response(
            429, "rate_limited", "too many requests", {"retry_after_seconds": wait}
        )
        response["Retry-After"] = str(wait)
        return response
    session = mcp.Session(agent, base_url=request.build_absolute_uri("/"))
    status, headers, body = run_to_completion(_serve_one(build_server(session), request))
    answer = HttpResponse(body, status=status)
    for name, value in headers:
        if name.lower() not in ("content-length", "connection"):
            answer[name] = value
    return answer


def run_to_completion[T](coroutine: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run`, also where this thread already runs an event loop (an async server,
    or a test process driving a browser): then on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _bearer(request: HttpRequest) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" else ""


def _unauthorized(request: HttpRequest) -> HttpResponse:
    try:
        api.refuse_if_too_many_bad_tokens(request)
    except api.Refused as refused:
        seconds = max(1, math.ceil(refused.wait or 1))
        response = error_response(
            429,
            "rate_limited",
            refused.message,
            {"retry_after_seconds": seconds, **refused.details},
        )
        response["Retry-After"] = str(seconds)
        return response
    response = error_response(401, "unauthorized", "a valid bearer token is required")
    response["WWW-Authenticate"] = 'Bearer realm="stepward"'
    return response


async def _serve_one(
    server: Server[Any], request: HttpRequest
) -> tuple[int, list[tuple[str, str]], bytes]:
    """Runs the SDK's streamable HTTP transport (stateless, JSON) for this one request."""
    manager = StreamableHTTPSessionManager(
        app=server,
        json_response=True,
        stateless=True,
        max_request_body_size=max(1, settings.API_MAX_BODY_BYTES),
    )
    scope = _asgi_scope(request)
    body = request.body
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            # The body was given whole; after it, the client is as good as gone.
            await anyio.sleep_forever()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    status = 500
    headers: list[tuple[str, str]] = []
    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            headers.extend(
                (name.decode("latin-1"), value.decode("latin-1"))
                for name, value in message.get("headers", [])
            )
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    async with manager.run():
        await manager.handle_request(scope, receive, send)  # type: ignore[arg-type]
    return status, headers, b"".join(chunks)


def _asgi_scope(request: HttpRequest) -> dict[str, Any]:
    headers = [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in request.headers.items()
    ]
    host, _, port = request.get_host().rpartition(":")
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": request.scheme,
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.META.get("QUERY_STRING", "").encode("latin-1"),
        "headers": headers,
        "server": (host or request.get_host(), int(port) if port.isdigit() else 80),
        "client": (request.META.get("REMOTE_ADDR", ""), 0),
    }
