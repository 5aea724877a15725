"""The async client the worker's calls are sent with (executor/tools/outbound.py): httpx's
client on a transport of h11 and asyncio's streams, one connection per request, closed with its
response, even when the server would keep it open; httpx's errors."""

from __future__ import annotations

import asyncio
import gzip
import logging
import shutil
import socket
import ssl
import subprocess
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from executor.contract.tool import Invocation
from executor.ledger.records import HttpToolSpec
from executor.tools import http as http_tools
from executor.tools import outbound


def run_apart[T](scenario: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on a thread of its own: a browser test earlier in the session leaves
    playwright's event loop running on the main thread, where asyncio.run refuses to start."""
    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(asyncio.run, scenario).result()


class KeepAliveServer:
    """Answers every request on a connection it keeps open (HTTP/1.1 keep-alive), and notes
    each connection's end as the client closes it."""

    def __init__(self) -> None:
        self.opened = 0
        self.closed = 0
        self.requests = 0
        self.cookies: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.opened += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                    if line.lower().startswith(b"cookie:"):
                        self.cookies.append(line)
                await reader.readexactly(length)
                self.requests += 1
                body = b'{"n": %d}' % self.requests
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Set-Cookie: session=%d; Path=/\r\n"
                    % self.requests
                    + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()


async def _until(check: Any) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)


def test_each_request_has_a_connection_of_its_own_closed_with_its_response() -> None:
    async def scenario() -> tuple[KeepAliveServer, list[Any], list[bytes]]:
        service = KeepAliveServer()
        server = await asyncio.start_server(service.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = outbound.async_client()
        answers = await asyncio.gather(
            *(client.post(f"http://127.0.0.1:{port}/x", json={"i": i}) for i in range(20))
        )
        bodies = []
        async with client.stream("GET", f"http://127.0.0.1:{port}/s") as response:
            bodies = [part async for part in response.aiter_bytes()]
        await _until(lambda: service.closed == 21)
        server.close()
        return service, [a.json() for a in answers], bodies

    service, answers, bodies = run_apart(scenario())

    assert sorted(a["n"] for a in answers) == list(range(1, 21))
    assert b"".join(bodies) == b'{"n": 21}'
    # 21 requests, 21 connections, every one closed by the client though the server kept it.
    assert (service.requests, service.opened, service.closed) == (21, 21, 21)
    # Every answer set a cookie; none was sent back (one client serves every workspace).
    assert service.cookies == []


def test_the_plain_client_keeps_no_cookie_either() -> None:
    async def scenario() -> KeepAliveServer:
        service = KeepAliveServer()
        server = await asyncio.start_server(service.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = outbound.client()
        for _ in range(3):
            await asyncio.to_thread(client.post, f"http://127.0.0.1:{port}/x", json={})
        server.close()
        return service

    service = run_apart(scenario())

    assert service.requests == 3
    assert service.cookies == []


def test_errors_are_httpxs_own() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # nothing listens on it once closed

    async def refused() -> None:
        await outbound.async_client().post(f"http://127.0.0.1:{port}/x")

    async def no_scheme() -> None:
        await outbound.async_client().send(httpx.Request("GET", "ftp://127.0.0.1/x"))

    with pytest.raises(httpx.ConnectError):
        run_apart(refused())
    with pytest.raises(httpx.UnsupportedProtocol):
        run_apart(no_scheme())


def test_a_server_that_never_answers_is_a_read_timeout() -> None:
    async def scenario() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1 << 16)
            await asyncio.sleep(5)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await outbound.async_client().post(f"http://127.0.0.1:{port}/x", timeout=0.2)
        finally:
            server.close()

    with pytest.raises(httpx.ReadTimeout):
        run_apart(scenario())


def test_a_server_that_hangs_up_without_an_answer_is_a_remote_protocol_error() -> None:
    async def scenario() -> None:
        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1 << 16)
            writer.close()

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await outbound.async_client().post(f"http://127.0.0.1:{port}/x", json={})
        finally:
            server.close()

    with pytest.raises(httpx.RemoteProtocolError, match="Server disconnected without sending"):
        run_apart(scenario())


