"""The ticket desk as a real process, and the tools that call it (DESIGN.md §6 to §8).

Why one module of about 1,100 lines: the desk's routes and faults and each desk tool's
failure classes share one desk process and its fixtures.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from executor.contract.tool import (
    FailureClass,
    Invocation,
    LookupOutcome,
    ToolError,
    get_tool,
)
from executor.tools.ticketdesk import _raise_for_status
from tests.support.desk import (
    POLL_SECONDS,
    Desk,
    start_desk,
    stop_desk,
    wait_for,
)


def new_ref() -> str:
    return f"op-{uuid.uuid4()}"


def closed_port() -> int:
    """A port nobody listens on: bound, then released, so a connection is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def invocation(tool_input: dict[str, Any], *, fence: int = 1, operation_id: str = "") -> Invocation:
    operation_id = operation_id or new_ref()
    return Invocation(
        step_id=str(uuid.uuid4()),
        operation_id=operation_id,
        input=tool_input,
        fence=fence,
        attempt=1,
        idempotency_key=operation_id,
    )


def tool_error(action: Callable[[], Any]) -> ToolError:
    with pytest.raises(ToolError) as caught:
        action()
    return caught.value


# --- the process -----------------------------------------------------------------------


def test_desk_prints_where_it_listens_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    desk = start_desk(tmp_path)
    assert httpx.get(f"{desk.url}/health").json() == {"status": "ok"}

    assert stop_desk(desk) == 0
    log = desk.log_path.read_text()
    assert f"listening on {desk.url}" in log
    assert "ticketdesk stopped" in log
    assert "Traceback" not in log


def test_desk_keeps_its_tickets_in_its_own_file_across_restarts(tmp_path: Path) -> None:
    first = start_desk(tmp_path)
    created = httpx.post(f"{first.url}/tickets", json={"title": "t", "client_ref": "r"}).json()
    stop_desk(first)

    second = start_desk(tmp_path)
    try:
        found = httpx.get(f"{second.url}/tickets/{created['ticket_id']}").json()
    finally:
        stop_desk(second)
    assert found["client_ref"] == "r"
    assert second.db_path.exists()


# --- routes ----------------------------------------------------------------------------


def test_health_answers_ok(desk: Desk) -> None:
    response = desk.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_every_post_to_tickets_creates_a_new_ticket(desk: Desk) -> None:
    ref = new_ref()
    first = desk.post("/tickets", {"title": "disk full", "body": "on db-3", "client_ref": ref})
    second = desk.post("/tickets", {"title": "disk full", "body": "on db-3", "client_ref": ref})

    assert first.status_code == second.status_code == 201
    assert first.json()["ticket_id"] != second.json()["ticket_id"]
    assert first.json()["title"] == "disk full"
    assert first.json()["body"] == "on db-3"
    assert first.json()["client_ref"] == ref
    assert first.json()["status"] == "open"
    assert desk.count(ref) == 2


def test_keyed_route_answers_the_original_ticket_for_a_repeated_key(desk: Desk) -> None:
    ref, key = new_ref(), str(uuid.uuid4())
    body = {"title": "renew cert", "client_ref": ref}

    first = desk.post("/tickets/keyed", body, **{"Idempotency-Key": key})
    again = desk.post("/tickets/keyed", body, **{"Idempotency-Key": key})

    assert first.status_code == 201
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert desk.count(ref) == 1


def test_keyed_route_without_an_idempotency_key_is_refused(desk: Desk) -> None:
    ref = new_ref()
    response = desk.post("/tickets/keyed", {"title": "t", "client_ref": ref})

    assert response.status_code == 400
    assert "Idempotency-Key" in response.json()["error"]
    assert desk.count(ref) == 0


def test_keyed_route_refuses_a_key_reused_for_a_different_request(desk: Desk) -> None:
    ref, key = new_ref(), str(uuid.uuid4())
    desk.post("/tickets/keyed", {"title": "one", "client_ref": ref}, **{"Idempotency-Key": key})

    response = desk.post(
        "/tickets/keyed", {"title": "two", "client_ref": ref}, **{"Idempotency-Key": key}
    )

    assert response.status_code == 422
    assert desk.count(ref) == 1


def test_list_by_client_ref_returns_only_that_references_tickets(desk: Desk) -> None:
    ref, other = new_ref(), new_ref()
    ids = [desk.create(ref)["ticket_id"], desk.create(ref)["ticket_id"]]
    desk.create(other)

    response = desk.get("/tickets", client_ref=ref)

    assert response.status_code == 200
    assert [t["ticket_id"] for t in response.json()["tickets"]] == ids
    assert desk.get("/tickets", client_ref=new_ref()).json() == {"tickets": [], "count": 0}


