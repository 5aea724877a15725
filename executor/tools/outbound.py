"""The HTTP clients tools send their requests with (one per process, shared by its threads;
one per event loop for the calls a worker awaits), and the allow-list of where they may send
them.

Making an httpx client costs tens of milliseconds of CPU (its TLS context), so a client per
call capped a worker at a few dozen calls a second. Connections are still never reused:
a kept-alive connection the server had closed would fail only after the request was
written, and make a request that never arrived look ambiguous (DESIGN.md §8). So the async
client has no pool either (`OneConnectionEach`): each request opens its connection and
closes it with its response, on h11 and asyncio's own streams. The HTTP tools' calls on the
worker's loop go through `exchange`, the same wire without httpx's client, request and
response objects (about 40% less CPU a call, which is what a drain of slow tools spends).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import ipaddress
import json
import ssl
import threading
import zlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any, Protocol

import h11
import httpx
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from executor.contract.tool import FailureClass, ToolError

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


def _unpooled_transport(context: ssl.SSLContext | None = None) -> OneConnectionEach:
    return OneConnectionEach(context or httpx.create_ssl_context())


class OneConnectionEach(httpx.AsyncBaseTransport):
    """httpx's transport interface on h11 (the HTTP/1.1 protocol library httpcore itself
    uses) and asyncio's own streams: a connection of its own for every request, closed with
    its response, even when the server would keep it open.

    httpx's own transport goes through httpcore: a connection pool walked at each request's
    start and end, and (on anyio) a task group for every connect and a cancel scope for every
    read and write. With keep-alive off the pool holds nothing worth sharing. Measured here
    (3,000 POSTs with their answers, 256 at once, CPU of the client's process): 0.9-1.0 ms a
    request through httpx's client on httpcore (already on asyncio's streams, without its
    pool), 0.72-0.81 ms through the same client on this transport; h11 on bare streams,
    without httpx's request and response objects, 0.35-0.4 ms. In a 250 ms drain the
    workers' CPU a step fell by about a tenth (2.29 to 2.05 ms); the drain's pace did not
    move beyond this machine's noise. Errors are httpx's, as from its own transport: a failed
    connect is a ConnectError or ConnectTimeout (nothing was sent), anything after it a read
    or write error or timeout, or a RemoteProtocolError.
    """

    def __init__(self, ssl_context: ssl.SSLContext) -> None:
        self._ssl_context = ssl_context

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme not in DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(
                f"Request URL has an unsupported protocol '{url.scheme}://'."
                if url.scheme
                else "Request URL is missing an 'http://' or 'https://' protocol.",
                request=request,
            )
        timeouts = request.extensions.get("timeout", {})
        wire = _Wire(request, timeouts.get("read"), timeouts.get("write"))
        await wire.connect(
            url.raw_host.decode("ascii"),
            url.port or DEFAULT_PORTS[url.scheme],
            self._ssl_context if url.scheme == "https" else None,
            timeouts.get("connect"),
        )
        try:
            await wire.send(
                h11.Request(method=request.method, target=url.raw_path, headers=request.headers.raw)
            )
            async for chunk in request.stream:  # type: ignore[union-attr]
                await wire.send(h11.Data(data=chunk))
            await wire.send(h11.EndOfMessage())
            head = await wire.next_event()
            while isinstance(head, h11.InformationalResponse):  # 100 Continue and the like
                head = await wire.next_event()
            if not isinstance(head, h11.Response):
                raise httpx.RemoteProtocolError(
                    "the server closed the connection without an answer", request=request
                )
        except BaseException:
            await wire.aclose()
            raise
        return httpx.Response(
            status_code=head.status_code,
            headers=head.headers.raw_items(),
            stream=_Body(wire),
            request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": head.reason},
        )


# --- one request, its answer read whole: the HTTP tools' calls on the worker's loop ----------


@dataclass(frozen=True, slots=True)
class Reply:
    """An answer read whole: its status, headers and body, as the HTTP tools read them."""

    status_code: int
    headers: httpx.Headers
    content: bytes

    @property
    def text(self) -> str:
        """The body as text, in the charset its Content-Type names (else UTF-8), as httpx
        decodes it: bytes that are not of it are replaced, never an error."""
        charset = self.headers.get("content-type", "").lower().partition("charset=")[2]
        charset = charset.split(";")[0].strip().strip("'\"") or "utf-8"
        try:
            return self.content.decode(charset, errors="replace")
        except LookupError:  # a charset Python does not know
            return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON (ValueError if it is not)."""
        return json.loads(self.content)


