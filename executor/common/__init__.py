"""What every layer may use: redaction, messages to the workers, named faults, log context."""
