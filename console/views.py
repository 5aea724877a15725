"""The reviewers' screens (DESIGN.md §12): inbox, step, runs, and the decisions on them.

Views stay thin: they find the object the reviewer may see, check the permission the
decision needs, and hand over to `executor.services`; reads come from `executor.ledger.selectors`.

Why one module of about 800 lines: one short view per console page and the helpers they
share; every decision on a step goes through one view, `step_decide`, driven by
`executor.services.decisions`.
"""

from __future__ import annotations

import csv
import io
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from functools import wraps
from typing import Any, Concatenate, cast
from urllib.parse import urlsplit

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.models import User
from django.contrib.auth.views import redirect_to_login
from django.core.handlers.asgi import ASGIRequest
from django.db.models import QuerySet
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    QueryDict,
    StreamingHttpResponse,
)
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
    BulkDecideForm,
    BulkReplayForm,
    DecisionFilterForm,
    DecisionForm,
    EvidenceForm,
    ExtendBudgetForm,
    InboxFilterForm,
    RunFilterForm,
)
from console.http import HtmxHttpRequest, ReviewerRequest
from executor.common.redaction import redact_text
from executor.ledger import selectors
from executor.ledger.records import (
    DrillReport,
    Event,
    Run,
    RunStatus,
    Step,
    Workspace,
    WorkspaceGroupObjectPermission,
    WorkspaceUserObjectPermission,
)
from executor.ledger.selectors import Cursor, InboxFilter, InboxKind, InboxSort
from executor.ledger.states import IN_FLIGHT, INBOX, PROGRESS_ORDER, REPORT_SECTIONS, State
from executor.services import decisions, desk, reviews
from executor.services.base import AlreadyHandled, Conflict, Invalid, NotPermitted
from executor.services.desk import claims_clear
from executor.services.reviews import approval_permission, requested_by, step_approval_status
from executor.services.runs import run_extend_budget

# Client-side event that tells the navigation counts to refresh at once.
INBOX_CHANGED = "inbox-changed"
# A run page lists this many steps; the report above it still covers every step.
RUN_STEPS_SHOWN = 100
# --- access -------------------------------------------------------------------------------


