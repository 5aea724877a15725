"""The ticket desk: a harmless stand-in for an external ticketing system (DESIGN.md §6).

It runs in its own process with its own SQLite file and knows nothing of Django or the
ledger, so that the executor meets it exactly as it would meet someone else's service:
over HTTP, with faults it cannot see coming. JSON in, JSON out; errors are
`{"error": "..."}`.

Routes:

- `POST /tickets` `{title, body?, client_ref}` → 201 ticket. Not idempotent: every POST
  creates a ticket, so a blind retry duplicates (that is the point).
- `POST /tickets/keyed`, same body, requires an `Idempotency-Key` header (400 without).
  The first request with a key creates the ticket (201); the same key again answers the
  original ticket (200, `Idempotent-Replayed: true`) and creates nothing. The same key
  with a different title, body or client_ref is refused with 422.
- `GET /tickets?client_ref=R` → 200 `{"tickets": [...], "count": n}`, every ticket with
  that reference, oldest first (without `client_ref`: every ticket).
- `GET /tickets/{id}` → the ticket, or 404.
- `POST /tickets/{id}/close` `{client_ref?}` → 200 the ticket, closed. Closing a closed
  ticket changes nothing and answers 200; an unknown id is 404.
- `POST /echo` → 200 `{"headers": {...}, "body": ...}`: what the desk received, request
  headers included, as a careless API might answer (to check what a tool stores of it).
- `GET /stats` → `{"tickets": n, "closed": n, "by_client_ref": {ref: n},
  "faults_injected": {...}, "stale_fence_refused": n, "delayed": n}`. Ticket counts
  come from the store; the fault, refusal and `delayed` counters (requests that began
  serving their latency: the request was read, its effect not yet decided) count since
  this process started.
- `GET /faults`, `POST /faults` `{latency_ms, error_503_rate, error_429_rate,
  retry_after, drop_after_commit_rate, seed, title_faults}` (each optional, merged into the
  current set; `{"reset": true}` clears them first). Rates are probabilities in [0, 1].
  `title_faults` `{"text": "error_503" | "error_429" | "drop_after_commit"}` picks calls
  by what they are rather than by chance: every create whose title contains the text
  gets that fault, every time, until the faults change (a demo or a test can then say
  which call drops).
- `GET /health` → 200.

Faults apply to the routes that create or close tickets, never to reads, stats or faults.
Latency is served first, then a 503 or a 429 (with `Retry-After`) is answered before
anything is committed. A drop lets the request take effect (a create, a keyed replay, a
close) and then closes the connection without a response, so the client sees a lost
connection after the effect happened.

As a reference target for HTTP tools defined as data (API.md "Your own tools"), the create
and close routes also take the client_ref from an `X-Stepward-Operation` header when the
body has none, and the fence from `X-Stepward-Fence`: such a tool's JSON input is the body.

Fencing: the create and close routes accept an `X-Fence-Token` integer together with the
request's client_ref. The desk remembers the highest token seen per client_ref and
refuses a lower one with 409 `{"error": "stale fence"}` before committing anything, so a
worker whose lease was taken over cannot act. `GET /tickets?client_ref=R` with a token
raises the remembered token without refusing: a lookup made under a newer lease thereby
stops a slower request from the old lease from committing after the lookup answered.

One file on purpose (about 750 lines): a standalone service that runs and can be copied
without the project.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

MAX_BODY_BYTES = 64 * 1024
MAX_TITLE_CHARS = 200
MAX_TEXT_CHARS = 20_000
MAX_REF_CHARS = 200
MAX_KEY_CHARS = 255
# SQLite integers are signed 64-bit; a larger id can name no ticket.
MAX_TICKET_ID = 2**63 - 1
MAX_LATENCY_MS = 120_000
MAX_RETRY_AFTER = 3600

SCHEMA = """
CREATE TABLE IF NOT EXISTS tickets (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    body TEXT NOT NULL DEFAULT '',
    client_ref TEXT NOT NULL,
    idempotency_key TEXT UNIQUE,
    status TEXT NOT NULL DEFAULT 'open' CHECK (status IN ('open', 'closed')),
    created_at TEXT NOT NULL,
    closed_at TEXT
);
CREATE INDEX IF NOT EXISTS tickets_client_ref ON tickets (client_ref);
CREATE TABLE IF NOT EXISTS fences (
    client_ref TEXT PRIMARY KEY,
    fence INTEGER NOT NULL
);
"""


class DeskError(Exception):
    """An answer other than success, with its status and JSON message."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class StaleFence(DeskError):
    def __init__(self) -> None:
        super().__init__(HTTPStatus.CONFLICT, "stale fence")


