"""Two rules of a step's attempts kept by a trigger instead of unique indexes (issue 25, bytes
a step; executor/ledger/guards.py): one open attempt a step (its partial index read `phase`,
so no move of an attempt could be a HOT update) and one attempt a fence (its index on (step,
fence) took about 100 bytes a step at a million steps).

The trigger is installed before the indexes are dropped, so a step is never without the
rules; the way back puts the indexes back before it drops the trigger.

On SQLite, dropping (or adding back) the unique (step, fence) rebuilds the attempts' table,
which drops its triggers: the counters' (migration 0018) and the guards are put back after.
"""

from __future__ import annotations

import importlib

from django.db import migrations

from executor.ledger import guards


def install(apps, schema_editor) -> None:
    guards.install(schema_editor.connection)


def uninstall(apps, schema_editor) -> None:
    guards.uninstall(schema_editor.connection)


def counter_triggers_back(apps, schema_editor) -> None:
    """The attempts' counter triggers of 0018, where SQLite's rebuild dropped them."""
    if schema_editor.connection.vendor != "sqlite":
        return
    counters = importlib.import_module("executor.migrations.0018_counters_and_indexes")
    for statement in counters.sqlite_statements():
        name = statement.split()[2]
        if name.startswith("stepward_attempts_"):
            schema_editor.execute(f"DROP TRIGGER IF EXISTS {name}")
            schema_editor.execute(statement)


def triggers_back(apps, schema_editor) -> None:
    counter_triggers_back(apps, schema_editor)
    install(apps, schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("executor", "0025_events_by_run_deduplicated"),
    ]

    operations = [
        # Unapplied last, after the way back has rebuilt the table.
        migrations.RunPython(migrations.RunPython.noop, counter_triggers_back, elidable=False),
        migrations.RunPython(install, uninstall, elidable=False),
        migrations.RemoveConstraint(
            model_name="attempt",
            name="attempt_one_open_per_step",
        ),
        migrations.RemoveConstraint(
            model_name="attempt",
            name="attempt_unique_fence",
        ),
        migrations.RunPython(triggers_back, migrations.RunPython.noop, elidable=False),
    ]