def test_get_ticket_answers_the_ticket_or_404(desk: Desk) -> None:
    ticket = desk.create(new_ref())

    assert desk.get(f"/tickets/{ticket['ticket_id']}").json() == ticket
    for missing in ("999999999", "99999999999999999999999"):
        response = desk.get(f"/tickets/{missing}")
        assert response.status_code == 404
        assert "error" in response.json()


def test_close_closes_and_closing_again_changes_nothing(desk: Desk) -> None:
    ticket = desk.create(new_ref())
    closed_before = desk.stats()["closed"]

    first = desk.post(f"/tickets/{ticket['ticket_id']}/close")
    again = desk.post(f"/tickets/{ticket['ticket_id']}/close")

    assert first.status_code == again.status_code == 200
    assert first.json()["status"] == "closed"
    assert again.json() == first.json()
    assert desk.get(f"/tickets/{ticket['ticket_id']}").json()["status"] == "closed"
    assert desk.stats()["closed"] == closed_before + 1


def test_closing_an_unknown_ticket_is_404(desk: Desk) -> None:
    response = desk.post("/tickets/999999999/close")
    assert response.status_code == 404
    assert "error" in response.json()


def test_stats_count_creations_per_client_ref_and_closes_do_not_change_them(desk: Desk) -> None:
    ref = new_ref()
    before = desk.stats()
    ticket = desk.create(ref)
    desk.create(ref)
    desk.post(f"/tickets/{ticket['ticket_id']}/close")

    after = desk.stats()

    assert after["tickets"] == before["tickets"] + 2
    assert after["by_client_ref"][ref] == 2
    assert after["closed"] == before["closed"] + 1


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b"", "not valid JSON"),
        (b'{"client_ref": "r"}', "title is required"),
        (b'{"title": "t"}', "client_ref is required"),
        (b'{"title": "  ", "client_ref": "r"}', "title must not be empty"),
        (b'{"title": 5, "client_ref": "r"}', "title must be a string"),
        (b'{"title": "' + b"x" * 201 + b'", "client_ref": "r"}', "longer than 200"),
    ],
)
def test_malformed_ticket_requests_are_400_json_errors(
    desk: Desk, raw: bytes, message: str
) -> None:
    tickets_before = desk.stats()["tickets"]

    response = desk.client.post("/tickets", content=raw)

    assert response.status_code == 400
    assert message in response.json()["error"]
    assert desk.stats()["tickets"] == tickets_before


def test_unknown_routes_are_404_and_wrong_methods_405(desk: Desk) -> None:
    unknown = desk.get("/nothing/here")
    wrong_method = desk.client.delete("/tickets")

    assert unknown.status_code == 404
    assert "error" in unknown.json()
    assert wrong_method.status_code == 405
    assert wrong_method.headers["Allow"] == "GET, POST"


def test_an_oversized_body_is_refused_without_a_traceback(desk: Desk) -> None:
    response = desk.client.post("/tickets", content=b"x" * (65 * 1024))
    assert response.status_code == 413
    assert response.json() == {"error": "body too large"}


