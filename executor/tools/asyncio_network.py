"""httpcore's network backend on asyncio's own streams, for the async client the worker's calls
are sent with (executor/tools/outbound.py).

httpcore runs on asyncio through anyio, whose connect starts a task group for Happy Eyeballs
and whose every read and write enters a cancel scope for its timeout: an eighth of the time a
worker spent with a 250 ms tool at 512 calls in flight (py-spy). Here a connect is
`asyncio.open_connection` (Happy Eyeballs for a name, none for an address) and a timeout is
`asyncio.timeout`. The errors are httpcore's, which httpx maps to its own as with any backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import select
import socket
import ssl
from collections.abc import Iterable
from typing import Any

import httpcore

# anyio's delay before a connect to a name's next address is started beside the first.
HAPPY_EYEBALLS_DELAY = 0.25


class AsyncioStream(httpcore.AsyncNetworkStream):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            async with asyncio.timeout(timeout):
                return await self._reader.read(max_bytes)
        except TimeoutError:
            raise httpcore.ReadTimeout(f"no answer within {timeout} s") from None
        except OSError as error:
            raise httpcore.ReadError(str(error) or type(error).__name__) from error

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            async with asyncio.timeout(timeout):
                self._writer.write(buffer)
                await self._writer.drain()
        except TimeoutError:
            raise httpcore.WriteTimeout(f"not written within {timeout} s") from None
        except OSError as error:
            raise httpcore.WriteError(str(error) or type(error).__name__) from error

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):  # the peer reset it first: closed all the same
            await self._writer.wait_closed()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                await self._writer.start_tls(ssl_context, server_hostname=server_hostname)
        except TimeoutError:
            await self.aclose()
            raise httpcore.ConnectTimeout(f"no TLS handshake within {timeout} s") from None
        except (OSError, ssl.SSLError) as error:
            await self.aclose()
            raise httpcore.ConnectError(str(error) or type(error).__name__) from error
        return self

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object":
            return self._writer.get_extra_info("ssl_object")
        if info == "client_addr":
            return self._writer.get_extra_info("sockname")
        if info == "server_addr":
            return self._writer.get_extra_info("peername")
        if info == "socket":
            return self._writer.get_extra_info("socket")
        if info == "is_readable":
            return _readable(self._writer.get_extra_info("socket"))
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    host,
                    port,
                    local_addr=(local_address, 0) if local_address else None,
                    happy_eyeballs_delay=None if _is_address(host) else HAPPY_EYEBALLS_DELAY,
                )
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"no connection within {timeout} s") from None
        except OSError as error:
            raise httpcore.ConnectError(str(error) or type(error).__name__) from error
        sock = writer.get_extra_info("socket")
        for option in socket_options or ():
            sock.setsockopt(*option)
        return AsyncioStream(reader, writer)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(path)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"no connection within {timeout} s") from None
        except OSError as error:
            raise httpcore.ConnectError(str(error) or type(error).__name__) from error
        return AsyncioStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _readable(sock: socket.socket | None) -> bool:
    """Whether a read would return at once (data, or the end): a connection the peer closed."""
    if sock is None or sock.fileno() < 0:
        return True
    if not hasattr(select, "poll"):  # select() only takes descriptors below 1024
        return bool(select.select([sock], [], [], 0)[0])
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(0))
