"""Agents and their API client, shared by every suite."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import connection
from django.test import Client

from executor.ledger.records import Agent


def on_postgres() -> bool:
    return connection.vendor == "postgresql"


@dataclass
class AgentAuth:
    agent: Agent
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"HTTP_AUTHORIZATION": f"Bearer {self.token}"}


class ApiClient:
    """The Django test client speaking JSON with an agent's bearer token."""

    def __init__(self, auth: AgentAuth | None) -> None:
        self.client = Client()
        self.headers = auth.headers if auth else {}

    def get(self, path: str, **extra: Any) -> Any:
        return self.client.get(path, **self.headers, **extra)

    def post(self, path: str, data: Any = None, **extra: Any) -> Any:
        return self.client.post(
            path,
            data=data if data is not None else {},
            content_type="application/json",
            **self.headers,
            **extra,
        )


def error_of(response: Any) -> dict[str, Any]:
    """The error object of an answer, after checking it has the one error shape."""
    assert response["Content-Type"].startswith("application/json"), response.content[:200]
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "details"}
    assert isinstance(body["error"]["message"], str)
    assert body["error"]["message"]
    return body["error"]
