"""The console's forms: the reviewers' decisions and the filters of the lists."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from django import forms
from django.core.exceptions import ValidationError

from executor.ledger.records import RunStatus, Workspace
from executor.ledger.selectors import DecisionKind, InboxKind, InboxSort

REASON_REQUIRED = "Give a reason: it is recorded with your decision."
PAGE_SIZE = 25
MAX_PAGE_SIZE = 100
PAUSED_RUNS = "paused"
AGES = {"1h": timedelta(hours=1), "1d": timedelta(days=1), "7d": timedelta(days=7)}


class DecisionForm(forms.Form):
    """What every decision carries: the version the reviewer saw and a reason."""

    reason = forms.CharField(
        label="Reason",
        max_length=2000,
        widget=forms.Textarea(attrs={"rows": 2}),
        error_messages={"required": REASON_REQUIRED},
    )
    version = forms.IntegerField(min_value=1, widget=forms.HiddenInput)


class EvidenceForm(DecisionForm):
    """A decision that records what a person found: "it happened"."""

    external_id = forms.CharField(label="External id", max_length=200, required=False)
    evidence = forms.CharField(
        label="Evidence",
        max_length=2000,
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="Where you found it: a link, a ticket, what the other system said.",
    )
    field_order = ["external_id", "evidence", "reason", "version"]


class ExtendBudgetForm(DecisionForm):
    add_calls = forms.IntegerField(label="Add calls", min_value=0, required=False, initial=0)
    add_cost = forms.DecimalField(
        label="Add cost", min_value=0, max_digits=14, decimal_places=4, required=False, initial=0
    )
    extend_minutes = forms.IntegerField(
        label="Extend the deadline by (minutes)", min_value=0, required=False, initial=0
    )
    resume = forms.BooleanField(label="Resume the run", required=False, initial=True)
    field_order = ["add_calls", "add_cost", "extend_minutes", "resume", "reason", "version"]


class StepVersionsField(forms.Field):
    """Checked rows, each `<step id>:<version>`: the version is the one the reviewer saw."""

    widget = forms.MultipleHiddenInput

    def to_python(self, value: Any) -> list[tuple[str, int]]:
        picked: list[tuple[str, int]] = []
        for item in value or []:
            try:
                step_id, version = str(item).rsplit(":", 1)
                picked.append((str(uuid.UUID(step_id)), int(version)))
            except ValueError:
                raise ValidationError(f"{item!r} is not a step and its version") from None
        return picked

    def validate(self, value: Any) -> None:
        if self.required and not value:
            raise ValidationError(self.error_messages["required"], code="required")


class BulkReplayForm(forms.Form):
    steps = StepVersionsField(error_messages={"required": "Select at least one dead letter."})
    reason = DecisionForm.base_fields["reason"]
    next = forms.CharField(required=False, widget=forms.HiddenInput)


class BulkDecideForm(forms.Form):
    """One decision (approve or reject) and one reason for every checked step."""

    steps = StepVersionsField(error_messages={"required": "Select at least one step."})
    reason = DecisionForm.base_fields["reason"]
    decision = forms.ChoiceField(choices=[("approve", "Approve"), ("reject", "Reject")])
    next = forms.CharField(required=False, widget=forms.HiddenInput)


def _page_size(value: str) -> int:
    try:
        size = int(value)
    except (TypeError, ValueError):
        return PAGE_SIZE
    # Capped, not refused: an edited URL still gets a page, only a bounded one.
    return max(1, min(MAX_PAGE_SIZE, size))


class ListForm(forms.Form):
    """A list's filters. Invalid values are dropped rather than refused: it is a GET."""

    workspace = forms.TypedChoiceField(
        label="Workspace", coerce=int, required=False, empty_value=None
    )
    after = forms.CharField(required=False, widget=forms.HiddenInput)
    before = forms.CharField(required=False, widget=forms.HiddenInput)
    size = forms.CharField(required=False, widget=forms.HiddenInput)

    def __init__(self, data: Any, *, workspaces: Iterable[Workspace], **kwargs: Any) -> None:
        super().__init__(data, **kwargs)
        field = self.fields["workspace"]
        assert isinstance(field, forms.TypedChoiceField)
        field.choices = [("", "All workspaces"), *((w.pk, w.name) for w in workspaces)]

    def value(self, name: str) -> Any:
        self.is_valid()
        return self.cleaned_data.get(name) if name not in self.errors else None

    def page_size(self) -> int:
        return _page_size(self.data.get("size", ""))

    def page_number(self) -> int:
        """The page's number as the links that led here counted it (1 on a first page)."""
        if not (self.data.get("after") or self.data.get("before")):
            return 1
        try:
            return max(1, min(1_000_000, int(self.data.get("page", ""))))
        except (TypeError, ValueError):
            return 1