async def exchange(
    method: str,
    url: str,
    *,
    headers: Mapping[str, str],
    params: Mapping[str, Any] | None = None,
    json_body: Any = None,
    timeout: float,
    context: ssl.SSLContext | None = None,
) -> Reply:
    """Sends one request on a connection of its own and reads its answer whole: what
    `async_client().request(...)` does for an HTTP tool, with the same URL parser, headers,
    JSON body, timeouts (`timeout` for the connect, each write and each read) and errors,
    but without httpx's client, request and response objects (measured here, 3,000 POSTs
    with their answers, 256 at once, CPU of the client's process: 1.36-1.75 ms a request
    through the client on OneConnectionEach, 0.82-0.89 ms through exchange, alternating on
    one slow morning; in a drain of a 250 ms tool the workers' CPU a step fell by about 30%).
    No redirect is followed and no cookie kept, as the client is set; credentials in the URL
    are sent as Basic auth, as httpx sends them. `json_body` None sends no body."""
    parsed = parsed_url(url)
    if params is not None:  # as httpx's: they replace the URL's query
        parsed = parsed.copy_with(params=params)
    if parsed.scheme not in DEFAULT_PORTS:
        raise httpx.UnsupportedProtocol(
            f"Request URL has an unsupported protocol '{parsed.scheme}://'."
            if parsed.scheme
            else "Request URL is missing an 'http://' or 'https://' protocol."
        )
    sent = {name.lower(): (name, value) for name, value in _DEFAULT_HEADERS}
    sent["host"] = ("Host", parsed.netloc.decode("ascii"))
    sent.update((name.lower(), (name, value)) for name, value in headers.items())
    if parsed.username or parsed.password:  # credentials in the URL: Basic auth, as httpx does
        pair = f"{parsed.username}:{parsed.password}".encode()
        sent["authorization"] = ("Authorization", f"Basic {base64.b64encode(pair).decode()}")
    body = b""
    if json_body is not None:
        body = json.dumps(
            json_body, ensure_ascii=False, separators=(",", ":"), allow_nan=False
        ).encode()
        sent.setdefault("content-type", ("Content-Type", "application/json"))
        sent["content-length"] = ("Content-Length", str(len(body)))
    elif method in ("POST", "PUT", "PATCH"):
        sent["content-length"] = ("Content-Length", "0")
    wire = _Wire(None, timeout, timeout)
    await wire.connect(
        parsed.raw_host.decode("ascii"),
        parsed.port or DEFAULT_PORTS[parsed.scheme],
        (context or _default_ssl_context()) if parsed.scheme == "https" else None,
        timeout,
    )
    try:
        await wire.send(
            h11.Request(
                method=method,
                target=parsed.raw_path,
                headers=[(name.encode(), value.encode()) for name, value in sent.values()],
            )
        )
        if body:
            await wire.send(h11.Data(data=body))
        await wire.send(h11.EndOfMessage())
        head = await wire.next_event()
        while isinstance(head, h11.InformationalResponse):
            head = await wire.next_event()
        if not isinstance(head, h11.Response):
            raise httpx.RemoteProtocolError("the server closed the connection without an answer")
        chunks = []
        while True:
            event = await wire.next_event()
            if isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                raise httpx.RemoteProtocolError(
                    "the server closed the connection before the answer's end"
                )
    finally:
        await wire.aclose()
    answered = httpx.Headers(head.headers.raw_items())
    return Reply(head.status_code, answered, _decoded(b"".join(chunks), answered))


# What httpx's client sends unless a tool's headers say otherwise (Connection: the
# connection is closed with its answer, and the server is told so).
_DEFAULT_HEADERS = (
    ("Accept", "*/*"),
    ("Accept-Encoding", "gzip, deflate"),
    ("Connection", "close"),
    ("User-Agent", f"python-httpx/{httpx.__version__}"),
)


@functools.cache
def _default_ssl_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def _decoded(content: bytes, headers: httpx.Headers) -> bytes:
    """The body without its Content-Encoding (gzip and deflate, the ones asked for; the
    last one applied is undone first)."""
    codings = [c.strip().lower() for c in headers.get("content-encoding", "").split(",")]
    for coding in reversed([c for c in codings if c and c != "identity"]):
        try:
            if coding in ("gzip", "x-gzip"):
                content = zlib.decompress(content, wbits=zlib.MAX_WBITS | 16)
            elif coding == "deflate":
                try:
                    content = zlib.decompress(content)
                except zlib.error:  # raw deflate, without zlib's header, as some servers send
                    content = zlib.decompress(content, wbits=-zlib.MAX_WBITS)
            else:
                raise httpx.DecodingError(f"the answer's Content-Encoding {coding!r} is unknown")
        except zlib.error as error:
            raise httpx.DecodingError(f"the answer's {coding} body is broken: {error}") from None
    return content


