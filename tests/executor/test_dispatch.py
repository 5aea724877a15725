"""Hints sent on a thread of their own (`dispatch.Background`): the sender never waits for the
broker, every hint goes out in order, and a failing broker stops no later hint."""

from __future__ import annotations

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
