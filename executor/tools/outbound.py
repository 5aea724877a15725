"""The HTTP clients tools send their requests with (one per process, shared by its threads;
one per event loop for the calls a worker awaits), and the allow-list of where they may send
them.

Making an httpx client costs tens of milliseconds of CPU (its TLS context), so a client per
call capped a worker at a few dozen calls a second. Connections are still never reused:
a kept-alive connection the server had closed would fail only after the request was
written, and make a request that never arrived look ambiguous (DESIGN.md §8).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from dataclasses import dataclass
from typing import Any

import httpx
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from executor.tools.base import FailureClass, ToolError

_LIMITS = httpx.Limits(max_keepalive_connections=0)
_ASYNC_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=0)
_client: httpx.Client | None = None
_lock = threading.Lock()
# The async client of each event loop (an httpx.AsyncClient belongs to the loop it was first
# used on): the worker's call loop has one, a loop of asyncio.run one of its own.
_async_clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}


def client() -> httpx.Client:
    global _client
    with _lock:
        if _client is None:
            _client = httpx.Client(limits=_LIMITS)
        return _client


def async_client() -> httpx.AsyncClient:
    """The running event loop's client (made on first use). Its connection pool is not
    bounded here: what bounds the calls in flight is EXECUTOR_MAX_IN_FLIGHT and the tools'
    own limits."""
    loop = asyncio.get_running_loop()
    with _lock:
        for old in [other for other in _async_clients if other.is_closed()]:
            del _async_clients[old]  # its loop is gone, and its client with it
        if loop not in _async_clients:
            _async_clients[loop] = httpx.AsyncClient(limits=_ASYNC_LIMITS)
        return _async_clients[loop]


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
