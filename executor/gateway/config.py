"""The `[[upstream]]` tables of a tools file, checked the way `load_tools` and admin check
them, and what each tool an upstream lists declares to the engine (API.md "MCP gateway").

Precedence, per declaration: the tool's own `[upstream.tools.X]` entry, then (with
`trust_annotations`) its MCP annotations, then the upstream's `defaults`, then Stepward's
own defaults (a write, not idempotent, approved by policy: irreversible writes need a
person). A tool its annotations call destructive needs a person unless its entry says not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from executor.contract.tool import (
    ApprovalRule,
    Effect,
    RetryPolicy,
    max_in_flight_problem,
    rate_problem,
    validator_class,
)
from executor.ledger.records import McpUpstream
from executor.tools import http as http_tools

NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
HEADER_NAME = http_tools.HEADER_NAME
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# An MCP tool's name as Stepward keeps it: `<upstream>.<tool>`, within a Tool row's 100.
MAX_TOOL_NAME = 100
IDEMPOTENCY = ("none", "idempotent")
DECLARED = ("effect", "idempotency", "approval")
MAX_TIMEOUT = 3600.0

# The fields of an [[upstream]] table: the TOML file's words, each with the row's field.
FIELDS = {
    "name": "name",
    "description": "description",
    "command": "command",
    "cwd": "cwd",
    "env": "env",
    "url": "url",
    "headers": "headers",
    "trust_annotations": "trust_annotations",
    "defaults": "defaults",
    "tools": "tool_settings",
    "timeout": "timeout_seconds",
    "concurrency": "concurrency",
}
MAX_CONCURRENCY = 64
# What an [upstream.tools.X] entry may say.
TOOL_FIELDS = (
    "description",
    "effect",
    "idempotency",
    "approval",
    "redact",
    "compensation",
    "retry",
    "timeout",
    "external_id",
    "external_id_from_text",
    "on_error",
    "max_in_flight",
    "rate",
)
# What an error answer the gateway cannot read means for a write: it failed (the default),
# or its effect is unknown (an upstream that may fail after acting).
ON_ERROR = ("failed", "unknown")


def upstream_errors(table: Mapping[str, Any], *, tools: Iterable[str] = ()) -> list[str]:
    """Everything wrong with one [[upstream]] table, each naming the upstream and the field;
    [] when it can be loaded. `tools` are the tool names that exist (for `compensation`)."""
    name = str(table["name"]) if isinstance(table.get("name"), str) else "(unnamed)"
    errors: list[str] = []

    def bad(where: str, problem: str) -> None:
        errors.append(f"upstream {name}: field {where!r}: {problem}")

    for word in table:
        if word not in FIELDS:
            bad(word, f"unknown field (known: {', '.join(sorted(FIELDS))})")
    if "name" not in table:
        bad("name", "is required")
    elif not isinstance(table["name"], str) or not NAME.fullmatch(table["name"]):
        bad("name", "must be one lower-case word (letters, digits, _), e.g. git")
    has_command, has_url = "command" in table, "url" in table
    if has_command == has_url:
        bad("command", "give exactly one of command (stdio) and url (streamable HTTP)")
    if has_command:
        command = table["command"]
        if (
            not isinstance(command, list)
            or not command
            or not all(isinstance(part, str) and part for part in command)
        ):
            bad(
                "command", 'must be a list of strings, e.g. ["mcp-server-git", "--repository", "."]'
            )
    if has_url:
        errors.extend(
            f"upstream {name}: field 'url': {problem}"
            for problem in http_tools.url_problems(table["url"])
        )
    for word, names, needs, kind, what in (
        ("headers", HEADER_NAME, has_url, "header names", "reached by url sends headers"),
        ("env", ENV_NAME, has_command, "variable names", "started by command has an environment"),
    ):
        if word not in table:
            continue
        if not needs:
            bad(word, f"only an upstream {what}")
        elif not _string_table(table[word], names):
            bad(word, f"must be a table of {kind} to strings")
    for word in ("description", "cwd"):
        if word in table and not isinstance(table[word], str):
            bad(word, "must be a string")
    if "trust_annotations" in table and not isinstance(table["trust_annotations"], bool):
        bad("trust_annotations", "must be true or false")
    concurrency = table.get("concurrency", 1)
    if (
        isinstance(concurrency, bool)
        or not isinstance(concurrency, int)
        or not 1 <= concurrency <= MAX_CONCURRENCY
    ):
        bad("concurrency", f"must be a whole number from 1 to {MAX_CONCURRENCY}")
    if "timeout" in table and not _seconds(table["timeout"]):
        bad("timeout", f"must be seconds, more than 0 and at most {MAX_TIMEOUT:g}")
    defaults = table.get("defaults", {})
    if not isinstance(defaults, dict):
        bad("defaults", "must be a table")
    else:
        for word in defaults:
            if word not in DECLARED:
                bad(f"defaults.{word}", f"unknown (known: {', '.join(DECLARED)})")
        errors.extend(
            f"upstream {name}: field 'defaults.{word}': {problem}"
            for word, problem in _declaration_problems(defaults)
        )
    entries = table.get("tools", {})
    if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
        bad("tools", "must hold one [upstream.tools.NAME] table per tool")
    else:
        known = set(tools)
        for tool, entry in entries.items():
            errors.extend(
                f"upstream {name}: field 'tools.{tool}{where}': {problem}"
                for where, problem in _tool_entry_problems(entry, name, known)
            )
    return errors


def _string_table(value: Any, names: re.Pattern[str]) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and names.fullmatch(k) and isinstance(v, str) for k, v in value.items()
    )


def _seconds(value: Any) -> bool:
    return (
        not isinstance(value, bool) and isinstance(value, int | float) and 0 < value <= MAX_TIMEOUT
    )


def _declaration_problems(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    choices: dict[str, list[str]] = {
        # Not `pure`: an upstream is another system, and pure calls run in the claiming
        # thread one after the other.
        "effect": [str(Effect.READ), str(Effect.WRITE), str(Effect.DESTRUCTIVE)],
        "idempotency": list(IDEMPOTENCY),
        "approval": list(ApprovalRule.values),
    }
    return [
        (word, f"must be one of {', '.join(allowed)}")
        for word, allowed in choices.items()
        if word in values and values[word] not in allowed
    ]


def _tool_entry_problems(
    entry: Mapping[str, Any], upstream: str, known: set[str]
) -> list[tuple[str, str]]:
    problems = [(f".{word}", problem) for word, problem in _declaration_problems(entry)]
    for word in entry:
        if word not in TOOL_FIELDS:
            problems.append((f".{word}", f"unknown field (known: {', '.join(TOOL_FIELDS)})"))
    for word in ("description", "external_id", "compensation"):
        if word in entry and not isinstance(entry[word], str):
            problems.append((f".{word}", "must be a string"))
    redact = entry.get("redact", [])
    if not isinstance(redact, list) or not all(isinstance(f, str) for f in redact):
        problems.append((".redact", "must be a list of input field names"))
    retry = entry.get("retry", {})
    if not isinstance(retry, dict) or set(retry) - http_tools.RETRY_FIELDS:
        problems.append((".retry", f"takes only {', '.join(sorted(http_tools.RETRY_FIELDS))}"))
    else:
        try:
            RetryPolicy(**retry)
        except (TypeError, ValueError) as error:
            problems.append((".retry", str(error)))
    if "on_error" in entry and entry["on_error"] not in ON_ERROR:
        problems.append((".on_error", f"must be one of {', '.join(ON_ERROR)}"))
    pattern = entry.get("external_id_from_text")
    if pattern is not None:
        try:
            if not isinstance(pattern, str) or re.compile(pattern).groups != 1:
                problems.append(
                    (".external_id_from_text", "must be a regular expression with one group")
                )
        except re.error as error:
            problems.append((".external_id_from_text", f"is not a regular expression: {error}"))
    if "max_in_flight" in entry and max_in_flight_problem(entry["max_in_flight"]):
        problems.append((".max_in_flight", max_in_flight_problem(entry["max_in_flight"])))
    if "rate" in entry and rate_problem(entry["rate"]):
        problems.append((".rate", rate_problem(entry["rate"])))
    if "timeout" in entry and not _seconds(entry["timeout"]):
        problems.append((".timeout", f"must be seconds, more than 0 and at most {MAX_TIMEOUT:g}"))
    compensation = entry.get("compensation", "")
    if (
        isinstance(compensation, str)
        and compensation
        and compensation not in known
        and not compensation.startswith(f"{upstream}.")
    ):
        problems.append(
            (".compensation", f"names no tool: {compensation!r} (nor one of {upstream}.*)")
        )
    return problems


def upstream_from_table(table: Mapping[str, Any]) -> McpUpstream:
    """An unsaved McpUpstream from a checked [[upstream]] table."""
    return McpUpstream(**{FIELDS[word]: value for word, value in table.items()})


def declared_fields(row: McpUpstream) -> dict[str, Any]:
    """What the operator declared of an upstream (not what its workers saw): a change to
    any of it is a change of every one of its tools."""
    return {
        "command": row.command,
        "cwd": row.cwd,
        "env": row.env,
        "url": row.url,
        "headers": row.headers,
        "trust_annotations": row.trust_annotations,
        "defaults": row.defaults,
        "tools": row.tool_settings,
        "timeout": row.timeout_seconds,
        "concurrency": row.concurrency,
        "description": row.description,
    }


# --- what a listed tool declares -----------------------------------------------------------


@dataclass(frozen=True)
class Declared:
    """One upstream tool's declarations, as the engine obeys them."""

    effect: Effect
    # A repeat after a lost answer does no more than the first call did.
    idempotent: bool
    approval: ApprovalRule
    description: str = ""
    redact: frozenset[str] = frozenset()
    compensation: str = ""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    timeout_seconds: float = 60.0
    # Which field of the structured result names the effect, or a pattern whose one group
    # finds it in the result's text (e.g. a commit's hash).
    external_id: str = ""
    external_id_from_text: str = ""
    # "unknown": an error answer it cannot read leaves a write's effect unknown (a person).
    on_error: str = "failed"
    # Limits across every worker (API.md "Slow tools").
    max_in_flight: int | None = None
    rate: str = ""
    # Where each declaration came from ("tools", "annotations", "defaults", "stepward").
    sources: tuple[tuple[str, str], ...] = ()


