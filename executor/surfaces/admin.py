"""Django admin for admins (DESIGN.md §1): workspaces, agents, permissions, read-only ledger.

The ledger (runs, steps, attempts, events, approvals, drills) can be read here but never
written: state changes go through the services, which keep the Event chain intact.

Why one module of about 800 lines: one short ModelAdmin per model (a dozen), with the
filters and links they share; split by model they would be files that change together.
"""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import IS_POPUP_VAR
from django.db import IntegrityError, transaction
from django.db.models import Count, IntegerField, Model, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from guardian.admin import GuardedModelAdmin

from executor.common.redaction import redact
from executor.contract.tool import all_tools, find_tool
from executor.gateway import config as gateway_config
from executor.ledger.chain import verify_chain
from executor.ledger.records import (
    ROLE_PERMISSIONS,
    Agent,
    Approval,
    Attempt,
    DeliveryStatus,
    DrillReport,
    Event,
    HttpToolSpec,
    McpUpstream,
    Notification,
    NotifyDelivery,
    NotifySubscription,
    Rule,
    Run,
    SignInIdentity,
    SignInRole,
    Signoff,
    Step,
    Tool,
    ToolPolicy,
    Workspace,
)
from executor.ledger.states import NEEDS_REVIEW
from executor.notifications import outbox
from executor.policy import authorization, simulation
from executor.services.accounts import (
    agent_create,
    agent_rotate_token,
    agent_set_active,
    agent_set_tools,
)
from executor.services.signin import sign_in_role_save
from executor.services.tools import tools_sync
from executor.tools import http as http_tools

# --- helpers ----------------------------------------------------------------------------


def changelist_link(model: type[Model], text: object, **filters: object) -> str:
    opts = model._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
    query = "&".join(f"{key}={value}" for key, value in filters.items())
    return format_html('<a href="{}?{}">{}</a>', url, query, text)


def pretty_json(value: Any, fields: frozenset[str] = frozenset()) -> str:
    """JSON for people to read, with anything that looks like a secret redacted (§15)."""
    if value is None:
        return "-"
    shown = redact(value, fields=fields)
    text = json.dumps(shown, indent=2, sort_keys=True, ensure_ascii=False, default=str)
    return format_html('<pre class="stepward-json">{}</pre>', text)


def short_hash(value: str) -> str:
    return format_html('<code title="{}">{}…</code>', value, value[:12]) if value else "-"


def count_of(model: type[Model], field: str) -> Coalesce:
    """A correlated COUNT: one subquery per count, instead of joins that multiply rows."""
    rows = (
        model._default_manager.filter(**{field: OuterRef("pk")})
        .order_by()
        .values(field)
        .annotate(n=Count("pk"))
        .values("n")
    )
    return Coalesce(Subquery(rows, output_field=IntegerField()), 0)


class ReadOnlyAdmin(admin.ModelAdmin):
    """Viewable, never writable: add, change and delete are refused (403 on POST)."""

    # Ledger tables grow large; a second COUNT(*) of the whole table on every filtered
    # page is not worth its cost.
    show_full_result_count = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    # "View on site" opens the record's page in the reviewers' console (with its
    # decisions), where there is one: the console's URL name.
    console_page = ""

    def get_view_on_site_url(self, obj: Any = None) -> str | None:
        if obj is None or not self.console_page:
            return None
        return console_url(self.console_page, obj.pk)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        own = [field.name for field in self.model._meta.fields]
        return own + [name for name in self.readonly_fields if name not in own]


class ReadOnlyInline(admin.TabularInline):
    extra = 0
    max_num = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


# --- workspaces and tools (guardian object permissions) ----------------------------------


class AgentInline(ReadOnlyInline):
    model = Agent
    fields = readonly_fields = ("name", "token_prefix", "is_active", "last_seen_at", "created_at")
    ordering = ["name"]


def console_url(name: str, pk: Any) -> str:
    """A console page by URL name; the ledger's app does not import the console."""
    return reverse(name, args=[pk])


class ToolPolicyInline(admin.TabularInline):
    """Which tools need a person's approval in this workspace (issue 11)."""

    model = ToolPolicy
    extra = 0
    fields = ["tool", "approval", "destructive", "irreversible", "cost_above"]
    autocomplete_fields = ["tool"]
    verbose_name = "approval policy"
    verbose_name_plural = (
        "Approval policies (tools without one follow their own declaration; changing one "
        "voids the approvals given under the old one)"
    )


@admin.register(Workspace)
class WorkspaceAdmin(GuardedModelAdmin):
    list_display = ["slug", "name", "agent_count", "run_count", "created_at"]
    list_filter = ["created_at"]
    search_fields = ["slug", "name"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [ToolPolicyInline, AgentInline]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Workspace]:
        return (
            super()
            .get_queryset(request)
            .annotate(
                agent_total=count_of(Agent, "workspace"),
                run_total=count_of(Run, "workspace"),
            )
        )

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # Commands (`--workspace SLUG`) and agents' user names refer to the slug.
        return ["created_at"] if obj is None else ["slug", "created_at"]

    def get_prepopulated_fields(self, request: HttpRequest, obj: Any = None) -> dict[str, Any]:
        return self.prepopulated_fields if obj is None else {}

    @admin.display(description="agents", ordering="agent_total")
    def agent_count(self, workspace: Any) -> str:
        return changelist_link(Agent, workspace.agent_total, workspace__id__exact=workspace.pk)

    @admin.display(description="runs", ordering="run_total")
    def run_count(self, workspace: Any) -> str:
        return changelist_link(Run, workspace.run_total, workspace__id__exact=workspace.pk)


