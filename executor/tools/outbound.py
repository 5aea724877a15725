"""The HTTP clients tools send their requests with (one per process, shared by its threads;
one per event loop for the calls a worker awaits), and the allow-list of where they may send
them.

Making an httpx client costs tens of milliseconds of CPU (its TLS context), so a client per
call capped a worker at a few dozen calls a second. Connections are still never reused:
a kept-alive connection the server had closed would fail only after the request was
written, and make a request that never arrived look ambiguous (DESIGN.md §8). So the async
client has no pool either (`_OneConnectionEach`): each request opens its connection and
closes it with its response, on asyncio's own streams (executor/tools/asyncio_network.py).
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import threading
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpcore
import httpx
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from executor.contract.tool import FailureClass, ToolError
from executor.tools.asyncio_network import AsyncioBackend

_LIMITS = httpx.Limits(max_keepalive_connections=0)
_client: httpx.Client | None = None
_lock = threading.Lock()
# The async client of each event loop (an httpx.AsyncClient belongs to the loop it was first
# used on): the worker's call loop has one, a loop of asyncio.run one of its own.
_async_clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}


def client() -> httpx.Client:
    global _client
    with _lock:
        if _client is None:
            _client = httpx.Client(limits=_LIMITS, cookies=_no_cookies())
        return _client


def async_client() -> httpx.AsyncClient:
    """The running event loop's client (made on first use). Nothing bounds its connections
    here: what bounds the calls in flight is EXECUTOR_MAX_IN_FLIGHT and the tools' own
    limits."""
    loop = asyncio.get_running_loop()
    with _lock:
        for old in [other for other in _async_clients if other.is_closed()]:
            del _async_clients[old]  # its loop is gone, and its client with it
        if loop not in _async_clients:
            _async_clients[loop] = httpx.AsyncClient(
                transport=_unpooled_transport(), cookies=_no_cookies()
            )
        return _async_clients[loop]


def _no_cookies() -> CookieJar:
    """A jar that keeps no cookie: one client sends every tool's calls, for every workspace,
    and a cookie one service set must not ride along on the next call to it."""
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


def _unpooled_transport(context: ssl.SSLContext | None = None) -> httpx.AsyncHTTPTransport:
    """httpx's async transport (its request and response types, its errors) on
    `_OneConnectionEach` instead of httpcore's pool. With keep-alive off the pool holds
    nothing worth sharing, and it walked every connection it had at each request's start
    and end: with hundreds of calls in flight, a sixth of the time a worker spent in httpx
    (py-spy, a 250 ms tool at 512 in flight)."""
    context = context or httpx.create_ssl_context()
    transport = httpx.AsyncHTTPTransport(verify=context)
    # The one attribute httpx's transport sends through (no public seam for a pool of
    # one's own); tests/executor/test_outbound.py holds it to a request and its errors.
    transport._pool = _OneConnectionEach(context)  # type: ignore[assignment]
    return transport


class _OneConnectionEach(httpcore.AsyncConnectionInterface):
    """A connection of its own for every request, closed when its response is."""

    def __init__(self, ssl_context: Any) -> None:
        self._ssl_context = ssl_context
        self._backend = AsyncioBackend()

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        scheme = request.url.scheme.decode()
        if scheme not in ("http", "https"):
            raise httpcore.UnsupportedProtocol(
                f"Request URL has an unsupported protocol '{scheme}://'."
                if scheme
                else "Request URL is missing an 'http://' or 'https://' protocol."
            )
        connection = httpcore.AsyncHTTPConnection(
            origin=request.url.origin,
            ssl_context=self._ssl_context,
            network_backend=self._backend,
        )
        try:
            response = await connection.handle_async_request(request)
        except BaseException:
            await connection.aclose()
            raise
        return httpcore.Response(
            status=response.status,
            headers=response.headers,
            content=_ClosingStream(response.stream, connection),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        """Nothing is held between requests."""

    async def __aenter__(self) -> _OneConnectionEach:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _ClosingStream:
    """A response's body that closes its connection when it is closed."""

    def __init__(self, stream: Any, connection: httpcore.AsyncHTTPConnection) -> None:
        self._stream = stream
        self._connection = connection

    async def __aiter__(self) -> Any:
        async for part in self._stream:
            yield part

    async def aclose(self) -> None:
        try:
            if hasattr(self._stream, "aclose"):
                await self._stream.aclose()
        finally:
            await self._connection.aclose()


# --- what an HTTP error answer means (API.md's table, DESIGN.md §8) --------------------------


