"""What a Celery worker runs: the tasks (ids in, the engine re-reads the ledger) and the sweeper."""
