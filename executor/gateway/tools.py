"""Each tool an upstream lists, as a Stepward tool `<upstream>.<tool>` (API.md "MCP
gateway"): registered in every process from the McpUpstream rows (refreshed like HTTP tools,
within EXECUTOR_TOOL_REFRESH_SECONDS of a change), called by the worker through this
process's session with the upstream, and what comes back classified (DESIGN.md §8).

The engine does the rest exactly as for any tool: the pending record and the `submitting`
mark come first, a lost answer of a write that is not idempotent is `unknown`, approvals,
budgets, fencing, redaction and the drill's fault points apply.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import mcp_types as types
from mcp.shared.exceptions import MCPError

from executor.common.redaction import scrub, scrub_strings
from executor.contract.tool import (
    RETRYABLE,
    FailureClass,
    Idempotency,
    Invocation,
    RegistrationError,
    Tool,
    ToolError,
    ToolResult,
    add_source,
    check_declarations,
    install,
    registered,
    uninstall,
)
from executor.gateway import config
from executor.gateway.connections import AnswerLost, Target, Unreachable, gateway
from executor.ledger.records import McpUpstream
from executor.tools import http as http_tools
from executor.tools import outbound
from executor.tools.rows import RowSource

logger = logging.getLogger(__name__)

# What a result keeps of an upstream's text (a file read whole, a long log): the rest is cut.
MAX_TEXT_CHARS = 256 * 1024
MESSAGE_CHARS = 1000

# An error result's text, read for what it says (first match wins). Anything else an
# upstream calls an error is not retried unless a repeat is safe.
ERROR_WORDS: tuple[tuple[FailureClass, re.Pattern[str]], ...] = (
    # A timeout inside the upstream: the work may have been done before it gave up.
    (FailureClass.AMBIGUOUS, re.compile(r"timed? ?out|timeout|deadline exceeded", re.IGNORECASE)),
    (
        FailureClass.RATE_LIMITED,
        re.compile(r"rate.?limit|too many requests", re.IGNORECASE),
    ),
    (
        FailureClass.PERMISSION_DENIED,
        re.compile(
            r"access denied|permission denied|not permitted|forbidden|unauthori[sz]ed|"
            r"outside (the )?allowed|\bEACCES\b|\bEPERM\b",
            re.IGNORECASE,
        ),
    ),
    (
        FailureClass.INVALID_INPUT,
        re.compile(
            r"validation error|invalid (argument|input|param)|input validation|"
            r"field required|is required|missing required|-32602|unknown tool",
            re.IGNORECASE,
        ),
    ),
)
PROTOCOL_INVALID = frozenset(
    {types.INVALID_PARAMS, types.METHOD_NOT_FOUND, types.INVALID_REQUEST, types.PARSE_ERROR}
)


class MissingVariable(Exception):
    pass


def target_for(upstream: str, fields: Mapping[str, Any]) -> Target:
    """How this process reaches the upstream, `${NAME}` read from its environment now."""
    secrets: set[str] = set()

    def rendered(text: str) -> str:
        try:
            return http_tools.render_env(text, secrets=secrets)
        except KeyError as missing:
            raise MissingVariable(
                f"${{{missing.args[0]}}} is not set in this worker's environment"
            ) from None

    return Target(
        name=upstream,
        command=tuple(rendered(part) for part in fields["command"]),
        cwd=rendered(fields["cwd"]),
        env=tuple(sorted((k, rendered(v)) for k, v in fields["env"].items())),
        url=rendered(fields["url"]),
        headers=tuple(sorted((k, rendered(v)) for k, v in fields["headers"].items())),
        secrets=frozenset(secrets),
        concurrency=fields.get("concurrency") or (8 if fields["url"] else 1),
    )


def row_target(row: McpUpstream) -> Target:
    return target_for(row.name, _reach(row))


def reach_refusal(target: Target) -> str:
    """Why this process may not reach an upstream by its URL now (its host no longer in
    EXECUTOR_HTTP_ALLOWED_HOSTS), or "" when it may: checked before every connection."""
    if not target.url:
        return ""
    refused = outbound.refusal(target.url)
    return f"upstream {target.name}: {scrub(refused, target.secrets)}" if refused else ""


def _reach(row: McpUpstream) -> dict[str, Any]:
    return {
        "command": list(row.command),
        "cwd": row.cwd,
        "env": dict(row.env),
        "url": row.url,
        "headers": dict(row.headers),
        "concurrency": row.concurrency,
    }


# --- the tool --------------------------------------------------------------------------------


# What a call to an upstream may raise besides an answer (`UpstreamTool._failure` maps them).
CALL_ERRORS = (Unreachable, AnswerLost, MCPError)


class UpstreamTool(Tool):
    """A tool an upstream lists; `tool_class` sets the declarations."""

    defined_by = "upstream"
    upstream: ClassVar[str]
    remote_name: ClassVar[str]
    reach: ClassVar[dict[str, Any]]
    declared: ClassVar[config.Declared]
    upstream_policy: ClassVar[dict[str, Any]]

    @classmethod
    def declared_extra(cls) -> dict[str, Any]:
        return {"upstream": cls.upstream, "remote": cls.remote_name, **cls.upstream_policy}

    @classmethod
    def request_details(cls) -> dict[str, Any]:
        reached = cls.reach["url"] or " ".join(cls.reach["command"])
        return {"upstream": cls.upstream, "upstream_tool": cls.remote_name, "reached": reached}

    @classmethod
    def safe_to_repeat(cls) -> bool:
        return cls.effect in ("pure", "read") or cls.idempotency == Idempotency.KEY

    def invoke(self, call: Invocation) -> ToolResult:
        target, request = self._request(call)
        try:
            result, server = gateway().call(target, self.remote_name, call.input, **request)
        except CALL_ERRORS as error:
            raise self._failure(error, target) from None
        return self._answer(result, server, target)

    async def ainvoke(self, call: Invocation) -> ToolResult:
        """`invoke` awaited on the worker's call loop (DESIGN.md §16): the session's own loop
        does the call; no thread waits for it."""
        target, request = self._request(call)
        try:
            result, server = await gateway().acall(target, self.remote_name, call.input, **request)
        except CALL_ERRORS as error:
            raise self._failure(error, target) from None
        return self._answer(result, server, target)

    def _request(self, call: Invocation) -> tuple[Target, dict[str, Any]]:
        """Where the call goes, and its timeout and meta."""
        target, meta = self._target(call)
        return target, {"timeout": self.declared.timeout_seconds, "meta": meta}

    def _target(self, call: Invocation) -> tuple[Target, dict[str, Any]]:
        try:
            target = target_for(self.upstream, self.reach)
        except MissingVariable as missing:
            raise ToolError(FailureClass.UNAVAILABLE, str(missing)) from None
        refused = reach_refusal(target)
        if refused:
            raise ToolError(FailureClass.POLICY_DENIED, refused)
        meta = {
            "stepward/operation_id": call.operation_id,
            "stepward/step_id": call.step_id,
            "stepward/fence": call.fence,
        }
        return target, meta

    def _failure(self, error: Exception, target: Target) -> ToolError:
        if isinstance(error, Unreachable):
            return ToolError(
                FailureClass.UNAVAILABLE,
                scrub(f"nothing was sent: {error}", target.secrets),
                evidence=scrub_strings(error.evidence, target.secrets),
            )
        if isinstance(error, AnswerLost):
            # Sent, and no reliable answer: it may have taken effect. The engine repeats it
            # only where that is safe, and otherwise hands it to a person (§7).
            return ToolError(
                FailureClass.AMBIGUOUS,
                scrub(str(error), target.secrets),
                evidence=scrub_strings(error.evidence, target.secrets),
            )
        assert isinstance(error, MCPError)
        return self._protocol_error(error, target)

    def _answer(
        self, result: types.CallToolResult, server: dict[str, Any], target: Target
    ) -> ToolResult:
        body = scrub_strings(result_body(result), target.secrets)
        evidence = {**server, "tool": self.remote_name, "is_error": bool(result.is_error)}
        if result.is_error:
            text = str(body.get("text", ""))
            failure = classify_error_text(text, safe=self.safe_to_repeat())
            if failure == FailureClass.CONFLICT and self.declared.on_error == "unknown":
                failure = FailureClass.AMBIGUOUS
            raise ToolError(
                failure,
                f"upstream {self.upstream} answered {self.remote_name} with an error: "
                f"{text[:MESSAGE_CHARS]}",
                evidence={**evidence, "answer": _cut(text, 4000)},
            )
        return ToolResult(result=body, external_id=self._external_id(body), evidence=evidence)

    def _external_id(self, body: dict[str, Any]) -> str:
        """The id of the effect, where the tool's entry says how to find it."""
        structured = body.get("structured")
        if self.declared.external_id and isinstance(structured, dict):
            return str(structured.get(self.declared.external_id, "") or "")[:200]
        if self.declared.external_id_from_text:
            found = re.search(self.declared.external_id_from_text, str(body.get("text", "")))
            return found.group(1)[:200] if found else ""
        return ""

    def _protocol_error(self, error: MCPError, target: Target) -> ToolError:
        """An error the upstream answered at the protocol level (JSON-RPC)."""
        code, message = error.error.code, scrub(error.error.message, target.secrets)
        evidence = {"upstream": self.upstream, "tool": self.remote_name, "code": code}
        text = f"upstream {self.upstream} refused {self.remote_name} ({code}): {message}"
        if code in PROTOCOL_INVALID:
            return ToolError(FailureClass.INVALID_INPUT, text, evidence=evidence)
        # Anything else (an internal error…) may have come after part of the work.
        return ToolError(FailureClass.AMBIGUOUS, text, evidence=evidence)

    def compensation_input_for(
        self, input: dict[str, Any], external_id: str, result: Any
    ) -> dict[str, Any]:
        # An upstream tool's undo is called with the arguments of the call it undoes (a
        # branch created is deleted by its name).
        return dict(input)


