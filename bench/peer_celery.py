"""Raw Celery doing no-op tasks, with Stepward's worker settings (a peer, not Stepward).

Runs in the bench's own virtualenv (bench/.peers), never in the project's. The task does
nothing; it only records, in Redis, when this worker process started its first task and
when it finished its latest one, and counts itself (one pipelined round trip per task):

    peer_celery.py enqueue N                        # queues N tasks, no worker running
    celery -A peer_celery worker --concurrency C    # (cwd bench/) runs them

Settings are Stepward's own (console/settings.py): acks_late, reject_on_worker_lost,
prefetch multiplier 1, results ignored. Environment: BENCH_CELERY_BROKER (Redis URL, its own
DB number), BENCH_CELERY_QUEUE.
"""

from __future__ import annotations

import os
import sys
import time

import redis
from celery import Celery

BROKER = os.environ.get("BENCH_CELERY_BROKER", "redis://127.0.0.1:6379/13")
QUEUE = os.environ.get("BENCH_CELERY_QUEUE", "bench-noop")
# Read by the bench: how many ran; per process, its first start and its latest end.
DONE, FIRST, LAST = f"{QUEUE}:done", f"{QUEUE}:first", f"{QUEUE}:last"

app = Celery("peer_celery", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    result_backend=None,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_redis: redis.Redis | None = None
_started = False


@app.task(name="bench.noop")
def noop() -> None:
    global _redis, _started
    began = time.time()
    if _redis is None:
        _redis = redis.Redis.from_url(BROKER)
    pipe = _redis.pipeline(transaction=False)
    if not _started:
        _started = True
        pipe.hsetnx(FIRST, str(os.getpid()), began)
    pipe.incr(DONE)
    pipe.hset(LAST, str(os.getpid()), time.time())
    pipe.execute()


def enqueue(n: int) -> None:
    r = redis.Redis.from_url(BROKER)
    r.delete(DONE, FIRST, LAST)
    with app.producer_or_acquire() as producer:
        for _ in range(n):
            noop.apply_async(producer=producer)


if __name__ == "__main__":
    if sys.argv[1] == "enqueue":
        enqueue(int(sys.argv[2]))
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
