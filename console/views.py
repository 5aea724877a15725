"""The reviewers' screens (DESIGN.md §12): inbox, step, runs, and the decisions on them.

Views stay thin: they find the object the reviewer may see, check the permission the
decision needs, and hand over to `executor.services`; reads come from `executor.selectors`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from functools import wraps
from typing import Any, Concatenate, cast
from urllib.parse import urlsplit

from django.contrib import messages
from django.contrib.auth.models import User
from django.contrib.auth.views import redirect_to_login
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, QueryDict
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import patch_vary_headers
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import (
    HttpResponseClientRedirect,
    HttpResponseClientRefresh,
    trigger_client_event,
)
from guardian.shortcuts import get_objects_for_user

from console.forms import (
    PAUSED_RUNS,
    BulkReplayForm,
    DecisionForm,
    ExtendBudgetForm,
    InboxFilterForm,
    ResolveForm,
    RunFilterForm,
)
from console.http import HtmxHttpRequest, ReviewerRequest
from executor import selectors, services
from executor.models import DrillReport, Run, RunStatus, Step, Workspace
from executor.selectors import Cursor, InboxFilter, InboxKind
from executor.services import Resolution
from executor.states import State
from executor.tools.base import Tool as ToolContract
from executor.tools.base import get_tool

# Client-side event that tells the navigation counts to refresh at once.
INBOX_CHANGED = "inbox-changed"
# A run page lists this many steps; the report above it still covers every step.
RUN_STEPS_SHOWN = 500
# The stacked progress bar, from done through in flight to what needs a person.
BAR_ORDER = (
    State.COMPLETED,
    State.COMPENSATED,
    State.VERIFYING,
    State.RUNNING,
    State.PENDING,
    State.APPROVED,
    State.PLANNED,
    State.UNKNOWN,
    State.BLOCKED,
    State.DEAD,
    State.FAILED,
    State.REJECTED,
    State.CANCELLED,
)


# States in which the engine moves a step on its own: its timeline refreshes itself.
IN_FLIGHT = (State.APPROVED, State.PENDING, State.RUNNING, State.VERIFYING)


# --- access -------------------------------------------------------------------------------


def reviewer_required[**P](
    view: Callable[Concatenate[ReviewerRequest, P], HttpResponse],
) -> Callable[Concatenate[HttpRequest, P], HttpResponse]:
    """login_required that also sends an htmx request to the sign-in page, not into a region."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: P.args, **kwargs: P.kwargs) -> HttpResponse:
        if request.user.is_authenticated and request.user.is_active:
            return view(cast(ReviewerRequest, request), *args, **kwargs)
        htmx = cast(HtmxHttpRequest, request).htmx
        if htmx:
            # The region's URL is no page to come back to; the page around it is.
            back = htmx.current_url_abs_path or reverse("inbox")
            return HttpResponseClientRedirect(redirect_to_login(back)["Location"])
        return redirect_to_login(request.get_full_path())

    return wrapper


def _visible_workspaces(request: ReviewerRequest) -> QuerySet[Workspace]:
    """The workspaces whose steps the reviewer may see: `review_steps` by guardian."""
    return get_objects_for_user(request.user, "executor.review_steps", klass=Workspace)


def _get_step_for_user(request: ReviewerRequest, pk: Any) -> Step:
    # Another workspace's step answers as if it did not exist, never 403: ids stay secret.
    return get_object_or_404(
        Step.objects.select_related("run", "run__workspace", "run__agent", "compensates"),
        pk=pk,
        run__workspace__in=_visible_workspaces(request),
    )


def _get_run_for_user(request: ReviewerRequest, pk: Any) -> Run:
    return get_object_or_404(
        Run.objects.select_related("workspace", "agent"),
        pk=pk,
        workspace__in=_visible_workspaces(request),
    )


def _may(user: User, permission: str, workspace: Workspace) -> bool:
    return user.is_active and user.has_perm(f"executor.{permission}", workspace)


def _refusal(permission: str, workspace: Workspace) -> str:
    return f"You need the {permission} permission on {workspace.slug} for this."


# --- rendering ----------------------------------------------------------------------------


