"""The HTTP client tools send their requests with: one per process, shared by its threads.

Making an httpx client costs tens of milliseconds of CPU (its TLS context), so a client per
call capped a worker at a few dozen calls a second. Connections are still never reused:
a kept-alive connection the server had closed would fail only after the request was
written, and make a request that never arrived look ambiguous (DESIGN.md §8).
"""

from __future__ import annotations

import threading

import httpx

_client: httpx.Client | None = None
_lock = threading.Lock()


def client() -> httpx.Client:
    global _client
    with _lock:
        if _client is None:
            _client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
        return _client