def test_an_answer_cut_short_is_a_remote_protocol_error() -> None:
    async def scenario() -> None:
        async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1 << 16)
            writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"partial"')
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(cut, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await outbound.async_client().post(f"http://127.0.0.1:{port}/x", json={})
        finally:
            server.close()

    with pytest.raises(httpx.RemoteProtocolError):
        run_apart(scenario())


def _certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost (openssl, as Debian ships it)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=DNS:localhost"),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_https_on_asyncio_streams_checks_the_certificate_and_its_name(tmp_path: Path) -> None:
    cert, key = _certificate(tmp_path)
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))

    def client() -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=outbound._unpooled_transport(trusting))

    async def scenario() -> tuple[int, Any, BaseException | None]:
        service = KeepAliveServer()
        server = await asyncio.start_server(service.handle, "127.0.0.1", 0, ssl=served)
        port = server.sockets[0].getsockname()[1]
        try:
            async with client() as c:
                answer = await c.post(f"https://localhost:{port}/x", json={})
                wrong: BaseException | None = None
                try:  # the certificate names localhost, not 127.0.0.1
                    await c.post(f"https://127.0.0.1:{port}/x", json={})
                except httpx.ConnectError as error:
                    wrong = error
            return answer.status_code, answer.json(), wrong
        finally:
            server.close()

    status, body, wrong = run_apart(scenario())

    assert (status, body) == (200, {"n": 1})
    assert isinstance(wrong, httpx.ConnectError)
    assert "certificate" in str(wrong).lower() or "ip address mismatch" in str(wrong).lower()