# Short enough to read as "3 dead" in the navigation.
NAV_LABELS = {
    InboxKind.UNKNOWN: "unknown",
    InboxKind.APPROVAL: "to approve",
    InboxKind.COMPENSATION: "to undo",
    InboxKind.DEAD: "dead",
    InboxKind.BLOCKED: "blocked",
    InboxKind.FAILED_COMPENSATION: "undo failed",
    PAUSED_RUNS: "paused",
}


@dataclass(frozen=True)
class NavCounts:
    kinds: dict[str, int]
    paused: int

    @property
    def total(self) -> int:
        return sum(self.kinds.values()) + self.paused

    def items(self) -> list[tuple[str, str, int]]:
        """(key, short label, count) for the navigation, in the inbox's order."""
        rows = [(kind.value, NAV_LABELS[kind], self.kinds[kind]) for kind in InboxKind]
        return [*rows, (PAUSED_RUNS, NAV_LABELS[PAUSED_RUNS], self.paused)]


def _nav_counts(request: ReviewerRequest) -> NavCounts:
    ids = tuple(_visible_workspaces(request).values_list("pk", flat=True))
    counts = selectors.inbox_counts(inbox=InboxFilter(workspace_ids=ids))
    paused = selectors.paused_run_counts(workspace_ids=ids)
    return NavCounts(kinds=counts["all"], paused=paused["all"])


def _render(
    request: ReviewerRequest,
    template: str,
    context: dict[str, Any],
    *,
    partial: str | None = None,
    status: int = 200,
) -> HttpResponse:
    """The whole page, or only `partial` of it when htmx asks for a region.

    A history restore is htmx asking for the whole page again, so it gets one.
    """
    as_partial = partial and request.htmx and not request.htmx.history_restore_request
    if not as_partial and "#" not in template and "nav" not in context:
        context["nav"] = _nav_counts(request)
    name = f"{template}#{partial}" if as_partial else template
    response = render(request, name, context, status=status)
    # The same URL answers with a page or a region: caches must keep them apart.
    patch_vary_headers(response, ("HX-Request", "HX-Target"))
    return response


@require_GET
@reviewer_required
def nav_counts(request: ReviewerRequest) -> HttpResponse:
    return _render(request, "base.html", {"nav": _nav_counts(request)}, partial="nav-counts")


# --- inbox --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tab:
    value: str
    label: str
    count: int
    current: bool


def _inbox_context(request: ReviewerRequest, params: QueryDict) -> dict[str, Any]:
    """Everything the inbox shows, in a fixed number of queries whatever its size."""
    workspaces = list(_visible_workspaces(request).order_by("slug"))
    ids = tuple(w.pk for w in workspaces)
    form = InboxFilterForm(params, workspaces=workspaces, tools=selectors.tool_names())
    state = form.value("state") or ""
    workspace_id = form.value("workspace")
    inbox = InboxFilter(
        workspace_ids=ids,
        workspace_id=workspace_id,
        tool=form.value("tool") or "",
        kind="" if state == PAUSED_RUNS else state,
        older_than=form.older_than(),
    )
    now = timezone.now()
    counts = selectors.inbox_counts(inbox=inbox, now=now)
    paused_counts = selectors.paused_run_counts(workspace_ids=ids, workspace_id=workspace_id)
    size = form.page_size()
    steps: list[Step] = []
    next_cursor = None
    if state != PAUSED_RUNS:
        steps, next_cursor = selectors.inbox_page(
            inbox=inbox, after=Cursor.decode(form.value("after") or ""), size=size, now=now
        )
    paused = (
        selectors.paused_runs(workspace_ids=ids, workspace_id=workspace_id)
        if state in ("", PAUSED_RUNS)
        else []
    )
    replayable = set(
        get_objects_for_user(
            request.user, "executor.replay_deadletter", klass=Workspace
        ).values_list("pk", flat=True)
    )
    rows = [
        {
            "step": step,
            "kind": selectors.inbox_kind_of(step),
            "can_replay": step.state == State.DEAD and step.run.workspace_id in replayable,
        }
        for step in steps
    ]
    shown = counts["shown"]
    tabs = [
        Tab("", "Everything", sum(shown.values()) + paused_counts["shown"], state == ""),
        *(Tab(k.value, k.label, shown[k], state == k.value) for k in InboxKind),
        Tab(PAUSED_RUNS, "Paused runs", paused_counts["shown"], state == PAUSED_RUNS),
    ]
    filtered = any(params.get(name) for name in ("workspace", "tool", "age"))
    return {
        "params": params,
        "filter_form": form,
        "rows": rows,
        "paused": paused,
        "paused_count": paused_counts["shown"],
        "tabs": tabs,
        "state": state,
        "filtered": filtered,
        "next_cursor": next_cursor.encode() if next_cursor else "",
        "is_first_page": not form.value("after"),
        "size": size,
        "bulk_form": BulkReplayForm(),
        "show_bulk": bool(replayable) and state in ("", InboxKind.DEAD),
        "nav": NavCounts(kinds=counts["all"], paused=paused_counts["all"]),
    }


