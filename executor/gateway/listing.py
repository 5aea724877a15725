"""Asking the upstreams for their tools and recording what they said (API.md "MCP
gateway"): by `load_tools` when an upstream is loaded, and by the sweeper after every pass,
each through this process's session (a worker's, since the credentials live there).

What is recorded (McpUpstream.listed_tools) is what every process registers its tools from,
so a web process never needs to reach an upstream. The listing is written only when it
changed; every attempt updates `checked_at` and `list_error` without touching `updated_at`.
An upstream that could not be listed is asked again after a pause that doubles each time
(up to five minutes), so one that hangs does not hold every sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import mcp_types as types
from django.conf import settings
from django.utils import timezone

from executor.gateway.connections import AnswerLost, Unreachable, gateway
from executor.gateway.tools import MissingVariable, reach_refusal, row_target, taken_names
from executor.ledger.records import McpUpstream

MAX_PAUSE_SECONDS = 300.0


@dataclass
class Listed:
    """What one attempt to list an upstream found."""

    upstream: str
    tools: list[str] = field(default_factory=list)
    changed: bool = False
    error: str = ""
    # Entries of `[upstream.tools.X]` that name no tool the upstream lists.
    unknown_entries: list[str] = field(default_factory=list)
    # Its tools whose names a tool of code or an HTTP tool holds: not registered.
    taken: list[str] = field(default_factory=list)


def tool_entry(tool: types.Tool) -> dict[str, Any]:
    """One listed tool as McpUpstream.listed_tools keeps it (MCP's wire names)."""
    annotations = (
        tool.annotations.model_dump(by_alias=True, exclude_none=True) if tool.annotations else {}
    )
    return {
        "name": tool.name,
        "description": tool.description or "",
        "input_schema": tool.input_schema,
        "annotations": annotations,
    }


def upstream_list(row: McpUpstream, *, timeout: float | None = None) -> Listed:
    """Lists `row`'s tools now and records them; never raises for the upstream's failures."""
    now = timezone.now()
    seconds = timeout or settings.EXECUTOR_UPSTREAM_START_SECONDS
    try:
        target = row_target(row)
        refused = reach_refusal(target)
        if refused:
            raise Unreachable(refused)
        listing = gateway().list_tools(target, timeout=seconds)
    except (MissingVariable, Unreachable, AnswerLost) as error:
        return _failed(row, str(error), now=now)
    except Exception as error:  # noqa: BLE001 - one bad upstream must not stop the others
        return _failed(row, f"{type(error).__name__}: {error}", now=now)
    # In name order: a server that lists in another order each time has not changed.
    entries = sorted((tool_entry(tool) for tool in listing.tools), key=lambda e: e["name"])
    changed = entries != row.listed_tools or listing.server != row.server_info
    fields: dict[str, Any] = {"checked_at": now, "list_error": ""}
    if changed:
        fields.update(
            listed_tools=entries, server_info=listing.server, listed_at=now, updated_at=now
        )
        row.listed_tools, row.server_info = entries, listing.server
    McpUpstream.objects.filter(pk=row.pk).update(**fields)
    names = [entry["name"] for entry in entries]
    tools = [f"{row.name}.{name}" for name in names]
    return Listed(
        upstream=row.name,
        tools=tools,
        changed=changed,
        unknown_entries=sorted(set(row.tool_settings) - set(names)),
        taken=taken_names(tools),
    )


def _failed(row: McpUpstream, message: str, *, now: Any) -> Listed:
    message = message[:2000]
    McpUpstream.objects.filter(pk=row.pk).update(checked_at=now, list_error=message)
    return Listed(upstream=row.name, error=message)


def due(row: McpUpstream, *, now: Any) -> bool:
    """Whether the sweeper should list `row` now: always, unless its last attempt failed,
    then after a pause that grows with how long it has been failing."""
    if row.checked_at is None or not row.list_error:
        return True
    if gateway().tools_changed(row.name):
        return True
    # Failing since it was last listed, or (never listed) since it was loaded or edited.
    since_listed = (row.checked_at - (row.listed_at or row.updated_at)).total_seconds()
    pause = min(MAX_PAUSE_SECONDS, max(settings.EXECUTOR_SWEEP_SECONDS, since_listed))
    return now >= row.checked_at + timedelta(seconds=pause)


def upstreams_list_due() -> list[Listed]:
    """Lists every upstream that is due (the sweeper's call)."""
    now = timezone.now()
    return [upstream_list(row) for row in McpUpstream.objects.all() if due(row, now=now)]


def upstreams_warm() -> int:
    """Opens this process's sessions with every upstream in the background (a worker
    process's start); returns how many it began to open."""
    targets = []
    for row in McpUpstream.objects.all():
        try:
            target = row_target(row)
        except MissingVariable:
            continue
        if not reach_refusal(target):
            targets.append(target)
    gateway().warm(targets)
    return len(targets)
