"""The drill's clients: of its ticket desk, over HTTP, and of the broker and queue it
announces steps on."""

from __future__ import annotations

from typing import Any

import httpx
from celery import Celery


class DeskClient:
    """The drill's ticket desk, over HTTP: the external truth about tickets."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=30)

    def set_faults(self, **faults: Any) -> dict[str, Any]:
        response = self.client.post("/faults", json={"reset": True, **faults})
        response.raise_for_status()
        return dict(response.json())

    def stats(self) -> dict[str, Any]:
        response = self.client.get("/stats")
        response.raise_for_status()
        return dict(response.json())

    def tickets(self, client_ref: Any = None) -> list[dict[str, Any]]:
        """Every ticket, or those of one client reference."""
        params = {} if client_ref is None else {"client_ref": str(client_ref)}
        response = self.client.get("/tickets", params=params)
        response.raise_for_status()
        return list(response.json()["tickets"])

    def close(self) -> None:
        self.client.close()


class Publisher:
    """Sends "look at step X" to the drill's broker and queue, whatever this process's
    own Celery settings are (the workers are told the same broker and queue)."""

    def __init__(self, broker_url: str, transport_options: dict[str, Any], *, queue: str) -> None:
        self.app = Celery("stepward-drill", broker=broker_url, set_as_current=False)
        self.app.conf.broker_transport_options = transport_options
        self.app.conf.task_default_queue = queue
        self.app.conf.broker_connection_retry_on_startup = True
        self.failed = 0

    def send(self, step_id: Any) -> None:
        try:
            self.app.send_task("stepward.execute_step", args=[str(step_id)])
        except Exception:  # noqa: BLE001 - a lost hint only delays: the sweeper resends it
            self.failed += 1

    def close(self) -> None:
        self.app.close()