def test_a_request_the_http_parser_refuses_still_gets_a_json_error(desk: Desk) -> None:
    url = httpx.URL(desk.url)
    headers = b"".join(b"X-H%d: v\r\n" % n for n in range(101))
    with socket.create_connection((url.host, url.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: desk\r\n" + headers + b"\r\n")
        answer = sock.makefile("rb").read()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431")
    assert b"Content-Type: application/json" in head
    assert body.startswith(b'{"error": ')


def test_concurrent_requests_neither_lose_tickets_nor_break_keyed_idempotency(desk: Desk) -> None:
    plain_ref, keyed_ref = new_ref(), new_ref()

    def plain(_: int) -> int:
        with httpx.Client(base_url=desk.url, timeout=30) as client:
            body = {"title": "t", "client_ref": plain_ref}
            return client.post("/tickets", json=body).status_code

    def keyed(_: int) -> int:
        with httpx.Client(base_url=desk.url, timeout=30) as client:
            body = {"title": "t", "client_ref": keyed_ref}
            return client.post(
                "/tickets/keyed", json=body, headers={"Idempotency-Key": keyed_ref}
            ).status_code

    with ThreadPoolExecutor(max_workers=16) as pool:
        plain_statuses = list(pool.map(plain, range(40)))
        keyed_statuses = list(pool.map(keyed, range(40)))

    assert plain_statuses == [201] * 40
    assert sorted(keyed_statuses) == [200] * 39 + [201]
    assert desk.count(plain_ref) == 40
    assert desk.count(keyed_ref) == 1


# --- faults ----------------------------------------------------------------------------


def test_faults_are_merged_into_the_current_set_and_reset_clears_them(desk: Desk) -> None:
    desk.faults(error_503_rate=0.5)
    merged = desk.faults(retry_after=7)

    assert merged["error_503_rate"] == 0.5
    assert merged["retry_after"] == 7
    assert desk.get("/faults").json() == merged
    cleared = desk.faults(reset=True)
    assert cleared == {
        "latency_ms": 0.0,
        "error_503_rate": 0.0,
        "error_429_rate": 0.0,
        "retry_after": 1,
        "drop_after_commit_rate": 0.0,
        "seed": None,
        "title_faults": {},
    }


def test_a_request_serving_its_latency_is_counted_as_delayed_before_it_takes_effect(
    desk: Desk,
) -> None:
    ref = new_ref()
    before = desk.stats()["delayed"]
    desk.faults(latency_ms=3000)  # ample time to read the count while the request is held

    with ThreadPoolExecutor(1) as pool:
        created = pool.submit(desk.post, "/tickets", {"title": "t", "client_ref": ref})
        wait_for(
            lambda: desk.stats()["delayed"] > before or None,
            seconds=POLL_SECONDS,
            what="the request to be read and held",
        )
        # Counted while held: what the recovery tests wait for before freezing a caller.
        assert desk.count(ref) == 0
        assert created.result().status_code == 201

    assert desk.stats()["delayed"] == before + 1
    assert desk.count(ref) == 1
    desk.faults(reset=True)
    desk.post("/tickets", {"title": "t", "client_ref": new_ref()})
    assert desk.stats()["delayed"] == before + 1  # no latency, not delayed


@pytest.mark.parametrize(
    "bad",
    [
        {"error_503_rate": 1.5},
        {"error_429_rate": -0.1},
        {"drop_after_commit_rate": "half"},
        {"error_503_rate": True},
        {"latency_ms": -1},
        {"retry_after": 1.5},
        {"seed": "abc"},
        {"reset": "yes"},
        {"no_such_fault": 1},
        {"title_faults": ["drop_after_commit"]},
        {"title_faults": {"": "error_503"}},
        {"title_faults": {"x" * 201: "error_503"}},
        {"title_faults": {"Refund": "explode"}},
        {"title_faults": {f"t{n}": "error_503" for n in range(51)}},
    ],
)
def test_bad_fault_settings_are_refused_and_change_nothing(desk: Desk, bad: dict[str, Any]) -> None:
    before = desk.get("/faults").json()

    response = desk.post("/faults", bad)

    assert response.status_code == 400
    assert "error" in response.json()
    assert desk.get("/faults").json() == before


def test_an_injected_503_commits_nothing(desk: Desk) -> None:
    ref = new_ref()
    ticket = desk.create(ref)
    desk.faults(error_503_rate=1.0)

    created = desk.post("/tickets", {"title": "t", "client_ref": ref})
    keyed = desk.post(
        "/tickets/keyed", {"title": "t", "client_ref": ref}, **{"Idempotency-Key": ref}
    )
    closed = desk.post(f"/tickets/{ticket['ticket_id']}/close")

    assert created.status_code == keyed.status_code == closed.status_code == 503
    desk.faults(reset=True)
    assert desk.count(ref) == 1
    assert desk.get(f"/tickets/{ticket['ticket_id']}").json()["status"] == "open"
    assert desk.stats()["faults_injected"]["error_503"] >= 3


def test_an_injected_429_commits_nothing_and_says_when_to_retry(desk: Desk) -> None:
    ref = new_ref()
    ticket = desk.create(ref)
    desk.faults(error_429_rate=1.0, retry_after=9)

    created = desk.post("/tickets", {"title": "t", "client_ref": ref})
    closed = desk.post(f"/tickets/{ticket['ticket_id']}/close")

    assert created.status_code == closed.status_code == 429
    assert created.headers["Retry-After"] == "9"
    desk.faults(reset=True)
    assert desk.count(ref) == 1
    assert desk.get(f"/tickets/{ticket['ticket_id']}").json()["status"] == "open"


def test_drop_after_commit_commits_exactly_one_ticket_and_drops_the_connection(
    desk: Desk,
) -> None:
    ref = new_ref()
    desk.faults(drop_after_commit_rate=1.0)

    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        httpx.post(f"{desk.url}/tickets", json={"title": "t", "client_ref": ref}, timeout=10)

    desk.faults(reset=True)
    assert desk.count(ref) == 1
    assert len(desk.get("/tickets", client_ref=ref).json()["tickets"]) == 1


def test_drop_after_commit_on_close_leaves_the_ticket_closed(desk: Desk) -> None:
    ticket = desk.create(new_ref())
    desk.faults(drop_after_commit_rate=1.0)

    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        httpx.post(f"{desk.url}/tickets/{ticket['ticket_id']}/close", timeout=10)

    assert desk.get(f"/tickets/{ticket['ticket_id']}").json()["status"] == "closed"


def test_faults_never_apply_to_reads_stats_or_faults(desk: Desk) -> None:
    ticket = desk.create(new_ref())
    desk.faults(error_503_rate=1.0, drop_after_commit_rate=1.0)

    assert desk.get("/health").status_code == 200
    assert desk.get("/tickets", client_ref=ticket["client_ref"]).status_code == 200
    assert desk.get(f"/tickets/{ticket['ticket_id']}").status_code == 200
    assert desk.get("/stats").status_code == 200
    assert desk.get("/faults").status_code == 200


def test_title_faults_pick_calls_by_their_title_every_time(desk: Desk) -> None:
    dropped, refused, spared = new_ref(), new_ref(), new_ref()
    desk.faults(title_faults={"Call back Alan": "drop_after_commit", "Escalate": "error_503"})

    for _ in range(2):
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            httpx.post(
                f"{desk.url}/tickets",
                json={"title": "Call back Alan Turing", "client_ref": dropped},
                timeout=10,
            )
    escalations = [
        desk.post(
            "/tickets/keyed",
            {"title": "Escalate refund 4471", "client_ref": refused},
            **{"Idempotency-Key": refused},
        ).status_code
        for _ in range(3)
    ]
    other = desk.post("/tickets", {"title": "Refund follow-up", "client_ref": spared})

    assert desk.count(dropped) == 2, "a drop comes after the commit"
    assert escalations == [503, 503, 503]
    assert desk.count(refused) == 0, "a 503 comes before it"
    assert other.status_code == 201
    desk.faults(reset=True)
    assert (
        desk.post(
            "/tickets/keyed",
            {"title": "Escalate refund 4471", "client_ref": refused},
            **{"Idempotency-Key": refused},
        ).status_code
        == 201
    )


def test_a_seeded_rate_injects_a_repeatable_share_of_faults(desk: Desk) -> None:
    def statuses() -> list[int]:
        desk.faults(error_503_rate=0.5, seed=42)
        ref = new_ref()
        return [
            desk.post("/tickets", {"title": "t", "client_ref": ref}).status_code for _ in range(20)
        ]

    first, second = statuses(), statuses()

    assert first == second
    assert set(first) == {201, 503}


# --- fences ----------------------------------------------------------------------------


def test_a_lower_fence_is_refused_before_anything_is_committed(desk: Desk) -> None:
    ref = new_ref()
    body = {"title": "t", "client_ref": ref}
    refused_before = desk.stats()["stale_fence_refused"]

    newer = desk.post("/tickets", body, **{"X-Fence-Token": "2"})
    stale = desk.post("/tickets", body, **{"X-Fence-Token": "1"})
    equal = desk.post("/tickets", body, **{"X-Fence-Token": "2"})
    higher = desk.post("/tickets", body, **{"X-Fence-Token": "3"})

    assert newer.status_code == equal.status_code == higher.status_code == 201
    assert stale.status_code == 409
    assert stale.json() == {"error": "stale fence"}
    assert desk.count(ref) == 3
    assert desk.stats()["stale_fence_refused"] == refused_before + 1


def test_the_keyed_route_refuses_a_stale_fence(desk: Desk) -> None:
    ref = new_ref()
    body = {"title": "t", "client_ref": ref}
    desk.post("/tickets/keyed", body, **{"Idempotency-Key": "k-" + ref, "X-Fence-Token": "5"})

    stale = desk.post("/tickets/keyed", body, **{"Idempotency-Key": ref, "X-Fence-Token": "4"})

    assert stale.status_code == 409
    assert desk.count(ref) == 1


def test_close_refuses_a_stale_fence_and_leaves_the_ticket_open(desk: Desk) -> None:
    ticket, other = desk.create(new_ref()), desk.create(new_ref())
    close_ref = new_ref()
    newer = desk.post(
        f"/tickets/{other['ticket_id']}/close", {"client_ref": close_ref}, **{"X-Fence-Token": "3"}
    )

    stale = desk.post(
        f"/tickets/{ticket['ticket_id']}/close", {"client_ref": close_ref}, **{"X-Fence-Token": "2"}
    )

    assert newer.status_code == 200

    assert stale.status_code == 409
    assert desk.get(f"/tickets/{ticket['ticket_id']}").json()["status"] == "open"


@pytest.mark.parametrize(
    ("path", "body", "fence"),
    [
        ("/tickets", {"title": "t", "client_ref": "r"}, "two"),
        ("/tickets", {"title": "t", "client_ref": "r"}, "1.5"),
        ("/tickets/1/close", {}, "1"),
    ],
)
def test_a_malformed_fence_or_a_fence_without_a_client_ref_is_400(
    desk: Desk, path: str, body: dict[str, Any], fence: str
) -> None:
    response = desk.post(path, body, **{"X-Fence-Token": fence})
    assert response.status_code == 400
    assert "X-Fence-Token" in response.json()["error"]


def test_a_lookup_with_a_newer_fence_fences_out_older_creates(desk: Desk) -> None:
    ref = new_ref()

    lookup = desk.client.get("/tickets", params={"client_ref": ref}, headers={"X-Fence-Token": "5"})
    late = desk.post("/tickets", {"title": "t", "client_ref": ref}, **{"X-Fence-Token": "4"})

    assert lookup.json() == {"tickets": [], "count": 0}
    assert late.status_code == 409
    assert desk.count(ref) == 0


# --- the create tools ------------------------------------------------------------------


def test_create_tool_opens_a_ticket_under_the_operation_id(desk: Desk, desk_settings: Any) -> None:
    tool = get_tool("ticketdesk.create")
    call = invocation({"title": "VPN down", "body": "since 9:00"})

    result = tool.invoke(call)

    ticket_id = result.result["ticket_id"]
    assert result.external_id == str(ticket_id)
    assert result.evidence["client_ref"] == call.operation_id
    assert desk.get(f"/tickets/{ticket_id}").json()["body"] == "since 9:00"
    assert desk.count(call.operation_id) == 1


def test_create_tool_repeated_blindly_duplicates_the_ticket(desk: Desk, desk_settings: Any) -> None:
    # Why the engine must never retry it after an ambiguous failure (DESIGN.md §13.3).
    tool = get_tool("ticketdesk.create")
    call = invocation({"title": "t"})

    tool.invoke(call)
    tool.invoke(call)

    assert desk.count(call.operation_id) == 2


def test_create_tool_lookup_finds_the_ticket_it_opened(desk: Desk, desk_settings: Any) -> None:
    tool = get_tool("ticketdesk.create")
    call = invocation({"title": "t"})
    result = tool.invoke(call)

    found = tool.lookup(call)

    assert found.outcome == LookupOutcome.FOUND
    assert found.external_id == result.external_id
    assert found.result == result.result


def test_create_tool_lookup_is_not_found_when_nothing_was_opened(
    desk: Desk, desk_settings: Any
) -> None:
    found = get_tool("ticketdesk.create").lookup(invocation({"title": "t"}))
    assert found.outcome == LookupOutcome.NOT_FOUND
    assert found.external_id == ""


def test_create_tool_lookup_shows_duplicates_in_its_evidence(
    desk: Desk, desk_settings: Any
) -> None:
    call = invocation({"title": "t"})
    first = desk.create(call.operation_id)["ticket_id"]
    second = desk.create(call.operation_id)["ticket_id"]

    found = get_tool("ticketdesk.create").lookup(call)

    assert found.external_id == str(first)
    assert found.evidence["ticket_ids"] == [first, second]


def test_lookup_cannot_tell_when_the_desk_is_unreachable(settings: Any) -> None:
    settings.TICKETDESK_URL = f"http://127.0.0.1:{closed_port()}"
    found = get_tool("ticketdesk.create").lookup(invocation({"title": "t"}))
    assert found.outcome == LookupOutcome.CANNOT_TELL


def test_create_tool_refused_connection_is_transient(settings: Any) -> None:
    settings.TICKETDESK_URL = f"http://127.0.0.1:{closed_port()}"
    error = tool_error(lambda: get_tool("ticketdesk.create").invoke(invocation({"title": "t"})))
    assert error.failure_class == FailureClass.TRANSIENT


def test_create_tool_503_is_unavailable_and_nothing_was_opened(
    desk: Desk, desk_settings: Any
) -> None:
    call = invocation({"title": "t"})
    desk.faults(error_503_rate=1.0)

    error = tool_error(lambda: get_tool("ticketdesk.create").invoke(call))

    assert error.failure_class == FailureClass.UNAVAILABLE
    assert desk.count(call.operation_id) == 0


def test_create_tool_429_is_rate_limited_with_the_retry_after(
    desk: Desk, desk_settings: Any
) -> None:
    call = invocation({"title": "t"})
    desk.faults(error_429_rate=1.0, retry_after=12)

    error = tool_error(lambda: get_tool("ticketdesk.create").invoke(call))

    assert error.failure_class == FailureClass.RATE_LIMITED
    assert error.retry_after == 12
    assert desk.count(call.operation_id) == 0


def test_create_tool_dropped_connection_is_ambiguous_and_lookup_finds_the_ticket(
    desk: Desk, desk_settings: Any
) -> None:
    tool = get_tool("ticketdesk.create")
    call = invocation({"title": "t"})
    desk.faults(drop_after_commit_rate=1.0)

    error = tool_error(lambda: tool.invoke(call))

    assert error.failure_class == FailureClass.AMBIGUOUS
    assert tool.classify(error) == FailureClass.AMBIGUOUS
    found = tool.lookup(call)
    assert found.outcome == LookupOutcome.FOUND
    assert desk.count(call.operation_id) == 1


def test_create_tool_read_timeout_is_ambiguous_and_the_ticket_may_appear_later(
    desk: Desk, desk_settings: Any
) -> None:
    desk_settings.TICKETDESK_TIMEOUT_SECONDS = 0.2
    tool = get_tool("ticketdesk.create")
    call = invocation({"title": "t"})
    desk.faults(latency_ms=2000)

    error = tool_error(lambda: tool.invoke(call))

    assert error.failure_class == FailureClass.AMBIGUOUS
    # The request arrived; the desk commits it when its latency is served.
    wait_for(lambda: desk.count(call.operation_id) or None, seconds=POLL_SECONDS, what="ticket")
    assert desk.count(call.operation_id) == 1


def test_lookup_under_a_newer_fence_stops_a_slower_create_from_the_old_lease(
    desk: Desk, desk_settings: Any
) -> None:
    desk_settings.TICKETDESK_TIMEOUT_SECONDS = 0.2
    tool = get_tool("ticketdesk.create")
    old_lease = invocation({"title": "t"}, fence=1)
    new_lease = invocation({"title": "t"}, fence=2, operation_id=old_lease.operation_id)
    refused_before = desk.stats()["stale_fence_refused"]
    desk.faults(latency_ms=3000)

    error = tool_error(lambda: tool.invoke(old_lease))
    found = tool.lookup(new_lease)

    assert error.failure_class == FailureClass.AMBIGUOUS
    assert found.outcome == LookupOutcome.NOT_FOUND
    wait_for(
        lambda: desk.stats()["stale_fence_refused"] > refused_before or None,
        seconds=POLL_SECONDS,
        what="the old lease's create to be refused",
    )
    assert desk.count(old_lease.operation_id) == 0


def test_create_tool_with_a_stale_fence_is_a_conflict(desk: Desk, desk_settings: Any) -> None:
    tool = get_tool("ticketdesk.create")
    newer = invocation({"title": "t"}, fence=3)
    tool.invoke(newer)
    stale = invocation({"title": "t"}, fence=2, operation_id=newer.operation_id)

    error = tool_error(lambda: tool.invoke(stale))

    assert error.failure_class == FailureClass.CONFLICT
    assert desk.count(newer.operation_id) == 1


def test_create_tool_refuses_invalid_input_without_calling_the_desk(
    desk: Desk, desk_settings: Any
) -> None:
    call = invocation({"title": ""})

    error = tool_error(lambda: get_tool("ticketdesk.create").invoke(call))

    assert error.failure_class == FailureClass.INVALID_INPUT
    assert desk.count(call.operation_id) == 0


def test_keyed_create_repeated_answers_the_original_ticket(desk: Desk, desk_settings: Any) -> None:
    tool = get_tool("ticketdesk.create_keyed")
    call = invocation({"title": "t"})

    first = tool.invoke(call)
    again = tool.invoke(call)

    assert again.external_id == first.external_id
    assert first.evidence["replayed"] is False
    assert again.evidence["replayed"] is True
    assert desk.count(call.operation_id) == 1


def test_keyed_create_retried_after_a_dropped_answer_creates_nothing_more(
    desk: Desk, desk_settings: Any
) -> None:
    tool = get_tool("ticketdesk.create_keyed")
    call = invocation({"title": "t"})
    desk.faults(drop_after_commit_rate=1.0)
    error = tool_error(lambda: tool.invoke(call))
    desk.faults(reset=True)

    retried = tool.invoke(call)

    assert error.failure_class == FailureClass.AMBIGUOUS
    assert retried.evidence["replayed"] is True
    assert tool.lookup(call).external_id == retried.external_id
    assert desk.count(call.operation_id) == 1


# --- the close tool --------------------------------------------------------------------


@pytest.mark.parametrize("as_string", [False, True])
def test_close_tool_closes_and_repeating_it_is_harmless(
    desk: Desk, desk_settings: Any, as_string: bool
) -> None:
    ticket_id = desk.create(new_ref())["ticket_id"]
    tool = get_tool("ticketdesk.close")
    call = invocation({"ticket_id": str(ticket_id) if as_string else ticket_id})
    closed_before = desk.stats()["closed"]

    first = tool.invoke(call)
    again = tool.invoke(call)

    assert first.external_id == again.external_id == str(ticket_id)
    assert again.result == {"ticket_id": ticket_id, "status": "closed"}
    assert desk.stats()["closed"] == closed_before + 1


def test_close_tool_on_an_unknown_ticket_is_invalid_input(desk: Desk, desk_settings: Any) -> None:
    error = tool_error(
        lambda: get_tool("ticketdesk.close").invoke(invocation({"ticket_id": 999_999_999}))
    )
    assert error.failure_class == FailureClass.INVALID_INPUT


def test_close_tool_dropped_connection_is_ambiguous(desk: Desk, desk_settings: Any) -> None:
    ticket_id = desk.create(new_ref())["ticket_id"]
    desk.faults(drop_after_commit_rate=1.0)

    error = tool_error(
        lambda: get_tool("ticketdesk.close").invoke(invocation({"ticket_id": ticket_id}))
    )

    assert error.failure_class == FailureClass.AMBIGUOUS
    assert desk.get(f"/tickets/{ticket_id}").json()["status"] == "closed"


def test_close_tool_503_is_unavailable_and_leaves_the_ticket_open(
    desk: Desk, desk_settings: Any
) -> None:
    ticket_id = desk.create(new_ref())["ticket_id"]
    desk.faults(error_503_rate=1.0)

    error = tool_error(
        lambda: get_tool("ticketdesk.close").invoke(invocation({"ticket_id": ticket_id}))
    )

    assert error.failure_class == FailureClass.UNAVAILABLE
    assert desk.get(f"/tickets/{ticket_id}").json()["status"] == "open"


# --- classification and declarations ---------------------------------------------------


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, FailureClass.INVALID_INPUT),
        (401, FailureClass.PERMISSION_DENIED),
        (403, FailureClass.PERMISSION_DENIED),
        (404, FailureClass.INVALID_INPUT),
        (409, FailureClass.CONFLICT),
        (422, FailureClass.INVALID_INPUT),
        (429, FailureClass.RATE_LIMITED),
        (500, FailureClass.AMBIGUOUS),
        (502, FailureClass.AMBIGUOUS),
        (503, FailureClass.UNAVAILABLE),
        (504, FailureClass.AMBIGUOUS),
    ],
)
def test_desk_answers_map_to_failure_classes(status: int, expected: FailureClass) -> None:
    response = httpx.Response(status, json={"error": "x"}, headers={"Retry-After": "3"})
    error = tool_error(lambda: _raise_for_status(response))
    assert error.failure_class == expected