def classify_error_text(text: str, *, safe: bool) -> FailureClass:
    """The failure class of an error an upstream answered (`isError`), by what it says.

    Only a tool safe to repeat is retried on the strength of a text: words are no proof
    that a write did nothing (an upstream may act, then say "rate limit"), so for one that
    is not, what would be retried is not."""
    for failure, words in ERROR_WORDS:
        if words.search(text):
            if failure in RETRYABLE and not safe:
                return FailureClass.CONFLICT
            return failure
    # It answered, so it did not simply fail to arrive; whether anything happened first is
    # the upstream's business: retried only where a repeat is safe.
    return FailureClass.TRANSIENT if safe else FailureClass.CONFLICT


def result_body(result: types.CallToolResult) -> dict[str, Any]:
    """What a step keeps of a tool result: its text, its structured content, and what other
    content it held (named, not copied: images and blobs stay with the upstream)."""
    texts: list[str] = []
    other: list[dict[str, Any]] = []
    for block in result.content:
        if isinstance(block, types.TextContent):
            texts.append(block.text)
        else:
            described: dict[str, Any] = {"type": block.type}
            for name in ("mime_type", "uri", "name"):
                value = getattr(block, name, None)
                if value is None and hasattr(block, "resource"):
                    value = getattr(block.resource, name, None)
                if value is not None:
                    described[name] = str(value)
            other.append(described)
    body: dict[str, Any] = {}
    if texts:
        body["text"] = _cut("\n".join(texts), MAX_TEXT_CHARS)
    if result.structured_content is not None:
        structured = json.dumps(result.structured_content, default=str)
        if len(structured) > MAX_TEXT_CHARS:
            body["structured_cut"] = f"{len(structured)} characters, not kept"
        else:
            body["structured"] = result.structured_content
    if other:
        body["other_content"] = other
    return storable(body)


