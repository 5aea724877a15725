"""Thin Celery tasks: ids in, the engine re-reads the ledger. Messages are only hints."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from celery import shared_task
from celery.signals import worker_init, worker_process_init
from django.conf import settings
from django.db import transaction

from executor import engine, faults, sweeper

logger = logging.getLogger(__name__)

_publish_suppressed = False


@contextlib.contextmanager
def publish_suppressed() -> Iterator[None]:
    """Drops every message sent inside the block, as a lost broker message would be."""
    global _publish_suppressed
    previous, _publish_suppressed = _publish_suppressed, True
    try:
        yield
    finally:
        _publish_suppressed = previous


def _publish(task: Any, step_id: Any, eta: datetime | None = None) -> None:
    if _publish_suppressed:
        return
    try:
        task.apply_async(args=[str(step_id)], eta=eta)
    except Exception:  # a lost message only delays work: the sweeper resends it
        logger.exception("could not publish %s for step %s", task.name, step_id)


def send_execute(step_id: Any, *, eta: datetime | None = None) -> None:
    transaction.on_commit(lambda: _publish(execute_step, step_id, eta))


def send_reconcile(step_id: Any) -> None:
    transaction.on_commit(lambda: _publish(reconcile_step, step_id))


@shared_task(name="stepward.execute_step", acks_late=True, ignore_result=True)
def execute_step(step_id: str) -> str:
    worker = engine.worker_name()
    outcome = engine.process(step_id, worker=worker)
    engine.drain(worker=worker, limit=settings.EXECUTOR_DRAIN_LIMIT)
    return outcome


@shared_task(name="stepward.reconcile_step", acks_late=True, ignore_result=True)
def reconcile_step(step_id: str) -> str:
    return engine.reconcile(step_id)


@shared_task(name="stepward.sweep", acks_late=True, ignore_result=True)
def sweep() -> dict[str, int] | None:
    report = sweeper.sweep(owner=engine.worker_name())
    return report.as_dict() if report else None


@worker_init.connect
def refuse_unallowed_faults(**kwargs: Any) -> None:
    faults.check_startup()


@worker_process_init.connect
def fresh_fault_dice(**kwargs: Any) -> None:
    # Forked pool children must not share their parent's random sequence.
    faults.reset()
    faults.configured_rates()