def test_the_tools_declare_what_the_engine_relies_on() -> None:
    create = get_tool("ticketdesk.create")
    keyed = get_tool("ticketdesk.create_keyed")
    close = get_tool("ticketdesk.close")
    email = get_tool("email.send")

    assert (create.idempotency, keyed.idempotency, close.idempotency) == ("none", "key", "key")
    assert create.compensation == keyed.compensation == "ticketdesk.close"
    assert close.compensation == email.compensation == ""
    assert create.has_lookup()
    assert create.lookup_authoritative
    assert create.accepts_fence
    assert keyed.has_lookup()
    assert keyed.lookup_authoritative
    assert not email.has_lookup()
    assert {t.effect for t in (create, keyed, close, email)} == {"write"}
    assert not any(t.needs_approval() for t in (create, keyed, close))
    assert email.requires_approval == "by_policy"


@pytest.mark.django_db
def test_the_new_tools_are_mirrored_into_the_ledger_with_their_lookups() -> None:
    from executor.ledger.records import Tool
    from executor.services.tools import tools_sync

    tools_sync()

    rows = {row.name: row for row in Tool.objects.filter(registered=True)}
    assert {
        "ticketdesk.create",
        "ticketdesk.create_keyed",
        "ticketdesk.close",
        "email.send",
    } <= set(rows)
    assert rows["ticketdesk.create"].has_lookup is True
    assert rows["ticketdesk.close"].has_lookup is False
    assert rows["email.send"].compensation == ""


