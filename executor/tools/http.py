"""HTTP tools defined as data (API.md "Your own tools"): a deployment's webhooks, CRM writes
or refunds, described in TOML (`manage.py load_tools`) or admin, never in code.

Each HttpToolSpec row becomes a Tool subclass, registered in every process and refreshed
when the rows change (`refresh`, throttled by EXECUTOR_TOOL_REFRESH_SECONDS). A call sends
the step's JSON input as the body (GET and DELETE: as the query string, after the URL's
own), the spec's headers with `${NAME}` read from the environment at that moment (never
stored, never shown: every value read is scrubbed from what the tool returns),
`X-Stepward-Operation` (the step's operation id) and `X-Stepward-Fence`, and with
`idempotency = "header"` the operation id in the idempotency header too, which makes a
repeat safe. Answers map to failure classes as API.md says. A worker's calls go through
`outbound.exchange` on its event loop; `invoke` (a thread's) through httpx's client: the
same request either way.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar
from urllib.parse import quote, urlsplit

import httpx
import jsonschema
from django.conf import settings

from executor.common.redaction import scrub, scrub_strings
from executor.contract.tool import (
    ApprovalRule,
    Effect,
    FailureClass,
    Idempotency,
    Invocation,
    Lookup,
    LookupOutcome,
    RegistrationError,
    RetryPolicy,
    Tool,
    ToolError,
    ToolResult,
    add_source,
    all_tools,
    check_declarations,
    install,
    max_in_flight_problem,
    rate_problem,
    uninstall,
)
from executor.ledger.records import HttpToolSpec
from executor.tools import outbound
from executor.tools.rows import RowSource

ENV_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
INPUT_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
NAME = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+|[a-z][a-z0-9_]*")
HEADER_NAME = re.compile(r"[A-Za-z0-9-]{1,100}")
RETRY_FIELDS = frozenset(RetryPolicy.__dataclass_fields__)
EVIDENCE_BODY_CHARS = 2000

# The fields of a [[tool]] table: the TOML file's words, each with the spec's field.
FIELDS = {
    "name": "name",
    "description": "description",
    "effect": "effect",
    "method": "method",
    "url": "url",
    "headers": "headers",
    "idempotency": "idempotency",
    "idempotency_header": "idempotency_header",
    "lookup_url": "lookup_url",
    "lookup_found": "lookup_found",
    "external_id": "external_id",
    "approval": "approval",
    "compensation": "compensation",
    "input_schema": "input_schema",
    "retry": "retry",
    "redact": "redact",
    "timeout": "timeout_seconds",
    "max_in_flight": "max_in_flight",
    "rate": "rate",
}
REQUIRED = ("name", "effect", "url")


# --- the spec ---------------------------------------------------------------------------------


def render_env(template: str, *, secrets: set[str] | None = None) -> str:
    """`template` with each `${NAME}` read from the environment now (KeyError if unset).
    Every value read is added to `secrets`, to be scrubbed from what the call returns."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise KeyError(name)
        found = os.environ[name]
        if secrets is not None and found:
            secrets.add(found)
        return found

    return ENV_PLACEHOLDER.sub(value, template)


