"""Writes for agents, reviewers and operators, one module per domain; each function is
imported from its home (`from executor.services.reviews import step_approve`).

Every step state change goes through executor/ledger/transitions.py, every run status change
through executor/ledger/runs.py.
"""