def declarations(row: McpUpstream, listed: Mapping[str, Any]) -> Declared:
    """What the tool `listed` (an entry of `row.listed_tools`) declares."""
    entry = row.tool_settings.get(listed["name"], {})
    hints = _hinted(listed.get("annotations") or {}) if row.trust_annotations else {}
    sources: list[tuple[str, str]] = []

    def pick(word: str, fallback: str) -> str:
        for source, values in (
            ("tools", entry),
            ("annotations", hints),
            ("defaults", row.defaults),
        ):
            if word in values:
                sources.append((word, source))
                return str(values[word])
        sources.append((word, "stepward"))
        return fallback

    effect = Effect(pick("effect", Effect.WRITE))
    idempotent = pick("idempotency", "none") == "idempotent"
    if effect == Effect.DESTRUCTIVE and "approval" not in entry:
        approval = ApprovalRule.ALWAYS
        sources.append(("approval", "destructive"))
    else:
        approval = ApprovalRule(pick("approval", ApprovalRule.BY_POLICY))
    return Declared(
        effect=effect,
        idempotent=idempotent,
        approval=approval,
        description=str(entry.get("description") or listed.get("description") or ""),
        redact=frozenset(entry.get("redact", ())),
        compensation=str(entry.get("compensation", "")),
        retry=RetryPolicy(**entry["retry"]) if entry.get("retry") else RetryPolicy(),
        timeout_seconds=float(entry.get("timeout", row.timeout_seconds)),
        external_id=str(entry.get("external_id", "")),
        external_id_from_text=str(entry.get("external_id_from_text", "")),
        on_error=str(entry.get("on_error", "failed")),
        max_in_flight=entry.get("max_in_flight"),
        rate=str(entry.get("rate", "")),
        sources=tuple(sources),
    )


def _hinted(annotations: Mapping[str, Any]) -> dict[str, str]:
    """The declarations MCP tool annotations make, where they say something explicitly
    (the specification's defaults, e.g. destructiveHint true, are not taken as said)."""
    hinted: dict[str, str] = {}
    if annotations.get("readOnlyHint") is True:
        hinted["effect"] = Effect.READ
    elif annotations.get("destructiveHint") is True:
        hinted["effect"] = Effect.DESTRUCTIVE
    elif annotations.get("readOnlyHint") is False and annotations.get("destructiveHint") is False:
        hinted["effect"] = Effect.WRITE
    if annotations.get("idempotentHint") is True:
        hinted["idempotency"] = "idempotent"
    elif annotations.get("idempotentHint") is False:
        hinted["idempotency"] = "none"
    return hinted


def schema_problem(schema: Any) -> str:
    """Why an upstream's input schema cannot be a Stepward tool's; "" when it can."""
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        return "its input schema does not describe an object"
    try:
        validator_class(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        return f"its input schema is not a JSON schema: {error.message}"
    return ""
