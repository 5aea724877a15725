"""Two rules of a step's attempts kept by a trigger instead of unique indexes (issue 25, bytes
a step; executor/ledger/guards.py): one open attempt a step (its partial index read `phase`,
so no move of an attempt could be a HOT update) and one attempt a fence (its index on (step,
fence) took about 100 bytes a step at a million steps).

The trigger is installed before the indexes are dropped, so a step is never without the
rules; the way back puts the indexes back before it drops the trigger.
"""

from __future__ import annotations

from django.db import migrations, models

from executor.ledger import guards


def install(apps, schema_editor) -> None:
    guards.install(schema_editor.connection)


def uninstall(apps, schema_editor) -> None:
    guards.uninstall(schema_editor.connection)


class Migration(migrations.Migration):
    dependencies = [
        ("executor", "0025_events_by_run_deduplicated"),
    ]

    operations = [
        migrations.RunPython(install, uninstall, elidable=False),
        migrations.RemoveConstraint(
            model_name="attempt",
            name="attempt_one_open_per_step",
        ),
        migrations.RemoveConstraint(
            model_name="attempt",
            name="attempt_unique_fence",
        ),
    ]