def spec_errors(spec: Mapping[str, Any], *, tools: Iterable[str] = ()) -> list[str]:
    """Everything wrong with one [[tool]] table, each naming the tool and the field; [] when
    it can be loaded. `tools` are the other tool names that exist (for `compensation`)."""
    name = spec.get("name") if isinstance(spec.get("name"), str) else "(unnamed)"
    errors: list[str] = []

    def bad(field: str, problem: str) -> None:
        errors.append(f"tool {name}: field {field!r}: {problem}")

    for field in spec:
        if field not in FIELDS:
            bad(field, f"unknown field (known: {', '.join(sorted(FIELDS))})")
    for field in REQUIRED:
        if field not in spec:
            bad(field, "is required")
    if errors:
        return errors
    if not isinstance(spec["name"], str) or not NAME.fullmatch(spec["name"]):
        bad("name", "must be lower-case words joined by dots or underscores, e.g. crm.create")
    choices = {
        "effect": HttpToolSpec.HttpEffect.values,
        "method": HttpToolSpec.Method.values,
        "idempotency": HttpToolSpec.HttpIdempotency.values,
        "lookup_found": HttpToolSpec.LookupFound.values,
        "approval": HttpToolSpec.Approval.values,
    }
    for field, allowed in choices.items():
        if field in spec and spec[field] not in allowed:
            bad(field, f"must be one of {', '.join(allowed)}")
    for field in ("description", "idempotency_header", "external_id", "compensation"):
        if field in spec and not isinstance(spec[field], str):
            bad(field, "must be a string")
    if isinstance(spec.get("idempotency_header"), str) and not HEADER_NAME.fullmatch(
        spec["idempotency_header"]
    ):
        bad("idempotency_header", "must be a header name")
    for field in ("url", "lookup_url"):
        if field in spec:
            errors.extend(f"tool {name}: field {field!r}: {p}" for p in url_problems(spec[field]))
    lookup_url = spec.get("lookup_url")
    if isinstance(lookup_url, str) and "{operation_id}" not in lookup_url:
        bad("lookup_url", "must hold {operation_id}, the operation the lookup asks about")
    headers = spec.get("headers", {})
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and HEADER_NAME.fullmatch(k) and isinstance(v, str)
        for k, v in headers.items()
    ):
        bad("headers", "must be a table of header names to strings")
    schema = spec.get("input_schema", {"type": "object"})
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
        if not isinstance(schema, dict) or schema.get("type") != "object":
            bad("input_schema", 'must describe an object (type = "object")')
    except jsonschema.SchemaError as error:
        bad("input_schema", f"is not a JSON schema: {error.message}")
    retry = spec.get("retry", {})
    if not isinstance(retry, dict) or set(retry) - RETRY_FIELDS:
        bad("retry", f"takes only {', '.join(sorted(RETRY_FIELDS))}")
    else:
        try:
            RetryPolicy(**retry)
        except (TypeError, ValueError) as error:
            bad("retry", str(error))
    redact = spec.get("redact", [])
    if not isinstance(redact, list) or not all(isinstance(f, str) for f in redact):
        bad("redact", "must be a list of input field names")
    timeout = spec.get("timeout", 10.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 300:
        bad("timeout", "must be seconds, more than 0 and at most 300")
    if "max_in_flight" in spec and max_in_flight_problem(spec["max_in_flight"]):
        bad("max_in_flight", max_in_flight_problem(spec["max_in_flight"]))
    if "rate" in spec and rate_problem(spec["rate"]):
        bad("rate", rate_problem(spec["rate"]))
    compensation = spec.get("compensation", "")
    if isinstance(compensation, str) and compensation and compensation not in set(tools):
        bad("compensation", f"names no tool: {compensation!r}")
    if spec.get("idempotency") == "header" and spec.get("idempotency_header", "x") == "":
        bad("idempotency_header", 'is required with idempotency = "header"')
    return errors


def url_problems(url: Any) -> list[str]:
    if not isinstance(url, str) or not url:
        return ["must be a URL"]
    try:
        rendered = render_env(url)
    except KeyError as missing:
        return [f"${{{missing.args[0]}}} is not set in this environment"]
    parts = urlsplit(rendered)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return [f"{rendered!r} is not an http(s) URL"]
    refusal = outbound.refusal(INPUT_PLACEHOLDER.sub("x", rendered))
    if refusal:
        return [f"{refusal} ({', '.join(settings.EXECUTOR_HTTP_ALLOWED_HOSTS) or 'empty'})"]
    return []


def spec_from_table(table: Mapping[str, Any]) -> HttpToolSpec:
    """An unsaved HttpToolSpec from a checked [[tool]] table."""
    values = {FIELDS[field]: value for field, value in table.items()}
    values.setdefault("input_schema", {"type": "object"})
    return HttpToolSpec(**values)


# --- the tool -----------------------------------------------------------------------------------


class HttpTool(Tool):
    """A tool made from an HttpToolSpec; `tool_class` sets the declarations."""

    spec: ClassVar[HttpToolSpec]
    defined_by = "http"

    @classmethod
    def declared_extra(cls) -> dict[str, Any]:
        spec = cls.spec
        return {
            "method": spec.method,
            "url": spec.url,
            "headers": spec.headers,
            "idempotency_header": spec.idempotency_header,
            "lookup_url": spec.lookup_url,
            "lookup_found": spec.lookup_found,
            "external_id": spec.external_id,
            "timeout": spec.timeout_seconds,
        }

    def invoke(self, call: Invocation) -> ToolResult:
        method, url, secrets, body = self._call_request(call)
        return self._answer(self._send(method, url, secrets, **body), secrets)

    async def ainvoke(self, call: Invocation) -> ToolResult:
        """`invoke` on the worker's event loop (DESIGN.md §16): the same request and answer."""
        method, url, secrets, body = self._call_request(call)
        try:
            response = await outbound.exchange(
                method,
                url,
                headers=body["headers"],
                params=body.get("params"),
                json_body=body.get("json"),
                timeout=self.spec.timeout_seconds,
            )
        except httpx.HTTPError as error:
            raise _send_failure(error, secrets) from None
        return self._answer(response, secrets)

    def _call_request(self, call: Invocation) -> tuple[str, str, set[str], dict[str, Any]]:
        """(method, url, the secrets read, the request's headers and body) of a call."""
        spec = self.spec
        secrets: set[str] = set()
        url, headers = self._request(spec.url, call, secrets)
        if spec.idempotency == HttpToolSpec.HttpIdempotency.HEADER:
            headers[spec.idempotency_header] = call.idempotency_key
        body: dict[str, Any] = {"headers": headers}
        if spec.method in ("GET", "DELETE"):
            # After the URL's own query, which httpx's `params` would replace.
            url = str(
                outbound.parsed_url(url).copy_merge_params(
                    {k: v for k, v in call.input.items() if isinstance(v, str | int | float)}
                )
            )
        else:
            body["json"] = call.input
        return spec.method, url, secrets, body

    def _answer(self, response: outbound.Answered, secrets: set[str]) -> ToolResult:
        status = response.status_code
        if 200 <= status < 300:
            answer = _json_or_text(response)
            external = _field(answer, self.spec.external_id) if self.spec.external_id else ""
            return ToolResult(
                result=scrub_strings(answer, secrets),
                external_id=scrub(str(external or ""), secrets),
                evidence={"status": status},
            )
        raise self._refusal(response, secrets)

    def lookup(self, call: Invocation) -> Lookup:
        spec = self.spec
        secrets: set[str] = set()
        template = spec.lookup_url.replace("{operation_id}", quote(call.operation_id, safe=""))
        url, headers = self._request(template, call, secrets)
        response = self._send("GET", url, secrets, headers=headers)
        status = response.status_code
        evidence = {"status": status}
        if spec.lookup_found == HttpToolSpec.LookupFound.STATUS:
            if status == 404:
                return Lookup(LookupOutcome.NOT_FOUND, evidence=evidence)
            if status != 200:
                return Lookup(LookupOutcome.CANNOT_TELL, evidence=evidence)
            answer = _json_or_text(response)
            first: Any = answer
        else:
            if status != 200:
                return Lookup(LookupOutcome.CANNOT_TELL, evidence=evidence)
            answer = _json_or_text(response)
            found, first = _counted(answer)
            if found is None:
                return Lookup(LookupOutcome.CANNOT_TELL, evidence={**evidence, "why": "no count"})
            if found == 0:
                return Lookup(LookupOutcome.NOT_FOUND, evidence=evidence)
        external = _field(first, spec.external_id) if spec.external_id else ""
        return Lookup(
            LookupOutcome.FOUND,
            external_id=scrub(str(external or ""), secrets),
            result=scrub_strings(first, secrets),
            evidence=evidence,
        )

    def compensation_input(self, external_id: str, result: Any) -> dict[str, Any]:
        return {self.spec.external_id or "external_id": external_id}

    # --- the request ----------------------------------------------------------------------

    def _request(
        self, template: str, call: Invocation, secrets: set[str]
    ) -> tuple[str, dict[str, str]]:
        try:
            url = render_env(template, secrets=secrets)
            headers = {
                name: render_env(value, secrets=secrets)
                for name, value in self.spec.headers.items()
            }
        except KeyError as missing:
            raise ToolError(
                FailureClass.UNAVAILABLE,
                f"${{{missing.args[0]}}} is not set in this worker's environment",
            ) from None

        def field(match: re.Match[str]) -> str:
            value = call.input.get(match.group(1))
            if value is None:
                raise ToolError(
                    FailureClass.INVALID_INPUT, f"the URL needs the input field {match.group(1)}"
                )
            return quote(str(value), safe="")

        url = INPUT_PLACEHOLDER.sub(field, url)
        refusal = outbound.refusal(url)
        if refusal:
            raise ToolError(FailureClass.POLICY_DENIED, refusal)
        headers["X-Stepward-Operation"] = call.operation_id
        headers["X-Stepward-Fence"] = str(call.fence)
        return url, headers

    def _send(self, method: str, url: str, secrets: set[str], **kwargs: Any) -> httpx.Response:
        try:
            return outbound.client().request(
                method, url, timeout=self.spec.timeout_seconds, follow_redirects=False, **kwargs
            )
        except httpx.HTTPError as error:
            raise _send_failure(error, secrets) from None

    def _refusal(self, response: outbound.Answered, secrets: set[str]) -> ToolError:
        status = response.status_code
        text = scrub(response.text[:EVIDENCE_BODY_CHARS], secrets)
        # A 5xx may come after it acted; `idempotency = "header"` makes a repeat safe.
        return outbound.failure_of(
            response,
            f"{self.spec.method} answered {status}: {text[:300]}",
            evidence={"status": status, "body": text},
        )


def _send_failure(error: httpx.HTTPError, secrets: set[str]) -> ToolError:
    """What a request that got no answer means: nothing sent (it failed to connect), or sent
    with no reliable answer (it may have taken effect, API.md)."""
    if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return ToolError(
            FailureClass.TRANSIENT,
            scrub(f"nothing was sent: {type(error).__name__}: {error}", secrets),
        )
    return ToolError(
        FailureClass.AMBIGUOUS,
        scrub(f"no reliable answer after sending: {type(error).__name__}: {error}", secrets),
    )


def _json_or_text(response: outbound.Answered) -> Any:
    try:
        return response.json()
    except ValueError:
        return {"body": response.text[:EVIDENCE_BODY_CHARS]}


def _field(answer: Any, name: str) -> Any:
    return answer.get(name, "") if isinstance(answer, dict) else ""


def _counted(answer: Any) -> tuple[int | None, Any]:
    """(how many, the first) of a lookup's answer: a list, or an object with a `count`
    (its first list-valued member holds the items)."""
    if isinstance(answer, list):
        return len(answer), answer[0] if answer else None
    if isinstance(answer, dict) and isinstance(answer.get("count"), int):
        items = next((v for v in answer.values() if isinstance(v, list)), [])
        return answer["count"], items[0] if items else answer
    return None, None


def tool_class(spec: HttpToolSpec) -> type[HttpTool]:
    """The Tool subclass of one spec, checked like any tool."""
    retry = RetryPolicy(**spec.retry) if spec.retry else RetryPolicy()
    attributes = {
        "__module__": __name__,
        "spec": spec,
        "name": spec.name,
        "description": spec.description,
        "effect": Effect(spec.effect),
        "idempotency": (
            Idempotency.KEY
            if spec.idempotency == HttpToolSpec.HttpIdempotency.HEADER
            else Idempotency.NONE
        ),
        "requires_approval": (
            ApprovalRule.ALWAYS
            if spec.approval == HttpToolSpec.Approval.ALWAYS
            else ApprovalRule.NEVER
        ),
        "compensation": spec.compensation,
        "retry": retry,
        "input_schema": spec.input_schema or {"type": "object"},
        "redact": frozenset(spec.redact),
        "max_in_flight": spec.max_in_flight,
        "rate": spec.rate,
        "lookup_authoritative": bool(spec.lookup_url),
    }
    if not spec.lookup_url:
        # No lookup: the contract's default, so `has_lookup()` is False.
        attributes["lookup"] = Tool.lookup
    cls = type(f"HttpTool_{spec.name.replace('.', '_')}", (HttpTool,), attributes)
    check_declarations(cls)
    return cls


# --- registration -------------------------------------------------------------------------------

_mine: set[str] = set()


def refresh(*, force: bool = False) -> None:
    """Registers the HTTP tools as the database has them now, when they changed (asked at
    most every EXECUTOR_TOOL_REFRESH_SECONDS unless forced)."""
    _rows.refresh(force=force)


def _install(specs: list[HttpToolSpec]) -> None:
    wanted = {spec.name for spec in specs}
    for name in _mine - wanted:
        uninstall(name, HttpTool.defined_by)
    _mine.intersection_update(wanted)
    for spec in specs:
        try:
            cls = tool_class(spec)
        except (RegistrationError, TypeError, ValueError):
            continue  # admin and load_tools check specs; a bad row registers nothing
        # A tool of code with the name wins (load_tools refuses such a file); one of an
        # upstream yields.
        if install(cls):
            _mine.add(spec.name)


def python_tool_names() -> set[str]:
    """Tools registered by code, not defined as data (HTTP tools, MCP upstreams')."""
    return {tool.name for tool in all_tools() if tool.defined_by == "code"}


_rows = RowSource(HttpToolSpec, _install)
add_source(refresh)