def _inbox_region(request: ReviewerRequest) -> str:
    # The polled list swaps only itself; a tab or a filter also redraws the filter form.
    return "inbox" if request.htmx.target == "inbox" else "inbox-list"


@require_GET
@reviewer_required
def inbox(request: ReviewerRequest) -> HttpResponse:
    context = _inbox_context(request, request.GET)
    return _render(request, "console/inbox.html", context, partial=_inbox_region(request))


def _return_params(request: ReviewerRequest) -> QueryDict:
    """The inbox filters the reviewer was looking at when they posted a bulk action."""
    url = request.htmx.current_url_abs_path if request.htmx else None
    if url is None:
        url = request.POST.get("next", "")
        if not url_has_allowed_host_and_scheme(url, allowed_hosts={request.get_host()}):
            url = ""
    return QueryDict(urlsplit(url).query)


@require_POST
@reviewer_required
def deadletters_replay(request: ReviewerRequest) -> HttpResponse:
    """Replays the checked dead letters, each at the version its row showed."""
    params = _return_params(request)
    form = BulkReplayForm(request.POST)

    def answer(status: int, *, notice: str = "", error: str = "") -> HttpResponse:
        context = _inbox_context(request, params)
        context.update(bulk_form=form, bulk_notice=notice, bulk_error=error)
        response = _render(
            request, "console/inbox.html", context, partial="inbox-list", status=status
        )
        return trigger_client_event(response, INBOX_CHANGED) if notice else response

    if not form.is_valid():
        return answer(422, error=" ".join(str(m) for ms in form.errors.values() for m in ms))
    picked: list[tuple[str, int]] = form.cleaned_data["steps"]
    ids = tuple(_visible_workspaces(request).values_list("pk", flat=True))
    steps = selectors.steps_visible(step_ids=[pk for pk, _ in picked], workspace_ids=ids)
    if len(steps) != len({pk for pk, _ in picked}):
        raise Http404("No such step.")
    for step in steps.values():
        if not _may(request.user, "replay_deadletter", step.run.workspace):
            return answer(403, error=_refusal("replay_deadletter", step.run.workspace))
    done, refused = services.deadletters_replay(
        steps=[(steps[pk], version) for pk, version in picked],
        user=request.user,
        reason=form.cleaned_data["reason"],
    )
    notice = f"Replayed {len(done)} dead letter{'s' if len(done) != 1 else ''}." if done else ""
    error = "; ".join(f"{step.key}: {why}" for step, why in refused)
    if not done:
        return answer(409, error=f"Nothing replayed. {error}")
    if request.htmx:
        return answer(200, notice=notice, error=error)
    messages.success(request, notice)
    if error:
        messages.warning(request, f"Not replayed: {error}")
    return redirect(f"{reverse('inbox')}?{params.urlencode()}" if params else reverse("inbox"))


# --- step ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolInfo:
    name: str
    effect: str
    idempotency: str
    has_lookup: bool
    lookup_authoritative: bool
    compensation: str
    needs_approval: bool
    registered: bool
    description: str = ""
    retry: dict[str, Any] = field(default_factory=dict)


