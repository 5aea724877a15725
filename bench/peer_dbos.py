"""DBOS Transact doing the same steps as the bench's drains (a peer, not Stepward).

Runs in the bench's own virtualenv (bench/.peers, made by `throughput.py --setup`), never in
the project's. The workflow is one `@DBOS.step` that returns its input, so each unit of work
is what a Stepward `echo` step is: a durable record, a claim, a no-op call, a recorded result.
With BENCH_DBOS_SLOW_URL set (bench/slow_drain.py), the step instead POSTs to that URL (the
neutral slow service, tests/support/slow_service.py) with `Idempotency-Key` and
`X-Stepward-Operation` both the workflow's id, as a Stepward HTTP tool with
`idempotency = "header"` does, and returns the service's answer: a slow tool's call.

    peer_dbos.py enqueue N      # launches DBOS without dequeuing, enqueues N workflows, exits
    peer_dbos.py worker NAME    # dequeues and runs them until SIGTERM

The bench reads the outcome from DBOS's own table (dbos.workflow_status). Environment:
BENCH_DBOS_URL (its own PostgreSQL database), BENCH_DBOS_QUEUE,
BENCH_DBOS_WORKER_CONCURRENCY (per process; 0 = no limit), BENCH_DBOS_POLLING (seconds),
BENCH_DBOS_SLOW_URL (optional: the slow service's POST URL). The standard library's urllib
makes the call: bench/.peers has no httpx, and each call opens a connection of its own, as
the service answers every request with `Connection: close` anyway.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import urllib.request
from typing import Any

APP = "stepward-bench-peer"
VERSION = "bench"  # the same in every process, so any worker may dequeue any workflow
URL = os.environ.get("BENCH_DBOS_URL", "postgresql://postgres@127.0.0.1:5432/stepward_bench_dbos")
QUEUE = os.environ.get("BENCH_DBOS_QUEUE", "bench")
WORKER_CONCURRENCY = int(os.environ.get("BENCH_DBOS_WORKER_CONCURRENCY", "0")) or None
POLLING = float(os.environ.get("BENCH_DBOS_POLLING", "0.01"))
SLOW_URL = os.environ.get("BENCH_DBOS_SLOW_URL", "")
# No proxy from the environment: the call goes straight to the local service.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def post_effect(key: str) -> Any:
    """One POST to the slow service, keyed by `key`; its JSON answer (raises on a non-2xx)."""
    request = urllib.request.Request(
        SLOW_URL,
        data=b"{}",
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Idempotency-Key": key,
            "X-Stepward-Operation": key,
        },
    )
    with OPENER.open(request, timeout=60) as response:
        return json.loads(response.read())


def start(executor_id: str, *, listen: bool) -> object:
    from dbos import DBOS, DBOSConfig

    config: DBOSConfig = {
        "name": APP,
        "system_database_url": URL,
        "application_version": VERSION,
        "executor_id": executor_id,
        "log_level": "WARNING",
    }
    DBOS(config=config)

    @DBOS.step()
    def noop(value: int) -> int:
        return value

    @DBOS.step()
    def slow_effect(value: int) -> Any:
        return post_effect(DBOS.workflow_id or "")

    @DBOS.workflow()
    def one_step(value: int) -> Any:
        return slow_effect(value) if SLOW_URL else noop(value)

    if not listen:
        DBOS.listen_queues([])
    DBOS.launch()
    DBOS.register_queue(
        QUEUE,
        worker_concurrency=WORKER_CONCURRENCY,
        polling_interval_sec=POLLING,
        on_conflict="always_update",
    )
    return one_step


def enqueue(n: int) -> None:
    from dbos import DBOS

    workflow = start("enqueuer", listen=False)
    for i in range(n):
        DBOS.enqueue_workflow(QUEUE, workflow, i)  # type: ignore[arg-type]
    DBOS.destroy()


def worker(name: str) -> None:
    from dbos import DBOS

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    start(name, listen=True)
    print("ready", flush=True)
    stop.wait()
    DBOS.destroy(workflow_completion_timeout_sec=5)


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "enqueue":
        enqueue(int(sys.argv[2]))
    elif command == "worker":
        worker(sys.argv[2])
    else:
        sys.exit(f"unknown command {command}")
