"""The embedded broker (console/broker.py) under a reader that polls while a writer sends."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from kombu import Connection
from kombu.transport.filesystem import Empty

import console.celery  # noqa: F401 - registers the stepwardfs scheme

MESSAGES = 2000


def channel(folder: Path) -> Any:
    options = {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "store_processed": False,
        "polling_interval": 0.001,
    }
    return Connection("stepwardfs://", transport_options=options).default_channel


def test_a_polling_reader_never_sees_a_message_half_written(tmp_path: Path) -> None:
    writer, reader = channel(tmp_path), channel(tmp_path)
    payload = {"body": "x" * 4000, "headers": {}, "properties": {}}
    received: list[Any] = []
    errors: list[BaseException] = []
    done_writing = threading.Event()

    def read() -> None:
        deadline = time.monotonic() + 120
        while len(received) < MESSAGES and time.monotonic() < deadline:
            try:
                received.append(reader._get("q"))
            except Empty:
                if done_writing.is_set() and not any(tmp_path.glob("*.q.msg")):
                    return
            except Exception as error:  # noqa: BLE001 - a torn read: what this test catches
                errors.append(error)

    thread = threading.Thread(target=read)
    thread.start()
    for number in range(MESSAGES):
        writer._put("q", {**payload, "n": number})
    done_writing.set()
    thread.join(timeout=150)

    assert errors == []
    assert sorted(message["n"] for message in received) == list(range(MESSAGES))
