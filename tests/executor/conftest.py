"""Fixtures of the executor tests: the ticket desk as a real process, one per module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.desk import Desk, DeskProcess, start_desk, stop_desk


@pytest.fixture(scope="module")
def desk_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeskProcess]:
    desk = start_desk(tmp_path_factory.mktemp("ticketdesk"))
    yield desk
    stop_desk(desk)


@pytest.fixture
def desk(desk_process: DeskProcess) -> Iterator[Desk]:
    desk = Desk(desk_process.url)
    desk.faults(reset=True)
    yield desk
    desk.faults(reset=True)
    desk.client.close()


@pytest.fixture
def desk_settings(desk: Desk, settings: Any) -> Any:
    settings.TICKETDESK_URL = desk.url
    return settings
