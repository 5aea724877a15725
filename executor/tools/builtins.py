"""The built-in tools (DESIGN.md §6): `STEPWARD_TOOLS=executor.tools.builtins` loads them all.

A deployment that adds its own keeps this entry and appends its modules, or names only the
built-in modules it wants (`executor.tools.echo`, …).
"""

from __future__ import annotations

from executor.gateway import tools as upstreams
from executor.tools import echo, email_send, http, http_get, ticketdesk

# `http` registers the HTTP tools defined as data (load_tools, admin); `upstreams` the tools
# of the MCP servers behind Stepward (API.md "MCP gateway").
__all__ = ["echo", "email_send", "http", "http_get", "ticketdesk", "upstreams"]
