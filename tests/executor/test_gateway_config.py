"""The [[upstream]] tables and what an upstream's tools declare, without a process (API.md
"MCP gateway"); the real upstreams are in tests/executor/test_gateway.py."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
from django.utils import timezone

from executor.contract.tool import (
    ApprovalRule,
    Effect,
    FailureClass,
    RegistrationError,
    find_tool,
    install,
    uninstall,
)
from executor.gateway import config
from executor.gateway.listing import due
from executor.gateway.tools import MAX_TEXT_CHARS, classify_error_text, result_body, tool_class
from executor.ledger.records import HttpToolSpec, McpUpstream
from executor.services import base
from executor.services.tools import tools_load
from executor.tools.files import ToolFileError, read_tool_file
from executor.tools.http import tool_class as http_tool_class

GIT = {"name": "git", "command": ["mcp-server-git", "--repository", "/srv/repo"]}
COMMIT = {
    "name": "git_commit",
    "description": "Records changes",
    "input_schema": {"type": "object", "properties": {"message": {"type": "string"}}},
    "annotations": {"readOnlyHint": False, "destructiveHint": False, "idempotentHint": False},
}
RESET = {
    "name": "git_reset",
    "input_schema": {"type": "object"},
    "annotations": {"readOnlyHint": False, "destructiveHint": True, "idempotentHint": True},
}
STATUS = {
    "name": "git_status",
    "input_schema": {"type": "object"},
    "annotations": {"readOnlyHint": True, "idempotentHint": True},
}


def problems(**changes: Any) -> list[str]:
    table = {**GIT, **changes}
    return config.upstream_errors({k: v for k, v in table.items() if v is not None})


def test_the_apis_example_table_loads() -> None:
    example = {
        **GIT,
        "env": {"GIT_AUTHOR_NAME": "stepward"},
        "trust_annotations": False,
        "defaults": {"effect": "write", "idempotency": "none", "approval": "never"},
        "tools": {
            "git_status": {"effect": "read"},
            "git_commit": {"effect": "write", "approval": "always", "redact": ["message"]},
        },
    }
    assert config.upstream_errors(example) == []


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"name": "Git Server"}, "field 'name': must be one lower-case word"),
        ({"command": None}, "give exactly one of command (stdio) and url"),
        ({"url": "http://127.0.0.1:9/mcp"}, "give exactly one of command"),
        ({"command": "mcp-server-git"}, "field 'command': must be a list of strings"),
        ({"colour": "blue"}, "field 'colour': unknown field"),
        ({"headers": {"X": "y"}}, "only an upstream reached by url sends headers"),
        ({"env": {"bad name": "x"}}, "field 'env': must be a table of variable names"),
        ({"timeout": 0}, "field 'timeout': must be seconds"),
        ({"concurrency": 0}, "field 'concurrency': must be a whole number from 1"),
        ({"defaults": {"effect": "pure"}}, "field 'defaults.effect': must be one of read"),
        ({"defaults": {"effect": "risky"}}, "field 'defaults.effect': must be one of"),
        ({"defaults": {"colour": "red"}}, "field 'defaults.colour': unknown"),
        ({"tools": {"git_commit": {"approval": "maybe"}}}, "'tools.git_commit.approval'"),
        ({"tools": {"git_commit": {"idempotency": "key"}}}, "must be one of none, idempotent"),
        ({"tools": {"git_commit": {"colour": 1}}}, "'tools.git_commit.colour': unknown field"),
        ({"tools": {"git_commit": {"compensation": "nothing.here"}}}, "names no tool"),
        ({"tools": {"git_commit": {"retry": {"max_attempts": 0}}}}, "tools.git_commit.retry"),
        (
            {"tools": {"git_commit": {"external_id_from_text": "hash [0-9a-f]+"}}},
            "with one group",
        ),
        ({"tools": {"git_commit": {"external_id_from_text": "(["}}}, "not a regular expression"),
    ],
)
def test_a_bad_table_is_refused_naming_the_upstream_and_the_field(
    changes: dict[str, Any], named: str
) -> None:
    found = problems(**changes)
    assert any(named in problem for problem in found), found
    assert all(problem.startswith("upstream ") for problem in found)


def test_a_url_must_be_allowed(settings: Any) -> None:
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = []
    found = problems(command=None, url="https://mcp.example.com/mcp")
    assert any("EXECUTOR_HTTP_ALLOWED_HOSTS" in problem for problem in found), found
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = ["mcp.example.com"]
    assert problems(command=None, url="https://mcp.example.com/mcp") == []


def test_a_compensation_may_name_a_tool_of_the_same_upstream() -> None:
    assert problems(tools={"git_create_branch": {"compensation": "git.git_delete_branch"}}) == []


def row(**fields: Any) -> McpUpstream:
    return McpUpstream(name="git", command=["x"], **fields)


def test_without_trust_every_tool_is_the_defaults_and_stepwards_own() -> None:
    declared = config.declarations(row(), STATUS)
    assert (declared.effect, declared.idempotent) == (Effect.WRITE, False)
    assert declared.approval == ApprovalRule.BY_POLICY
    assert dict(declared.sources) == {
        "effect": "stepward",
        "idempotency": "stepward",
        "approval": "stepward",
    }


def test_trusted_annotations_decide_where_the_tools_entry_does_not() -> None:
    trusted = row(trust_annotations=True, defaults={"approval": "never"})
    status = config.declarations(trusted, STATUS)
    commit = config.declarations(trusted, COMMIT)
    reset = config.declarations(trusted, RESET)
    assert (status.effect, status.idempotent, status.approval) == (
        Effect.READ,
        True,
        ApprovalRule.NEVER,
    )
    assert (commit.effect, commit.idempotent) == (Effect.WRITE, False)
    # Destructive: a person approves, whatever the defaults say...
    assert (reset.effect, reset.approval) == (Effect.DESTRUCTIVE, ApprovalRule.ALWAYS)
    # ...unless the tool's own entry says otherwise; and the entry beats the annotations.
    told = row(
        trust_annotations=True,
        tool_settings={
            "git_reset": {"approval": "never"},
            "git_status": {"effect": "write", "idempotency": "none"},
        },
    )
    assert config.declarations(told, RESET).approval == ApprovalRule.NEVER
    status_told = config.declarations(told, STATUS)
    assert (status_told.effect, status_told.idempotent) == (Effect.WRITE, False)


def test_absent_hints_are_not_the_specifications_defaults() -> None:
    # MCP says a missing destructiveHint means true; a missing hint is taken as unsaid.
    silent = {"name": "x", "input_schema": {"type": "object"}, "annotations": {}}
    declared = config.declarations(row(trust_annotations=True), silent)
    assert declared.effect == Effect.WRITE


def test_a_listed_tool_becomes_a_checked_tool_class() -> None:
    cls = tool_class(
        row(trust_annotations=True, tool_settings={"git_commit": {"redact": ["message"]}}), COMMIT
    )
    assert cls.name == "git.git_commit"
    assert cls.redact == frozenset({"message"})
    assert cls.validate_input({"message": 5})
    assert not cls.validate_input({"message": "ok"})


def test_a_draft_07_schema_is_validated_as_draft_07() -> None:
    listed = {
        "name": "write_file",
        "input_schema": {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
            "additionalProperties": False,
        },
    }
    cls = tool_class(row(), listed)
    assert cls.validate_input({"path": "/a"}) == []
    assert cls.validate_input({"path": "/a", "other": 1})


@pytest.mark.parametrize(
    "listed",
    [
        {"name": "x" * 120, "input_schema": {"type": "object"}},
        {"name": "bad", "input_schema": {"type": "array"}},
        {"name": "bad", "input_schema": {"type": "object", "properties": 5}},
    ],
)
def test_a_tool_that_cannot_be_a_stepward_tool_is_not_registered(listed: dict[str, Any]) -> None:
    with pytest.raises(RegistrationError):
        tool_class(row(), listed)


@pytest.mark.parametrize(
    ("text", "safe", "failure"),
    [
        # What real servers answer (seen from mcp-server-git and the npm servers).
        (
            "Error executing tool git_commit: 1 validation error for commitArguments\nmessage\n"
            "  Field required [type=missing]",
            False,
            FailureClass.INVALID_INPUT,
        ),
        (
            "MCP error -32602: Input validation error: Invalid arguments for tool write_file",
            False,
            FailureClass.INVALID_INPUT,
        ),
        (
            "Access denied - path outside allowed directories: /etc/x not in /tmp/repo",
            False,
            FailureClass.PERMISSION_DENIED,
        ),
        (
            "Error executing tool git_status: Repository path '/x' is outside the allowed "
            "repository '/tmp/repo'",
            True,
            FailureClass.PERMISSION_DENIED,
        ),
        # Words are no proof that a write did nothing: only a safe tool is retried on them.
        ("API rate limit exceeded, retry later", True, FailureClass.RATE_LIMITED),
        ("API rate limit exceeded, retry later", False, FailureClass.CONFLICT),
        ("issue #429 is closed", False, FailureClass.CONFLICT),
        ("Error executing tool git_commit: No changes staged", False, FailureClass.CONFLICT),
        ("upstream request timed out after 30s", False, FailureClass.AMBIGUOUS),
        ("something went wrong", True, FailureClass.TRANSIENT),
        ("something went wrong", False, FailureClass.CONFLICT),
    ],
)
def test_an_error_result_is_classified_by_what_it_says(
    text: str, safe: bool, failure: FailureClass
) -> None:
    assert classify_error_text(text, safe=safe) == failure


def test_a_tools_file_holds_tools_and_upstreams(tmp_path: Path) -> None:
    path = tmp_path / "tools.toml"
    path.write_text(
        '[[upstream]]\nname = "git"\ncommand = ["mcp-server-git"]\n\n'
        '[upstream.tools.git_commit]\napproval = "always"\n'
    )
    file = read_tool_file(path)
    assert file.tools == []
    assert file.upstreams == [
        {
            "name": "git",
            "command": ["mcp-server-git"],
            "tools": {"git_commit": {"approval": "always"}},
        }
    ]
    path.write_text('[[hook]]\ntool = "x"\n')
    with pytest.raises(ToolFileError, match="unknown table"):
        read_tool_file(path)


@pytest.mark.django_db
def test_loading_a_bad_upstream_writes_nothing_and_names_every_problem() -> None:
    with pytest.raises(base.Invalid) as refused:
        tools_load(tables=[], upstreams=[{"name": "Bad", "colour": 1}])
    assert len(refused.value.details["problems"]) >= 3
    assert not McpUpstream.objects.exists()


@pytest.mark.django_db
def test_check_and_prune_apply_to_upstreams(tmp_path: Path, settings: Any) -> None:
    table = {"name": "ghost", "command": [str(tmp_path / "no-such-server")]}
    checked = tools_load(tables=[], upstreams=[table], check=True)
    assert checked.upstreams_created == ["ghost"]
    assert not McpUpstream.objects.exists()

    loaded = tools_load(tables=[], upstreams=[table])
    # It could not be started from here: said, not refused.
    assert loaded.listed[0].error
    assert McpUpstream.objects.get().list_error
    again = tools_load(tables=[], upstreams=[table], connect=False)
    assert again.upstreams_unchanged == ["ghost"]

    # A file of HTTP tools prunes HTTP tools only: the upstream stays.
    desk_echo = {"name": "desk.echo", "effect": "read", "url": "http://127.0.0.1:9/echo"}
    settings.EXECUTOR_HTTP_ALLOWED_HOSTS = ["127.0.0.1:9"]
    only_tools = tools_load(tables=[desk_echo], prune=True)
    assert only_tools.upstreams_removed == []
    assert McpUpstream.objects.filter(name="ghost").exists()
    # A file of upstreams prunes the upstreams it does not name, and no HTTP tool.
    other = {"name": "other", "command": [str(tmp_path / "no-such-server")]}
    pruned = tools_load(tables=[], upstreams=[other], prune=True, connect=False)
    assert pruned.upstreams_removed == ["ghost"]
    assert pruned.removed == []
    assert list(McpUpstream.objects.values_list("name", flat=True)) == ["other"]
    assert HttpToolSpec.objects.filter(name="desk.echo").exists()


def test_an_upstream_that_keeps_failing_to_list_is_asked_less_and_less_often() -> None:
    now = timezone.now()
    listed = row(checked_at=now, listed_at=now, list_error="")
    assert due(listed, now=now)  # listed fine: every sweep
    failing = row(checked_at=now, listed_at=now - timedelta(seconds=100), list_error="down")
    assert not due(failing, now=now + timedelta(seconds=50))
    assert due(failing, now=now + timedelta(seconds=100))
    never = row(
        checked_at=now, listed_at=None, list_error="down", updated_at=now - timedelta(hours=1)
    )
    assert not due(never, now=now + timedelta(seconds=200))
    assert due(never, now=now + timedelta(seconds=300))  # the pause stops growing at 5 minutes


@pytest.mark.django_db
def test_of_an_http_tool_and_an_upstreams_tool_of_one_name_the_http_tool_keeps_it() -> None:
    spec = HttpToolSpec(name="git.git_commit", effect="write", url="http://127.0.0.1:9/x")
    http_class = http_tool_class(spec)
    upstream_class = tool_class(row(), COMMIT)
    try:
        # Whichever a process loads first, the HTTP tool ends up holding the name.
        assert install(upstream_class)
        assert install(http_class)
        assert not install(upstream_class)
        assert isinstance(find_tool("git.git_commit"), http_class)
        uninstall("git.git_commit", "upstream")  # the upstream's own clean-up leaves it
        assert isinstance(find_tool("git.git_commit"), http_class)
    finally:
        uninstall("git.git_commit", "http")
        uninstall("git.git_commit", "upstream")


def test_a_result_keeps_its_text_and_structured_content_storable_and_bounded() -> None:
    result = types.CallToolResult(
        content=[
            types.TextContent(type="text", text="binary \x00 inside"),
            types.ImageContent(type="image", data="aGk=", mime_type="image/png"),
        ],
        structured_content={"big": "x" * (MAX_TEXT_CHARS + 1)},
    )
    body = result_body(result)
    assert body["text"] == "binary \ufffd inside"
    assert "structured" not in body
    assert body["structured_cut"].endswith("characters, not kept")
    assert body["other_content"] == [{"type": "image", "mime_type": "image/png"}]


def test_an_upstream_tools_entry_declares_its_limits() -> None:
    limited = {"git_commit": {"max_in_flight": 1, "rate": "30/m"}}
    cls = tool_class(row(tool_settings=limited), COMMIT)
    assert (cls.max_in_flight, cls.rate) == (1, "30/m")

    found = problems(tools={"git_commit": {"max_in_flight": 0, "rate": "often"}})
    assert any("git_commit.max_in_flight" in problem for problem in found), found
    assert any("git_commit.rate" in problem and "'often'" in problem for problem in found)
