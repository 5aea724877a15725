"""The MCP gateway (API.md "MCP gateway"): existing MCP servers behind Stepward.

`config` checks the operator's `[[upstream]]` tables and says what each listed tool
declares; `connections` keeps this process's sessions with the upstreams warm on one event
loop; `tools` makes each listed tool a Stepward tool, calls it and classifies what comes
back; `listing` asks the upstreams for their tools and records what they said.
"""
