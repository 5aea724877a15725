"""The executor: claim, authorize, submit, call, persist, verify (DESIGN.md §5, §8, §14, §16).

A queue message only says "look at the ledger"; everything here re-reads the ledger and acts
on what it says. Work is claimed in batches: one commit takes a batch of due steps (each with
its own lease and fence), records their attempts and events, and decides each one's
authorization from facts read once for the batch. Every write a worker makes after its claim
is conditional on its fence, so a worker whose lease was taken over writes nothing to the
step and stops.

Commit points of one attempt:
  pure tools:              claim+authorize+submitting (batch) | call | completed (batch)
  read tools:              claim+authorize+submitting (batch) | call in flight | completed
                           (the answers that arrived together)
  write/destructive tools: claim+authorize (batch) | submitting (the calls about to start,
                           together) | call in flight | responded→verifying (the answers that
                           arrived together) | completed (together)

One module per seam, in the order a step meets them:

- `claiming`: the claim of a batch, authorization, per-tool limits;
- `commits`: an attempt's commit points after its claim, alone and in groups;
- `statements`: the PostgreSQL statements of a write's commits made alone;
- `calls`: the process's event loop, where calls wait without a connection;
- `inflight`: a drain's calls in flight and their group commits;
- `leases`: one heartbeat for every lease a drain holds;
- `failures`: classification, retries with backoff, unknown outcomes;
- `runtime`: a message's drain, and `process` (a batch of one);
- `common`: the claim itself and what every seam writes (attempt closed, fenced out).

Beside them, off the path from a claim to an outcome: `progress` (what a completion unlocks)
and `recovery` (dead workers, unknown outcomes). What a Celery worker runs (its tasks, the
sweeper) is executor/worker/.
"""

from __future__ import annotations

from executor.engine.claiming import Batch, claim, claim_step
from executor.engine.commits import (
    execute_claimed,
    persist_light,
    persist_response,
    run_light,
    store_answers,
    submit,
    submit_many,
    verify_many,
    verify_step,
)
from executor.engine.common import (
    Claim,
    Outcome,
    close_attempt,
    executor_actor,
    invocation,
    is_light,
    lease_seconds,
    log_fields,
    record_fenced_out,
    safe_to_repeat,
    worker_name,
)
from executor.engine.failures import backoff_seconds, handle_failure
from executor.engine.inflight import InFlight
from executor.engine.leases import LeaseKeeper, extend_leases, still_holds_lease
from executor.engine.runtime import cancel_if_run_cancelled, drain, process, wake

__all__ = [
    "Batch",
    "Claim",
    "InFlight",
    "LeaseKeeper",
    "Outcome",
    "backoff_seconds",
    "cancel_if_run_cancelled",
    "claim",
    "claim_step",
    "close_attempt",
    "drain",
    "execute_claimed",
    "executor_actor",
    "extend_leases",
    "handle_failure",
    "invocation",
    "is_light",
    "lease_seconds",
    "log_fields",
    "persist_light",
    "persist_response",
    "process",
    "record_fenced_out",
    "run_light",
    "safe_to_repeat",
    "still_holds_lease",
    "store_answers",
    "submit",
    "submit_many",
    "verify_many",
    "verify_step",
    "wake",
    "worker_name",
]
