"""Tools: the registry's records, HTTP tools loaded from files, approval policies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.db import transaction

from executor.contract.tool import ApprovalRule, all_tools
from executor.gateway import config as gateway_config
from executor.gateway import listing as upstream_listing
from executor.gateway import tools as upstream_tools
from executor.gateway.listing import Listed
from executor.ledger.records import (
    HttpToolSpec,
    McpUpstream,
    Tool,
    ToolPolicy,
    Workspace,
)
from executor.services.base import Invalid
from executor.tools import http as http_tools


def tools_sync(*, using: str = "default") -> None:
    """Mirrors the registry into the Tool table, so permissions can be granted per tool."""
    http_tools.refresh(force=True)
    upstream_tools.refresh(force=True)
    registered = set()
    for tool in all_tools():
        registered.add(tool.name)
        Tool.objects.using(using).update_or_create(
            name=tool.name,
            defaults={
                "effect": tool.effect,
                "idempotency": tool.idempotency,
                "requires_approval": tool.requires_approval,
                "compensation": tool.compensation,
                "has_lookup": tool.has_lookup(),
                "policy_version": tool.policy_version(),
                "registered": True,
                "max_in_flight": tool.max_in_flight,
                "rate": tool.rate,
            },
        )
    Tool.objects.using(using).exclude(name__in=registered).update(registered=False)


@dataclass
class ToolsLoaded:
    """What `tools_load` did (or, checking, would do), by name: HTTP tools and upstreams."""

    created: list[str]
    updated: list[str]
    unchanged: list[str]
    removed: list[str]
    upstreams_created: list[str] = field(default_factory=list)
    upstreams_updated: list[str] = field(default_factory=list)
    upstreams_unchanged: list[str] = field(default_factory=list)
    upstreams_removed: list[str] = field(default_factory=list)
    # What asking each loaded upstream for its tools found (when it was asked).
    listed: list[Listed] = field(default_factory=list)


def http_tools_load(
    *, tables: Sequence[dict[str, Any]], prune: bool = False, check: bool = False
) -> ToolsLoaded:
    """`tools_load` of a file that holds HTTP tools only."""
    return tools_load(tables=tables, prune=prune, check=check)


def tools_load(
    *,
    tables: Sequence[dict[str, Any]],
    upstreams: Sequence[dict[str, Any]] = (),
    prune: bool = False,
    check: bool = False,
    connect: bool = True,
) -> ToolsLoaded:
    """Creates or updates the HTTP tools ([[tool]]) and MCP upstreams ([[upstream]]) of a
    tools file, all or nothing.

    Every table is checked first (its fields, its hosts against EXECUTOR_HTTP_ALLOWED_HOSTS,
    its schema, its compensation): any problem raises Invalid listing every one, each naming
    the tool or upstream and the field, and nothing is written. `prune` removes the HTTP
    tools (when the file holds any) and the upstreams (when it holds any) that it does not
    name; `check` only says what loading would do. An edited tool or upstream gets a new
    policy version, so approvals of its earlier version no longer authorize anything. With
    `connect`, each loaded upstream is asked for its tools at once (from this process: a
    worker asks again at its next sweep, and where this process cannot reach it, that is
    said, not refused).
    """
    existing = {spec.name: spec for spec in HttpToolSpec.objects.all()}
    existing_upstreams = {row.name: row for row in McpUpstream.objects.all()}
    in_code = http_tools.python_tool_names()
    names = [t.get("name") for t in tables]
    upstream_names = [t.get("name") for t in upstreams]
    known = (
        in_code
        | set(existing)
        | {n for n in names if isinstance(n, str)}
        | upstream_tools.upstream_tool_names()
    )
    problems: list[str] = []
    for table in tables:
        problems += http_tools.spec_errors(table, tools=known)
        name = table.get("name")
        if name in in_code:
            problems.append(f"tool {name}: field 'name': a tool of that name is defined in code")
        elif name in upstream_tools.upstream_tool_names():
            problems.append(f"tool {name}: field 'name': an MCP upstream lists a tool of that name")
        if isinstance(name, str) and names.count(name) > 1:
            problems.append(f"tool {name}: field 'name': the file defines it more than once")
    for table in upstreams:
        problems += gateway_config.upstream_errors(table, tools=known)
        name = table.get("name")
        if isinstance(name, str) and upstream_names.count(name) > 1:
            problems.append(f"upstream {name}: field 'name': the file defines it more than once")
    if problems:
        raise Invalid(
            f"{len(problems)} problem(s); nothing was loaded", {"problems": sorted(set(problems))}
        )
    report = ToolsLoaded(created=[], updated=[], unchanged=[], removed=[])
    fresh = {spec.name: spec for spec in map(http_tools.spec_from_table, tables)}
    for name, spec in fresh.items():
        old = existing.get(name)
        if old is None:
            report.created.append(name)
        elif (
            http_tools.tool_class(old).policy_version()
            != http_tools.tool_class(spec).policy_version()
            or old.description != spec.description
        ):
            report.updated.append(name)
        else:
            report.unchanged.append(name)
    fresh_upstreams = {row.name: row for row in map(gateway_config.upstream_from_table, upstreams)}
    for name, row in fresh_upstreams.items():
        old_row = existing_upstreams.get(name)
        if old_row is None:
            report.upstreams_created.append(name)
        elif gateway_config.declared_fields(old_row) != gateway_config.declared_fields(row):
            report.upstreams_updated.append(name)
        else:
            report.upstreams_unchanged.append(name)
    # A file prunes the kinds it holds: one of HTTP tools leaves the upstreams alone, and
    # one of upstreams the HTTP tools.
    if prune and tables:
        report.removed = sorted(set(existing) - set(fresh))
    if prune and upstreams:
        report.upstreams_removed = sorted(set(existing_upstreams) - set(fresh_upstreams))
    for listed in (
        report.created,
        report.updated,
        report.unchanged,
        report.upstreams_created,
        report.upstreams_updated,
        report.upstreams_unchanged,
    ):
        listed.sort()
    if check:
        return report
    with transaction.atomic():
        for name in [*report.created, *report.updated]:
            spec = fresh[name]
            if name in existing:
                spec.pk = existing[name].pk
            spec.save()
        HttpToolSpec.objects.filter(name__in=report.removed).delete()
        for name in [*report.upstreams_created, *report.upstreams_updated]:
            row = fresh_upstreams[name]
            if name in existing_upstreams:
                # What its workers listed stays until they list it again.
                old_row = existing_upstreams[name]
                row.pk = old_row.pk
                row.listed_tools, row.server_info = old_row.listed_tools, old_row.server_info
                row.listed_at, row.checked_at = old_row.listed_at, old_row.checked_at
            row.save()
        McpUpstream.objects.filter(name__in=report.upstreams_removed).delete()
        tools_sync()
    if connect:
        for name in sorted(fresh_upstreams):
            report.listed.append(upstream_listing.upstream_list(McpUpstream.objects.get(name=name)))
        if any(found.changed for found in report.listed):
            tools_sync()
    return report


def upstreams_relist() -> list[Listed]:
    """Asks every upstream that is due for its tools and mirrors any change into the Tool
    table (the sweeper's call, after each pass)."""
    found = upstream_listing.upstreams_list_due()
    if any(listed.changed for listed in found):
        tools_sync()
    return found


def tool_policy_set(
    *,
    workspace: Workspace,
    tool: str,
    approval: str,
    destructive: bool = True,
    irreversible: bool = True,
    cost_above: Decimal | None = None,
) -> ToolPolicy | None:
    """Sets whether a person approves each call of `tool` in `workspace` (issue 11);
    `approval = "default"` removes the workspace's policy, so the tool's declaration holds.

    Approvals given under the earlier policy no longer authorize anything (their policy
    version changes). Returns the policy, or None for the default.
    """
    row = Tool.objects.filter(name=tool, registered=True).first()
    if row is None:
        raise Invalid(f"no such tool: {tool}", {"tool": tool})
    if approval == "default":
        ToolPolicy.objects.filter(workspace=workspace, tool=row).delete()
        return None
    if approval not in ApprovalRule.values:
        raise Invalid(
            f"approval must be default or one of {', '.join(ApprovalRule.values)}",
            {"approval": approval},
        )
    if cost_above is not None and cost_above < 0:
        raise Invalid("cost_above must not be negative", {"cost_above": str(cost_above)})
    found, _ = ToolPolicy.objects.update_or_create(
        workspace=workspace,
        tool=row,
        defaults={
            "approval": approval,
            "destructive": destructive,
            "irreversible": irreversible,
            "cost_above": cost_above,
        },
    )
    return found