class InboxFilterForm(ListForm):
    tool = forms.ChoiceField(label="Tool", required=False)
    state = forms.ChoiceField(
        label="Waiting as",
        required=False,
        choices=[("", "Everything"), *InboxKind.choices, (PAUSED_RUNS, "Paused runs")],
    )
    age = forms.ChoiceField(
        label="Age",
        required=False,
        choices=[
            ("", "Any age"),
            ("1h", "Older than 1 hour"),
            ("1d", "Older than 1 day"),
            ("7d", "Older than 7 days"),
        ],
    )
    q = forms.CharField(
        label="Search",
        required=False,
        max_length=200,
        strip=True,
        help_text="A key, an operation or step id, an external id, a tool, words of the summary",
    )
    sort = forms.ChoiceField(label="Sort", required=False, choices=InboxSort.choices)
    field_order = ["q", "workspace", "state", "tool", "age", "sort", "after", "size"]

    def __init__(
        self, data: Any, *, workspaces: Iterable[Workspace], tools: Iterable[str], **kwargs: Any
    ) -> None:
        super().__init__(data, workspaces=workspaces, **kwargs)
        field = self.fields["tool"]
        assert isinstance(field, forms.ChoiceField)
        field.choices = [("", "All tools"), *((name, name) for name in tools)]

    def older_than(self) -> timedelta | None:
        return AGES.get(self.value("age") or "")

    def search(self) -> str:
        # Too long to be anything a step holds: searched as its first 200 characters.
        return (self.value("q") or str(self.data.get("q", ""))[:200]).strip()


class RunFilterForm(ListForm):
    status = forms.ChoiceField(
        label="Status", required=False, choices=[("", "Any status"), *RunStatus.choices]
    )
    field_order = ["workspace", "status", "after", "size"]


# Days a decisions filter can name: a wider range is a typo (or a probe), and its bounds
# would not fit a datetime (9999-12-31 plus one day).
FIRST_YEAR, LAST_YEAR = 2000, 2999


class DayField(forms.DateField):
    """A day (YYYY-MM-DD) within FIRST_YEAR and LAST_YEAR."""

    def validate(self, value: Any) -> None:
        super().validate(value)
        if value and not FIRST_YEAR <= value.year <= LAST_YEAR:
            raise ValidationError(
                f"{value:%Y-%m-%d} is not a day between {FIRST_YEAR} and {LAST_YEAR}",
                code="out_of_range",
            )


class DecisionFilterForm(ListForm):
    """The decisions page's filters. A bad day is reported, and ignored on the page."""

    person = forms.ChoiceField(label="Person", required=False)
    tool = forms.ChoiceField(label="Tool", required=False)
    kind = forms.ChoiceField(
        label="Decision", required=False, choices=[("", "Any decision"), *DecisionKind.choices]
    )
    since = DayField(label="From", required=False, widget=forms.DateInput(attrs={"type": "date"}))
    until = DayField(
        label="To (inclusive)", required=False, widget=forms.DateInput(attrs={"type": "date"})
    )
    field_order = ["workspace", "person", "tool", "kind", "since", "until", "after", "size"]

    def __init__(
        self,
        data: Any,
        *,
        workspaces: Iterable[Workspace],
        people: Iterable[str],
        tools: Iterable[str],
        **kwargs: Any,
    ) -> None:
        super().__init__(data, workspaces=workspaces, **kwargs)
        person = self.fields["person"]
        tool = self.fields["tool"]
        assert isinstance(person, forms.ChoiceField)
        assert isinstance(tool, forms.ChoiceField)
        person.choices = [("", "Everyone"), *((name, name) for name in people)]
        tool.choices = [("", "All tools"), *((name, name) for name in tools)]

    def problems(self) -> list[str]:
        """What in the query was not understood, as a person reads it ("until: …")."""
        self.is_valid()
        return [
            f"{self.fields[name].label or name}: {message}"
            for name, messages in self.errors.items()
            if name in ("since", "until", "person", "tool", "kind")
            for message in messages
        ]

    def bounds(self) -> tuple[datetime | None, datetime | None]:
        """The days as times: from the start of `since` to the end of `until` (UTC)."""
        since: date | None = self.value("since")
        until: date | None = self.value("until")
        return (
            datetime.combine(since, time.min, tzinfo=UTC) if since else None,
            datetime.combine(until, time.min, tzinfo=UTC) + timedelta(days=1) if until else None,
        )
