"""The recovery drill (DESIGN.md §5, §13): `manage.py drill` and its parts.

    config      DrillConfig, the fault specs, the database and broker the workers get
    processes   child processes (the desk, workers, the sweeper) and the /proc probe;
                the recovery and browser suites run theirs with it too
    clients     the drill's clients of the ticket desk and of the broker
    invariants  the checks of §13, as a Verdict
    runner      Drill: starts the processes, posts, drives the chaos, checks, saves
    report      the report's notes, the progress and the summary printed
    broken      a deliberately broken engine, for the drill's own test

Only what is safe to import before Django is set up is imported here:
`python -m executor.drill.broken` imports this package first and sets Django up after.
The runner and the report are imported from their own modules.
"""

from __future__ import annotations

from executor.drill.config import (
    BREAKS,
    DEFAULT_DESK_FAULTS,
    DEFAULT_WORKER_FAULTS,
    DrillConfig,
    DrillError,
    parse_desk_faults,
    parse_worker_faults,
    redact_url,
    same_database,
)

__all__ = [
    "BREAKS",
    "DEFAULT_DESK_FAULTS",
    "DEFAULT_WORKER_FAULTS",
    "DrillConfig",
    "DrillError",
    "parse_desk_faults",
    "parse_worker_faults",
    "redact_url",
    "same_database",
]