class DropConnection(Exception):
    """The effect is committed; close the socket without answering."""


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _ticket(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "ticket_id": row["id"],
        "title": row["title"],
        "body": row["body"],
        "client_ref": row["client_ref"],
        "status": row["status"],
        "created_at": row["created_at"],
        "closed_at": row["closed_at"],
    }


# --- storage ---------------------------------------------------------------------------


class TicketStore:
    """The desk's SQLite file. Each request opens its own connection; writes are
    `BEGIN IMMEDIATE` so that check-then-insert (fences, idempotency keys) is serialized
    even across processes sharing the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        # Writers of this process queue here rather than in SQLite's busy handler, which
        # sleeps in growing steps while the file is locked: under a few dozen concurrent
        # requests that sleeping, not the writes, was most of each request's time.
        self._writing = threading.Lock()
        with self._connection() as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(SCHEMA)

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA synchronous=NORMAL")
            yield conn
        finally:
            conn.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._writing, self._connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    @staticmethod
    def _check_fence(
        conn: sqlite3.Connection, client_ref: str, fence: int | None, *, refuse: bool = True
    ) -> None:
        if fence is None:
            return
        row = conn.execute(
            "SELECT fence FROM fences WHERE client_ref = ?", (client_ref,)
        ).fetchone()
        if row is not None and fence < row["fence"]:
            if refuse:
                raise StaleFence()
            return
        conn.execute(
            "INSERT INTO fences (client_ref, fence) VALUES (?, ?) "
            "ON CONFLICT (client_ref) DO UPDATE SET fence = MAX(fence, excluded.fence)",
            (client_ref, fence),
        )

    def create(
        self,
        *,
        title: str,
        body: str,
        client_ref: str,
        fence: int | None,
        idempotency_key: str | None,
    ) -> tuple[dict[str, Any], bool]:
        """Returns the ticket and whether this call created it."""
        with self._write() as conn:
            self._check_fence(conn, client_ref, fence)
            if idempotency_key is not None:
                row = conn.execute(
                    "SELECT * FROM tickets WHERE idempotency_key = ?", (idempotency_key,)
                ).fetchone()
                if row is not None:
                    if (row["title"], row["body"], row["client_ref"]) != (title, body, client_ref):
                        raise DeskError(
                            HTTPStatus.UNPROCESSABLE_ENTITY,
                            "idempotency key reused with a different request",
                        )
                    return _ticket(row), False
            cursor = conn.execute(
                "INSERT INTO tickets (title, body, client_ref, idempotency_key, created_at) "
                "VALUES (?, ?, ?, ?, ?) RETURNING *",
                (title, body, client_ref, idempotency_key, _now()),
            )
            return _ticket(cursor.fetchone()), True

    def close(
        self,
        ticket_id: int,
        *,
        client_ref: str | None,
        fence: int | None,
    ) -> dict[str, Any]:
        with self._write() as conn:
            if client_ref is not None:
                self._check_fence(conn, client_ref, fence)
            row = conn.execute("SELECT * FROM tickets WHERE id = ?", (ticket_id,)).fetchone()
            if row is None:
                raise DeskError(HTTPStatus.NOT_FOUND, f"no ticket {ticket_id}")
            if row["status"] != "closed":
                row = conn.execute(
                    "UPDATE tickets SET status = 'closed', closed_at = ? WHERE id = ? RETURNING *",
                    (_now(), ticket_id),
                ).fetchone()
            return _ticket(row)

    def get(self, ticket_id: int) -> dict[str, Any] | None:
        with self._connection() as conn:
            row = conn.execute("SELECT * FROM tickets WHERE id = ?", (ticket_id,)).fetchone()
        return _ticket(row) if row is not None else None

    def find(self, client_ref: str | None, *, fence: int | None = None) -> list[dict[str, Any]]:
        if client_ref is None:
            with self._connection() as conn:
                rows = conn.execute("SELECT * FROM tickets ORDER BY id").fetchall()
            return [_ticket(row) for row in rows]
        query = "SELECT * FROM tickets WHERE client_ref = ? ORDER BY id"
        if fence is None:
            with self._connection() as conn:
                rows = conn.execute(query, (client_ref,)).fetchall()
        else:
            # Raising the fence and reading in one transaction: any create with an older
            # token either committed before this read (and is listed) or will be refused.
            with self._write() as conn:
                self._check_fence(conn, client_ref, fence, refuse=False)
                rows = conn.execute(query, (client_ref,)).fetchall()
        return [_ticket(row) for row in rows]

    def stats(self) -> dict[str, Any]:
        with self._connection() as conn:
            total, closed = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(status = 'closed'), 0) FROM tickets"
            ).fetchone()
            by_ref = conn.execute(
                "SELECT client_ref, COUNT(*) FROM tickets GROUP BY client_ref"
            ).fetchall()
        return {"tickets": total, "closed": closed, "by_client_ref": dict(by_ref)}


# --- faults ----------------------------------------------------------------------------


@dataclass
class Faults:
    latency_ms: float = 0.0
    error_503_rate: float = 0.0
    error_429_rate: float = 0.0
    retry_after: int = 1
    drop_after_commit_rate: float = 0.0
    seed: int | None = None
    title_faults: dict[str, str] = field(default_factory=dict)


TITLE_FAULTS = ("error_503", "error_429", "drop_after_commit")
MAX_TITLE_FAULTS = 50


def _is_number(value: Any) -> bool:
    # bool is an int in Python, but `true` is not a number in JSON.
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _validate_faults(changes: dict[str, Any]) -> dict[str, Any]:
    known = set(Faults.__dataclass_fields__) | {"reset"}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise DeskError(HTTPStatus.BAD_REQUEST, f"unknown fault settings: {', '.join(unknown)}")
    for name in ("error_503_rate", "error_429_rate", "drop_after_commit_rate"):
        if name in changes and not (_is_number(changes[name]) and 0 <= changes[name] <= 1):
            raise DeskError(HTTPStatus.BAD_REQUEST, f"{name} must be a number in [0, 1]")
    latency = changes.get("latency_ms", 0)
    if not (_is_number(latency) and 0 <= latency <= MAX_LATENCY_MS):
        raise DeskError(HTTPStatus.BAD_REQUEST, f"latency_ms must be in [0, {MAX_LATENCY_MS}]")
    retry_after = changes.get("retry_after", 0)
    if not (isinstance(retry_after, int) and not isinstance(retry_after, bool)) or not (
        0 <= retry_after <= MAX_RETRY_AFTER
    ):
        raise DeskError(
            HTTPStatus.BAD_REQUEST, f"retry_after must be an integer in [0, {MAX_RETRY_AFTER}]"
        )
    seed = changes.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise DeskError(HTTPStatus.BAD_REQUEST, "seed must be an integer or null")
    if not isinstance(changes.get("reset", False), bool):
        raise DeskError(HTTPStatus.BAD_REQUEST, "reset must be a boolean")
    by_title = changes.get("title_faults", {})
    if not isinstance(by_title, dict) or len(by_title) > MAX_TITLE_FAULTS:
        raise DeskError(
            HTTPStatus.BAD_REQUEST,
            f"title_faults must be an object of at most {MAX_TITLE_FAULTS} entries",
        )
    for text, fault in by_title.items():
        if not text or len(text) > MAX_TITLE_CHARS or fault not in TITLE_FAULTS:
            raise DeskError(
                HTTPStatus.BAD_REQUEST,
                "title_faults maps a text found in titles (1 to "
                f"{MAX_TITLE_CHARS} characters) to one of {', '.join(TITLE_FAULTS)}",
            )
    return changes


class FaultInjector:
    """The current faults and the counts of those injected, shared by request threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults = Faults()
        self._random = random.Random()
        self.injected = {"error_503": 0, "error_429": 0, "drop_after_commit": 0}
        self.stale_fence_refused = 0
        self.delayed = 0

    def current(self) -> dict[str, Any]:
        with self._lock:
            return asdict(self._faults)

    def update(self, changes: dict[str, Any]) -> dict[str, Any]:
        _validate_faults(changes)
        with self._lock:
            merged = asdict(Faults() if changes.get("reset") else self._faults)
            merged.update({k: v for k, v in changes.items() if k != "reset"})
            for name in (
                "latency_ms",
                "error_503_rate",
                "error_429_rate",
                "drop_after_commit_rate",
            ):
                merged[name] = float(merged[name])
            self._faults = Faults(**merged)
            if "seed" in changes or changes.get("reset"):
                self._random = random.Random(self._faults.seed)
            return asdict(self._faults)

    def _roll(self, rate: float) -> bool:
        return rate > 0 and self._random.random() < rate

    def _by_title(self, title: str | None) -> set[str]:
        if not title:
            return set()
        return {fault for text, fault in self._faults.title_faults.items() if text in title}

    def before_commit(self, title: str | None = None) -> None:
        """Serves latency, then answers 503 or 429 before anything is committed."""
        with self._lock:
            faults = self._faults
            chosen = self._by_title(title)
            error_503 = "error_503" in chosen or self._roll(faults.error_503_rate)
            error_429 = not error_503 and (
                "error_429" in chosen or self._roll(faults.error_429_rate)
            )
            if error_503:
                self.injected["error_503"] += 1
            if error_429:
                self.injected["error_429"] += 1
            if faults.latency_ms:
                self.delayed += 1
        if faults.latency_ms:
            time.sleep(faults.latency_ms / 1000)
        if error_503:
            raise DeskError(HTTPStatus.SERVICE_UNAVAILABLE, "service unavailable (injected)")
        if error_429:
            raise DeskError(
                HTTPStatus.TOO_MANY_REQUESTS,
                "rate limited (injected)",
                headers={"Retry-After": str(faults.retry_after)},
            )

    def after_commit(self, title: str | None = None) -> None:
        with self._lock:
            drop = "drop_after_commit" in self._by_title(title) or self._roll(
                self._faults.drop_after_commit_rate
            )
            if drop:
                self.injected["drop_after_commit"] += 1
        if drop:
            raise DropConnection()

    def count_stale_fence(self) -> None:
        with self._lock:
            self.stale_fence_refused += 1

    def counters(self) -> dict[str, Any]:
        with self._lock:
            return {
                "faults_injected": dict(self.injected),
                "stale_fence_refused": self.stale_fence_refused,
                "delayed": self.delayed,
            }