# --- email.send ------------------------------------------------------------------------


def email_call(**overrides: Any) -> Invocation:
    return invocation({"to": "bob@example.com", "subject": "Hello", "body": "Hi Bob.", **overrides})


def test_email_send_delivers_one_message_with_a_stable_message_id(mailoutbox: list[Any]) -> None:
    call = email_call()

    result = get_tool("email.send").invoke(call)

    assert len(mailoutbox) == 1
    sent = mailoutbox[0]
    assert sent.to == ["bob@example.com"]
    assert sent.subject == "Hello"
    assert sent.body == "Hi Bob."
    assert sent.extra_headers["Message-ID"] == f"<{call.operation_id}@stepward>"
    assert result.external_id == f"<{call.operation_id}@stepward>"


@pytest.mark.parametrize(
    "overrides",
    [
        {"subject": "Hi\r\nBcc: everyone@example.com"},
        {"to": "not an address"},
        {"to": "bob@exa mple..com"},
        {"to": "bob@example..com"},
        {"body": 5},
    ],
)
def test_email_send_refuses_invalid_input_and_sends_nothing(
    mailoutbox: list[Any], overrides: dict[str, Any]
) -> None:
    error = tool_error(lambda: get_tool("email.send").invoke(email_call(**overrides)))

    assert error.failure_class == FailureClass.INVALID_INPUT
    assert mailoutbox == []


