"""What operators alert on (API.md "For operators: metrics", docs/metrics.md).

Counts come from the counters the database keeps as the ledger moves (executor/ledger/counters.py):
a counter only grows, and a scrape reads a few small rows whatever the ledger's size. The
gauges that no counter holds read small indexed sets (failed compensations, paused runs,
due steps). One scrape is four statements, right however many web and worker hosts there
are, since none keeps a count of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

from django.db.models import Min
from django.db.models.functions import Coalesce
from django.utils import timezone
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from executor.ledger.counters import counter_values
from executor.ledger.records import Run, RunStatus, Step
from executor.ledger.selectors import FAILED_COMPENSATION, InboxKind
from executor.ledger.states import State

# Posted → completed, in seconds: from a pure step's fraction of a second to a day's wait
# for a person. The triggers of migration 0018 sort each completion into these (the same
# list, written there as SQL).
STEP_SECONDS_BUCKETS = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 6 * 3600, 24 * 3600)

Values = dict[tuple[str, str, str], float]


class LedgerCollector(Collector):
    """The series API.md names."""

    def __init__(self, now: datetime | None = None) -> None:
        self.now = now

    def collect(self) -> Iterator[Metric]:
        now = self.now or timezone.now()
        values = counter_values()
        yield self.steps(values)
        yield self.inbox(values)
        yield from self.attempts(values)
        yield self.oldest_due(now)
        yield self.step_seconds(values)

    def steps(self, values: Values) -> Metric:
        family = GaugeMetricFamily("stepward_steps", "Steps in each state, now.", labels=["state"])
        for state in State:
            family.add_metric([state.value], values.get(("steps", state.value, ""), 0))
        return family

    def inbox(self, values: Values) -> Metric:
        family = GaugeMetricFamily(
            "stepward_inbox",
            "What waits for a person, by reason: the console inbox's tabs, and paused runs.",
            labels=["reason"],
        )

        def steps(state: State, name: str = "steps") -> float:
            return values.get((name, state.value, ""), 0)

        planned_compensations = steps(State.PLANNED, "compensation_steps")
        waiting = {
            InboxKind.UNKNOWN: steps(State.UNKNOWN),
            InboxKind.APPROVAL: steps(State.PLANNED) - planned_compensations,
            InboxKind.COMPENSATION: planned_compensations,
            InboxKind.DEAD: steps(State.DEAD),
            InboxKind.BLOCKED: steps(State.BLOCKED),
            # A failed compensation waits while the effect it should undo stands: that
            # depends on another step's state, so it is counted here, among the few steps
            # that compensate (the `step_compensates` index).
            InboxKind.FAILED_COMPENSATION: Step.objects.filter(FAILED_COMPENSATION).count(),
        }
        for reason, n in waiting.items():
            family.add_metric([str(reason)], n)
        family.add_metric(["paused_run"], Run.objects.filter(status=RunStatus.PAUSED).count())
        return family

    def attempts(self, values: Values) -> Iterator[Metric]:
        closed = CounterMetricFamily(
            "stepward_attempts",
            "Attempts that ended, by tool and how: responded, an error class, or abandoned "
            "(released unsent, or closed by recovery). Counted once, when the attempt ends.",
            labels=["tool", "outcome"],
        )
        in_flight = GaugeMetricFamily(
            "stepward_attempts_open",
            "Attempts in flight now (claimed or submitting), by tool.",
            labels=["tool"],
        )
        for (name, tool, outcome), n in sorted(values.items()):
            if name == "attempts":
                closed.add_metric([tool, outcome], n)
            elif name == "attempts_open":
                in_flight.add_metric([tool], n)
        recoveries = CounterMetricFamily(
            "stepward_lease_recoveries",
            "Attempts whose worker's lease expired and which recovery took over (DESIGN.md "
            "§7): a worker killed, frozen or partitioned.",
            value=values.get(("lease_recoveries", "", ""), 0),
        )
        yield closed
        yield in_flight
        yield recoveries

    def oldest_due(self, now: datetime) -> Metric:
        # Pending steps only (the `step_due_in_run` partial index): the backlog, not history.
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

    def step_seconds(self, values: Values) -> Metric:
        buckets = []
        seen = 0.0
        for bound in STEP_SECONDS_BUCKETS:
            seen += values.get(("step_seconds_bucket", f"{bound:g}", ""), 0)
            buckets.append((f"{bound:g}", seen))
        seen += values.get(("step_seconds_bucket", "+Inf", ""), 0)
        buckets.append(("+Inf", seen))
        return HistogramMetricFamily(
            "stepward_step_seconds",
            "Steps that ever completed, by the time from posted to completed; observed once, "
            "when the step completes (a later compensation does not take it back).",
            buckets=buckets,
            sum_value=values.get(("step_seconds_sum", "", ""), 0),
        )
