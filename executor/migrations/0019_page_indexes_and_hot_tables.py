"""Indexes for pages that read a page, not the ledger, and hot tables that stay healthy
(issue 25.1, 25.2): the runs list in (created_at, id) order, of all a reviewer's workspaces and
of one; a run's steps by state in posting order (the run page's report); and, on PostgreSQL,
per-table autovacuum thresholds and fillfactor for the tables every move updates."""

from __future__ import annotations

from django.db import migrations, models

# --- hot tables (PostgreSQL): vacuumed and analyzed by the thousand changes, not by 20% ------
#
# PostgreSQL's defaults vacuum a table when a fifth of it is dead and analyze it when a tenth
# changed: for a ledger of millions of steps, hundreds of thousands of dead entries in the
# due index and statistics hours old (issue 25: the claim's plan flipped after a burst).
# Each table updated at every move gets thresholds in rows instead, and room on its pages
# (fillfactor) where its updates touch no indexed column, so they stay on the page (HOT).
# docs/operations.md explains each.
HOT_TABLES = {
    # Every move: state (indexed) changes, so no HOT; room still keeps a step's versions
    # on its page.
    "executor_step": {
        "fillfactor": 85,
        "autovacuum_vacuum_scale_factor": 0.02,
        "autovacuum_vacuum_threshold": 1000,
        "autovacuum_analyze_scale_factor": 0.01,
        "autovacuum_analyze_threshold": 1000,
        "autovacuum_vacuum_insert_scale_factor": 0.05,
    },
    # Written at the claim, updated once or twice (submitting, closed).
    "executor_attempt": {
        "fillfactor": 90,
        "autovacuum_vacuum_scale_factor": 0.05,
        "autovacuum_vacuum_threshold": 1000,
        "autovacuum_analyze_scale_factor": 0.02,
        "autovacuum_analyze_threshold": 1000,
        "autovacuum_vacuum_insert_scale_factor": 0.05,
    },
    # Insert-only: vacuumed for its visibility map (index-only scans), analyzed for plans.
    "executor_event": {
        "autovacuum_analyze_scale_factor": 0.02,
        "autovacuum_analyze_threshold": 1000,
        "autovacuum_vacuum_insert_scale_factor": 0.05,
    },
    # A run's usage is counted at every claim (no indexed column: HOT with room).
    "executor_run": {
        "fillfactor": 70,
        "autovacuum_vacuum_scale_factor": 0.05,
        "autovacuum_vacuum_threshold": 500,
        "autovacuum_analyze_scale_factor": 0.05,
        "autovacuum_analyze_threshold": 500,
    },
    # One row a run, incremented at every post.
    "executor_stepcounter": {
        "fillfactor": 70,
        "autovacuum_vacuum_scale_factor": 0.05,
        "autovacuum_vacuum_threshold": 1000,
    },
    # A few rows updated at every move: vacuumed by the thousand dead rows whatever its size.
    "executor_counter": {
        "fillfactor": 50,
        "autovacuum_vacuum_scale_factor": 0.0,
        "autovacuum_vacuum_threshold": 1000,
    },
    "executor_runstepcount": {
        "fillfactor": 70,
        "autovacuum_vacuum_scale_factor": 0.02,
        "autovacuum_vacuum_threshold": 1000,
        "autovacuum_analyze_scale_factor": 0.02,
        "autovacuum_analyze_threshold": 1000,
    },
}


def tune_hot_tables(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return  # SQLite has no such settings (and no vacuum running behind it)
    for table, options in HOT_TABLES.items():
        settings = ", ".join(f"{name} = {value}" for name, value in options.items())
        schema_editor.execute(f"ALTER TABLE {table} SET ({settings})")


def untune_hot_tables(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, options in HOT_TABLES.items():
        schema_editor.execute(f"ALTER TABLE {table} RESET ({', '.join(options)})")


class Migration(migrations.Migration):
    dependencies = [
        ("executor", "0018_counters_and_indexes"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="run",
            index=models.Index(fields=["created_at", "id"], name="run_created"),
        ),
        migrations.AddIndex(
            model_name="step",
            index=models.Index(fields=["run", "state", "position"], name="step_run_state"),
        ),
        migrations.AddIndex(
            model_name="run",
            index=models.Index(
                fields=["workspace", "created_at", "id"], name="run_workspace_created"
            ),
        ),
        migrations.RunPython(tune_hot_tables, untune_hot_tables, elidable=False),
    ]
