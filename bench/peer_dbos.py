"""DBOS Transact doing the same no-op steps as the bench's `echo` drain (a peer, not Stepward).

Runs in the bench's own virtualenv (bench/.peers, made by `throughput.py --setup`), never in
the project's. The workflow is one `@DBOS.step` that returns its input, so each unit of work
is what a Stepward `echo` step is: a durable record, a claim, a no-op call, a recorded result.

    peer_dbos.py enqueue N      # launches DBOS without dequeuing, enqueues N workflows, exits
    peer_dbos.py worker NAME    # dequeues and runs them until SIGTERM

The bench reads the outcome from DBOS's own table (dbos.workflow_status). Environment:
BENCH_DBOS_URL (its own PostgreSQL database), BENCH_DBOS_QUEUE,
BENCH_DBOS_WORKER_CONCURRENCY (per process; 0 = no limit), BENCH_DBOS_POLLING (seconds).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

APP = "stepward-bench-peer"
VERSION = "bench"  # the same in every process, so any worker may dequeue any workflow
URL = os.environ.get("BENCH_DBOS_URL", "postgresql://postgres@127.0.0.1:5432/stepward_bench_dbos")
QUEUE = os.environ.get("BENCH_DBOS_QUEUE", "bench")
WORKER_CONCURRENCY = int(os.environ.get("BENCH_DBOS_WORKER_CONCURRENCY", "0")) or None
POLLING = float(os.environ.get("BENCH_DBOS_POLLING", "0.01"))


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

    @DBOS.workflow()
    def one_step(value: int) -> int:
        return noop(value)

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