def _tool_info(step: Step) -> ToolInfo:
    try:
        tool: ToolContract | None = get_tool(step.tool_id)
    except LookupError:
        tool = None
    if tool is None:
        # Gone from the code: the Tool table still holds what it declared.
        row = step.tool
        return ToolInfo(
            name=row.name,
            effect=row.effect,
            idempotency=row.idempotency,
            has_lookup=row.has_lookup,
            lookup_authoritative=False,
            compensation=row.compensation,
            needs_approval=True,
            registered=False,
        )
    return ToolInfo(
        name=tool.name,
        effect=str(tool.effect),
        idempotency=str(tool.idempotency),
        has_lookup=tool.has_lookup(),
        lookup_authoritative=tool.lookup_authoritative,
        compensation=tool.compensation,
        needs_approval=tool.needs_approval(),
        registered=True,
        description=tool.description,
        retry=tool.retry.as_dict(),
    )


@dataclass
class Decision:
    """One decision the step page offers: its form, or why the reviewer cannot take it."""

    name: str
    title: str
    button: str
    url: str
    permission: str
    allowed: bool
    form: DecisionForm
    fields: tuple[str, ...] = ("reason",)
    tone: str = ""
    help: str = ""
    error: str = ""


def _run_again_allowed(step: Step) -> bool:
    try:
        return services.run_again_allowed(step)
    except LookupError:
        return False


def _open_compensation(step: Step) -> Step | None:
    return (
        step.compensations.exclude(state__in=(State.REJECTED, State.CANCELLED, State.FAILED))
        .order_by("position")
        .first()
    )


def _decisions(
    request: ReviewerRequest,
    step: Step,
    tool: ToolInfo,
    *,
    bound: DecisionForm | None = None,
    failed: str = "",
    error: str = "",
) -> tuple[list[Decision], list[str]]:
    """The decisions that fit the step's state, and notes on the ones that do not apply.

    Each is shown with its form only when the reviewer holds its permission; the view
    that receives the form checks the permission again.
    """
    workspace = step.run.workspace
    decisions: list[Decision] = []
    notes: list[str] = []

    def offer(
        name: str,
        title: str,
        button: str,
        url_name: str,
        permission: str,
        form_class: type[DecisionForm] = DecisionForm,
        **extra: Any,
    ) -> None:
        initial: dict[str, Any] = {"version": step.version}
        if form_class is ResolveForm:
            initial["resolution"] = name.removeprefix("resolve-").replace("-", "_")
        form = bound if bound is not None and failed == name else None
        decisions.append(
            Decision(
                name=name,
                title=title,
                button=button,
                url=reverse(url_name, args=[step.pk]),
                permission=permission,
                allowed=_may(request.user, permission, workspace),
                form=form or form_class(initial=initial, auto_id=f"{name}-%s"),
                error=error if failed == name else "",
                **extra,
            )
        )

    approval = services.approval_permission(step)
    match step.state:
        case State.UNKNOWN:
            offer(
                "resolve-happened",
                "It happened",
                "Mark as completed",
                "step_resolve",
                "resolve_unknown",
                ResolveForm,
                fields=("external_id", "evidence", "reason"),
                help="You found the effect in the other system: record what you found.",
            )
            if _run_again_allowed(step):
                offer(
                    "resolve-run-again",
                    "It did not happen: run again",
                    "Run it again",
                    "step_resolve",
                    "resolve_unknown",
                    ResolveForm,
                    help="Sends the same operation again (same operation id).",
                )
            else:
                notes.append(
                    f"Running it again is not offered: {tool.name} is not safe to repeat and "
                    "has no authoritative lookup, so a second call could duplicate the effect."
                )
            offer(
                "resolve-give-up",
                "It did not happen: give up",
                "Give up",
                "step_resolve",
                "resolve_unknown",
                ResolveForm,
                tone="danger",
                help="The step becomes failed; nothing is sent again.",
            )
            if tool.has_lookup:
                offer(
                    "probe",
                    "Look it up again",
                    "Look it up again",
                    "step_probe",
                    "review_steps",
                    help="Asks the other system now whether this operation happened.",
                )
        case State.PLANNED:
            what = "compensation" if step.compensates_id else "call"
            offer("approve", "Approve", f"Approve this {what}", "step_approve", approval)
            offer("reject", "Reject", f"Reject this {what}", "step_reject", approval, tone="danger")
        case State.COMPLETED:
            if not tool.compensation:
                notes.append(f"Irreversible: {tool.name} declares no compensation.")
            elif (open_request := _open_compensation(step)) is not None:
                notes.append(f"A compensation is already {open_request.state}.")
            else:
                offer(
                    "compensate",
                    "Request compensation",
                    "Request compensation",
                    "step_compensate",
                    "approve_compensation",
                    help=f"Creates a {tool.compensation} step that undoes this one; "
                    "it waits for approval.",
                )
        case State.DEAD:
            offer(
                "replay",
                "Replay",
                "Replay this dead letter",
                "step_replay",
                "replay_deadletter",
                help="Sends it again with the same operation id; retries start afresh.",
            )
        case State.BLOCKED:
            offer(
                "resume",
                "Resume",
                "Resume this step",
                "step_resume",
                approval,
                help="Re-approves this exact call in your name; every check runs again.",
            )
        case _:
            notes.append(f"Nothing to decide while the step is {step.state}.")
    return decisions, notes