def storable(value: Any) -> Any:
    """`value` with every NUL character replaced (a binary file read as text): PostgreSQL's
    jsonb refuses them, and the result must be stored."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [storable(v) for v in value]
    return value


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"… [{len(text) - limit} more characters]"


def tool_class(row: McpUpstream, listed: Mapping[str, Any]) -> type[UpstreamTool]:
    """The Tool subclass of one listed tool, checked like any tool."""
    name = f"{row.name}.{listed['name']}"
    if len(name) > config.MAX_TOOL_NAME:
        raise RegistrationError(f"{name[:60]}…: names longer than {config.MAX_TOOL_NAME}")
    problem = config.schema_problem(listed.get("input_schema"))
    if problem:
        raise RegistrationError(f"{name}: {problem}")
    declared = config.declarations(row, listed)
    schema = {"type": "object", **dict(listed.get("input_schema") or {})}
    attributes = {
        "__module__": __name__,
        "upstream": row.name,
        "remote_name": listed["name"],
        "reach": _reach(row),
        "declared": declared,
        "upstream_policy": {
            **config.declared_fields(row),
            "annotations": listed.get("annotations") or {},
        },
        "name": name,
        "description": declared.description,
        "effect": declared.effect,
        "idempotency": Idempotency.KEY if declared.idempotent else Idempotency.NONE,
        "requires_approval": declared.approval,
        "compensation": declared.compensation,
        "retry": declared.retry,
        "input_schema": schema,
        "redact": declared.redact,
        "max_in_flight": declared.max_in_flight,
        "rate": declared.rate,
    }
    cls = type(f"UpstreamTool_{re.sub(r'\W', '_', name)}", (UpstreamTool,), attributes)
    check_declarations(cls)
    return cls


# --- registration ------------------------------------------------------------------------------

_mine: set[str] = set()


def refresh(*, force: bool = False) -> None:
    """Registers the upstreams' tools as the database lists them now, when that changed
    (asked at most every EXECUTOR_TOOL_REFRESH_SECONDS unless forced)."""
    _rows.refresh(force=force)


def _install(rows: list[McpUpstream]) -> None:
    """Registers each listed tool, replacing in one step what changed (a reader never finds
    a name empty); a tool of code or an HTTP tool keeps a name it shares (PRECEDENCE)."""
    wanted: dict[str, type[UpstreamTool]] = {}
    for row in rows:
        for listed in row.listed_tools:
            try:
                cls = tool_class(row, listed)
            except (RegistrationError, KeyError, TypeError, ValueError) as error:
                logger.warning("gateway: upstream %s: tool not registered: %s", row.name, error)
                continue
            wanted[cls.name] = cls
    for name in _mine - set(wanted):
        uninstall(name, UpstreamTool.defined_by)
    _mine.intersection_update(wanted)
    for name, cls in wanted.items():
        current = registered(name)
        if isinstance(current, UpstreamTool) and _same(type(current), cls):
            continue
        if install(cls):
            _mine.add(name)
        else:
            logger.warning("gateway: %s is another tool's name; not registered", name)


def _same(registered_class: type[UpstreamTool], cls: type[UpstreamTool]) -> bool:
    return (
        registered_class.policy_version() == cls.policy_version()
        and registered_class.description == cls.description
        and registered_class.reach == cls.reach
    )


def taken_names(names: list[str]) -> list[str]:
    """Which of these tool names a tool of code or an HTTP tool holds (they keep them)."""
    taken = []
    for name in names:
        tool = registered(name)
        if tool is not None and tool.defined_by != UpstreamTool.defined_by:
            taken.append(name)
    return taken


def upstream_tool_names() -> set[str]:
    return set(_mine)


_rows = RowSource(McpUpstream, _install)
add_source(refresh)
