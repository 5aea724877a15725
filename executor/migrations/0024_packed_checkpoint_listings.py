"""Checkpoints' listings packed (issue 25, bytes a step): from now on a checkpoint lists its
steps' heads and closed attempts as fixed-size binary records (68 and 56 bytes, against about
165 and 125 as JSON, 96 and 115 as PostgreSQL stored that compressed), and its hash covers
their SHA-256. Checkpoints taken before keep their
JSON listings and verify as they did; nothing is rewritten.

On PostgreSQL the packed columns are stored uncompressed (random digests do not compress), so
verification reads a listing a slice at a time without decompressing it from its start.
"""

from __future__ import annotations

from django.db import migrations, models

PACKED = ("packed_heads", "packed_attempts")


def _storage(schema_editor, storage: str) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for column in PACKED:
        schema_editor.execute(
            f"ALTER TABLE executor_checkpoint ALTER COLUMN {column} SET STORAGE {storage}"
        )


def uncompressed(apps, schema_editor) -> None:
    _storage(schema_editor, "EXTERNAL")


def refuse_if_packed(apps, schema_editor) -> None:
    """Back to 0023 only while no checkpoint lists packed: its hash is over them, and the
    code before cannot read them (dropping them would leave the chain unverifiable)."""
    Checkpoint = apps.get_model("executor", "Checkpoint")
    packed = Checkpoint.objects.exclude(packed_heads=b"") | Checkpoint.objects.exclude(
        packed_attempts=b""
    )
    if packed.exists():
        raise RuntimeError(
            "checkpoints were taken with packed listings (0024): the code of 0023 cannot "
            "verify them, and unapplying 0024 would drop them; restore a backup instead"
        )


class Migration(migrations.Migration):
    dependencies = [
        ("executor", "0023_step_ids_in_time_order"),
    ]

    operations = [
        migrations.AddField(
            model_name="checkpoint",
            name="packed_heads",
            field=models.BinaryField(blank=True, default=b""),
        ),
        migrations.AddField(
            model_name="checkpoint",
            name="packed_attempts",
            field=models.BinaryField(blank=True, default=b""),
        ),
        migrations.RunPython(uncompressed, refuse_if_packed, elidable=False),
    ]