@admin.register(Tool)
class ToolAdmin(GuardedModelAdmin):
    """Declarations mirror the code's registry; here an admin grants who may use a tool and
    may override its limits (API.md "Slow tools"), nothing else."""

    list_display = [
        "name",
        "effect",
        "idempotency",
        "requires_approval",
        "reversible",
        "has_lookup",
        "registered",
        "updated_at",
    ]
    list_filter = ["effect", "idempotency", "requires_approval", "has_lookup", "registered"]
    search_fields = ["name", "compensation"]
    readonly_fields = (
        "name",
        "description",
        "effect",
        "idempotency",
        "requires_approval",
        "compensation",
        "has_lookup",
        "policy_version",
        "registered",
        "max_in_flight",
        "rate",
        "updated_at",
    )
    fields = (*readonly_fields[:-1], "max_in_flight_override", "rate_override", "updated_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Only the limits' overrides are editable (`fields`); the registry rewrites the
        # rest after every migrate. guardian's "Object permissions" pages ask this too.
        return super().has_change_permission(request, obj)

    @admin.display(description="description")
    def description(self, tool: Tool) -> str:
        registered = find_tool(tool.name)
        return (registered.description or "-") if registered else "no longer registered"

    @admin.display(description="compensation", ordering="compensation")
    def reversible(self, tool: Tool) -> str:
        return tool.compensation or "irreversible"


class HttpToolSpecForm(forms.ModelForm):
    """The fields of API.md's [[tool]] table, checked exactly as `load_tools` checks them."""

    class Meta:
        model = HttpToolSpec
        fields = [
            "name",
            "description",
            "effect",
            "method",
            "url",
            "headers",
            "idempotency",
            "idempotency_header",
            "lookup_url",
            "lookup_found",
            "external_id",
            "approval",
            "compensation",
            "input_schema",
            "retry",
            "redact",
            "timeout_seconds",
            "max_in_flight",
            "rate",
        ]
        help_texts = {
            "max_in_flight": "Calls of this tool in flight at once across all workers; "
            "empty for no limit.",
            "rate": "Calls started per period across all workers: 20/s, 600/m, 1000/h; "
            "empty for no limit.",
            "headers": "A JSON object; values may read the environment at call time: "
            '{"Authorization": "Bearer ${CRM_TOKEN}"}. The secret itself is never stored.',
            "url": "Its host must be in EXECUTOR_HTTP_ALLOWED_HOSTS. {field} takes the "
            "input's field.",
            "lookup_url": "Optional: asks whether the operation happened; must hold "
            "{operation_id}.",
            "external_id": "The answer's JSON field that names the effect.",
            "retry": 'e.g. {"max_attempts": 5, "initial_interval": 1.0, "deadline": 600}',
        }

    def clean(self) -> dict[str, Any]:
        cleaned: dict[str, Any] = super().clean() or {}
        table = {
            word: cleaned[field]
            for word, field in http_tools.FIELDS.items()
            if field in cleaned and cleaned[field] not in ("", None, {}, [])
        }
        table.setdefault("name", cleaned.get("name", ""))
        others = {t.name for t in all_tools()} - {cleaned.get("name")}
        for problem in http_tools.spec_errors(table, tools=others | {cleaned.get("name", "")}):
            self.add_error(None, problem)
        if self.instance.pk is None and cleaned.get("name") in http_tools.python_tool_names():
            self.add_error("name", "a tool of that name is defined in code")
        return cleaned


@admin.register(HttpToolSpec)
class HttpToolSpecAdmin(admin.ModelAdmin):
    """HTTP tools as data: the same records `manage.py load_tools` writes (API.md)."""

    form = HttpToolSpecForm
    list_display = ["name", "effect", "method", "url", "idempotency", "approval", "updated_at"]
    list_filter = ["effect", "method", "idempotency", "approval"]
    search_fields = ["name", "url", "description"]

    def save_model(self, request: HttpRequest, obj: HttpToolSpec, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        # Registered here at once (other processes within EXECUTOR_TOOL_REFRESH_SECONDS),
        # and mirrored so that use_tool can be granted on it.
        tools_sync()
        if change:
            messages.info(
                request,
                "A new policy version: approvals of the tool's earlier version no longer "
                "authorize anything.",
            )

    def delete_model(self, request: HttpRequest, obj: HttpToolSpec) -> None:
        super().delete_model(request, obj)
        tools_sync()


class McpUpstreamForm(forms.ModelForm):
    """The fields of API.md's [[upstream]] table, checked exactly as `load_tools` checks
    them; what its workers listed is shown, not edited."""

    class Meta:
        model = McpUpstream
        fields = [
            "name",
            "description",
            "command",
            "cwd",
            "env",
            "url",
            "headers",
            "trust_annotations",
            "defaults",
            "tool_settings",
            "timeout_seconds",
            "concurrency",
        ]
        help_texts = {
            "command": "stdio: the command a worker starts, as a JSON list, e.g. "
            '["mcp-server-git", "--repository", "/srv/repo"]. Leave [] for one reached by URL.',
            "url": "streamable HTTP: its host must be in EXECUTOR_HTTP_ALLOWED_HOSTS.",
            "env": "Extra environment for the command; values may read the worker's: "
            '{"GITHUB_TOKEN": "${GITHUB_TOKEN}"}. The secret itself is never stored.',
            "headers": '{"Authorization": "Bearer ${MCP_TOKEN}"}, read at connection time.',
            "trust_annotations": "Let the upstream's MCP annotations (readOnlyHint, "
            "destructiveHint, idempotentHint) set what a tool declares where tool_settings "
            "does not.",
            "defaults": '{"effect": "write", "idempotency": "none", "approval": "never"}',
            "tool_settings": 'Per tool: {"git_commit": {"approval": "always", "redact": '
            '["message"]}} (effect, idempotency, approval, redact, compensation, retry, '
            "timeout, external_id, description).",
            "timeout_seconds": "How long a call may take before its answer counts as lost.",
            "concurrency": "Calls one worker process sends it at once (empty: 1 for a "
            "command, 8 for a URL); the others wait their turn before being sent.",
        }

    def clean(self) -> dict[str, Any]:
        cleaned: dict[str, Any] = super().clean() or {}
        table = {
            word: cleaned[field]
            for word, field in gateway_config.FIELDS.items()
            if field in cleaned and cleaned[field] not in ("", None, {}, [])
        }
        table.setdefault("name", cleaned.get("name", ""))
        if "timeout_seconds" in cleaned:
            table["timeout"] = cleaned["timeout_seconds"]
        if cleaned.get("concurrency") is None:
            table.pop("concurrency", None)
        tools = {t.name for t in all_tools()}
        for problem in gateway_config.upstream_errors(table, tools=tools):
            self.add_error(None, problem)
        return cleaned


@admin.register(McpUpstream)
class McpUpstreamAdmin(admin.ModelAdmin):
    """MCP servers behind Stepward: the same records `manage.py load_tools` writes (API.md
    "MCP gateway"). The workers list each one's tools after every sweep."""

    form = McpUpstreamForm
    list_display = ["name", "reached_by", "tool_count", "listed_at", "checked_at", "status"]
    search_fields = ["name", "url", "description"]
    readonly_fields = ["listed", "server", "listed_at", "checked_at", "list_error"]

    @admin.display(description="reached by")
    def reached_by(self, obj: McpUpstream) -> str:
        return obj.url or " ".join(obj.command)

    @admin.display(description="tools")
    def tool_count(self, obj: McpUpstream) -> int:
        return len(obj.listed_tools)

    @admin.display(description="status")
    def status(self, obj: McpUpstream) -> str:
        if obj.list_error:
            return f"not listed: {obj.list_error[:120]}"
        return "listed" if obj.listed_at else "not listed yet"

    @admin.display(description="tools it lists, as Stepward declares them")
    def listed(self, obj: McpUpstream) -> SafeString:
        rows = []
        for entry in obj.listed_tools:
            declared = gateway_config.declarations(obj, entry)
            rows.append(
                format_html(
                    "<li><code>{}.{}</code>: {}, {}, approval {} <small>({})</small></li>",
                    obj.name,
                    entry.get("name", "?"),
                    declared.effect,
                    "idempotent" if declared.idempotent else "not idempotent",
                    declared.approval,
                    ", ".join(f"{word} from {source}" for word, source in declared.sources),
                )
            )
        return format_html("<ul>{}</ul>", SafeString("".join(rows))) if rows else SafeString("-")

    @admin.display(description="server")
    def server(self, obj: McpUpstream) -> str:
        return pretty_json(obj.server_info)

    def save_model(self, request: HttpRequest, obj: McpUpstream, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        tools_sync()
        messages.info(
            request,
            "Saved. The workers list its tools at their next sweep; a change is a new policy "
            "version for every one of its tools (earlier approvals no longer authorize).",
        )

    def delete_model(self, request: HttpRequest, obj: McpUpstream) -> None:
        super().delete_model(request, obj)
        tools_sync()


@admin.register(ToolPolicy)
class ToolPolicyAdmin(admin.ModelAdmin):
    """Whether a person approves each call of a tool in a workspace: `always`, `never`, or
    `by_policy` with its rules. Without a policy, the tool's own declaration holds."""

    list_display = ["tool", "workspace", "approval", "destructive", "irreversible", "cost_above"]
    list_filter = ["approval", "workspace"]
    search_fields = ["tool__name", "workspace__slug"]
    autocomplete_fields = ["workspace", "tool"]
    fields = ["workspace", "tool", "approval", "destructive", "irreversible", "cost_above"]


@admin.register(Rule)
class RuleAdmin(admin.ModelAdmin):
    """Approval rules (API.md "Approval rules", docs/rules.md): tried in position order, the
    first whose condition holds decides. Saving one is a new policy version for the tools it
    names: approvals given before no longer authorize. The page shows what the rules in force
    would do to the workspace's recent calls."""

    list_display = ["position", "tool", "workspace", "action", "when", "reason"]
    list_display_links = ["position", "tool"]
    list_filter = ["action", "workspace"]
    search_fields = ["tool", "when", "reason"]
    autocomplete_fields = ["workspace"]
    fields = ["position", "tool", "workspace", "when", "action", "reason", "simulation"]
    readonly_fields = ["simulation"]
    ordering = ["position", "id"]

    # Recent calls weighed on the page: enough to see a rule's effect, quick to compute.
    SIMULATED_CALLS = 200

    @admin.display(description="what the rules would do to recent calls")
    def simulation(self, rule: Rule) -> SafeString | str:
        if rule.pk is None:
            return "Save the rule to see what it would do to recent calls."
        result = simulation.rules_simulate(
            workspace=rule.workspace,
            tool="" if rule.tool == "*" else rule.tool,
            last=self.SIMULATED_CALLS,
        )
        mine = [call for call in result.calls if call.rule_id == rule.pk]
        counts = result.counts
        summary = format_html(
            "Of the last {} calls of {} in {}: {} allowed, {} to one person, {} to two, {} "
            "refused; this rule decides {} of them.",
            len(result.calls),
            rule.tool if rule.tool != "*" else "any tool",
            rule.workspace.slug if rule.workspace else "every workspace",
            counts.get("allow", 0),
            counts.get("require_approval", 0),
            counts.get("require_two", 0),
            counts.get("refuse", 0),
            len(mine),
        )
        if not mine:
            return summary
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td><a href='{}'>{}</a></td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    f"{call.posted_at:%Y-%m-%d %H:%M:%S}",
                    console_url("step", call.step_id),
                    call.key,
                    call.summary,
                    call.would,
                    call.happened,
                )
                for call in mine[:50]
            ),
        )
        return format_html(
            '{}<table class="stepward-simulation"><thead><tr><th>posted</th><th>step</th>'
            "<th>call</th><th>would</th><th>happened</th></tr></thead><tbody>{}</tbody></table>",
            summary,
            rows,
        )


