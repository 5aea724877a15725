"""A run's events indexed by the run alone (issue 25, bytes a step): PostgreSQL's B-tree
deduplication then stores each run once with its events' addresses, about 7 bytes an event
where (run, created_at) took 44 (132 MB at a million steps). Nothing reads a run's events in
time order; a run's deletion (its foreign key's check) and the drill read them by run.

The new index is built before the old one is dropped, so a run's events are never without
one: a few seconds a million events on PostgreSQL, holding a SHARE lock on the events
(writes wait; docs/operations.md).
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("executor", "0024_packed_checkpoint_listings"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="event",
            index=models.Index(fields=["run"], name="event_run"),
        ),
        migrations.RemoveIndex(
            model_name="event",
            name="event_run_time",
        ),
    ]
