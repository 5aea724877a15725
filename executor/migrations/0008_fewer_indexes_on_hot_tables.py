"""Drops the indexes that other indexes already lead with (each is one more write for every
step, event and approval inserted), and indexes two mostly empty foreign keys where set only.

Only the indexes change in the database: the foreign keys stay as they are, where altering
the fields would have dropped and re-validated each one (a scan of the whole table). On
PostgreSQL the indexes are made and dropped CONCURRENTLY, so posting and draining go on
while a large table is read to build them.
"""

from __future__ import annotations

from typing import Any

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

# Django's names for the foreign keys' own indexes, and their tables and columns.
DROPPED = [
    ("executor_approval_approver_id_20ffd8b7", "executor_approval", "approver_id"),
    ("executor_event_run_id_d42b355d", "executor_event", "run_id"),
    ("executor_event_step_id_5cfdc8ba", "executor_event", "step_id"),
    ("executor_step_compensates_id_89ee80e3", "executor_step", "compensates_id"),
    ("executor_step_run_id_1e2630ac", "executor_step", "run_id"),
    ("executor_step_tool_90be21ce", "executor_step", "tool"),
]
# And the LIKE index PostgreSQL had beside the last one (not made again when reversed).
DROPPED_LIKE = "executor_step_tool_90be21ce_like"
# Indexes where the column is set only, made before the full ones go.
PARTIAL = [
    ("approval_by_person", "executor_approval", "approver_id"),
    ("step_compensates", "executor_step", "compensates_id"),
]


def _how(schema_editor: Any) -> str:
    return "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""


def forwards(apps: Any, schema_editor: Any) -> None:
    how = _how(schema_editor)
    for name, table, column in PARTIAL:
        schema_editor.execute(
            f"CREATE INDEX {how}IF NOT EXISTS {name} ON {table} ({column}) "
            f"WHERE {column} IS NOT NULL"
        )
    for name in [*(name for name, _, _ in DROPPED), DROPPED_LIKE]:
        schema_editor.execute(f"DROP INDEX {how}IF EXISTS {name}")


def backwards(apps: Any, schema_editor: Any) -> None:
    how = _how(schema_editor)
    for name, table, column in DROPPED:
        schema_editor.execute(f"CREATE INDEX {how}IF NOT EXISTS {name} ON {table} ({column})")
    for name, _, _ in PARTIAL:
        schema_editor.execute(f"DROP INDEX {how}IF EXISTS {name}")


class Migration(migrations.Migration):
    atomic = False  # CREATE/DROP INDEX CONCURRENTLY run outside a transaction

    dependencies = [
        ("executor", "0007_run_actions_and_no_closed_status"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="approval",
                    name="approver",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        help_text="Empty when the tool's policy approved the step.",
                        null=True,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="approvals",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
                migrations.AlterField(
                    model_name="event",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="events",
                        to="executor.run",
                    ),
                ),
                migrations.AlterField(
                    model_name="event",
                    name="step",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="events",
                        to="executor.step",
                    ),
                ),
                migrations.AlterField(
                    model_name="step",
                    name="compensates",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="compensations",
                        to="executor.step",
                    ),
                ),
                migrations.AlterField(
                    model_name="step",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="steps",
                        to="executor.run",
                    ),
                ),
                migrations.AlterField(
                    model_name="step",
                    name="tool",
                    field=models.ForeignKey(
                        db_column="tool",
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="+",
                        to="executor.tool",
                        to_field="name",
                    ),
                ),
                migrations.AddIndex(
                    model_name="approval",
                    index=models.Index(
                        condition=models.Q(("approver__isnull", False)),
                        fields=["approver"],
                        name="approval_by_person",
                    ),
                ),
                migrations.AddIndex(
                    model_name="step",
                    index=models.Index(
                        condition=models.Q(("compensates__isnull", False)),
                        fields=["compensates"],
                        name="step_compensates",
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(forwards, backwards)],
        ),
    ]
