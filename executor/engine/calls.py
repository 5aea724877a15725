"""Calls in flight (DESIGN.md §16): the worker's event loop, where the calls of claimed steps
wait for their answers while the drain goes on committing.

A call in flight holds no database connection and no thread that touches the database. A
tool that can wait on the loop (`async def invoke`, or an `ainvoke` beside its plain
`invoke`: the HTTP tools and `http.get`, on httpx's async client) is awaited there; a plain
one runs on a thread of the loop's pool, which only calls the tool. Everything the database
hears about a call (its `submitting` mark before, its response after) the drain's thread
writes, in groups (executor/engine/inflight.py).

One loop per process, on a thread of its own, made on first use; a forked child (a Celery
prefork worker) inherits the object but not the thread, and makes its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from django.conf import settings

from executor.common import faults, logcontext
from executor.contract.tool import Invocation, Tool, ToolResult, awaitable

logger = logging.getLogger(__name__)

Answer = ToolResult | BaseException


class CallLoop:
    def __init__(self) -> None:
        self._forget()

    def _forget(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: ThreadPoolExecutor | None = None

    def start(self, tool: Tool, call: Invocation, context: dict[str, Any]) -> Future[Answer]:
        """Starts the call; its future holds the tool's answer or the error it raised (never
        raises itself). `context` is the log context its lines carry."""
        return asyncio.run_coroutine_threadsafe(self._call(tool, call, context), self._event_loop())

    async def _call(self, tool: Tool, call: Invocation, context: dict[str, Any]) -> Answer:
        with logcontext.bound(**context):
            faults.hit("before_invoke")
            native = awaitable(tool)
            try:
                if native is not None:
                    answer = await native(call)
                else:
                    answer = await asyncio.get_running_loop().run_in_executor(
                        self._pool(), _plainly(tool.invoke, context), call
                    )
            except Exception as error:  # noqa: BLE001 - every error is classified, none escapes
                return error
            faults.hit("after_submit")
            return answer

    def _pool(self) -> ThreadPoolExecutor:
        """Threads for plain tools' calls, as many as calls may be in flight (made as needed)."""
        if self._threads is None:
            self._threads = ThreadPoolExecutor(
                max_workers=max(1, settings.EXECUTOR_MAX_IN_FLIGHT),
                thread_name_prefix="stepward-call",
            )
        return self._threads

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._pid != os.getpid():
            self._forget()  # a forked child: the parent's loop thread is not here
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="stepward-calls", daemon=True
                ).start()
                self._loop = loop
            return self._loop


def _plainly(
    invoke: Callable[[Invocation], ToolResult], context: dict[str, Any]
) -> Callable[[Invocation], ToolResult]:
    """`invoke` with the call's log context bound in the pool's thread (contextvars stay
    with the loop's task)."""

    def call(invocation: Invocation) -> ToolResult:
        with logcontext.bound(**context):
            return invoke(invocation)

    return call


_loop = CallLoop()


def call_loop() -> CallLoop:
    return _loop
