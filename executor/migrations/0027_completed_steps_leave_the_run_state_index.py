"""Completed steps leave the run page's index by state (issue 25, bytes a step): (run, state,
position) holds every step but the completed ones. They are most of a ledger, and nothing
looks for them by state but the run page's report, which now reads a run's first completed
steps in posting order from (run, position). At a million steps the index held about 100
bytes a step.

The new index is built before the old one is dropped: a few seconds a million steps on
PostgreSQL, holding a SHARE lock on the steps (moves wait; docs/operations.md).
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("executor", "0026_attempt_rules_by_trigger"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="step",
            index=models.Index(
                condition=~models.Q(state="completed"),
                fields=["run", "state", "position"],
                name="step_run_incomplete",
            ),
        ),
        migrations.RemoveIndex(model_name="step", name="step_run_state"),
    ]