# --- agents -----------------------------------------------------------------------------


def tool_choices() -> QuerySet[Tool]:
    return Tool.objects.filter(registered=True).order_by("name")


class AgentAddForm(forms.ModelForm):
    """Only what an admin chooses; the user, permissions and token come from the service."""

    tools = forms.ModelMultipleChoiceField(
        queryset=Tool.objects.none(),
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="The tools this agent may use (use_tool). Leave all unticked for every tool.",
    )

    class Meta:
        model = Agent
        fields = ["workspace", "name"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["tools"].queryset = tool_choices()  # type: ignore[attr-defined]


class AgentChangeForm(forms.ModelForm):
    tools = forms.ModelMultipleChoiceField(
        queryset=Tool.objects.none(),
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="The tools this agent may use (use_tool), checked again at every claim.",
    )

    class Meta:
        model = Agent
        fields = ["is_active"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields["tools"]
        field.queryset = tool_choices()  # type: ignore[attr-defined]
        if self.instance.pk:
            usable = authorization.grants(
                users=[self.instance.user_id],
                workspaces=[],
                tools=list(tool_choices().values_list("name", flat=True)),
            )
            field.initial = tool_choices().filter(
                name__in={tool for _, codename, _, tool in usable if codename == "use_tool"}
            )


def show_token_once(request: HttpRequest, agent: Agent, token: str, verb: str) -> None:
    messages.success(
        request,
        format_html(
            "{} token for agent “{}”: <code class='stepward-token'>{}</code> Copy it now: "
            "only its hash is stored and it will not be shown again.",
            verb,
            agent.name,
            token,
        ),
    )


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "workspace",
        "token_prefix",
        "is_active",
        "last_seen_at",
        "created_at",
        "runs",
    ]
    list_filter = ["is_active", "workspace", "created_at"]
    search_fields = ["name", "workspace__slug", "token_prefix", "user__username"]
    list_select_related = ["workspace"]
    autocomplete_fields = ["workspace"]
    actions = ["rotate_token", "deactivate", "activate"]
    fieldsets = [
        (None, {"fields": ["workspace", "name", "is_active", "tools"]}),
        (
            "Identity",
            {
                "fields": ["user", "token_prefix", "created_at", "last_seen_at"],
                "description": "The token itself is never stored; rotate it to issue a new one.",
            },
        ),
    ]
    add_fieldsets = [
        (
            None,
            {
                "fields": ["workspace", "name", "tools"],
                "description": (
                    "Saving creates the agent's user with submit_steps on the workspace and "
                    "use_tool on the tools ticked (every tool when none is), and shows its "
                    "token once."
                ),
            },
        )
    ]

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Runs and events refer to agents; deactivate an agent instead of deleting it.
        return False

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        return self.add_fieldsets if obj is None else self.fieldsets

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        if obj is None:
            return []
        # The name is part of the agent's user name and of its events' actor.
        return ["workspace", "name", "user", "token_prefix", "created_at", "last_seen_at"]

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        kwargs["form"] = AgentAddForm if obj is None else AgentChangeForm
        return super().get_form(request, obj, change=change, **kwargs)

    def save_model(self, request: HttpRequest, obj: Agent, form: Any, change: bool) -> None:
        chosen = [tool.name for tool in form.cleaned_data.get("tools") or []]
        if change:
            agent_set_active(agent=obj, active=obj.is_active)
            agent_set_tools(agent=obj, tools=chosen)
            return
        agent, token = agent_create(workspace=obj.workspace, name=obj.name, tools=chosen or None)
        # The admin goes on with `obj` (history entry, redirect): make it the saved agent.
        for field in Agent._meta.concrete_fields:
            setattr(obj, field.attname, getattr(agent, field.attname))
        obj._state.adding = False
        obj._state.db = agent._state.db
        show_token_once(request, agent, token, "New")

    def response_add(
        self, request: HttpRequest, obj: Agent, post_url_continue: str | None = None
    ) -> HttpResponse:
        if IS_POPUP_VAR in request.POST or "_addanother" in request.POST:
            return super().response_add(request, obj, post_url_continue)
        # Stay on the new agent, where its token prefix can be checked against the token.
        return HttpResponseRedirect(reverse("admin:executor_agent_change", args=[obj.pk]))

    @admin.display(description="runs")
    def runs(self, agent: Agent) -> str:
        return changelist_link(Run, "runs", agent__id__exact=agent.pk)

    @admin.action(description="Rotate token (the new token is shown once)", permissions=["change"])
    def rotate_token(self, request: HttpRequest, queryset: QuerySet[Agent]) -> None:
        for agent in queryset:
            token = agent_rotate_token(agent=agent)
            self.log_change(request, agent, "Rotated the token.")
            show_token_once(request, agent, token, "New")

    @admin.action(
        description="Deactivate (its steps stop at their next claim)", permissions=["change"]
    )
    def deactivate(self, request: HttpRequest, queryset: QuerySet[Agent]) -> None:
        agents = list(queryset.filter(is_active=True))
        for agent in agents:
            agent_set_active(agent=agent, active=False)
        self.message_user(request, f"Deactivated {len(agents)} agent(s).", messages.SUCCESS)

    @admin.action(description="Activate", permissions=["change"])
    def activate(self, request: HttpRequest, queryset: QuerySet[Agent]) -> None:
        agents = list(queryset.filter(is_active=False))
        for agent in agents:
            agent_set_active(agent=agent, active=True)
        self.message_user(request, f"Activated {len(agents)} agent(s).", messages.SUCCESS)


# --- the ledger (read-only) ---------------------------------------------------------------


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    console_page = "run"

    list_display = [
        "name",
        "workspace",
        "agent",
        "status",
        "calls",
        "used_cost",
        "step_count",
        "created_at",
    ]
    list_filter = ["status", "workspace", "created_at"]
    search_fields = ["name", "key", "=id", "agent__name"]
    list_select_related = ["workspace", "agent", "agent__workspace"]
    date_hierarchy = "created_at"
    fieldsets = [
        (None, {"fields": ["id", "name", "key", "workspace", "agent", "status", "pause_reason"]}),
        ("Budget", {"fields": ["max_calls", "max_cost", "deadline"]}),
        ("Usage", {"fields": ["used_calls", "used_cost", "steps_and_events"]}),
        ("Record", {"fields": ["version", "created_at", "updated_at"]}),
    ]
    readonly_fields = ["steps_and_events"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Run]:
        return super().get_queryset(request).annotate(step_total=count_of(Step, "run"))

    @admin.display(description="calls")
    def calls(self, run: Run) -> str:
        return f"{run.used_calls} / {run.max_calls}" if run.max_calls else str(run.used_calls)

    @admin.display(description="steps", ordering="step_total")
    def step_count(self, run: Any) -> str:
        return changelist_link(Step, run.step_total, run__id__exact=run.pk)

    @admin.display(description="steps and events")
    def steps_and_events(self, run: Any) -> str:
        return format_html(
            "{} · {}",
            changelist_link(Step, f"{run.step_total} steps", run__id__exact=run.pk),
            changelist_link(Event, "events", run__id__exact=run.pk),
        )


class NeedsReviewFilter(admin.SimpleListFilter):
    title = "waits for a person"
    parameter_name = "needs_review"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Yes"), ("no", "No")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "yes":
            return queryset.filter(state__in=NEEDS_REVIEW)
        if self.value() == "no":
            return queryset.exclude(state__in=NEEDS_REVIEW)
        return queryset


class AttemptInline(ReadOnlyInline):
    model = Attempt
    fields = readonly_fields = (
        "number",
        "fence",
        "worker",
        "phase",
        "error_class",
        "error_message",
        "cost",
        "claimed_at",
        "submitted_at",
        "finished_at",
        "fenced_out_write",
    )
    ordering = ["number"]


class EventInline(ReadOnlyInline):
    model = Event
    fields = readonly_fields = (
        "seq",
        "from_state",
        "to_state",
        "actor",
        "reason",
        "created_at",
        "event_hash",
    )
    ordering = ["seq"]
    show_change_link = True

    @admin.display(description="hash")
    def event_hash(self, event: Event) -> str:
        return short_hash(event.hash)


class ApprovalInline(ReadOnlyInline):
    model = Approval
    fields = readonly_fields = (
        "approver",
        "tool",
        "policy_version",
        "approved_at",
        "expires_at",
        "consumed_at",
    )
    ordering = ["approved_at"]


class SignoffInline(ReadOnlyInline):
    """Reviewers' approvals of a call a rule gives to two people (docs/rules.md)."""

    model = Signoff
    fields = readonly_fields = (
        "approver",
        "reason",
        "policy_version",
        "signed_at",
        "approval",
    )
    ordering = ["signed_at"]


@admin.register(Step)
class StepAdmin(ReadOnlyAdmin):
    console_page = "step"

    list_display = [
        "key",
        "run",
        "tool_name",
        "state",
        "version",
        "attempt_count",
        "external_id",
        "updated_at",
    ]
    list_filter = [NeedsReviewFilter, "state", "tool", "run__workspace", "created_at"]
    search_fields = ["key", "=id", "=operation_id", "external_id", "run__name"]
    list_select_related = ["run"]
    date_hierarchy = "created_at"
    fieldsets = [
        (
            None,
            {"fields": ["id", "run", "position", "key", "tool", "state", "version", "chain"]},
        ),
        (
            "Call",
            {
                "fields": [
                    "input_summary",
                    "pretty_input",
                    "input_hash",
                    "operation_id",
                    "depends_on",
                    "compensates",
                ]
            },
        ),
        (
            "Outcome",
            {"fields": ["external_id", "pretty_result", "failure_class", "failure_message"]},
        ),
        (
            "Lease and retries",
            {
                "fields": [
                    "lease_owner",
                    "lease_expires_at",
                    "fence",
                    "attempt_count",
                    "not_before",
                    "first_scheduled_at",
                ]
            },
        ),
        ("Record", {"fields": ["head_hash", "created_at", "updated_at"]}),
    ]
    readonly_fields = ["chain", "pretty_input", "pretty_result"]
    inlines = [ApprovalInline, SignoffInline, AttemptInline, EventInline]

    @admin.display(description="tool", ordering="tool")
    def tool_name(self, step: Step) -> str:
        return step.tool_id

    @admin.display(description="input")
    def pretty_input(self, step: Step) -> str:
        tool = find_tool(step.tool_id)
        return pretty_json(step.input, fields=tool.redact if tool else frozenset())

    @admin.display(description="result")
    def pretty_result(self, step: Step) -> str:
        return pretty_json(step.result)

    @admin.display(description="event chain")
    def chain(self, step: Step) -> SafeString:
        report = verify_chain(step_ids=[step.pk])
        if report.ok:
            return format_html("intact ({} events)", report.events)
        finding = report.findings[0]
        return format_html(
            '<strong class="stepward-broken">broken at event {} (seq {}): {}</strong>',
            finding.event_id if finding.event_id is not None else "-",
            finding.seq if finding.seq is not None else "-",
            finding.problem,
        )


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin):
    list_display = [
        "__str__",
        "step",
        "number",
        "phase",
        "worker",
        "error_class",
        "cost",
        "claimed_at",
        "finished_at",
    ]
    list_filter = ["phase", "error_class", "claimed_at"]
    search_fields = ["=step__id", "step__key", "worker", "error_message"]
    list_select_related = ["step"]
    date_hierarchy = "claimed_at"
    readonly_fields = ["pretty_request", "pretty_response", "pretty_fenced_out"]
    fieldsets = [
        (None, {"fields": ["step", "number", "fence", "worker", "phase"]}),
        ("Evidence", {"fields": ["pretty_request", "pretty_response", "cost"]}),
        ("Error", {"fields": ["error_class", "error_message"]}),
        ("Fenced out", {"fields": ["fenced_out_at", "fenced_out_write", "pretty_fenced_out"]}),
        ("Times", {"fields": ["claimed_at", "submitted_at", "finished_at"]}),
    ]

    @admin.display(description="request evidence")
    def pretty_request(self, attempt: Attempt) -> str:
        return pretty_json(attempt.request_evidence)

    @admin.display(description="response evidence")
    def pretty_response(self, attempt: Attempt) -> str:
        return pretty_json(attempt.response_evidence)

    @admin.display(description="what the refused write carried")
    def pretty_fenced_out(self, attempt: Attempt) -> str:
        return pretty_json(attempt.fenced_out_evidence)


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "step", "seq", "from_state", "to_state", "actor", "reason"]
    list_filter = ["to_state", "from_state", "run__workspace", "created_at"]
    search_fields = ["=step__id", "=run__id", "step__key", "actor", "reason"]
    list_select_related = ["step"]
    date_hierarchy = "created_at"
    readonly_fields = ["pretty_data"]
    fieldsets = [
        (None, {"fields": ["run", "step", "seq", "from_state", "to_state", "actor", "reason"]}),
        ("Data", {"fields": ["pretty_data", "created_at"]}),
        ("Chain", {"fields": ["prev_hash", "hash"]}),
    ]

    @admin.display(description="data")
    def pretty_data(self, event: Event) -> str:
        return pretty_json(event.data)