def _step_context(
    request: ReviewerRequest,
    step: Step,
    *,
    bound: DecisionForm | None = None,
    failed: str = "",
    error: str = "",
    notice: str = "",
) -> dict[str, Any]:
    tool = _tool_info(step)
    decisions, notes = _decisions(request, step, tool, bound=bound, failed=failed, error=error)
    return {
        "step": step,
        "run": step.run,
        "tool": tool,
        "decisions": decisions,
        "decision_notes": notes,
        # A failure that belongs to no form on the page (the step moved on) shows on top.
        "decision_error": error if error and not any(d.error for d in decisions) else "",
        "decision_notice": notice,
        "timeline": selectors.step_timeline(step=step),
        "compensations": list(step.compensations.order_by("position")),
        "polling": step.state in IN_FLIGHT,
    }


@require_GET
@reviewer_required
def step_page(request: ReviewerRequest, pk: Any) -> HttpResponse:
    step = _get_step_for_user(request, pk)
    return _render(request, "console/step.html", _step_context(request, step), partial="step")


@require_GET
@reviewer_required
def step_decisions(request: ReviewerRequest, pk: Any) -> HttpResponse:
    step = _get_step_for_user(request, pk)
    context = _step_context(request, step)
    return _render(request, "console/step.html#step-decisions", context)


@require_GET
@reviewer_required
def step_timeline(request: ReviewerRequest, pk: Any) -> HttpResponse:
    step = _get_step_for_user(request, pk)
    seen = request.GET.get("seen")
    if request.htmx and seen and seen != step.state:
        # The step left the state the page was drawn for: its decisions changed too.
        return HttpResponseClientRefresh()
    context = {
        "step": step,
        "timeline": selectors.step_timeline(step=step),
        "polling": step.state in IN_FLIGHT,
    }
    return _render(request, "console/step.html#step-timeline", context)


type Act = Callable[[Step, User, dict[str, Any]], str]


def _decide(
    request: ReviewerRequest,
    pk: Any,
    *,
    name: str,
    permission: Callable[[Step], str],
    form_class: type[DecisionForm],
    act: Act,
) -> HttpResponse:
    """The common path of every decision on a step.

    404 for a step the reviewer may not see, 403 without the permission, 422 for a form
    error, 409 when the step changed since the reviewer loaded it; otherwise the service
    acts and the reviewer sees the step as it is now.
    """
    step = _get_step_for_user(request, pk)
    needed = permission(step)
    form = form_class(request.POST, auto_id=f"{name}-%s")

    def refuse(status: int, error: str, *, keep_form: bool = True) -> HttpResponse:
        fresh = _get_step_for_user(request, pk)
        # A form drawn for a version that is gone would only fail again: draw it afresh.
        keep_form = keep_form and fresh.version == step.version
        context = _step_context(
            request, fresh, bound=form if keep_form else None, failed=name, error=error
        )
        return _render(request, "console/step.html", context, partial="step", status=status)

    if not _may(request.user, needed, step.run.workspace):
        return refuse(403, _refusal(needed, step.run.workspace))
    if not form.is_valid():
        return refuse(422, _form_problem(form))
    try:
        notice = act(step, request.user, form.cleaned_data)
    except services.NotPermitted as error:
        return refuse(403, error.message)
    except services.AlreadyHandled as error:
        return refuse(409, _handled_message(step, form.cleaned_data["version"], error))
    except services.Conflict as error:
        return refuse(409, error.message, keep_form=False)
    except services.Invalid as error:
        for field_name, problems in (error.details or {}).items():
            if field_name in form.fields:
                form.add_error(field_name, problems)
        return refuse(422, error.message)
    if request.htmx:
        fresh = _get_step_for_user(request, pk)
        response = _render(
            request,
            "console/step.html",
            _step_context(request, fresh, notice=notice),
            partial="step",
        )
        return trigger_client_event(response, INBOX_CHANGED)
    messages.success(request, notice)
    return redirect("step", pk=step.pk)


