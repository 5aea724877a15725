"""Thin Celery tasks: ids in, the engine re-reads the ledger. Messages are only hints."""

from __future__ import annotations

import gc
import logging
from typing import Any

from celery import shared_task
from celery.signals import (
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
)
from django.db import close_old_connections

from executor import engine
from executor.common import dispatch, faults
from executor.engine import recovery
from executor.gateway.connections import gateway
from executor.gateway.listing import upstreams_warm
from executor.worker import sweeper

logger = logging.getLogger(__name__)


@shared_task(name=dispatch.EXECUTE, acks_late=True, ignore_result=True)
def execute_step(step_id: str) -> str:
    """Looks at the named step in the first batch, then drains due work in batches until
    none is left (up to EXECUTOR_DRAIN_LIMIT steps). Returns what happened to the named step."""
    return engine.wake(step_id, worker=engine.worker_name())


@shared_task(name=dispatch.RECONCILE, acks_late=True, ignore_result=True)
def reconcile_step(step_id: str) -> str:
    return recovery.reconcile(step_id)


@shared_task(name=dispatch.SWEEP, acks_late=True, ignore_result=True)
def sweep() -> dict[str, int] | None:
    report = sweeper.sweep(owner=engine.worker_name())
    return report.as_dict() if report else None


@task_prerun.connect
def usable_connections(sender: Any = None, **kwargs: Any) -> None:
    # The connections kept from the task before (console/celery.py): closed if unusable
    # (the server restarted) or older than CONN_MAX_AGE, as Django does before a request.
    if not getattr(getattr(sender, "request", None), "is_eager", False):
        close_old_connections()


@worker_init.connect
def refuse_unallowed_faults(**kwargs: Any) -> None:
    faults.check_startup()


@worker_process_init.connect
def fresh_fault_dice(**kwargs: Any) -> None:
    # Forked pool children must not share their parent's random sequence.
    faults.reset()
    faults.configured_rates()


@worker_process_init.connect
def warm_upstreams(**kwargs: Any) -> None:
    # Each pool process keeps its own sessions with the MCP upstreams: start them now, so a
    # first call does not wait for a stdio server to start (nothing here waits for them).
    try:
        upstreams_warm()
    except Exception:
        logger.exception("gateway: could not start the upstreams' sessions")


@worker_process_shutdown.connect
def send_waiting_hints(**kwargs: Any) -> None:
    # A pool process ends without running atexit: the hints it sent would wait for nothing.
    dispatch.background.flush()


@worker_process_shutdown.connect
def end_upstream_sessions(**kwargs: Any) -> None:
    # Ended, not abandoned: a stdio upstream exits, an HTTP one is told the session is over.
    gateway().close()


# The worker's garbage collector (DESIGN.md §16). With hundreds of calls in flight a worker
# makes and drops objects by the tens of thousands a second (responses, rows, events), and
# CPython's default thresholds (2,000 allocations, 10, 10) ran collections many times a
# second, and every hundredth walked every object the process holds (Django, the tools,
# the models' metadata): a sixth of its CPU at 250 ms calls (bench/slow_drain.py: 530-570
# steps/s without this, 640 with it). What was made at start-up is frozen out of the
# collector's walks, and the first generation is collected every GC_THRESHOLD[0]
# allocations. Reference counting still frees what is not in a cycle at once.
GC_THRESHOLD = (50_000, 20, 100)


@worker_init.connect
@worker_process_init.connect
def quieter_garbage_collector(**kwargs: Any) -> None:
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