class ApprovedByFilter(admin.SimpleListFilter):
    title = "approved by"
    parameter_name = "approved_by"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("person", "A person"), ("policy", "The tool's policy")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "person":
            return queryset.filter(approver__isnull=False)
        if self.value() == "policy":
            return queryset.filter(approver__isnull=True)
        return queryset


@admin.register(Approval)
class ApprovalAdmin(ReadOnlyAdmin):
    list_display = ["step", "tool", "approved_by", "approved_at", "expires_at", "status"]
    list_filter = [ApprovedByFilter, "tool", "approved_at"]
    search_fields = ["=step__id", "step__key", "approver__username", "reason"]
    list_select_related = ["step", "approver"]
    date_hierarchy = "approved_at"

    @admin.display(description="approved by", ordering="approver__username")
    def approved_by(self, approval: Approval) -> str:
        return approval.approver.get_username() if approval.approver else "policy"

    @admin.display(description="status")
    def status(self, approval: Approval) -> str:
        if approval.revoked_at:
            return "revoked"
        if approval.consumed_at:
            return "used"
        return "live"


@admin.register(DrillReport)
class DrillReportAdmin(ReadOnlyAdmin):
    console_page = "drill"

    list_display = [
        "started_at",
        "version",
        "passed",
        "duplicates",
        "lost",
        "left_for_review",
        "elapsed_seconds",
    ]
    list_filter = ["passed", "version", "started_at"]
    search_fields = ["version", "notes"]
    date_hierarchy = "started_at"
    readonly_fields = ["pretty_parameters", "pretty_interruption_points", "pretty_counts"]
    fieldsets = [
        (None, {"fields": ["version", "passed", "started_at", "finished_at", "elapsed_seconds"]}),
        ("Outcome", {"fields": ["duplicates", "lost", "left_for_review", "pretty_counts"]}),
        ("Drill", {"fields": ["pretty_parameters", "pretty_interruption_points", "notes"]}),
    ]

    @admin.display(description="parameters")
    def pretty_parameters(self, report: DrillReport) -> str:
        return pretty_json(report.parameters)

    @admin.display(description="interruption points")
    def pretty_interruption_points(self, report: DrillReport) -> str:
        return pretty_json(report.interruption_points)

    @admin.display(description="counts")
    def pretty_counts(self, report: DrillReport) -> str:
        return pretty_json(report.counts)


