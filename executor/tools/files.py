"""A tools file, as `manage.py load_tools FILE.toml` reads it: `[[tool]]` tables (HTTP tools,
API.md "Your own tools"), `[[upstream]]` tables (MCP servers behind Stepward, "MCP gateway")
and `[[rule]]` tables (approval rules), unchecked: `tools.http.spec_errors`,
`gateway.config.upstream_errors` and `executor.services.rules.rules_check` check each table.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from executor.tools.http import ENV_PLACEHOLDER

KINDS = {"tool": "tools", "upstream": "upstreams", "rule": "rules"}


class ToolFileError(ValueError):
    """A tools file that cannot be read; the message names the file."""


@dataclass(frozen=True)
class ToolFile:
    path: Path
    tools: list[dict[str, Any]]
    upstreams: list[dict[str, Any]]
    # Approval rules (API.md "Approval rules"): checked by executor.services.rules.
    rules: list[dict[str, Any]]


def read_tool_file(path: Path) -> ToolFile:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as error:
        raise ToolFileError(f"{path}: {error.strerror or error}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ToolFileError(f"{path}: not TOML: {error}") from None
    unknown = sorted(set(data) - set(KINDS))
    if unknown:
        raise ToolFileError(
            f"{path}: unknown table(s) {', '.join(unknown)}; "
            "expected [[tool]], [[upstream]] or [[rule]]"
        )
    found: dict[str, list[dict[str, Any]]] = {}
    for kind in KINDS:
        tables = data.get(kind, [])
        if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
            raise ToolFileError(f"{path}: every {kind} must be a [[{kind}]] table")
        found[kind] = tables
    if not any(found.values()):
        raise ToolFileError(f"{path}: no [[tool]], [[upstream]] or [[rule]] tables")
    return ToolFile(
        path=path, tools=found["tool"], upstreams=found["upstream"], rules=found["rule"]
    )


# Where a table may read `${NAME}`: an HTTP tool's URLs and header values; an upstream's
# command, folder, environment, URL and header values.
PLACES = {
    "tool": ("url", "lookup_url", "headers"),
    "upstream": ("command", "cwd", "env", "url", "headers"),
}


def unset_variables(file: ToolFile, environ: Mapping[str, str]) -> list[str]:
    """Each `${NAME}` the file's tables read that `environ` does not set, as a sentence
    naming the variable, the tool or upstream and the field."""
    problems: list[str] = []
    for kind, tables in (("tool", file.tools), ("upstream", file.upstreams)):
        for table in tables:
            name = table.get("name") if isinstance(table.get("name"), str) else "(unnamed)"
            for field in PLACES[kind]:
                for variable in ENV_PLACEHOLDER.findall(_text(table.get(field))):
                    problem = (
                        f"{kind} {name}: ${{{variable}}} (in {field!r}) is not set in this "
                        "environment"
                    )
                    if variable not in environ and problem not in problems:
                        problems.append(problem)
    return problems


def _text(value: Any) -> str:
    """A field's strings, joined: a table's values, a list's items, or the string."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return " ".join(str(item) for item in value)
    return value if isinstance(value, str) else ""
