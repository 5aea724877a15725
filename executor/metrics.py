"""What operators alert on (API.md "For operators: metrics"), read from the ledger at scrape
time: right however many web and worker hosts there are, since none keeps a count of its
own. One scrape costs a fixed number of queries, whatever the ledger's size.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

from django.db.models import Count, DurationField, ExpressionWrapper, F, Min, Q, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from executor.models import Attempt, Phase, Run, RunStatus, Step
from executor.selectors import INBOX_KIND_Q
from executor.states import State

# Posted → completed, in seconds: from a pure step's fraction of a second to a day's wait
# for a person.
STEP_SECONDS_BUCKETS = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 6 * 3600, 24 * 3600)
LEASE_EXPIRED = "lease_expired"


class LedgerCollector(Collector):
    """The series API.md names, each from one query over the ledger."""

    def __init__(self, now: datetime | None = None) -> None:
        self.now = now

    def collect(self) -> Iterator[Metric]:
        now = self.now or timezone.now()
        yield self.steps()
        yield self.inbox()
        yield from self.attempts()
        yield self.oldest_due(now)
        yield self.step_seconds()

    def steps(self) -> Metric:
        family = GaugeMetricFamily("stepward_steps", "Steps in each state, now.", labels=["state"])
        counts = dict(Step.objects.order_by().values_list("state").annotate(n=Count("pk")))
        for state in State:
            family.add_metric([state.value], counts.get(state.value, 0))
        return family

    def inbox(self) -> Metric:
        family = GaugeMetricFamily(
            "stepward_inbox",
            "What waits for a person, by reason: the console inbox's tabs, and paused runs.",
            labels=["reason"],
        )
        waiting = Step.objects.aggregate(
            **{kind: Count("pk", filter=condition) for kind, condition in INBOX_KIND_Q.items()}
        )
        for reason, n in waiting.items():
            family.add_metric([reason], n or 0)
        family.add_metric(["paused_run"], Run.objects.filter(status=RunStatus.PAUSED).count())
        return family

    def attempts(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "stepward_attempts",
            "Attempts by tool and how they ended: responded, an error class, abandoned "
            "(released unsent, or closed by recovery), or open.",
            labels=["tool", "outcome"],
        )
        recoveries = CounterMetricFamily(
            "stepward_lease_recoveries",
            "Attempts whose worker's lease expired and which recovery took over (DESIGN.md "
            "§7): a worker killed, frozen or partitioned.",
        )
        recovered = 0
        rows = (
            Attempt.objects.order_by()
            .values_list("step__tool", "phase", "error_class")
            .annotate(n=Count("pk"))
        )
        outcomes: dict[tuple[str, str], int] = {}
        for tool, phase, error_class, n in rows:
            if phase == Phase.ERRORED:
                outcome = error_class or "error"
            elif phase in (Phase.CLAIMED, Phase.SUBMITTING):
                outcome = "open"
            else:
                outcome = str(phase)
            outcomes[(tool, outcome)] = outcomes.get((tool, outcome), 0) + n
            if phase == Phase.ABANDONED and error_class == LEASE_EXPIRED:
                recovered += n
        for (tool, outcome), n in sorted(outcomes.items()):
            family.add_metric([tool, outcome], n)
        recoveries.add_metric([], recovered)
        yield family
        yield recoveries

    def oldest_due(self, now: datetime) -> Metric:
        oldest = (
            Step.objects.due(now)
            .of_open_runs()
            .aggregate(first=Min(Coalesce("not_before", "state_since")))["first"]
        )
        age = (now - oldest).total_seconds() if oldest else 0.0
        return GaugeMetricFamily(
            "stepward_oldest_due_seconds",
            "How long the oldest due step of an open run has waited for a worker (0: none).",
            value=max(0.0, age),
        )

    def step_seconds(self) -> Metric:
        took = ExpressionWrapper(F("state_since") - F("created_at"), output_field=DurationField())
        bounds = {f"le_{i}": bound for i, bound in enumerate(STEP_SECONDS_BUCKETS)}
        row = (
            Step.objects.filter(state=State.COMPLETED)
            .annotate(took=took)
            .aggregate(
                count=Count("pk"),
                total=Sum("took"),
                **{
                    name: Count("pk", filter=Q(took__lte=timedelta(seconds=bound)))
                    for name, bound in bounds.items()
                },
            )
        )
        buckets = [(f"{bound:g}", row[name] or 0) for name, bound in bounds.items()]
        buckets.append(("+Inf", row["count"] or 0))
        total = row["total"]
        return HistogramMetricFamily(
            "stepward_step_seconds",
            "Steps now completed, by the time from posted to completed.",
            buckets=buckets,
            sum_value=total.total_seconds() if total else 0.0,
        )
