"""The ledger and the engine. Knows nothing of the console."""
