"""Where Django looks for the app's models: the ledger's records live in
executor/ledger/records.py; this module only hands them to Django. Import them from there."""

from __future__ import annotations

from executor.ledger.records import *  # noqa: F403