def failure_of(
    response: httpx.Response,
    message: str,
    *,
    evidence: dict[str, Any] | None = None,
    server_error: FailureClass = FailureClass.AMBIGUOUS,
    before_effect: tuple[int, ...] = (),
) -> ToolError:
    """The ToolError an answer that is not a success means, for every HTTP tool alike: 429
    rate-limited (with its Retry-After), 401/403 permission denied, 409 conflict, a status in
    `before_effect` (one the service answers before acting: the desk's 503) unavailable, 408
    and 5xx `server_error` (a write's: ambiguous, it may have acted first; a read's:
    unavailable, safe to repeat), any other invalid input."""
    status = response.status_code
    if status == 429:
        return ToolError(
            FailureClass.RATE_LIMITED,
            message,
            retry_after=retry_after(response),
            evidence=evidence,
        )
    if status in (401, 403):
        return ToolError(FailureClass.PERMISSION_DENIED, message, evidence=evidence)
    if status == 409:
        return ToolError(FailureClass.CONFLICT, message, evidence=evidence)
    if status in before_effect:
        return ToolError(FailureClass.UNAVAILABLE, message, evidence=evidence)
    if status == 408 or status >= 500:
        return ToolError(server_error, message, evidence=evidence)
    return ToolError(FailureClass.INVALID_INPUT, message, evidence=evidence)


def retry_after(response: httpx.Response) -> float | None:
    """The seconds a Retry-After header asks for, or None (absent, or an HTTP date)."""
    try:
        return max(0.0, float(response.headers.get("Retry-After", "")))
    except ValueError:
        return None


# --- where tools may reach: EXECUTOR_HTTP_ALLOWED_HOSTS ---------------------------------------

DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class AllowedHost:
    host: str
    # None: the scheme's default port only (80 for http, 443 for https).
    port: int | None

    def admits(self, host: str, scheme: str, port: int) -> bool:
        return host == self.host and port == (self.port or DEFAULT_PORTS[scheme])


def _url_host(host: str) -> str:
    """`host` as httpx sends it: lower case, IDNA-encoded, IPv6 without brackets."""
    bracketed = f"[{host}]" if ":" in host else host
    return httpx.URL(f"http://{bracketed}/").raw_host.decode("ascii")


@functools.cache
def _parse_allowed(entries: tuple[str, ...]) -> tuple[AllowedHost, ...]:
    parsed = []
    for entry in entries:
        text = entry.strip()
        if text.startswith("["):
            host, closed, rest = text[1:].partition("]")
            if not closed or (rest and not rest.startswith(":")):
                host = ""
            port_text = rest[1:]
        elif text.count(":") == 1:
            host, port_text = text.split(":")
        else:
            # A bare IPv6 address has colons of its own and no port.
            host, port_text = text, ""
        try:
            port = int(port_text) if port_text else None
            if port is not None and not 0 < port < 65536:
                raise ValueError(port)
            if not host:
                raise ValueError(host)
            parsed.append(AllowedHost(_url_host(host), port))
        except (ValueError, UnicodeError, httpx.InvalidURL):
            raise ImproperlyConfigured(
                f"EXECUTOR_HTTP_ALLOWED_HOSTS: {entry!r} is not host or host:port"
            ) from None
    return tuple(parsed)


def allowed_hosts() -> tuple[AllowedHost, ...]:
    """The parsed EXECUTOR_HTTP_ALLOWED_HOSTS (ImproperlyConfigured if an entry is not
    `host`, `host:port`, `[v6]` or `[v6]:port`)."""
    return _parse_allowed(tuple(settings.EXECUTOR_HTTP_ALLOWED_HOSTS))


def refusal(url: str) -> str | None:
    """Why a tool may not send a request to `url`, or None when it may.

    The URL is read by httpx's own parser, the one that will connect: `http://a@b/` is
    host b to both. A host alone in the list admits the scheme's default port only, so
    allowing a site's `127.0.0.1` does not open every port of the machine.
    """
    try:
        parsed = httpx.URL(url)
        host = parsed.raw_host.decode("ascii")
    except (httpx.InvalidURL, ValueError, TypeError, UnicodeError):
        return "the url is not a valid URL"
    if parsed.scheme not in DEFAULT_PORTS:
        return "the url must be http:// or https://"
    if not host:
        return "the url names no host"
    port = parsed.port if parsed.port is not None else DEFAULT_PORTS[parsed.scheme]
    if any(allowed.admits(host, parsed.scheme, port) for allowed in allowed_hosts()):
        return None
    shown = f"[{host}]" if ":" in host else host
    return f"host {shown}:{port} is not in EXECUTOR_HTTP_ALLOWED_HOSTS"
