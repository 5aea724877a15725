"""Serving from an event loop (ASGI, the uvicorn worker under gunicorn): what lets one
client hold nothing that others need (issue 22).

- `StaticFiles`: whitenoise's middleware, async-capable. Whitenoise's own is sync-only, and
  one sync-only middleware puts every async view below it back on a thread for its whole
  run, a long-poll's wait included.
- `BodyDeadline`: the ASGI application around Django's. A request's body must arrive whole
  within REQUEST_BODY_SECONDS of its headers and stay within REQUEST_BODY_MAX_BYTES, or the
  request is answered 408 / 413 and its connection closed. Django's ASGI handler reads the
  whole body before any view runs, and would wait as long as a sender trickles it; here the
  waiting costs a coroutine, and ends.
- `pooled`: the database settings for it. Each ASGI request's sync code runs on a thread of
  its own that ends with the request, so a connection kept per thread (CONN_MAX_AGE) would be
  opened per request, as many at once as requests in progress: a hundred long-polls
  arriving together made PostgreSQL answer "too many clients". psycopg's pool instead: at
  most DATABASE_POOL_SIZE (8) connections a process, a request waiting its turn for one
  (DATABASE_POOL_TIMEOUT, 10 s).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest
from whitenoise.middleware import WhiteNoiseMiddleware

from executor.surfaces.http import API_PREFIX, error_response


def pooled(database: dict[str, Any]) -> dict[str, Any]:
    """`database` (a DATABASES entry) as an ASGI process uses it: PostgreSQL through psycopg's
    pool; SQLite as it is (a file, opened per thread)."""
    if database["ENGINE"] != "django.db.backends.postgresql":
        return database
    pool = {
        "min_size": 1,
        "max_size": int(os.environ.get("DATABASE_POOL_SIZE") or 8),
        "timeout": int(os.environ.get("DATABASE_POOL_TIMEOUT") or 10),
    }
    options = {"pool": pool, **database.get("OPTIONS", {})}
    return {**database, "CONN_MAX_AGE": 0, "CONN_HEALTH_CHECKS": False, "OPTIONS": options}


class StaticFiles(WhiteNoiseMiddleware):
    """Whitenoise's middleware, sync and async: a static file is answered as whitenoise
    answers it (its files are found in memory, or on disk with autorefresh in DEBUG);
    anything else passes to the next layer, awaited under ASGI."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any) -> None:
        super().__init__(get_response)
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if iscoroutinefunction(self):
            return self._acall(request)
        return super().__call__(request)

    async def _acall(self, request: HttpRequest) -> Any:
        if self.autorefresh:
            static_file = self.find_file(request.path_info)
        else:
            static_file = self.files.get(request.path_info)
        if static_file is not None:
            return self.serve(static_file, request)
        return await self.get_response(request)


class _Refused(Exception):
    def __init__(
        self, status: int, code: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.details = details or {}


class BodyDeadline:
    """The ASGI application `app`, with a deadline and a size limit on each request's body."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seconds = settings.REQUEST_BODY_SECONDS
        limit = settings.REQUEST_BODY_MAX_BYTES
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _answer(send, scope, _too_large(limit))
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        read = 0
        whole = False
        started = False

        async def receive_in_time() -> dict[str, Any]:
            nonlocal read, whole
            if whole:  # the body is in: what follows is the client's disconnect, if any
                return dict(await receive())
            try:
                message = dict(await asyncio.wait_for(receive(), deadline - loop.time()))
            except TimeoutError:
                raise _Refused(
                    408,
                    "request_timeout",
                    f"the request body did not arrive within {seconds:g} seconds",
                ) from None
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > limit:
                    raise _too_large(limit)
                whole = not message.get("more_body", False)
            return message

        async def send_noting_start(message: dict[str, Any]) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, receive_in_time, send_noting_start)
        except _Refused as refused:
            if started:
                raise
            await _answer(send, scope, refused)


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _too_large(limit: int) -> _Refused:
    return _Refused(
        413,
        "body_too_large",
        f"the request body is over the limit of {limit} bytes",
        {"limit": limit},
    )


async def _answer(send: Any, scope: dict[str, Any], refused: _Refused) -> None:
    """The refusal, in the API's error shape on the API's paths, as text elsewhere; the
    connection is closed after it (the rest of the body is never read)."""
    if scope.get("path", "").startswith(API_PREFIX):
        # The API's one error shape, rendered by the API's own helper.
        response = error_response(refused.status, refused.code, refused.message, refused.details)
        body, content_type = response.content, response["Content-Type"].encode()
    else:
        body = f"{refused.message}\n".encode()
        content_type = b"text/plain; charset=utf-8"
    await send(
        {
            "type": "http.response.start",
            "status": refused.status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
