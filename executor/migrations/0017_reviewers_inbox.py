"""The review desk (issue 23.3): reviewers' claims on waiting steps, and an index of the
events people wrote (the decisions page), built without locking the events table."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class AddIndexConcurrently(migrations.AddIndex):
    """`AddIndex`, as CREATE INDEX CONCURRENTLY on PostgreSQL: the events table is the
    ledger's largest and busiest; a plain CREATE INDEX would stop every write to it."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        model = to_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.add_index(model, self.index, concurrently=True)
        else:
            schema_editor.add_index(model, self.index)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        model = from_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.remove_index(model, self.index, concurrently=True)
        else:
            schema_editor.remove_index(model, self.index)


class Migration(migrations.Migration):
    # CONCURRENTLY cannot run inside a transaction.
    atomic = False

    dependencies = [
        ("executor", "0014_notifications"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="StepClaim",
            fields=[
                (
                    "step",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="claim",
                        serialize=False,
                        to="executor.step",
                    ),
                ),
                ("claimed_at", models.DateTimeField()),
                ("expires_at", models.DateTimeField()),
                (
                    "user",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
        ),
        AddIndexConcurrently(
            model_name="event",
            index=models.Index(
                condition=models.Q(("actor__startswith", "user:")),
                fields=["created_at", "id"],
                name="event_by_person",
            ),
        ),
    ]