def test_no_request_line_with_its_query_reaches_the_log(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        service = KeepAliveServer()
        server = await asyncio.start_server(service.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        url = f"http://user:pw-in-url@127.0.0.1:{port}/x?api_key=key-in-query"
        await outbound.async_client().post(url, json={})
        await asyncio.to_thread(outbound.client().post, url, json={})
        server.close()

    with caplog.at_level(logging.DEBUG):
        run_apart(scenario())

    assert "key-in-query" not in caplog.text
    assert "pw-in-url" not in caplog.text


# --- exchange: the HTTP tools' calls on the worker's loop, without httpx's client -----------


class Recorder:
    """Answers every request with `answer` (raw bytes) and keeps each request's head, as
    {lower-case name: value}, its request line and its body; closes after each answer."""

    def __init__(self, answer: bytes = b"") -> None:
        self.answer = answer or (
            b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
            b'Content-Length: 9\r\n\r\n{"id": 7}'
        )
        self.seen: list[tuple[bytes, dict[bytes, bytes], bytes]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        line, *lines = head[:-4].split(b"\r\n")
        headers = {}
        for raw in lines:
            name, _, value = raw.partition(b":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
        self.seen.append((line, headers, body))
        writer.write(self.answer)
        await writer.drain()
        writer.close()


def _served[T](service: Any, scenario: Any) -> T:
    async def run() -> T:
        server = await asyncio.start_server(service.handle, "127.0.0.1", 0)
        try:
            return await scenario(server.sockets[0].getsockname()[1])
        finally:
            server.close()

    return run_apart(run())


def test_exchange_sends_the_request_httpxs_client_sends() -> None:
    """The HTTP tools' two ways of calling (httpx's client from a thread, `exchange` on the
    worker's loop) send one request: the same line, headers and body. Only how the
    connection ends is told to the server differently (exchange says it will close it)."""
    recorder = Recorder()
    url_of = "http://agent:s%40cret@127.0.0.1:{port}/tickets/7?kind=a b&x=1"
    headers = {"Accept": "application/json", "X-Stepward-Fence": "3", "Idem-Key": "op-1"}
    body = {"title": "Drucker läuft nicht", "n": 1.5, "tags": ["a", None]}
    params = {"page": 2, "q": "ä&b"}

    async def scenario(port: int) -> list[Any]:
        url = url_of.format(port=port)
        answers = [
            await outbound.async_client().request(
                "POST", url, headers=headers, json=body, timeout=5, follow_redirects=False
            ),
            await outbound.exchange("POST", url, headers=headers, json_body=body, timeout=5),
            await outbound.async_client().request(
                "GET", url, headers=headers, params=params, timeout=5, follow_redirects=False
            ),
            await outbound.exchange("GET", url, headers=headers, params=params, timeout=5),
            await outbound.async_client().request("DELETE", url, timeout=5),
            await outbound.exchange("DELETE", url, headers={}, timeout=5),
        ]
        return [(a.status_code, a.json()) for a in answers]

    answers = _served(recorder, scenario)

    assert answers == [(201, {"id": 7})] * 6
    assert len(recorder.seen) == 6
    for (line, by_client, sent), (line2, by_exchange, sent2) in zip(
        recorder.seen[0::2], recorder.seen[1::2], strict=True
    ):
        assert line2 == line
        assert sent2 == sent
        assert by_client.pop(b"connection") == b"keep-alive"
        assert by_exchange.pop(b"connection") == b"close"
        assert by_exchange == by_client
    assert recorder.seen[0][1][b"authorization"].startswith(b"Basic ")
    assert recorder.seen[0][2] == (
        '{"title":"Drucker läuft nicht","n":1.5,"tags":["a",null]}'.encode()
    )
    # `params` replace the URL's query, in httpx's client and in exchange alike.
    assert recorder.seen[2][0].startswith(b"GET /tickets/7?page=2&q=")


def test_exchange_closes_each_connection_with_its_answer() -> None:
    service = KeepAliveServer()

    async def scenario(port: int) -> list[Any]:
        answers = await asyncio.gather(
            *(
                outbound.exchange(
                    "POST", f"http://127.0.0.1:{port}/x", headers={}, json_body={}, timeout=5
                )
                for _ in range(5)
            )
        )
        await _until(lambda: service.closed == 5)
        return [a.json()["n"] for a in answers]

    assert sorted(_served(service, scenario)) == [1, 2, 3, 4, 5]
    assert (service.requests, service.opened, service.closed) == (5, 5, 5)
    assert service.cookies == []


def test_exchange_undoes_gzip_and_reads_text_in_the_answers_charset() -> None:
    packed = gzip.compress('{"name": "Müller"}'.encode("latin-1"))
    recorder = Recorder(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; Charset=latin-1\r\n"
        b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s" % (len(packed), packed)
    )

    async def scenario(port: int) -> Any:
        return await outbound.exchange("GET", f"http://127.0.0.1:{port}/", headers={}, timeout=5)

    answer = _served(recorder, scenario)

    assert answer.text == '{"name": "Müller"}'
    assert answer.headers["content-encoding"] == "gzip"


def test_exchange_raises_httpxs_errors() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        closed_port = free.getsockname()[1]

    async def call(url: str, timeout: float = 5) -> Any:
        return await outbound.exchange("POST", url, headers={}, json_body={}, timeout=timeout)

    with pytest.raises(httpx.ConnectError):
        run_apart(call(f"http://127.0.0.1:{closed_port}/x"))
    with pytest.raises(httpx.UnsupportedProtocol):
        run_apart(call("ftp://127.0.0.1/x"))

    class Hangs:
        async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1 << 16)
            writer.close()

    class Silent:
        async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1 << 16)
            await asyncio.sleep(5)

    with pytest.raises(httpx.RemoteProtocolError, match="Server disconnected without sending"):
        _served(Hangs(), lambda port: call(f"http://127.0.0.1:{port}/x"))
    with pytest.raises(httpx.ReadTimeout):
        _served(Silent(), lambda port: call(f"http://127.0.0.1:{port}/x", timeout=0.2))
    cut = Recorder(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"partial"')
    with pytest.raises(httpx.RemoteProtocolError):
        _served(cut, lambda port: call(f"http://127.0.0.1:{port}/x"))
    packed = Recorder(b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\nxx")
    with pytest.raises(httpx.DecodingError, match="'br' is unknown"):
        _served(packed, lambda port: call(f"http://127.0.0.1:{port}/x"))


def test_an_http_tools_two_ways_send_one_request_keeping_the_urls_query(settings: Any) -> None:
    """A GET tool's input goes after its URL's own query (httpx's `params` would replace
    it), from a thread's `invoke` and from the loop's `ainvoke` alike."""
    recorder = Recorder(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b'Content-Length: 13\r\n\r\n{"id": "t-9"}'
    )
    call = Invocation(
        step_id="s",
        operation_id="op-1",
        input={"q": "a b", "n": 2, "skip": [1]},
        fence=4,
        attempt=1,
        idempotency_key="op-1",
    )

    async def scenario(port: int) -> list[Any]:
        settings.EXECUTOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{port}"]
        spec = HttpToolSpec(
            name="t.search",
            effect="read",
            method="GET",
            external_id="id",
            url=f"http://127.0.0.1:{port}/search?format=json",
            headers={"X-Team": "blue"},
        )
        tool = http_tools.tool_class(spec)()
        return [await asyncio.to_thread(tool.invoke, call), await tool.ainvoke(call)]

    by_thread, on_loop = _served(recorder, scenario)

    assert by_thread == on_loop
    assert on_loop.external_id == "t-9"
    (line, by_client, _), (line2, by_exchange, _) = recorder.seen
    assert line == line2 == b"GET /search?format=json&q=a+b&n=2 HTTP/1.1"
    assert by_client.pop(b"connection") == b"keep-alive"
    assert by_exchange.pop(b"connection") == b"close"
    assert by_exchange == by_client
    assert by_client[b"x-team"] == b"blue"
    assert by_client[b"x-stepward-fence"] == b"4"
