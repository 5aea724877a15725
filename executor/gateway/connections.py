"""This process's sessions with its MCP upstreams, kept warm on one event loop thread
(API.md "MCP gateway"), through the official SDK's client.

A worker's threads call `gateway().call(...)` and `.list_tools(...)` synchronously; each
runs on the process's event loop, where one session per upstream stays open between calls
(a stdio upstream is one child process per worker process, not one per call). A session
whose upstream died, or whose answer timed out and which then did not answer a ping, is
dropped and started again on the next call. Nothing here touches the database.

Whether a call may have had its effect is what the caller must know, so every failure is
one of two kinds: `Unreachable` (nothing was sent: the upstream could not be started,
reached or initialized, or was known dead before the request went out) or `AnswerLost`
(the request was handed to the upstream and no answer came: it died, dropped the
connection, or did not answer within the timeout). An error the upstream answered is the
SDK's `MCPError` with the upstream's code.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp_types as types
from django.conf import settings
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

logger = logging.getLogger(__name__)

CLIENT_INFO = types.Implementation(name="stepward-gateway", version="1")
# How long a session that did not answer in time gets to answer a probe before it is taken
# for hung and dropped (its child process ended).
PROBE_SECONDS = 5.0
STDERR_TAIL_LINES = 20
STDERR_TAIL_BYTES = 8192
# The `_meta` key that names one call, so the HTTP transport can say which calls it never
# delivered.
CALL_META_KEY = "stepward/call"
# Spare time on top of a call's own timeout before the calling thread stops waiting for
# the event loop (which enforces the timeout itself).
MARGIN_SECONDS = 10.0


class Unreachable(Exception):
    """Nothing was sent: the upstream could not be started, reached or initialized."""

    def __init__(self, message: str, evidence: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.evidence = evidence or {}


class AnswerLost(Exception):
    """The request was handed to the upstream and no answer came back."""

    def __init__(self, message: str, evidence: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.evidence = evidence or {}


@dataclass(frozen=True)
class Target:
    """How to reach one upstream, with every `${NAME}` already read from this process's
    environment (`secrets` holds the values read: scrubbed from all that is shown)."""

    name: str
    command: tuple[str, ...] = ()
    cwd: str = ""
    env: tuple[tuple[str, str], ...] = ()
    url: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    secrets: frozenset[str] = frozenset()
    # Calls one process sends it at once (more wait their turn before being sent): a
    # server that handles one call at a time would otherwise count its queue in each
    # call's timeout.
    concurrency: int = 1

    @property
    def fingerprint(self) -> str:
        """Changes whenever anything about how it is reached does (a secret rotated too)."""
        parts = [self.command, self.cwd, self.env, self.url, self.headers]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    def describe(self) -> str:
        return self.url or " ".join(self.command)

    def scrubbed(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "[redacted]")
        return text


def resolve_command(program: str) -> str:
    """A bare program name is looked up beside this Python first (the project's virtualenv,
    where `mcp-server-git` installs), then on PATH; a path is taken as it is."""
    if os.sep in program:
        return program
    here = str(Path(sys.executable).parent)
    return shutil.which(program, path=os.pathsep.join([here, os.environ.get("PATH", "")])) or (
        program
    )


@dataclass
class Listing:
    """What an upstream said of itself and its tools."""

    tools: list[types.Tool]
    server: dict[str, Any]


@dataclass
class _Session:
    """One open session, owned by a task of its own (the SDK's transports are anyio context
    managers that must be left in the task that entered them)."""

    target: Target
    log_path: Path
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    client: Client | None = None
    failure: BaseException | None = None
    # Set once the upstream's side of the connection ended (its output closed) or the
    # session was given up: nothing sent now can reach it.
    broken: bool = False
    tools_changed: bool = False
    task: asyncio.Task[None] | None = None
    # What the upstream said of itself when it was initialized (kept: the client cannot be
    # asked once its session has ended).
    server: dict[str, Any] = field(default_factory=dict)
    # Calls handed to the upstream and not answered yet, and a turn for each call sent.
    in_flight: int = 0
    slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    # Calls (by their `stepward/call` id) that provably never reached the upstream's
    # handler over HTTP: the connection was refused, or a 4xx status answered the POST.
    unsent: dict[str, str] = field(default_factory=dict)

    async def run(self) -> None:
        try:
            async with AsyncExitStack() as stack:
                transport = await stack.enter_async_context(self._transport())
                self.client = await stack.enter_async_context(
                    Client(
                        _Watched(transport, self),
                        cache=None,
                        client_info=CLIENT_INFO,
                        message_handler=self._on_message,
                    )
                )
                self.server = _described(self.target.name, self.client)
                self.ready.set()
                await self.stop.wait()
        except BaseException as error:  # noqa: BLE001 - whatever ends it is recorded
            self.failure = error
        finally:
            self.broken = True
            self.ready.set()

    @asynccontextmanager
    async def _transport(self) -> AsyncIterator[Any]:
        target = self.target
        if target.url:
            headers = dict(target.headers)
            transport = _Recording(httpx2.AsyncHTTPTransport(), self)
            async with (
                httpx2.AsyncClient(
                    headers=headers, timeout=60, follow_redirects=False, transport=transport
                ) as http,
                streamable_http_client(target.url, http_client=http) as streams,
            ):
                yield streams
            return
        program, *args = target.command
        parameters = StdioServerParameters(
            command=resolve_command(program),
            args=args,
            env=dict(target.env),
            cwd=target.cwd or None,
        )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a", encoding="utf-8", errors="replace") as errlog:
            async with stdio_client(parameters, errlog=errlog) as streams:
                yield streams

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, Exception):
            # A line the SDK could not read (a server that logs on stdout) or a stream that
            # hiccuped: the session goes on; one that really ended is seen by _Watched.
            logger.warning(
                "gateway: upstream %s: %s", self.target.name, self.target.scrubbed(str(message))
            )
        elif isinstance(message, types.ToolListChangedNotification):
            self.tools_changed = True
        await anyio.lowlevel.checkpoint()

    def stderr_tail(self) -> list[str]:
        """The last lines the upstream wrote to its stderr (stdio only), secrets scrubbed."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(0, self.log_path.stat().st_size - STDERR_TAIL_BYTES))
                tail = log.read().decode("utf-8", errors="replace")
        except OSError:
            return []
        return [self.target.scrubbed(line) for line in tail.splitlines()[-STDERR_TAIL_LINES:]]


