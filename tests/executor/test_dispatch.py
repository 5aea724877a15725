"""Hints sent on a thread of their own (`dispatch.Background`): the sender never waits for the
broker, every hint goes out in order, and a failing broker stops no later hint."""

from __future__ import annotations

import os
import signal
import threading
from datetime import datetime

import pytest

from executor.common import dispatch

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


def test_a_child_forked_while_the_lock_was_held_does_not_wait_for_it() -> None:
    background = dispatch.Background(lambda task, step_id, eta: None)
    # What the module does for its own publisher: os.register_at_fork(forget_parent).
    os.register_at_fork(after_in_child=background.forget_parent)
    with background._lock:  # a thread of the parent is starting its sender at the fork
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports by its exit code
            signal.alarm(10)  # waiting on the parent's lock would end the child here
            background(dispatch.EXECUTE, "child", None)
            os._exit(0 if background.flush(timeout=10) else 1)
        _, status = os.waitpid(child, 0)

    assert os.waitstatus_to_exitcode(status) == 0


def test_past_its_limit_a_hint_is_dropped_not_held(caplog: pytest.LogCaptureFixture) -> None:
    sending, broker_answers = threading.Event(), threading.Event()
    published: list[str] = []

    def stuck_broker(task: str, step_id: str, eta: datetime | None) -> None:
        sending.set()
        broker_answers.wait(10)
        published.append(step_id)

    background = dispatch.Background(stuck_broker, limit=2)
    background(dispatch.EXECUTE, "sending", None)
    assert sending.wait(10)
    for step_id in ("waits-1", "waits-2", "dropped"):
        background(dispatch.EXECUTE, step_id, None)
    broker_answers.set()

    assert background.flush(timeout=10) is True
    assert published == ["sending", "waits-1", "waits-2"]
    assert "dropped execute_step for step dropped" in caplog.text.replace("stepward.", "")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_sender_thread_that_died_is_replaced() -> None:
    published: list[str] = []

    def broker(task: str, step_id: str, eta: datetime | None) -> None:
        if step_id == "fatal":
            raise SystemExit  # not an Exception: it ends the thread
        published.append(step_id)

    background = dispatch.Background(broker)
    background(dispatch.EXECUTE, "fatal", None)
    assert background.flush(timeout=10) is True
    dead = background._thread
    assert dead is not None
    dead.join(10)

    background(dispatch.EXECUTE, "after", None)

    assert background.flush(timeout=10) is True
    assert published == ["after"]