class FakeSmtpServer(socketserver.ThreadingTCPServer):
    """Just enough SMTP to reach the points where a real server can fail us."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.messages_received = 0
        super().__init__(("127.0.0.1", 0), SmtpHandler)


class SmtpHandler(socketserver.StreamRequestHandler):
    server: FakeSmtpServer

    def reply(self, line: bytes) -> None:
        self.wfile.write(line + b"\r\n")

    def handle(self) -> None:
        self.reply(b"220 fake ESMTP")
        while line := self.rfile.readline():
            verb = line[:4].upper()
            if verb in (b"EHLO", b"HELO", b"MAIL", b"RSET", b"NOOP"):
                self.reply(b"250 ok")
            elif verb == b"RCPT":
                self.reply(b"550 no such user" if self.server.mode == "refuse" else b"250 ok")
            elif verb == b"DATA":
                self.reply(b"354 go ahead")
                while self.rfile.readline() not in (b".\r\n", b""):
                    pass
                self.server.messages_received += 1
                if self.server.mode == "drop":
                    return  # took the message, hangs up before saying so
                self.reply(b"250 queued")
            elif verb == b"QUIT":
                self.reply(b"221 bye")
                return
            else:
                self.reply(b"500 unknown")


@pytest.fixture
def smtp_settings(settings: Any) -> Callable[[int], Any]:
    backend = "django.core.mail.backends.smtp.EmailBackend"

    def use(port: int) -> Any:
        if hasattr(settings, "MAILERS"):
            options = {"host": "127.0.0.1", "port": port, "timeout": 10}
            settings.MAILERS = {"default": {"BACKEND": backend, "OPTIONS": options}}
        else:  # the settings from before Django 6.1's MAILERS
            settings.EMAIL_BACKEND = backend
            settings.EMAIL_HOST = "127.0.0.1"
            settings.EMAIL_PORT = port
            settings.EMAIL_TIMEOUT = 10
        return settings

    return use


@pytest.fixture
def fake_smtp() -> Iterator[Callable[[str], FakeSmtpServer]]:
    servers: list[FakeSmtpServer] = []

    def start(mode: str) -> FakeSmtpServer:
        server = FakeSmtpServer(mode)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_email_send_through_smtp_delivers(
    smtp_settings: Callable[[int], Any], fake_smtp: Callable[[str], FakeSmtpServer]
) -> None:
    server = fake_smtp("accept")
    smtp_settings(server.server_address[1])

    result = get_tool("email.send").invoke(email_call())

    assert result.evidence["backend"] == "EmailBackend"
    assert server.messages_received == 1


def test_email_send_refused_connection_is_transient(smtp_settings: Callable[[int], Any]) -> None:
    smtp_settings(closed_port())
    error = tool_error(lambda: get_tool("email.send").invoke(email_call()))
    assert error.failure_class == FailureClass.TRANSIENT


def test_email_send_connection_lost_after_the_data_is_ambiguous(
    smtp_settings: Callable[[int], Any], fake_smtp: Callable[[str], FakeSmtpServer]
) -> None:
    server = fake_smtp("drop")
    smtp_settings(server.server_address[1])

    error = tool_error(lambda: get_tool("email.send").invoke(email_call()))

    assert error.failure_class == FailureClass.AMBIGUOUS
    assert server.messages_received == 1


def test_email_send_with_every_recipient_refused_is_invalid_input(
    smtp_settings: Callable[[int], Any], fake_smtp: Callable[[str], FakeSmtpServer]
) -> None:
    server = fake_smtp("refuse")
    smtp_settings(server.server_address[1])

    error = tool_error(lambda: get_tool("email.send").invoke(email_call()))

    assert error.failure_class == FailureClass.INVALID_INPUT
    assert server.messages_received == 0