# --- HTTP ------------------------------------------------------------------------------

TICKET_PATH = re.compile(r"^/tickets/(\d+)$")
CLOSE_PATH = re.compile(r"^/tickets/(\d+)/close$")


def _text_field(data: dict[str, Any], name: str, *, limit: int, required: bool) -> str | None:
    value = data.get(name)
    if value is None:
        if required:
            raise DeskError(HTTPStatus.BAD_REQUEST, f"{name} is required")
        return None
    if not isinstance(value, str):
        raise DeskError(HTTPStatus.BAD_REQUEST, f"{name} must be a string")
    if required and not value.strip():
        raise DeskError(HTTPStatus.BAD_REQUEST, f"{name} must not be empty")
    if len(value) > limit:
        raise DeskError(HTTPStatus.BAD_REQUEST, f"{name} is longer than {limit} characters")
    return value


def _ticket_id(text: str) -> int:
    ticket_id = int(text)
    if ticket_id > MAX_TICKET_ID:
        raise DeskError(HTTPStatus.NOT_FOUND, f"no ticket {text}")
    return ticket_id


class DeskHandler(BaseHTTPRequestHandler):
    server: TicketDeskServer
    protocol_version = "HTTP/1.1"
    server_version = "TicketDesk/1"

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # --- plumbing ----------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        try:
            raw = self._read_body()
            url = urlsplit(self.path)
            status, payload, headers = self._route(method, url.path, url.query, raw)
        except DropConnection:
            self.close_connection = True
            self.log_message('"%s" dropped after commit (injected)', self.requestline)
            return
        except DeskError as error:
            status, payload, headers = error.status, {"error": error.message}, error.headers
        except Exception as error:  # noqa: BLE001 - a client gets JSON, never a traceback
            self.log_error("internal error: %r", error)
            self.close_connection = True
            status, payload, headers = 500, {"error": "internal error"}, {}
        self._send_json(status, payload, headers)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise DeskError(HTTPStatus.LENGTH_REQUIRED, "send a Content-Length, not chunks")
        length_text = self.headers.get("Content-Length", "0")
        if not length_text.isdigit():
            self.close_connection = True
            raise DeskError(HTTPStatus.BAD_REQUEST, "bad Content-Length")
        length = int(length_text)
        if length > MAX_BODY_BYTES:
            # The unread body would corrupt the next request on this connection.
            self.close_connection = True
            raise DeskError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large")
        return self.rfile.read(length) if length else b""

    def _send_json(self, status: int, payload: Any, headers: dict[str, str]) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in headers.items():
                self.send_header(name, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            # The client went away; there is no one left to answer.
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # The base class answers malformed requests with HTML; clients here expect JSON.
        self.close_connection = True
        self._send_json(code, {"error": message or HTTPStatus(code).phrase}, {})

    def log_message(self, format: str, *args: Any) -> None:
        if not self.server.quiet:
            super().log_message(format, *args)

    def _json_object(self, raw: bytes, *, allow_empty: bool = False) -> dict[str, Any]:
        if not raw.strip() and allow_empty:
            return {}
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise DeskError(HTTPStatus.BAD_REQUEST, "body is not valid JSON") from None
        if not isinstance(data, dict):
            raise DeskError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
        return data

    def _fence(self) -> int | None:
        # Stepward's HTTP tools send X-Stepward-Fence; the built-in desk tools X-Fence-Token.
        value = self.headers.get("X-Fence-Token") or self.headers.get("X-Stepward-Fence")
        if value is None:
            return None
        if not re.fullmatch(r"\s*-?\d{1,18}\s*", value):
            raise DeskError(HTTPStatus.BAD_REQUEST, "X-Fence-Token must be an integer")
        return int(value)

    def _client_ref(self, data: dict[str, Any], *, required: bool) -> str | None:
        """The body's client_ref, else the X-Stepward-Operation header (what Stepward's HTTP
        tools send: their JSON input is the body, the operation id travels beside it)."""
        if "client_ref" in data:
            return _text_field(data, "client_ref", limit=MAX_REF_CHARS, required=required)
        header = (self.headers.get("X-Stepward-Operation") or "").strip()
        if header:
            return _text_field(
                {"client_ref": header}, "client_ref", limit=MAX_REF_CHARS, required=True
            )
        return _text_field(data, "client_ref", limit=MAX_REF_CHARS, required=required)

    # --- routes ------------------------------------------------------------------------

    def _route(
        self, method: str, path: str, query: str, raw: bytes
    ) -> tuple[int, Any, dict[str, str]]:
        routes: list[tuple[re.Pattern[str] | str, dict[str, Callable[..., Any]]]] = [
            ("/health", {"GET": self._health}),
            ("/tickets", {"GET": self._list, "POST": self._create}),
            ("/tickets/keyed", {"POST": self._create_keyed}),
            (TICKET_PATH, {"GET": self._get}),
            (CLOSE_PATH, {"POST": self._close}),
            ("/echo", {"POST": self._echo}),
            ("/stats", {"GET": self._stats}),
            ("/faults", {"GET": self._get_faults, "POST": self._set_faults}),
        ]
        for pattern, handlers in routes:
            if isinstance(pattern, str):
                if path != pattern:
                    continue
                args: tuple[str, ...] = ()
            else:
                match = pattern.match(path)
                if match is None:
                    continue
                args = match.groups()
            if method not in handlers:
                raise DeskError(
                    HTTPStatus.METHOD_NOT_ALLOWED,
                    f"{method} is not allowed here",
                    headers={"Allow": ", ".join(handlers)},
                )
            result: tuple[int, Any, dict[str, str]] = handlers[method](*args, query=query, raw=raw)
            return result
        raise DeskError(HTTPStatus.NOT_FOUND, f"no route {path}")

    def _health(self, *, query: str, raw: bytes) -> tuple[int, Any, dict[str, str]]:
        return 200, {"status": "ok"}, {}

    def _list(self, *, query: str, raw: bytes) -> tuple[int, Any, dict[str, str]]:
        refs = parse_qs(query, keep_blank_values=True).get("client_ref")
        client_ref = refs[0] if refs else None
        fence = self._fence() if client_ref is not None else None
        tickets = self.server.store.find(client_ref, fence=fence)
        return 200, {"tickets": tickets, "count": len(tickets)}, {}

    def _get(self, ticket_id: str, *, query: str, raw: bytes) -> tuple[int, Any, dict[str, str]]:
        ticket = self.server.store.get(_ticket_id(ticket_id))
        if ticket is None:
            raise DeskError(HTTPStatus.NOT_FOUND, f"no ticket {ticket_id}")
        return 200, ticket, {}

    def _create(self, *, query: str, raw: bytes) -> tuple[int, Any, dict[str, str]]:
        return self._create_ticket(raw, idempotency_key=None)

    def _create_keyed(self, *, query: str, raw: bytes) -> tuple[int, Any, dict[str, str]]:
        key = (self.headers.get("Idempotency-Key") or "").strip()
        if not key:
            raise DeskError(HTTPStatus.BAD_REQUEST, "the Idempotency-Key header is required")
        if len(key) > MAX_KEY_CHARS:
            raise DeskError(HTTPStatus.BAD_REQUEST, "Idempotency-Key is too long")
        return self._create_ticket(raw, idempotency_key=key)

    def _create_ticket(
        self, raw: bytes, *, idempotency_key: str | None
    ) -> tuple[int, Any, dict[str, str]]:
        data = self._json_object(raw)
        title = _text_field(data, "title", limit=MAX_TITLE_CHARS, required=True)
        body = _text_field(data, "body", limit=MAX_TEXT_CHARS, required=False) or ""
        client_ref = self._client_ref(data, required=True)
        assert title is not None
        assert client_ref is not None
        fence = self._fence()
        faults = self.server.faults
        faults.before_commit(title)
        try:
            ticket, created = self.server.store.create(
                title=title,
                body=body,
                client_ref=client_ref,
                fence=fence,
                idempotency_key=idempotency_key,
            )
        except StaleFence:
            faults.count_stale_fence()
            raise
        faults.after_commit(title)
        if created:
            return HTTPStatus.CREATED, ticket, {}
        return HTTPStatus.OK, ticket, {"Idempotent-Replayed": "true"}

    def _close(self, ticket_id: str, *, query: str, raw: bytes) -> tuple[int, Any, dict[str, str]]:
        data = self._json_object(raw, allow_empty=True)
        client_ref = self._client_ref(data, required=False)
        fence = self._fence()
        if fence is not None and not client_ref:
            raise DeskError(HTTPStatus.BAD_REQUEST, "X-Fence-Token needs a client_ref")
        number = _ticket_id(ticket_id)
        faults = self.server.faults
        faults.before_commit()
        try:
            ticket = self.server.store.close(number, client_ref=client_ref, fence=fence)
        except StaleFence:
            faults.count_stale_fence()
            raise
        faults.after_commit()
        return 200, ticket, {}

    def _echo(self, *, query: str, raw: bytes) -> tuple[int, Any, dict[str, str]]:
        """What the desk received, headers included, as a careless API might answer."""
        received = dict(self.headers.items())
        return 200, {"headers": received, "body": self._json_object(raw, allow_empty=True)}, {}

    def _stats(self, *, query: str, raw: bytes) -> tuple[int, Any, dict[str, str]]:
        return 200, {**self.server.store.stats(), **self.server.faults.counters()}, {}

    def _get_faults(self, *, query: str, raw: bytes) -> tuple[int, Any, dict[str, str]]:
        return 200, self.server.faults.current(), {}

    def _set_faults(self, *, query: str, raw: bytes) -> tuple[int, Any, dict[str, str]]:
        return 200, self.server.faults.update(self._json_object(raw)), {}


class TicketDeskServer(ThreadingHTTPServer):
    # Keep-alive connections must not hold up shutdown.
    daemon_threads = True

    def __init__(self, address: tuple[str, int], store: TicketStore, *, quiet: bool) -> None:
        self.store = store
        self.faults = FaultInjector()
        self.quiet = quiet
        super().__init__(address, DeskHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-answer is ordinary here (drills kill workers).
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def make_server(host: str, port: int, db_path: str, *, quiet: bool = False) -> TicketDeskServer:
    """Binds the desk (port 0 picks a free port; see `.url`) without serving yet."""
    return TicketDeskServer((host, port), TicketStore(db_path), quiet=quiet)


def serve(
    host: str,
    port: int,
    db_path: str,
    *,
    quiet: bool = False,
    ready: Callable[[TicketDeskServer], None] | None = None,
) -> None:
    """Serves until SIGTERM or SIGINT (when run in the main thread)."""
    server = make_server(host, port, db_path, quiet=quiet)
    previous: dict[signal.Signals, Any] = {}

    def stop(signum: int, frame: Any) -> None:
        # shutdown() waits for serve_forever() to return, so it cannot run on this thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    if threading.current_thread() is threading.main_thread():
        for stop_signal in (signal.SIGTERM, signal.SIGINT):
            previous[stop_signal] = signal.signal(stop_signal, stop)
    try:
        if ready is not None:
            ready(server)
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        for stop_signal, handler in previous.items():
            signal.signal(stop_signal, handler)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The ticket desk, without Django.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--db", default="ticketdesk.sqlite3")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    def ready(server: TicketDeskServer) -> None:
        print(f"ticketdesk listening on {server.url} (db {args.db})", flush=True)

    serve(args.host, args.port, args.db, quiet=args.quiet, ready=ready)


if __name__ == "__main__":
    main()