def _form_problem(form: DecisionForm) -> str:
    """The message above a refused form: field errors show at their fields, the rest here."""
    hidden = [
        f"{name}: {message}"
        for name, messages_ in form.errors.items()
        if name == "__all__" or form.fields[name].widget.is_hidden
        for message in messages_
    ]
    if hidden:
        return "This form could not be used (" + "; ".join(hidden) + "). Reload the page."
    return "Nothing was decided: check the field marked below."


def _handled_message(step: Step, seen: int, error: services.AlreadyHandled) -> str:
    """Names the first move after the version the reviewer saw: that is who beat them.

    The service names the newest event, which after an approval is the policy's own
    follow-up move (approved → pending), not the person who decided.
    """
    move = selectors.step_move_after(step=step, version=seen)
    if move is None:
        return error.message
    current = Step.objects.filter(pk=step.pk).values_list("state", flat=True).first()
    return (
        f"This step was already handled by {move.actor} at "
        f"{move.created_at:%Y-%m-%d %H:%M:%S} UTC ({move.from_state} → {move.to_state}; "
        f"now {current}). Nothing was changed by your decision."
    )


@require_POST
@reviewer_required
def step_approve(request: ReviewerRequest, pk: Any) -> HttpResponse:
    def act(step: Step, user: User, data: dict[str, Any]) -> str:
        services.step_approve(step=step, user=user, version=data["version"], reason=data["reason"])
        return "Approved."

    return _decide(
        request,
        pk,
        name="approve",
        permission=services.approval_permission,
        form_class=DecisionForm,
        act=act,
    )


@require_POST
@reviewer_required
def step_reject(request: ReviewerRequest, pk: Any) -> HttpResponse:
    def act(step: Step, user: User, data: dict[str, Any]) -> str:
        services.step_reject(step=step, user=user, version=data["version"], reason=data["reason"])
        return "Rejected."

    return _decide(
        request,
        pk,
        name="reject",
        permission=services.approval_permission,
        form_class=DecisionForm,
        act=act,
    )


RESOLVED = {
    Resolution.HAPPENED: "Marked as completed.",
    Resolution.RUN_AGAIN: "Sent to run again.",
    Resolution.GIVE_UP: "Given up: the step is failed.",
}


@require_POST
@reviewer_required
def step_resolve(request: ReviewerRequest, pk: Any) -> HttpResponse:
    resolution = request.POST.get("resolution", "")
    if resolution not in Resolution.values:
        resolution = Resolution.HAPPENED

    def act(step: Step, user: User, data: dict[str, Any]) -> str:
        services.step_resolve_unknown(
            step=step,
            user=user,
            version=data["version"],
            resolution=data["resolution"],
            reason=data["reason"],
            external_id=data.get("external_id", ""),
            evidence=data.get("evidence", ""),
        )
        return RESOLVED[Resolution(data["resolution"])]

    return _decide(
        request,
        pk,
        name="resolve-" + resolution.replace("_", "-"),
        permission=lambda step: "resolve_unknown",
        form_class=ResolveForm,
        act=act,
    )


@require_POST
@reviewer_required
def step_probe(request: ReviewerRequest, pk: Any) -> HttpResponse:
    def act(step: Step, user: User, data: dict[str, Any]) -> str:
        outcome = services.step_probe(
            step=step, user=user, version=data["version"], reason=data["reason"]
        )
        return f"Looked it up again: {outcome}."

    return _decide(
        request,
        pk,
        name="probe",
        permission=lambda step: "review_steps",
        form_class=DecisionForm,
        act=act,
    )