class _Recording(httpx2.AsyncBaseTransport):
    """An HTTP upstream's transport that notes which calls provably never reached its
    handler: the connection was refused, or a 4xx status (an unknown session, a refused
    request) answered their POST. Such a call was not sent, whatever the SDK then says."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, session: _Session) -> None:
        self._inner = inner
        self._session = session

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        call_id = _call_id(request)
        try:
            response = await self._inner.handle_async_request(request)
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as error:
            if call_id:
                self._session.unsent[call_id] = f"the connection was refused ({error})"
            raise
        if call_id and 400 <= response.status_code < 500:
            self._session.unsent[call_id] = f"it answered HTTP {response.status_code}"
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _call_id(request: httpx2.Request) -> str:
    if request.method != "POST":
        return ""
    try:
        body = json.loads(request.content or b"{}")
        return str(body["params"]["_meta"][CALL_META_KEY])
    except (ValueError, KeyError, TypeError):
        return ""


class _Watched:
    """The transport's streams, with the read side watched: when the upstream's output ends
    (a stdio child that exited, a dropped HTTP session) the session is marked broken at
    once, so the next call starts a new one instead of sending into a dead one."""

    def __init__(self, streams: Any, session: _Session) -> None:
        self._streams = streams
        self._session = session
        self._tasks = anyio.create_task_group()

    async def __aenter__(self) -> tuple[Any, Any]:
        read, write = self._streams
        send, receive = anyio.create_memory_object_stream[Any](16)
        await self._tasks.__aenter__()

        async def forward() -> None:
            async with send:
                async for item in read:
                    await send.send(item)
            self._session.broken = True
            self._session.stop.set()

        self._tasks.start_soon(forward)
        return receive, write

    async def __aexit__(self, *exc: Any) -> bool | None:
        self._tasks.cancel_scope.cancel()
        return await self._tasks.__aexit__(*exc)


@dataclass
class _Progress:
    """How far one call got, read by the calling thread when it stops waiting for it."""

    sent: bool = False


def _bound(timeout: float) -> float:
    """How long a caller waits for a call: its timeout, a start, and a margin; never forever."""
    return timeout + settings.EXECUTOR_UPSTREAM_START_SECONDS + MARGIN_SECONDS


def _given_up(progress: _Progress, bound: float) -> Exception:
    """A call given up on before it was sent is Unreachable, one given up on after is
    AnswerLost."""
    if progress.sent:
        return AnswerLost(f"no answer within {bound:g}s")
    return Unreachable(f"not sent within {bound:g}s (waiting for its turn)")


class Gateway:
    """The sessions of this process, on an event loop thread of its own (made again in a
    forked child, which inherits the object but not the thread)."""

    def __init__(self) -> None:
        self._forget()

    def _forget(self) -> None:
        """No loop, no session: what a new process (a forked child too) starts with. The
        lock is new as well: a thread of the parent may have held it at the fork."""
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sessions: dict[str, _Session] = {}
        self._opening: dict[str, asyncio.Lock] = {}
        # Per upstream: how many starts were tried, and how the last failed one failed.
        self._starts: dict[str, int] = {}
        self._failed: dict[str, tuple[int, Unreachable]] = {}

    # --- what callers use -------------------------------------------------------------------

    def call(
        self,
        target: Target,
        tool: str,
        arguments: dict[str, Any],
        *,
        timeout: float,
        meta: dict[str, Any] | None = None,
    ) -> tuple[types.CallToolResult, dict[str, Any]]:
        """Calls `tool`; returns its result and what is known of the upstream (its server
        info). Raises Unreachable, AnswerLost, or MCPError (an error the upstream answered)."""
        progress = _Progress()
        return self._run(
            self._call(target, tool, arguments, timeout, meta, progress), timeout, progress
        )

    async def acall(
        self,
        target: Target,
        tool: str,
        arguments: dict[str, Any],
        *,
        timeout: float,
        meta: dict[str, Any] | None = None,
    ) -> tuple[types.CallToolResult, dict[str, Any]]:
        """`call`, awaited from another event loop (the worker's call loop): the sessions'
        loop makes the call, and the caller's loop waits for it without a thread."""
        progress = _Progress()
        future = asyncio.run_coroutine_threadsafe(
            self._call(target, tool, arguments, timeout, meta, progress), self._event_loop()
        )
        bound = _bound(timeout)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), bound)
        except TimeoutError:
            future.cancel()
            raise _given_up(progress, bound) from None

    def list_tools(self, target: Target, *, timeout: float) -> Listing:
        """Every tool the upstream lists (all pages). Raises Unreachable or AnswerLost."""
        return self._run(self._list(target, timeout), timeout, _Progress(sent=True))

    def warm(self, targets: list[Target]) -> None:
        """Starts a session with each target in the background, so the first call finds it
        open (a worker process does this when it starts); failures wait for that call."""
        loop = self._event_loop()

        async def start(target: Target) -> None:
            with contextlib.suppress(Unreachable):
                await self._session(target)

        for target in targets:
            asyncio.run_coroutine_threadsafe(start(target), loop)

    def open_sessions(self) -> set[str]:
        """The upstreams this process has a live session with now."""
        return {name for name, session in self._sessions.items() if not session.broken}

    def tools_changed(self, name: str) -> bool:
        """Whether the upstream said its tools changed since it was last listed here."""
        session = self._sessions.get(name)
        return bool(session and session.tools_changed and not session.broken)

    def close(self) -> None:
        """Ends every session (stdio children exit) and the loop."""
        with self._lock:
            loop, self._loop = self._loop, None
            if loop is None or self._pid != os.getpid():
                return

        async def close_all() -> None:
            for session in list(self._sessions.values()):
                await self._drop(session)
            self._sessions.clear()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close_all(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        self._failed.clear()

    # --- the event loop -----------------------------------------------------------------------

    def _run[T](self, work: Coroutine[Any, Any, T], timeout: float, progress: _Progress) -> T:
        """Runs `work` on the loop and waits for it, at most a bound past the call's own
        timeout (waiting for a turn and a start included): never forever. A call given up on
        before it was sent is Unreachable, one given up on after is AnswerLost."""
        future = asyncio.run_coroutine_threadsafe(work, self._event_loop())
        bound = _bound(timeout)
        try:
            return future.result(bound)
        except TimeoutError:
            future.cancel()
            raise _given_up(progress, bound) from None

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._pid != os.getpid():
            self._forget()  # a fork the at-fork hook did not see
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()

                def run() -> None:
                    loop.run_forever()
                    loop.close()

                threading.Thread(target=run, name="stepward-gateway", daemon=True).start()
                self._loop = loop
            return self._loop

    # --- sessions -------------------------------------------------------------------------------

    async def _session(self, target: Target) -> _Session:
        """The open session with `target`, started now if there is none (or it broke). The
        calls that queued behind a start that failed fail at once, as it did, rather than
        each trying again in turn; a call that comes later tries again."""
        lock = self._opening.setdefault(target.name, asyncio.Lock())
        waiting_since = self._starts.get(target.name, 0)
        async with lock:
            session = self._sessions.get(target.name)
            if session is not None and not session.broken and session.target == target:
                return session
            if session is not None:
                await self._drop(session)
            failed = self._failed.get(target.name)
            if failed is not None and failed[0] > waiting_since:
                raise failed[1]
            attempt = self._starts.get(target.name, 0) + 1
            self._starts[target.name] = attempt
            try:
                session = await self._start(target)
            except Unreachable as error:
                self._failed[target.name] = (attempt, error)
                raise
            self._failed.pop(target.name, None)
            self._sessions[target.name] = session
            logger.info(
                "gateway: connected to upstream %s (%s)",
                target.name,
                session.server.get("name", "?"),
            )
            return session

    async def _start(self, target: Target) -> _Session:
        _prune_logs(target)
        session = _Session(
            target=target,
            log_path=_log_path(target),
            slots=asyncio.Semaphore(max(1, target.concurrency)),
        )
        session.task = asyncio.create_task(session.run(), name=f"upstream {target.name}")
        seconds = settings.EXECUTOR_UPSTREAM_START_SECONDS
        try:
            async with asyncio.timeout(seconds):
                await session.ready.wait()
        except TimeoutError:
            evidence = _evidence(session)
            await self._drop(session)
            raise Unreachable(
                f"upstream {target.name} did not start and answer within {seconds:g}s",
                evidence,
            ) from None
        except BaseException:
            # Given up on (the caller stopped waiting): the half-started child must go too.
            await asyncio.shield(self._drop(session))
            raise
        if session.broken or session.client is None:
            evidence = _evidence(session)
            await self._drop(session)
            raise Unreachable(
                f"upstream {target.name} could not be started or reached: "
                f"{target.scrubbed(_failure_text(session.failure))}",
                evidence,
            )
        return session

    async def _drop(self, session: _Session) -> None:
        session.broken = True
        session.stop.set()
        if session.task is not None and session.client is None:
            # Still starting (a hung initialization): nothing waits on `stop` yet.
            session.task.cancel()
        if session.task is not None and not session.task.done():
            # The SDK's shutdown is bounded (stdin closed, then terminate, then kill).
            try:
                async with asyncio.timeout(15):
                    await asyncio.shield(session.task)
            except TimeoutError:
                session.task.cancel()
        if self._sessions.get(session.target.name) is session:
            del self._sessions[session.target.name]
        with contextlib.suppress(OSError):
            session.log_path.unlink()

    async def _call(
        self,
        target: Target,
        tool: str,
        arguments: dict[str, Any],
        timeout: float,
        meta: dict[str, Any] | None,
        progress: _Progress,
    ) -> tuple[types.CallToolResult, dict[str, Any]]:
        session = await self._session(target)
        call_id = uuid.uuid4().hex
        async with session.slots:
            client = session.client
            if session.broken or client is None:
                # Died before its turn came: nothing has been sent yet.
                await self._drop(session)
                raise Unreachable(f"upstream {target.name} ended before the call was sent")
            session.in_flight += 1
            progress.sent = True
            try:
                result = await client.call_tool(
                    tool,
                    arguments,
                    read_timeout_seconds=timeout,
                    meta={**(meta or {}), CALL_META_KEY: call_id},  # type: ignore[arg-type]
                )
            except MCPError as error:
                raise await self._call_failed(session, tool, timeout, call_id, error) from None
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as error:
                evidence = _evidence(session)
                await self._drop(session)
                raise AnswerLost(
                    f"upstream {target.name}: the connection failed while {tool} was on its "
                    f"way ({type(error).__name__})",
                    evidence,
                ) from None
            except RuntimeError as error:
                # An answer that did not fit its declared output schema: it came, so the
                # call happened, but what it said is not known.
                raise AnswerLost(
                    f"upstream {target.name} answered {tool} with an invalid result: {error}",
                    _evidence(session),
                ) from None
            finally:
                session.in_flight -= 1
                session.unsent.pop(call_id, None)
        if not isinstance(result, types.CallToolResult):
            raise AnswerLost(
                f"upstream {target.name} answered {tool} with a result of another kind"
            )
        return result, _server_info(session)

    async def _call_failed(
        self, session: _Session, tool: str, timeout: float, call_id: str, error: MCPError
    ) -> Exception:
        """What a call that ended in an MCPError is: never delivered (Unreachable), no answer
        (AnswerLost), or the upstream's own refusal (the MCPError)."""
        target = session.target
        code = error.error.code
        # Read before the session may be dropped below (its stderr log goes with it).
        evidence = _evidence(session)
        unsent = session.unsent.get(call_id)
        if unsent is not None:
            # Over HTTP, refused before its handler ran: the session is no good either (an
            # unknown session's 404, a refused connection).
            await self._drop(session)
            return Unreachable(
                f"upstream {target.name}: {tool} was not delivered: {unsent}", evidence
            )
        if code == types.REQUEST_TIMEOUT:
            await self._check_alive(session)
            return AnswerLost(
                f"upstream {target.name} did not answer {tool} within {timeout:g}s", evidence
            )
        if code == types.CONNECTION_CLOSED:
            # The SDK's own code for a transport that ended (a stdio child that exited, an
            # HTTP stream that broke): whatever the upstream did is not known.
            await self._drop(session)
            return AnswerLost(
                f"upstream {target.name} ended or dropped the connection while {tool} was on "
                f"its way; no answer came ({error.error.message})",
                evidence,
            )
        if target.url and code in (types.INTERNAL_ERROR, types.INVALID_REQUEST):
            # What the SDK says when an HTTP upstream answers an error status: a session it
            # may no longer know. Start a new one for the next call.
            await self._drop(session)
        return error

    async def _check_alive(self, session: _Session) -> None:
        """After a timed-out call: a session that does not answer a short request is hung,
        and goes (its child process ended) — unless other calls are on their way on it,
        which its end would lose. The probe is a listing: `ping` is gone from the
        2026-07-28 protocol."""
        if session.in_flight > 1:
            return
        client = session.client
        try:
            assert client is not None
            async with asyncio.timeout(PROBE_SECONDS):
                await client.list_tools(cache_mode="refresh")
        except Exception:  # noqa: BLE001 - any failure means it is not answering
            logger.warning(
                "gateway: upstream %s did not answer a probe: restarting it", session.target.name
            )
            await self._drop(session)

    async def _list(self, target: Target, timeout: float) -> Listing:
        session = await self._session(target)
        client = session.client
        assert client is not None
        tools: list[types.Tool] = []
        cursor: str | None = None
        session.tools_changed = False
        try:
            async with asyncio.timeout(timeout):
                for _ in range(100):
                    page = await client.list_tools(cursor=cursor)
                    tools.extend(page.tools)
                    cursor = page.next_cursor
                    if not cursor:
                        break
        except TimeoutError:
            await self._check_alive(session)
            raise AnswerLost(
                f"upstream {target.name} did not list its tools within {timeout:g}s"
            ) from None
        except MCPError as error:
            await self._drop(session)
            raise AnswerLost(
                f"upstream {target.name} could not list its tools: {error.error.message}"
            ) from None
        return Listing(tools=tools, server=_server_info(session))


def _log_path(target: Target) -> Path:
    return _log_dir() / f"{target.name}.{os.getpid()}.log"


def _log_dir() -> Path:
    return Path(settings.VAR_DIR) / "upstreams"


def _prune_logs(target: Target) -> None:
    """Removes the stderr logs of this upstream left by processes that no longer run (a
    worker killed before it could remove its own)."""
    for path in _log_dir().glob(f"{target.name}.*.log"):
        pid = path.name.removeprefix(f"{target.name}.").removesuffix(".log")
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                path.unlink()
        except OSError:
            continue


def _server_info(session: _Session) -> dict[str, Any]:
    return dict(session.server) or {"upstream": session.target.name}


def _described(name: str, client: Client) -> dict[str, Any]:
    found: dict[str, Any] = {"upstream": name}
    info = client.server_info
    if info is not None:
        found.update(name=info.name, version=info.version)
    found["protocol"] = client.protocol_version
    return found


def _evidence(session: _Session) -> dict[str, Any]:
    """What a reviewer can learn of a failed call from the upstream's side."""
    evidence: dict[str, Any] = {**_server_info(session), "reached": session.target.describe()}
    for secret in session.target.secrets:
        evidence["reached"] = evidence["reached"].replace(secret, "[redacted]")
    tail = session.stderr_tail() if not session.target.url else []
    if tail:
        evidence["stderr_tail"] = tail
    if session.failure is not None:
        evidence["failure"] = _failure_text(session.failure)
    return evidence


def _failure_text(error: BaseException | None) -> str:
    """The innermost errors of what ended a session, as one line each (the SDK's task
    groups wrap them in exception groups)."""
    if error is None:
        return "it closed"
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(_failure_text(inner) for inner in error.exceptions)
    return f"{type(error).__name__}: {error}"[:500]


_gateway = Gateway()
# A forked child (Celery's pool) inherits the object, not the loop's thread.
os.register_at_fork(after_in_child=_gateway._forget)


def gateway() -> Gateway:
    return _gateway
