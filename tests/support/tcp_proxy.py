"""A TCP proxy a test can cut and restore: a network partition between one process and a
server (PostgreSQL), with the connections left open. Cut, it forwards nothing and accepts
nothing onward (what was sent waits in the kernel's buffers, as on a link that went dark);
restored, everything flows again where it stopped. `cut_open` darkens only the connections
open now (one process's calls in flight), and new ones flow: another process reaching the
same server through it is not cut off."""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType
from typing import Self


class TcpProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self.stopping = threading.Event()
        self.connections = 0
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        # Each connection's own switch, and whether each of its two pumps still runs.
        self._links: list[tuple[threading.Event, list[bool]]] = []

    def __enter__(self) -> Self:
        self._spawn(self._accept)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stopping.set()
        self.flowing.set()
        for sock in [self.listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def cut(self) -> None:
        self.flowing.clear()

    def cut_open(self) -> int:
        """Darkens the connections open now (both directions still pumping); returns how
        many."""
        darkened = 0
        for link, pumps in self._links:
            link.clear()
            darkened += pumps == [True, True]
        return darkened

    def restore(self) -> None:
        for link, _ in self._links:
            link.set()
        self.flowing.set()

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                client, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            self._spawn(self._connect, client)

    def _connect(self, client: socket.socket) -> None:
        self.flowing.wait()  # a connection made while cut reaches nothing until restored
        if self.stopping.is_set():
            client.close()
            return
        try:
            server = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            client.close()
            return
        self.connections += 1
        self._sockets += [client, server]
        link = threading.Event()
        link.set()
        pumps = [True, True]
        self._links.append((link, pumps))
        for sock in (client, server):
            sock.settimeout(0.1)
        self._spawn(self._pump, client, server, link, pumps, 0)
        self._spawn(self._pump, server, client, link, pumps, 1)

    def _pump(
        self,
        source: socket.socket,
        target: socket.socket,
        link: threading.Event,
        pumps: list[bool],
        which: int,
    ) -> None:
        try:
            self._forward(source, target, link)
        finally:
            pumps[which] = False

    def _forward(self, source: socket.socket, target: socket.socket, link: threading.Event) -> None:
        while not self.stopping.is_set():
            if not self.flowing.wait(timeout=0.1) or not link.wait(timeout=0.1):
                continue  # cut: nothing is read, so nothing moves
            try:
                data = source.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            try:
                target.sendall(data)
            except OSError:
                break
        for sock in (source, target):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