def reviewer_required[**P, R: HttpResponseBase](
    view: Callable[Concatenate[ReviewerRequest, P], R],
) -> Callable[Concatenate[HttpRequest, P], R | HttpResponse]:
    """login_required that also sends an htmx request to the sign-in page, not into a region."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: P.args, **kwargs: P.kwargs) -> R | HttpResponse:
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


def _workspace_permissions(request: ReviewerRequest, ids: tuple[int, ...]) -> dict[int, set[str]]:
    """The reviewer's permissions on each of the workspaces `ids`, own and by group, in one
    query (what the page offers; every action checks again when it is taken)."""
    user = request.user
    if not user.is_active:
        return {}
    if user.is_superuser:
        every = {"replay_deadletter", "approve_steps", "approve_compensation", "review_steps"}
        return {pk: set(every) for pk in ids}
    own = WorkspaceUserObjectPermission.objects.filter(user=user, content_object_id__in=ids)
    grouped = WorkspaceGroupObjectPermission.objects.filter(
        group__in=user.groups.all(), content_object_id__in=ids
    )
    rows = own.values_list("content_object_id", "permission__codename").union(
        grouped.values_list("content_object_id", "permission__codename")
    )
    found: dict[int, set[str]] = {}
    for workspace_id, codename in rows:
        found.setdefault(workspace_id, set()).add(codename)
    return found


def _page_links(
    params: QueryDict, page: selectors.Page[Any], number: int, total: int, size: int
) -> dict[str, Any]:
    """The pager: "page 2 of 6 · 137", and the previous and next pages' queries."""
    pages = max(1, -(-total // size))
    number = 1 if page.previous is None else min(max(number, 2), pages)
    links: dict[str, Any] = {"number": number, "pages": pages, "total": total, "size": size}
    base = params.copy()
    for name in ("after", "before", "page"):
        base.pop(name, None)
    if page.next is not None:
        after = base.copy()
        after.update({"after": page.next.encode(), "page": str(number + 1)})
        links["next"] = "?" + after.urlencode()
    if page.previous is not None:
        before = base.copy()
        if number > 2:
            before.update({"before": page.previous.encode(), "page": str(number - 1)})
        links["previous"] = "?" + before.urlencode() if before else "?"
    links["first"] = "?" + base.urlencode() if base else "?"
    return links


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
        search=form.search(),
    )
    sort = form.value("sort") or InboxSort.OLDEST
    now = timezone.now()
    counts = selectors.inbox_counts(inbox=inbox, now=now)
    paused_counts = selectors.paused_run_counts(workspace_ids=ids, workspace_id=workspace_id)
    size = form.page_size()
    page: selectors.Page[Step] = selectors.Page([], None, None)
    if state != PAUSED_RUNS:
        page = selectors.inbox_page(
            inbox=inbox,
            after=Cursor.decode(form.value("after") or ""),
            before=Cursor.decode(form.value("before") or ""),
            size=size,
            sort=sort,
            now=now,
        )
    # Paused runs are not steps: a search for a step does not list them.
    paused = (
        selectors.paused_runs(workspace_ids=ids, workspace_id=workspace_id)
        if state in ("", PAUSED_RUNS) and not inbox.search
        else []
    )
    allowed = _workspace_permissions(request, ids)
    rows = []
    for step in page.rows:
        held = getattr(step, "claim", None)
        may = allowed.get(step.run.workspace_id, set())
        rows.append(
            {
                "step": step,
                "kind": selectors.inbox_kind_of(step),
                "can_replay": step.state == State.DEAD and "replay_deadletter" in may,
                "can_decide": step.state == State.PLANNED and approval_permission(step) in may,
                "claim": held if held is not None and held.held(now) else None,
            }
        )
    shown = counts["shown"]
    tabs = [
        Tab("", "Everything", sum(shown.values()) + paused_counts["shown"], state == ""),
        *(Tab(k.value, k.label, shown[k], state == k.value) for k in InboxKind),
        Tab(PAUSED_RUNS, "Paused runs", paused_counts["shown"], state == PAUSED_RUNS),
    ]
    steps_total = shown[state] if state in shown else sum(shown.values())
    filtered = any(params.get(name) for name in ("workspace", "tool", "age", "q"))
    return {
        "params": params,
        "filter_form": form,
        "rows": rows,
        "paused": paused,
        "paused_count": paused_counts["shown"],
        "tabs": tabs,
        "state": state,
        "search": inbox.search,
        "sort": sort,
        "filtered": filtered,
        "pager": _page_links(params, page, form.page_number(), steps_total, size),
        "size": size,
        "bulk_form": BulkReplayForm(),
        # Only with a dead letter on the page that this reviewer may replay.
        "show_bulk": any(row["can_replay"] for row in rows),
        "show_bulk_decide": any(row["can_decide"] for row in rows),
        "nav": NavCounts(kinds=counts["all"], paused=paused_counts["all"]),
        "now": now,
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
    done, refused = reviews.deadletters_replay(
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


@require_POST
@reviewer_required
def steps_bulk_decide(request: ReviewerRequest) -> HttpResponse:
    """Approves or rejects the checked steps with one reason, each at the version its row
    showed and each checked on its own (permission, four eyes, rules, version): the answer
    names what became of every one."""
    params = _return_params(request)
    form = BulkDecideForm(request.POST)

    def answer(
        status: int, *, results: list[decisions.BulkResult] | None = None, error: str = ""
    ) -> HttpResponse:
        context = _inbox_context(request, params)
        context.update(bulk_results=results or [], bulk_error=error)
        response = _render(
            request, "console/inbox.html", context, partial="inbox-list", status=status
        )
        landed = any(result.landed for result in results or [])
        return trigger_client_event(response, INBOX_CHANGED) if landed else response

    if not form.is_valid():
        return answer(422, error=" ".join(str(m) for ms in form.errors.values() for m in ms))
    name = form.cleaned_data["decision"]
    picked: list[tuple[str, int]] = form.cleaned_data["steps"]
    ids = tuple(_visible_workspaces(request).values_list("pk", flat=True))
    steps = selectors.steps_visible(step_ids=[pk for pk, _ in picked], workspace_ids=ids)
    if len(steps) != len({pk for pk, _ in picked}):
        raise Http404("No such step.")
    decision = decisions.BY_NAME[name]
    # Nothing at all this reviewer may decide: refused as a whole, as one step's form is.
    if not any(
        _may(request.user, decision.permission(step), step.run.workspace) for step in steps.values()
    ):
        step = next(iter(steps.values()))
        return answer(403, error=_refusal(decision.permission(step), step.run.workspace))
    results = decisions.decide_many(
        name=name,
        steps=[(steps[pk], version) for pk, version in picked],
        user=request.user,
        reason=form.cleaned_data["reason"],
    )
    claims_clear(step_ids=[r.step.pk for r in results if r.landed])
    status = 200 if any(result.landed for result in results) else 409
    if request.htmx:
        return answer(status, results=results)
    for result in results:
        level = messages.success if result.landed else messages.warning
        level(request, f"{result.step.key}: {result.outcome.label} — {result.message}")
    return redirect(f"{reverse('inbox')}?{params.urlencode()}" if params else reverse("inbox"))


# --- claims -------------------------------------------------------------------------------


def _claim_answer(
    request: ReviewerRequest, step: Step, *, status: int = 200, error: str = "", notice: str = ""
) -> HttpResponse:
    """The region the claim button sat in: the inbox's list, or the step page."""
    if request.htmx and request.htmx.target == "inbox-list":
        context = _inbox_context(request, _return_params(request))
        context.update(bulk_error=error)
        return _render(request, "console/inbox.html", context, partial="inbox-list", status=status)
    if request.htmx:
        fresh = _get_step_for_user(request, step.pk)
        context = _step_context(request, fresh, error=error, notice=notice)
        return _render(request, "console/step.html", context, partial="step", status=status)
    if error:
        messages.error(request, error)
    elif notice:
        messages.success(request, notice)
    return redirect("step", pk=step.pk)


@require_POST
@reviewer_required
def step_claim(request: ReviewerRequest, pk: Any) -> HttpResponse:
    step = _get_step_for_user(request, pk)
    try:
        claim = desk.step_claim(step=step, user=request.user)
    except NotPermitted as error:
        return _claim_answer(request, step, status=403, error=error.message)
    except Conflict as error:
        return _claim_answer(request, step, status=409, error=error.message)
    return _claim_answer(
        request, step, notice=f"You are handling this step until {claim.expires_at:%H:%M} UTC."
    )


@require_POST
@reviewer_required
def step_release(request: ReviewerRequest, pk: Any) -> HttpResponse:
    step = _get_step_for_user(request, pk)
    try:
        desk.step_release(step=step, user=request.user)
    except NotPermitted as error:
        return _claim_answer(request, step, status=403, error=error.message)
    except Conflict as error:
        return _claim_answer(request, step, status=409, error=error.message)
    return _claim_answer(request, step, notice="Released: anyone may take it.")


# --- step ---------------------------------------------------------------------------------


@dataclass
class Offer:
    """A decision as the step page offers it: its form, or why the reviewer cannot take it."""

    decision: decisions.Decision
    name: str
    title: str
    button: str
    url: str
    permission: str
    # Why the reviewer cannot take it ("" when they can).
    refused: str
    form: DecisionForm
    fields: tuple[str, ...]
    tone: str = ""
    help: str = ""
    error: str = ""


def _form_class(decision: decisions.Decision) -> type[DecisionForm]:
    return EvidenceForm if "external_id" in decision.fields else DecisionForm


def _offers(
    request: ReviewerRequest,
    step: Step,
    tool: selectors.ToolInfo,
    *,
    bound: DecisionForm | None = None,
    failed: str = "",
    error: str = "",
) -> tuple[list[Offer], list[str]]:
    """The decisions the table offers for the step, each with its form when the reviewer
    holds its permission (the view that receives the form checks it again), and notes on
    those that do not apply."""
    applying, notes = decisions.offered(step, tool)
    offers = []
    for decision in applying:
        permission = decision.permission(step)
        refused = _refused(request.user, decision, step, permission)
        form = bound if bound is not None and failed == decision.name else None
        offers.append(
            Offer(
                decision=decision,
                name=decision.name,
                title=decision.title,
                button=decision.button_for(step),
                url=reverse("step_decide", args=[step.pk, decision.name]),
                permission=permission,
                refused=refused,
                form=form
                or _form_class(decision)(
                    initial={"version": step.version}, auto_id=f"{decision.name}-%s"
                ),
                fields=decision.fields,
                tone=decision.tone,
                help=decision.help,
                # A refused decision shows no form to carry its error: the page's top does.
                error=error if failed == decision.name and not refused else "",
            )
        )
    return offers, notes


def _refused(user: User, decision: decisions.Decision, step: Step, permission: str) -> str:
    if not _may(user, permission, step.run.workspace):
        return f"You need the {permission} permission on {step.run.workspace.slug}."
    refusal = decision.refuses(step, user)
    return refusal[:1].upper() + refusal[1:] + "." if refusal else ""


def _asked_by(actor: str) -> str:
    """Who asked for the step, as the summary's heading says it."""
    if actor.startswith("user:"):
        return f"What {actor.removeprefix('user:')} (a reviewer) asked"
    return "What the agent asked"


def _step_context(
    request: ReviewerRequest,
    step: Step,
    *,
    bound: DecisionForm | None = None,
    failed: str = "",
    error: str = "",
    notice: str = "",
) -> dict[str, Any]:
    tool = selectors.tool_info(name=step.tool_id, workspace_id=step.run.workspace_id)
    offers, notes = _offers(request, step, tool, bound=bound, failed=failed, error=error)
    return {
        "step": step,
        "run": step.run,
        "tool": tool,
        "asked_by": _asked_by(requested_by(step)),
        "approving": selectors.approval_to_give(step=step, tool=tool)
        if step.state == State.PLANNED
        else None,
        "approval_status": step_approval_status(step),
        "decisions": offers,
        "decision_notes": notes,
        # A failure that belongs to no form on the page (the step moved on) shows on top.
        "decision_error": error if error and not any(d.error for d in offers) else "",
        "decision_notice": notice,
        "timeline": selectors.step_timeline(step=step),
        "compensations": list(step.compensations.order_by("position")),
        "polling": step.state in IN_FLIGHT,
        **_step_live(request, step),
    }


def _step_live(request: ReviewerRequest, step: Step) -> dict[str, Any]:
    """The claim on the step and what the page polls with: a new version redraws the page's
    step region for whoever has it open, a new claim only its claim bar."""
    waits = step.state in INBOX or step.state == State.FAILED
    claim = selectors.step_claim_held(step=step) if waits else None
    return {
        "claim": claim,
        "claimable": waits,
        "mine": claim is not None and claim.user_id == request.user.pk,
        "claim_stamp": f"{claim.user_id}.{claim.expires_at.timestamp():.0f}" if claim else "0",
        "live_seconds": settings.CONSOLE_LIVE_SECONDS,
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
def step_live(request: ReviewerRequest, pk: Any) -> HttpResponse:
    """Whether the step changed since the page drew it: 204 if not; a decision (a new
    version) answers the step region drawn afresh and tells the navigation's counts to
    follow; a new or lapsed claim answers the claim bar alone, out of band, so that a reason
    being typed is not wiped."""
    step = _get_step_for_user(request, pk)
    live = _step_live(request, step)
    if request.GET.get("version") == str(step.version):
        if request.GET.get("claim") == live["claim_stamp"]:
            return HttpResponse(status=204)
        context = {"step": step, "run": step.run, "oob": True, **live}
        response = _render(request, "console/step.html#step-claim", context)
        response["HX-Reswap"] = "none"
        return response
    response = _render(request, "console/step.html", _step_context(request, step), partial="step")
    return trigger_client_event(response, INBOX_CHANGED)


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


@require_POST
@reviewer_required
def step_decide(request: ReviewerRequest, pk: Any, name: str) -> HttpResponse:
    """Carries out one decision of the table (executor/services/decisions.py) on a step.

    404 for a step the reviewer may not see or a decision that does not exist, 403 without
    the permission, 422 for a form error, 409 when the step changed since the reviewer
    loaded it; otherwise the service acts and the reviewer sees the step as it is now.
    """
    decision = decisions.BY_NAME.get(name)
    if decision is None:
        raise Http404("no such decision")
    step = _get_step_for_user(request, pk)
    needed = decision.permission(step)
    form = _form_class(decision)(request.POST, auto_id=f"{name}-%s")

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
        notice = decision.act(step, request.user, form.cleaned_data)
    except NotPermitted as error:
        return refuse(403, error.message)
    except AlreadyHandled as error:
        return refuse(409, _handled_message(step, form.cleaned_data["version"], error))
    except Conflict as error:
        return refuse(409, error.message, keep_form=False)
    except Invalid as error:
        for field_name, problems in (error.details or {}).items():
            if field_name in form.fields:
                form.add_error(field_name, problems)
        return refuse(422, error.message)
    fresh = _get_step_for_user(request, pk)
    if fresh.state not in INBOX:
        claims_clear(step_ids=[fresh.pk])
    if request.htmx:
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


def _handled_message(step: Step, seen: int, error: AlreadyHandled) -> str:
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
    """A length of time as a person says it: to the second under a minute, then to the
    nearest minute (an hour's deadline is "1 h", not "59 min 59 s")."""
    if seconds < 59.5:
        return f"{max(0, int(seconds + 0.5))} s"
    minutes = int(seconds / 60 + 0.5)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def _run_context(
    request: ReviewerRequest,
    run: Run,
    *,
    form: ExtendBudgetForm | None = None,
    error: str = "",
    notice: str = "",
) -> dict[str, Any]:
    counts = selectors.run_counts(run=run)
    # Reconciling reads every attempt of the run and asks the external systems for their
    # own counts (a network call): only on request.
    report = selectors.run_report_shown(
        run=run, counts=counts, reconcile=request.GET.get("reconcile") == "1"
    )
    after = _position(request.GET.get("after", ""))
    shown, next_after = selectors.run_steps_page(
        run=run, total=sum(counts.values()), after=after, size=RUN_STEPS_SHOWN
    )
    return {
        "run": run,
        "counts": counts,
        "total": sum(counts.values()),
        "bar": [(state.value, counts[state]) for state in PROGRESS_ORDER if counts.get(state)],
        "budget_lines": _budget_lines(run),
        "report": report,
        "report_sections": [
            (
                name,
                report[name],
                report["counts"][name],
                report["counts"][name] - len(report[name]),
            )
            for name in REPORT_SECTIONS
            if report["counts"][name]
        ],
        "steps": shown,
        "steps_after": after,
        "steps_next": next_after,
        "run_events": list(run.run_events.order_by("-created_at", "-pk")[:20]),
        "can_extend": run.status == RunStatus.PAUSED
        and _may(request.user, "extend_budget", run.workspace),
        "extend_form": form
        or ExtendBudgetForm(initial={"version": run.version}, auto_id="extend-%s"),
        "extend_error": error,
        "extend_notice": notice,
        "polling": run.status in (RunStatus.OPEN, RunStatus.PAUSED),
    }


def _position(text: str) -> int:
    """A page's `after` (a step position); anything else is the first page."""
    return int(text) if text.isdigit() and len(text) < 10 else 0


@require_GET
@reviewer_required
def run_page(request: ReviewerRequest, pk: Any) -> HttpResponse:
    run = _get_run_for_user(request, pk)
    return _render(request, "console/run.html", _run_context(request, run), partial="run")


@require_GET
@reviewer_required
def run_live(request: ReviewerRequest, pk: Any) -> HttpResponse:
    run = _get_run_for_user(request, pk)
    seen = request.GET.get("seen")
    if request.htmx and seen and seen != run.status:
        # Paused, resumed or cancelled since the page was drawn: its header and forms changed.
        return HttpResponseClientRefresh()
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
        run_extend_budget(
            run=run,
            user=request.user,
            version=data["version"],
            reason=data["reason"],
            add_calls=data.get("add_calls") or 0,
            add_cost=data.get("add_cost") or Decimal(0),
            extend_deadline_seconds=(data.get("extend_minutes") or 0) * 60,
            resume=bool(data.get("resume")),
        )
    except NotPermitted as error:
        return refuse(403, error.message)
    except AlreadyHandled as error:
        return refuse(409, error.message, keep_form=False)
    except Conflict as error:
        return refuse(409, error.message)
    except Invalid as error:
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


# --- decisions ----------------------------------------------------------------------------

DECISIONS_PAGE = 50
CSV_COLUMNS = (
    "at",
    "person",
    "decision",
    "from_state",
    "to_state",
    "workspace",
    "run",
    "step_key",
    "step_id",
    "tool",
    "reason",
)


def _decisions_filter(
    request: ReviewerRequest, params: QueryDict
) -> tuple[DecisionFilterForm, selectors.DecisionFilter, list[Workspace]]:
    workspaces = list(_visible_workspaces(request).order_by("slug"))
    ids = tuple(w.pk for w in workspaces)
    form = DecisionFilterForm(
        params,
        workspaces=workspaces,
        people=selectors.decision_people(workspace_ids=ids),
        tools=selectors.tool_names(),
    )
    workspace_id = form.value("workspace")
    since, until = form.bounds()
    decided = selectors.DecisionFilter(
        workspace_ids=(workspace_id,) if workspace_id in ids else ids,
        person=form.value("person") or "",
        tool=form.value("tool") or "",
        kind=form.value("kind") or "",
        since=since,
        until=until,
    )
    return form, decided, workspaces


@require_GET
@reviewer_required
def decisions_list(request: ReviewerRequest) -> HttpResponseBase:
    """Who decided what and why, newest first, filtered; `?format=csv` exports it all."""
    form, decided, _ = _decisions_filter(request, request.GET)
    problems = form.problems()
    if request.GET.get("format") == "csv":
        if problems:
            return HttpResponse(
                "Nothing exported: " + "; ".join(problems) + "\n",
                status=400,
                content_type="text/plain; charset=utf-8",
            )
        return _decisions_csv(request, decided)
    size = form.page_size() if request.GET.get("size") else DECISIONS_PAGE
    page = selectors.decisions_page(
        decisions=decided,
        after=Cursor.decode(form.value("after") or ""),
        before=Cursor.decode(form.value("before") or ""),
        size=size,
    )
    total = selectors.decisions_count(decisions=decided)
    export = request.GET.copy()
    for name in ("after", "before", "page", "size"):
        export.pop(name, None)
    export["format"] = "csv"
    context = {
        "params": request.GET,
        "filter_form": form,
        "problems": problems,
        "rows": [{"event": e, "kind": selectors.decision_kind_of(e)} for e in page.rows],
        "kinds": dict(selectors.DecisionKind.choices),
        "pager": _page_links(request.GET, page, form.page_number(), total, size),
        "csv_query": "?" + export.urlencode(),
    }
    return _render(request, "console/decisions.html", context, partial="decisions-list")


def _csv_cell(value: Any) -> str:
    """A cell a spreadsheet shows as text: no formula from a reason that starts with "="."""
    text = str(value)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def _csv_lines(rows: list[Event]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    for event in rows:
        writer.writerow(
            [
                _csv_cell(cell)
                for cell in (
                    event.created_at.isoformat(),
                    event.actor.removeprefix("user:"),
                    selectors.decision_kind_of(event),
                    event.from_state,
                    event.to_state,
                    event.run.workspace.slug,
                    event.run.name,
                    event.step.key,
                    event.step_id,
                    event.step.tool_id,
                    redact_text(event.reason),
                )
            ]
        )
    return buffer.getvalue()


def _next_chunk(chunks: Iterator[list[Event]]) -> list[Event] | None:
    return next(chunks, None)


def _decisions_csv(request: ReviewerRequest, decided: selectors.DecisionFilter) -> HttpResponseBase:
    """Streams every decision under the filter, a chunk of rows a query. Under ASGI the
    body is an async iterator (a sync one would be read whole before the first byte, as
    Django warns); under WSGI a plain generator."""
    header = ",".join(CSV_COLUMNS) + "\r\n"

    def lines() -> Iterator[str]:
        yield header
        for rows in selectors.decisions_chunks(decisions=decided):
            yield _csv_lines(rows)

    async def lines_async() -> AsyncIterator[str]:
        yield header
        chunks = selectors.decisions_chunks(decisions=decided)
        while True:
            rows = await sync_to_async(_next_chunk)(chunks)
            if rows is None:
                return
            yield _csv_lines(rows)

    body: Any = lines_async() if isinstance(request, ASGIRequest) else lines()
    response = StreamingHttpResponse(body, content_type="text/csv; charset=utf-8")
    stamp = timezone.now().strftime("%Y%m%d-%H%M")
    response["Content-Disposition"] = f'attachment; filename="decisions-{stamp}.csv"'
    return response


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
    points = report.interruption_points
    worker = _mapping(points.get("worker"))
    desk = _mapping(points.get("desk"))
    kills, freezes = _mapping(points.get("kills")), _mapping(points.get("freezes"))
    context = {
        "report": report,
        "counts": sorted(report.counts.items()),
        # Each fault point: how often it was set to fire and how often it did.
        "worker_points": [
            (name, _mapping(row).get("rate", 0), _mapping(row).get("hits", 0))
            for name, row in sorted(worker.items())
        ]
        # Reports of the first version kept only each point's rate, at the top level.
        or [(name, rate, "—") for name, rate in sorted(points.items()) if _is_number(rate)],
        "desk_faults": [
            (name, row.get("rate", 0), row.get("injected", "—"))
            for name, row in sorted(desk.items())
            if isinstance(row, dict)
        ],
        "disturbances": [
            ("Workers killed (SIGKILL)", kills.get("done", 0), _every(kills)),
            ("Workers frozen past their lease", freezes.get("done", 0), _every(freezes)),
            ("Worker crashes at fault points", points.get("worker_crashes", 0), ""),
            ("Stale fences refused by the desk", desk.get("stale_fence_refused", 0), ""),
            ("Stale fences refused by the ledger", points.get("fenced_out_attempts", 0), ""),
        ],
        "latency_ms": points.get("desk_latency_ms")
        if _is_number(points.get("desk_latency_ms"))
        else 0,
        "parameters": [(name, _plain(value)) for name, value in sorted(report.parameters.items())],
        "notes": [line for line in report.notes.splitlines() if line.strip()],
    }
    return _render(request, "console/drill.html", context)


def _mapping(value: Any) -> dict[str, Any]:
    """A report's JSON object, or an empty one where an older report wrote something else."""
    return value if isinstance(value, dict) else {}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _every(schedule: dict[str, Any]) -> str:
    every = schedule.get("every_seconds")
    return f"every {every:g} s" if _is_number(every) and every else "not scheduled"


def _plain(value: Any) -> str:
    """A parameter as a person reads it: a list as "a, b", a mapping as "k=v, …"."""
    if isinstance(value, list | tuple):
        return ", ".join(str(item) for item in value) or "none"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in sorted(value.items())) or "none"
    return str(value)
