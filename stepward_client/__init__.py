"""Stepward's Python client for agents (API.md): needs only httpx, imports nothing of the
server. `from stepward_client import Stepward`; the whole client is the one file
stepward_client/client.py, which an agent may also copy."""

from __future__ import annotations

from stepward_client import client
from stepward_client.client import *  # noqa: F403

__all__ = client.__all__
