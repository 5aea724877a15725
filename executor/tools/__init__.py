"""Tools: one module per tool; `base` holds the contract and the registry."""
