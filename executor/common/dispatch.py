"""Messages to the workers: "look at the ledger" (DESIGN.md §2), sent after commit, by task name.

A message is only a hint: losing one delays work until the sweeper resends it, a duplicate
does nothing. Messages are sent by task name through a publisher, so nothing here imports
the tasks, and a test, the drill or the bench can swap the publisher (`publishing`) instead
of production code holding a flag for them.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import queue
import threading
import time
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


class Background:
    """Publishes through `publisher` on a thread of its own, in the order sent, so that a
    request answers without waiting for the broker (a post's round trip to Redis was an
    eighth of its time). Only a hint can wait here: what it points at is committed, and a
    hint lost with the process is resent by the sweeper, as any lost message is.

    A process forked from this one (a prefork worker) starts its own thread when it first
    sends. At most `limit` hints wait: past it, while the broker does not answer, a hint is
    dropped (and logged), not held in memory. `flush` waits for what was sent so far; it
    runs at exit, and in a worker's pool process before it ends (executor/worker/tasks.py).
    """

    def __init__(self, publisher: Publisher, limit: int = 10_000) -> None:
        self.publisher = publisher
        self.limit = limit
        self._lock = threading.Lock()
        self._pid = 0
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue[tuple[str, str, datetime | None]] = queue.Queue(limit)

    def forget_parent(self) -> None:
        """In a forked child: the parent's thread and lock are not this process's."""
        self._lock = threading.Lock()
        self._pid = 0

    def __call__(self, task: str, step_id: str, eta: datetime | None) -> None:
        if self._pid != os.getpid() or self._thread is None or not self._thread.is_alive():
            self._start()
        try:
            self._queue.put_nowait((task, step_id, eta))
        except queue.Full:  # the broker has not answered for a while: the sweeper resends it
            logger.warning(
                "%d hints wait for the broker; dropped %s for step %s", self.limit, task, step_id
            )

    def _start(self) -> None:
        with self._lock:
            alive = self._thread is not None and self._thread.is_alive()
            if self._pid == os.getpid() and alive:
                return
            if self._pid != os.getpid():  # what waited in the parent is the parent's to send
                self._queue = queue.Queue(self.limit)
            self._thread = threading.Thread(
                target=self._send_forever,
                args=(self._queue,),
                name="stepward-dispatch",
                daemon=True,
            )
            self._thread.start()
            self._pid = os.getpid()

    def _send_forever(self, messages: queue.Queue[tuple[str, str, datetime | None]]) -> None:
        while True:
            task, step_id, eta = messages.get()
            try:
                self.publisher(task, step_id, eta)
            except Exception:  # only a hint: the sweeper resends it
                logger.exception("could not publish %s for step %s", task, step_id)
            finally:
                messages.task_done()

    def flush(self, timeout: float = 5.0) -> bool:
        """Waits up to `timeout` seconds for every message sent so far; True if all went."""
        if self._pid != os.getpid():
            return True
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True


background = Background(celery_publisher)
atexit.register(background.flush)
# A child forked while a thread of the parent held the lock would wait on it forever.
os.register_at_fork(after_in_child=background.forget_parent)

_publisher: Publisher = background


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