# --- company sign-in (docs/sign-in.md) --------------------------------------------------


@admin.register(SignInRole)
class SignInRoleAdmin(admin.ModelAdmin):
    """An identity provider group → a role in a workspace. Members of the group get the role
    at their next sign-in and lose it at the first sign-in without the group; a change or a
    deletion here applies at once to everyone who holds the role."""

    list_display = ["idp_group", "workspace", "role", "members", "created_at"]
    list_select_related = ["workspace"]
    list_filter = ["role", "workspace"]
    search_fields = ["idp_group", "workspace__slug"]
    autocomplete_fields = ["workspace"]
    fields = ["workspace", "idp_group", "role", "permissions", "members"]
    readonly_fields = ["permissions", "members"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[SignInRole]:
        return super().get_queryset(request).annotate(member_count=Count("group__user"))

    @admin.display(description="permissions on the workspace")
    def permissions(self, obj: SignInRole) -> str:
        return ", ".join(ROLE_PERMISSIONS.get(obj.role, ())) or "-"

    @admin.display(description="members now")
    def members(self, obj: SignInRole) -> int:
        count = getattr(obj, "member_count", None)
        if count is None:
            count = obj.group.user_set.count() if obj.group_id else 0
        return count

    def save_model(self, request: HttpRequest, obj: SignInRole, form: Any, change: bool) -> None:
        sign_in_role_save(role=obj)


@admin.register(SignInIdentity)
class SignInIdentityAdmin(admin.ModelAdmin):
    """Who a user is at the identity provider. Made at a first sign-in; add one by hand to let
    an existing account sign in through the provider (its issuer and subject, the `sub`)."""

    list_display = ["user", "subject", "issuer", "last_sign_in_at"]
    search_fields = ["user__username", "subject", "user__email"]
    list_filter = ["issuer"]
    autocomplete_fields = ["user"]
    fields = ["user", "issuer", "subject", "idp_groups", "created_at", "last_sign_in_at"]
    readonly_fields = ["idp_groups", "created_at", "last_sign_in_at"]


# --- notifications (docs/notifications.md) ---------------------------------------------------


class NotifySubscriptionForm(forms.ModelForm):
    class Meta:
        model = NotifySubscription
        fields = ["workspace", "name", "url", "kinds", "user", "active"]
        widgets = {"url": forms.TextInput(attrs={"size": 80, "autocomplete": "off"})}

    def clean_url(self) -> str:
        url = self.cleaned_data["url"].strip()
        problem = outbox.url_problem(url)
        if problem:
            raise forms.ValidationError(problem)
        return url


@admin.register(NotifySubscription)
class NotifySubscriptionAdmin(admin.ModelAdmin):
    """Who is told about a workspace's waiting items. NOTIFY_URLS adds its URLs to every
    workspace's; they are shown on the deliveries, not here."""

    form = NotifySubscriptionForm
    list_display = ["name", "workspace", "masked_url", "kinds", "user", "active"]
    list_filter = ["active", "workspace"]
    search_fields = ["name", "workspace__slug", "user__username"]
    list_select_related = ["workspace", "user"]
    autocomplete_fields = ["user"]
    actions = ["send_test"]

    @admin.display(description="URL")
    def masked_url(self, subscription: NotifySubscription) -> str:
        return outbox.masked(subscription.url)

    @admin.action(description="Send a test message now")
    def send_test(self, request: HttpRequest, queryset: QuerySet[NotifySubscription]) -> None:
        message = outbox.Message(
            "Stepward: test message",
            "A test of this subscription, sent from the admin.",
            {"event": "test", "workspace": None, "console_url": outbox.absolute("/")},
        )
        for subscription in queryset:
            error = outbox.apprise_send(subscription.url, message)
            if error is None:
                self.message_user(request, f"{subscription}: delivered.", messages.SUCCESS)
            else:
                self.message_user(request, f"{subscription}: {error}", messages.ERROR)


@admin.register(NotifyDelivery)
class NotifyDeliveryAdmin(ReadOnlyAdmin):
    """Every message, sent or not: what it held, how often it was tried, why it failed."""

    list_display = [
        "created_at",
        "target",
        "status",
        "items",
        "attempts",
        "send_after",
        "next_attempt_at",
        "sent_at",
        "last_error_short",
    ]
    list_filter = ["status", "created_at"]
    search_fields = ["target", "last_error", "subscriber"]
    date_hierarchy = "created_at"
    exclude = ["notifications"]
    readonly_fields = ["items"]
    actions = ["retry_now"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[NotifyDelivery]:
        through = NotifyDelivery.notifications.through
        return (
            super().get_queryset(request).annotate(item_count=count_of(through, "notifydelivery"))
        )

    @admin.display(description="items", ordering="item_count")
    def items(self, delivery: NotifyDelivery) -> str:
        count = getattr(delivery, "item_count", None)
        if count is None:
            count = delivery.notifications.count()
        return changelist_link(Notification, count, deliveries__id__exact=delivery.pk)

    @admin.display(description="last error")
    def last_error_short(self, delivery: NotifyDelivery) -> str:
        error = delivery.last_error
        return error if len(error) <= 120 else error[:119] + "…"

    @admin.action(description="Retry now")
    def retry_now(self, request: HttpRequest, queryset: QuerySet[NotifyDelivery]) -> None:
        """A pending one is tried at the next sweep; a failed one too, unless its subscriber
        has another message gathering items already."""
        retried = 0
        for delivery in queryset.exclude(status=DeliveryStatus.SENT):
            other = NotifyDelivery.objects.filter(
                subscriber=delivery.subscriber, status=DeliveryStatus.PENDING
            ).exclude(pk=delivery.pk)
            if other.exists():
                continue
            try:
                with transaction.atomic():
                    retried += NotifyDelivery.objects.filter(pk=delivery.pk).update(
                        status=DeliveryStatus.PENDING, next_attempt_at=None, attempts=0
                    )
            except IntegrityError:
                continue  # the sweeper opened a message for this subscriber meanwhile
        self.message_user(request, f"{retried} message(s) will be sent at the next sweep.")


@admin.register(Notification)
class NotificationAdmin(ReadOnlyAdmin):
    """What started waiting for a person, as the database recorded it with the move."""

    list_display = ["id", "kind", "step_link", "run_link", "created_at", "fanned_out_at"]
    list_filter = ["kind", "created_at"]
    search_fields = ["=step__id", "=run__id"]
    date_hierarchy = "created_at"

    @admin.display(description="step")
    def step_link(self, notification: Notification) -> str:
        if notification.step_id is None:
            return "-"
        url = reverse("admin:executor_step_change", args=[notification.step_id])
        return format_html('<a href="{}">{}</a>', url, notification.step_id)

    @admin.display(description="run")
    def run_link(self, notification: Notification) -> str:
        url = reverse("admin:executor_run_change", args=[notification.run_id])
        return format_html('<a href="{}">{}</a>', url, notification.run_id)
