"""HTTP tools from a TOML file in the drill (`drill --tools-file FILE [--tools a,b]`).

The file is read and its choice checked before the drill writes anything (`read_tools_file`,
`check_loadable`); once the drill's desk is up, its tools are loaded into the drill's own
database with `url` and `lookup_url` pointed at that desk (`load`). Every `${NAME}` that
the file's headers read gets a throwaway value in the workers' environment, never the
caller's own, and the drill checks that none of those values reaches the ledger.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import jsonschema
from django.conf import settings

from executor.drill.config import DrillError
from executor.ledger.records import Attempt, Event, Run, Step
from executor.services.base import Invalid
from executor.services.tools import ToolsLoaded, http_tools_load
from executor.tools import http as http_tools
from executor.tools.files import ToolFileError, read_tool_file

# What the drill posts to every desk write, the built-in ones and the file's alike.
DRILL_INPUT: dict[str, Any] = {"title": "drill ticket 0", "body": "recovery drill"}
URL_FIELDS = ("url", "lookup_url")
# Where the file's tools point while they are checked, before the desk is up.
PLACEHOLDER_DESK = "http://127.0.0.1:9"


@dataclass
class ToolsFile:
    path: Path
    tables: list[dict[str, Any]]
    # The file's tools the drill posts steps to (its other tools run as compensations).
    chosen: list[str]
    # Each `${NAME}` its headers read, with the throwaway value the workers get.
    secrets: dict[str, str]

    def compensations(self) -> dict[str, str]:
        """Each chosen tool that names a compensation, with that compensation's name."""
        return {
            table["name"]: table["compensation"]
            for table in self.tables
            if table.get("name") in self.chosen and table.get("compensation")
        }


def read_tools_file(path: str, tools: str = "") -> ToolsFile:
    """The file and the tools of it the drill posts: `tools` (comma-separated) or, when
    empty, every write tool of the file that is no other tool's compensation."""
    file = Path(path).resolve()
    try:
        tables = read_tool_file(file).tools
    except ToolFileError as error:
        raise DrillError(f"--tools-file {error}") from None
    if not tables:
        raise DrillError(f"--tools-file {file}: no [[tool]] tables (the drill runs HTTP tools)")
    by_name = {t["name"]: t for t in tables if isinstance(t.get("name"), str)}
    undoes = {
        t["compensation"]: name
        for name, t in by_name.items()
        if isinstance(t.get("compensation"), str) and t["compensation"]
    }
    problems: list[str] = []
    for name, table in by_name.items():
        for field in URL_FIELDS:
            if "${" in str(table.get(field, "")):
                problems.append(
                    f"tool {name}: field {field!r}: the drill points it at its own desk and "
                    "cannot rewrite a ${NAME} in it"
                )
    named = [part.strip() for part in tools.split(",") if part.strip()]
    chosen = named or [
        name for name, t in by_name.items() if t.get("effect") == "write" and name not in undoes
    ]
    for name in named:
        if name not in by_name:
            problems.append(
                f"--tools: {file.name} has no tool named {name!r} "
                f"(it has {', '.join(by_name) or 'none'})"
            )
        elif name in undoes:
            problems.append(
                f"--tools: {name} is the compensation of {undoes[name]}: the drill runs it "
                "only to undo that tool's steps"
            )
        elif by_name[name].get("effect") != "write":
            problems.append(
                f"--tools: {name} is a {by_name[name].get('effect')!s} tool; the drill posts "
                "writes to its desk and checks their tickets"
            )
    for name in chosen:
        if by_name.get(name, {}).get("approval") == "always":
            problems.append(
                f"--tools: {name} waits for a person to approve each call "
                '(approval = "always"); the drill posts tools that run unattended'
            )
        refusal = _input_refused(by_name.get(name, {}))
        if refusal:
            problems.append(
                f"--tools: {name}'s input_schema refuses the drill's input "
                f"{json.dumps(DRILL_INPUT)}: {refusal}"
            )
    if len(set(named)) != len(named):
        problems.append("--tools: a tool is named twice")
    if not chosen:
        problems.append(f"--tools-file {file}: no write tool for the drill to post")
    if problems:
        raise DrillError("\n".join(problems))
    names = set()
    for table in tables:
        headers = table.get("headers", {})
        if isinstance(headers, dict):
            for value in headers.values():
                names.update(http_tools.ENV_PLACEHOLDER.findall(str(value)))
    return ToolsFile(
        path=file,
        tables=tables,
        chosen=chosen,
        secrets={name: f"drill-secret-{secrets.token_hex(12)}" for name in sorted(names)},
    )


