"""What agents, operators and admins reach: the JSON API, MCP, metrics, admin."""
