"""The chain's digests as their 32 bytes on PostgreSQL (issue 25: bytes a step).

On PostgreSQL the columns become `bytea`, each value decoded from its hex in the same
statement (one rewrite of each table); elsewhere (SQLite) they stay hex text, and only the
field changes. Reversible: back to hex text.
"""
from __future__ import annotations

from django.db import migrations

import executor.ledger.records

COLUMNS = {
    "executor_event": ("prev_hash", "hash", "step_digest"),
    "executor_step": ("head_hash",),
}


def _alter(schema_editor, *, to_bytes: bool) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    quote = schema_editor.quote_name
    for table, columns in COLUMNS.items():
        clauses = [
            f"ALTER COLUMN {quote(c)} TYPE bytea USING decode({quote(c)}, 'hex')"
            if to_bytes
            else f"ALTER COLUMN {quote(c)} TYPE varchar(64) USING encode({quote(c)}, 'hex')"
            for c in columns
        ]
        schema_editor.execute(f"ALTER TABLE {quote(table)} {', '.join(clauses)}")


def forwards(apps, schema_editor) -> None:
    _alter(schema_editor, to_bytes=True)


def backwards(apps, schema_editor) -> None:
    _alter(schema_editor, to_bytes=False)


def _field(**kwargs):
    return executor.ledger.records.DigestField(max_length=64, **kwargs)


class Migration(migrations.Migration):
    dependencies = [
        ("executor", "0021_run_closed"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(model_name="event", name="hash", field=_field()),
                migrations.AlterField(
                    model_name="event", name="prev_hash", field=_field(blank=True)
                ),
                migrations.AlterField(
                    model_name="event", name="step_digest", field=_field(blank=True)
                ),
                migrations.AlterField(
                    model_name="step", name="head_hash", field=_field(blank=True)
                ),
            ],
            database_operations=[migrations.RunPython(forwards, backwards, elidable=False)],
        ),
    ]