class _Wire:
    """One request's connection: h11's state machine on an asyncio stream, httpx's errors."""

    def __init__(
        self, request: httpx.Request | None, read: float | None, write: float | None
    ) -> None:
        self.request = request
        self._read = read
        self._write = write
        self._h11 = h11.Connection(h11.CLIENT)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def connect(
        self, host: str, port: int, context: ssl.SSLContext | None, timeout: float | None
    ) -> None:
        try:
            async with asyncio.timeout(timeout):
                self._reader, self._writer = await asyncio.open_connection(
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if context else None,
                    # Happy Eyeballs for a name (its addresses tried side by side after a
                    # delay, as anyio does), none for an address.
                    happy_eyeballs_delay=None if _is_address(host) else HAPPY_EYEBALLS_DELAY,
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(
                f"no connection within {timeout} s", request=self.request
            ) from None
        except (OSError, ssl.SSLError) as error:
            raise httpx.ConnectError(
                str(error) or type(error).__name__, request=self.request
            ) from error

    async def send(self, event: Any) -> None:
        assert self._writer is not None
        try:
            data = self._h11.send(event)
        except h11.LocalProtocolError as error:
            raise httpx.LocalProtocolError(str(error), request=self.request) from error
        if not data:
            return
        try:
            async with asyncio.timeout(self._write):
                self._writer.write(data)
                await self._writer.drain()
        except TimeoutError:
            raise httpx.WriteTimeout(
                f"not written within {self._write} s", request=self.request
            ) from None
        except OSError as error:
            raise httpx.WriteError(
                str(error) or type(error).__name__, request=self.request
            ) from error

    async def next_event(self) -> Any:
        assert self._reader is not None
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as error:
                raise httpx.RemoteProtocolError(str(error), request=self.request) from error
            if event is not h11.NEED_DATA:
                return event
            try:
                async with asyncio.timeout(self._read):
                    data = await self._reader.read(READ_BYTES)
            except TimeoutError:
                raise httpx.ReadTimeout(
                    f"no answer within {self._read} s", request=self.request
                ) from None
            except OSError as error:
                raise httpx.ReadError(
                    str(error) or type(error).__name__, request=self.request
                ) from error
            if not data and self._h11.their_state is h11.SEND_RESPONSE:
                # Closed before a byte of the answer (a server that dropped the connection):
                # httpcore's own words, which reviewers and logs have been reading.
                raise httpx.RemoteProtocolError(
                    "Server disconnected without sending a response.", request=self.request
                )
            self._h11.receive_data(data)  # b"": the server closed its end

    async def aclose(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):  # the peer reset it first: closed all the same
                await self._writer.wait_closed()
            self._writer = None


class _Body(httpx.AsyncByteStream):
    """A response's body, read as it is iterated; closing it closes its connection."""

    def __init__(self, wire: _Wire) -> None:
        self._wire = wire

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            while True:
                event = await self._wire.next_event()
                if isinstance(event, h11.Data):
                    yield bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return
                else:
                    raise httpx.RemoteProtocolError(
                        "the server closed the connection before the answer's end",
                        request=self._wire.request,
                    )
        finally:
            await self._wire.aclose()

    async def aclose(self) -> None:
        await self._wire.aclose()


# How much one read of a response takes from its socket at most.
READ_BYTES = 65536
# anyio's delay before a connect to a name's next address is started beside the first.
HAPPY_EYEBALLS_DELAY = 0.25


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


# --- what an HTTP error answer means (API.md's table, DESIGN.md §8) --------------------------


class Answered(Protocol):
    """What the HTTP tools read of an answer: httpx's Response, or exchange's Reply."""

    @property
    def status_code(self) -> int: ...
    @property
    def headers(self) -> httpx.Headers: ...
    @property
    def text(self) -> str: ...
    def json(self) -> Any: ...


def failure_of(
    response: Answered,
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


def retry_after(response: Answered) -> float | None:
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


@functools.lru_cache(maxsize=1024)
def parsed_url(url: str) -> httpx.URL:
    """`url` read by httpx's parser (InvalidURL if it cannot be), kept for the next call to
    the same URL: a tool's calls mostly go to a handful, and the parse is a fifth of a call's
    CPU. An httpx.URL never changes, so a kept one is safe to share."""
    return httpx.URL(url)


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
        parsed = parsed_url(url)
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
