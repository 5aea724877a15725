"""The demo world: the ticket desk (an external system stand-in) and the demo agent."""