@require_POST
@reviewer_required
def step_replay(request: ReviewerRequest, pk: Any) -> HttpResponse:
    def act(step: Step, user: User, data: dict[str, Any]) -> str:
        services.deadletter_replay(
            step=step, user=user, version=data["version"], reason=data["reason"]
        )
        return "Replayed: the step is pending again."

    return _decide(
        request,
        pk,
        name="replay",
        permission=lambda step: "replay_deadletter",
        form_class=DecisionForm,
        act=act,
    )


@require_POST
@reviewer_required
def step_resume(request: ReviewerRequest, pk: Any) -> HttpResponse:
    def act(step: Step, user: User, data: dict[str, Any]) -> str:
        services.step_resume(step=step, user=user, version=data["version"], reason=data["reason"])
        return "Resumed: the step is pending again."

    return _decide(
        request,
        pk,
        name="resume",
        permission=services.approval_permission,
        form_class=DecisionForm,
        act=act,
    )


@require_POST
@reviewer_required
def step_compensate(request: ReviewerRequest, pk: Any) -> HttpResponse:
    def act(step: Step, user: User, data: dict[str, Any]) -> str:
        compensation = services.compensation_request(
            step=step, user=user, version=data["version"], reason=data["reason"]
        )
        return f"Compensation requested: {compensation.key} waits for approval."

    # DESIGN.md §11: requesting a compensation takes approve_compensation, as approving it does.
    return _decide(
        request,
        pk,
        name="compensate",
        permission=lambda step: "approve_compensation",
        form_class=DecisionForm,
        act=act,
    )


# --- runs ---------------------------------------------------------------------------------


@require_GET
@reviewer_required
def runs(request: ReviewerRequest) -> HttpResponse:
    workspaces = list(_visible_workspaces(request).order_by("slug"))
    form = RunFilterForm(request.GET, workspaces=workspaces)
    page, next_cursor = selectors.runs_page(
        workspace_ids=tuple(w.pk for w in workspaces),
        workspace_id=form.value("workspace"),
        status=form.value("status") or "",
        after=Cursor.decode(form.value("after") or ""),
        size=form.page_size(),
    )
    context = {
        "params": request.GET,
        "filter_form": form,
        "runs": page,
        "next_cursor": next_cursor.encode() if next_cursor else "",
        "is_first_page": not form.value("after"),
    }
    return _render(request, "console/runs.html", context, partial="runs-list")


@dataclass(frozen=True)
class BudgetLine:
    label: str
    used: str
    limit: str
    percent: str
    exhausted: bool


def _percent(used: float, limit: float | None) -> str:
    if not limit:
        return "0"
    return f"{max(0.0, min(100.0, used * 100 / limit)):.1f}"


def _budget_lines(run: Run) -> list[BudgetLine]:
    usage = selectors.run_usage(run=run)
    budget = selectors.run_budget(run=run)
    lines = [
        BudgetLine(
            "Calls",
            str(usage["calls"]),
            str(budget["max_calls"]) if budget["max_calls"] is not None else "",
            _percent(usage["calls"], budget["max_calls"]),
            budget["max_calls"] is not None and usage["calls"] >= budget["max_calls"],
        ),
        BudgetLine(
            "Cost",
            f"{run.used_cost.normalize():f}",
            f"{run.max_cost.normalize():f}" if run.max_cost is not None else "",
            _percent(usage["cost"], budget["max_cost"]),
            run.max_cost is not None and run.used_cost >= run.max_cost,
        ),
    ]
    elapsed = usage["elapsed_seconds"]
    allowed = (run.deadline - run.created_at).total_seconds() if run.deadline else None
    lines.append(
        BudgetLine(
            "Time",
            _duration(elapsed),
            _duration(allowed) if allowed is not None else "",
            _percent(elapsed, allowed),
            allowed is not None and elapsed >= allowed,
        )
    )
    return lines


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def _run_context(
    request: ReviewerRequest,
    run: Run,
    *,
    form: ExtendBudgetForm | None = None,
    error: str = "",
    notice: str = "",
) -> dict[str, Any]:
    counts = selectors.run_counts(run=run)
    # Asking the external systems for their own counts is a network call: only on request.
    report = selectors.run_report(run=run, external=request.GET.get("reconcile") == "1")
    shown = list(run.steps.order_by("position")[:RUN_STEPS_SHOWN])
    return {
        "run": run,
        "counts": counts,
        "total": sum(counts.values()),
        "bar": [(state.value, counts[state]) for state in BAR_ORDER if counts.get(state)],
        "budget_lines": _budget_lines(run),
        "report": report,
        "report_sections": [
            (name, report[name]) for name in selectors.REPORT_SECTIONS if report[name]
        ],
        "steps": shown,
        "steps_hidden": max(0, sum(counts.values()) - len(shown)),
        "run_events": list(run.run_events.order_by("-created_at", "-pk")[:20]),
        "can_extend": run.status == RunStatus.PAUSED
        and _may(request.user, "extend_budget", run.workspace),
        "extend_form": form
        or ExtendBudgetForm(initial={"version": run.version}, auto_id="extend-%s"),
        "extend_error": error,
        "extend_notice": notice,
        "polling": run.status in (RunStatus.OPEN, RunStatus.PAUSED),
    }


