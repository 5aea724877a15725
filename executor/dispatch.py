"""Messages to the workers: "look at the ledger" (DESIGN.md §2), sent after commit, by task name.

A message is only a hint: losing one delays work until the sweeper resends it, a duplicate
does nothing. Messages are sent by task name through a publisher, so nothing here imports
the tasks, and a test, the drill or the bench can swap the publisher (`publishing`) instead
of production code holding a flag for them.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction

logger = logging.getLogger(__name__)

EXECUTE = "stepward.execute_step"
RECONCILE = "stepward.reconcile_step"
SWEEP = "stepward.sweep"

# (task name, step id, eta) → the message is on its way, or lost (only a delay).
Publisher = Callable[[str, str, datetime | None], None]


def celery_publisher(task: str, step_id: str, eta: datetime | None) -> None:
    from celery import current_app

    try:
        current_app.send_task(task, args=[step_id], eta=eta)
    except Exception:  # a lost message only delays work: the sweeper resends it
        logger.exception("could not publish %s for step %s", task, step_id)


def dropping_publisher(task: str, step_id: str, eta: datetime | None) -> None:
    """Loses every message, as a broker that drops them would."""


_publisher: Publisher = celery_publisher


@contextlib.contextmanager
def publishing(publisher: Publisher) -> Iterator[None]:
    """Sends every message of the block through `publisher` (tests, the drill, the bench)."""
    global _publisher
    previous, _publisher = _publisher, publisher
    try:
        yield
    finally:
        _publisher = previous


def _send(task: str, step_id: Any, eta: datetime | None = None) -> None:
    # Looked up when the transaction commits, so the publisher in force then is used.
    transaction.on_commit(lambda: _publisher(task, str(step_id), eta))


def execute(step_id: Any, *, eta: datetime | None = None) -> None:
    """Wakes a worker (at `eta`) to claim due work; `step_id` is a hint, not an order."""
    _send(EXECUTE, step_id, eta)


def execute_many(step_ids: Sequence[Any]) -> None:
    """Wakes enough workers for `step_ids`: one message per batch a worker claims at once.

    A woken worker drains batches until nothing is due, so a message per step would only
    cost the broker; one per batch lets several workers share a large post.
    """
    if not step_ids:
        return
    batch = max(1, settings.EXECUTOR_BATCH_SIZE)
    for index in range(math.ceil(len(step_ids) / batch)):
        execute(step_ids[index * batch])


def reconcile(step_id: Any) -> None:
    _send(RECONCILE, step_id)
