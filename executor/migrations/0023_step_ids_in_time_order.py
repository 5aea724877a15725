"""Fewer bytes a step (issue 25): new steps' ids in time order (UUIDv7: the indexes that
lead with a step's id take new entries at their right edge, packed, not on a random page),
a step's input hash as its 32 bytes on PostgreSQL (like the chain's digests in 0022), and no
index on an attempt's step alone ((step, number) and (step, fence) lead with it).

On PostgreSQL `input_hash` is decoded from its hex in one rewrite of the steps table;
elsewhere (SQLite) it stays hex text. Reversible. Existing steps keep their ids.
"""

from __future__ import annotations

import django.db.models.deletion
from django.db import migrations, models

import executor.ledger.records


def _alter(schema_editor, *, to_bytes: bool) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    clause = (
        "TYPE bytea USING decode(input_hash, 'hex')"
        if to_bytes
        else "TYPE varchar(64) USING encode(input_hash, 'hex')"
    )
    schema_editor.execute(f"ALTER TABLE executor_step ALTER COLUMN input_hash {clause}")


def forwards(apps, schema_editor) -> None:
    _alter(schema_editor, to_bytes=True)


def backwards(apps, schema_editor) -> None:
    _alter(schema_editor, to_bytes=False)


def _step_index(schema_editor) -> str:
    # The name Django gave the foreign key's index (0001), as it computes it.
    return schema_editor._create_index_name("executor_attempt", ["step_id"])


def drop_step_index(apps, schema_editor) -> None:
    schema_editor.execute(
        f"DROP INDEX IF EXISTS {schema_editor.quote_name(_step_index(schema_editor))}"
    )


def create_step_index(apps, schema_editor) -> None:
    name = schema_editor.quote_name(_step_index(schema_editor))
    schema_editor.execute(f"CREATE INDEX {name} ON executor_attempt (step_id)")


class Migration(migrations.Migration):
    dependencies = [
        ("executor", "0022_digests_as_bytes"),
    ]

    operations = [
        # By name: Django's own AlterField drops every one-column index on step_id, the
        # partial unique `attempt_one_open_per_step` with it.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="attempt",
                    name="step",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="attempts",
                        to="executor.step",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunPython(drop_step_index, create_step_index, elidable=False)
            ],
        ),
        # A default computed in Python: nothing changes in the database (SQLite would
        # rebuild the table).
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="step",
                    name="id",
                    field=models.UUIDField(
                        default=executor.ledger.records.time_ordered_uuid,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
            ],
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="step",
                    name="input_hash",
                    field=executor.ledger.records.DigestField(max_length=64),
                ),
            ],
            database_operations=[migrations.RunPython(forwards, backwards, elidable=False)],
        ),
    ]
