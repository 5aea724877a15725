"""The ledger: its records, the only code that moves them, the chain that proves them, and
the reads."""
