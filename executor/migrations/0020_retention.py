from django.db import migrations, models


def index_event_time(apps, schema_editor):
    """What changed since a time, read from the append-only events (checkpoints, verify
    --since): a BRIN index on PostgreSQL (a few pages for millions of rows, nearly free to
    keep as rows arrive in time order), a plain one elsewhere."""
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            "CREATE INDEX IF NOT EXISTS event_created_brin ON executor_event "
            "USING brin (created_at)"
        )
    else:
        schema_editor.execute(
            "CREATE INDEX IF NOT EXISTS event_created_at ON executor_event (created_at)"
        )


def drop_event_time(apps, schema_editor):
    schema_editor.execute("DROP INDEX IF EXISTS event_created_brin")
    schema_editor.execute("DROP INDEX IF EXISTS event_created_at")


class Migration(migrations.Migration):
    dependencies = [
        ("executor", "0019_page_indexes_and_hot_tables"),
    ]

    operations = [
        migrations.AddField(
            model_name="checkpoint",
            name="archived",
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.AddField(
            model_name="checkpoint",
            name="pruned",
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.RunPython(index_event_time, drop_event_time),
    ]
