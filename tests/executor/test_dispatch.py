"""Hints sent on a thread of their own (`dispatch.Background`): the sender never waits for the
broker, every hint goes out in order, and a failing broker stops no later hint."""

from __future__ import annotations

import os
import threading
from datetime import datetime

from executor import dispatch

Sent = tuple[str, str, datetime | None]


def test_sending_does_not_wait_for_the_broker_and_every_hint_goes_out_in_order() -> None:
    broker_answers = threading.Event()
    published: list[Sent] = []

    def slow_broker(task: str, step_id: str, eta: datetime | None) -> None:
        broker_answers.wait(10)
        published.append((task, step_id, eta))

    background = dispatch.Background(slow_broker)
    for n in range(3):
        background(dispatch.EXECUTE, f"step-{n}", None)

    assert published == []  # the sender went on while the broker has not answered
    assert background.flush(timeout=0.05) is False
    broker_answers.set()
    assert background.flush(timeout=10) is True
    assert published == [(dispatch.EXECUTE, f"step-{n}", None) for n in range(3)]


def test_a_failing_broker_loses_that_hint_only() -> None:
    published: list[str] = []

    def flaky_broker(task: str, step_id: str, eta: datetime | None) -> None:
        if step_id == "refused":
            raise ConnectionError("broker down")
        published.append(step_id)

    background = dispatch.Background(flaky_broker)
    for step_id in ("first", "refused", "after"):
        background(dispatch.EXECUTE, step_id, None)

    assert background.flush(timeout=10) is True
    assert published == ["first", "after"]


def test_the_default_publisher_sends_to_celery_in_the_background() -> None:
    assert isinstance(dispatch.background, dispatch.Background)
    assert dispatch.background.publisher is dispatch.celery_publisher


def test_a_forked_process_sends_through_a_thread_of_its_own() -> None:
    # A prefork worker or a gunicorn worker: the parent's sending thread is not in the child.
    read, write = os.pipe()

    def to_pipe(task: str, step_id: str, eta: datetime | None) -> None:
        os.write(write, f"{os.getpid()}:{step_id}\n".encode())

    background = dispatch.Background(to_pipe)
    background(dispatch.EXECUTE, "parent", None)
    assert background.flush(timeout=10) is True

    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports by its exit code
        sent = False
        try:
            background(dispatch.EXECUTE, "child", None)
            sent = background.flush(timeout=10)
        finally:
            os._exit(0 if sent else 1)
    _, status = os.waitpid(child, 0)

    assert os.waitstatus_to_exitcode(status) == 0
    os.close(write)
    with os.fdopen(read) as lines:
        assert lines.read().split() == [f"{os.getpid()}:parent", f"{child}:child"]