def _input_refused(table: dict[str, Any]) -> str:
    schema = table.get("input_schema", {"type": "object"})
    try:
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(schema).iter_errors(DRILL_INPUT)
        )
    except (jsonschema.SchemaError, TypeError, AttributeError):
        return ""  # load_tools' own check names what is wrong with the schema
    return error.message if error is not None else ""


def at_desk(tables: list[dict[str, Any]], desk_url: str) -> list[dict[str, Any]]:
    """The tables with the scheme, host and port of `url` and `lookup_url` the desk's."""
    desk = urlsplit(desk_url)
    moved = []
    for table in tables:
        table = dict(table)
        for field in URL_FIELDS:
            if isinstance(table.get(field), str):
                parts = urlsplit(table[field])
                table[field] = urlunsplit(parts._replace(scheme=desk.scheme, netloc=desk.netloc))
        moved.append(table)
    return moved


@contextmanager
def allowing(desk_url: str) -> Iterator[None]:
    """The desk's host in this process's EXECUTOR_HTTP_ALLOWED_HOSTS for a while: the
    tools are checked against it when they are loaded."""
    before = settings.EXECUTOR_HTTP_ALLOWED_HOSTS
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = [*before, urlsplit(desk_url).netloc]
    try:
        yield
    finally:
        settings.EXECUTOR_HTTP_ALLOWED_HOSTS = before


def _load(tools: ToolsFile, desk_url: str, *, check: bool) -> ToolsLoaded:
    with allowing(desk_url):
        try:
            return http_tools_load(tables=at_desk(tools.tables, desk_url), check=check)
        except Invalid as error:
            problems = (error.details or {}).get("problems", [])
            raise DrillError(
                "\n".join([f"--tools-file {tools.path}: {error.message}", *problems])
            ) from None


def check_loadable(tools: ToolsFile) -> None:
    """Refuses a file that `load_tools` would refuse; writes nothing."""
    _load(tools, PLACEHOLDER_DESK, check=True)


def load(tools: ToolsFile, desk_url: str) -> ToolsLoaded:
    """Loads the file's tools into this database, pointed at the desk at `desk_url`."""
    return _load(tools, desk_url, check=False)


def secret_leaks(run: Run, values: dict[str, str]) -> list[str]:
    """Where a throwaway secret's value appears in the ledger of `run`: a step's input,
    result or failure, an attempt's evidence or error, an event's data or reason."""
    if not values:
        return []
    found: list[str] = []
    rows: list[tuple[str, Any]] = []
    for step in Step.objects.filter(run=run).values(
        "key", "input", "result", "external_id", "failure_message"
    ):
        rows.append((f"step {step['key']}", step))
    for attempt in Attempt.objects.filter(step__run=run).values(
        "step__key", "number", "request_evidence", "response_evidence", "error_message"
    ):
        rows.append((f"step {attempt['step__key']} attempt {attempt['number']}", attempt))
    for event in Event.objects.filter(run=run).values("step__key", "seq", "reason", "data"):
        rows.append((f"step {event['step__key']} event {event['seq']}", event))
    for where, row in rows:
        text = json.dumps(row, default=str)
        for name, value in values.items():
            if value in text:
                found.append(f"§15 the value of ${{{name}}} appears in the ledger: {where}")
    return found