@require_GET
@reviewer_required
def run_page(request: ReviewerRequest, pk: Any) -> HttpResponse:
    run = _get_run_for_user(request, pk)
    return _render(request, "console/run.html", _run_context(request, run), partial="run")


@require_GET
@reviewer_required
def run_live(request: ReviewerRequest, pk: Any) -> HttpResponse:
    run = _get_run_for_user(request, pk)
    return _render(request, "console/run.html#run-live", _run_context(request, run))


@require_POST
@reviewer_required
def run_extend(request: ReviewerRequest, pk: Any) -> HttpResponse:
    """Extends a paused run's budget and, when asked, resumes it."""
    run = _get_run_for_user(request, pk)
    form = ExtendBudgetForm(request.POST, auto_id="extend-%s")

    def refuse(status: int, error: str, *, keep_form: bool = True) -> HttpResponse:
        fresh = _get_run_for_user(request, pk)
        context = _run_context(request, fresh, form=form if keep_form else None, error=error)
        return _render(request, "console/run.html", context, partial="run", status=status)

    if not _may(request.user, "extend_budget", run.workspace):
        return refuse(403, _refusal("extend_budget", run.workspace))
    if not form.is_valid():
        return refuse(422, _form_problem(form))
    data = form.cleaned_data
    try:
        services.run_extend_budget(
            run=run,
            user=request.user,
            version=data["version"],
            reason=data["reason"],
            add_calls=data.get("add_calls") or 0,
            add_cost=data.get("add_cost") or Decimal(0),
            extend_deadline_seconds=(data.get("extend_minutes") or 0) * 60,
            resume=bool(data.get("resume")),
        )
    except services.NotPermitted as error:
        return refuse(403, error.message)
    except services.AlreadyHandled as error:
        return refuse(409, error.message, keep_form=False)
    except services.Conflict as error:
        return refuse(409, error.message)
    except services.Invalid as error:
        return refuse(422, error.message)
    fresh = _get_run_for_user(request, pk)
    notice = "Budget extended" + (" and run resumed." if fresh.status == RunStatus.OPEN else ".")
    if request.htmx:
        response = _render(
            request, "console/run.html", _run_context(request, fresh, notice=notice), partial="run"
        )
        return trigger_client_event(response, INBOX_CHANGED)
    messages.success(request, notice)
    return redirect("run", pk=run.pk)


# --- recovery drills -------------------------------------------------------------------
# A drill tests the system, not a workspace's work: any signed-in reviewer may read them.


@require_GET
@reviewer_required
def drills(request: ReviewerRequest) -> HttpResponse:
    reports = DrillReport.objects.order_by("-started_at")[:100]
    return _render(request, "console/drills.html", {"reports": reports})


@require_GET
@reviewer_required
def drill_page(request: ReviewerRequest, pk: int) -> HttpResponse:
    report = get_object_or_404(DrillReport, pk=pk)
    context = {
        "report": report,
        "counts": sorted(report.counts.items()),
        "points": sorted(report.interruption_points.items()),
        "parameters": sorted(report.parameters.items()),
        "notes": [line for line in report.notes.splitlines() if line.strip()],
    }
    return _render(request, "console/drill.html", context)
