"""SQL statements (by kind) and commits per step, Stepward run in this process.

    DATABASE_URL=postgres://... .venv/bin/python bench/engine_counts.py N AGENT_TOKEN

Measures, each on its own and after a warm-up of the same kind:
- `single_post`: one `POST /api/v1/runs/{id}/steps` (`echo`), through Django's whole request
  stack in this process (token check, permissions, the step, its Events, the dispatch);
- `batch_post`: `POST /api/v1/runs/{id}/steps/batch`, per step (and per request);
- `pure_step`: an `echo` step executed by `engine.drain(worker=..., limit=...)`, N of them
  due together (the engine batches them as it does in a worker);
- `write_step`: a `ticketdesk.create_keyed` step the same way (TICKETDESK_URL must answer);
- `pure_step_alone`, `write_step_alone`: one step posted, then `engine.drain(limit=1)`, and
  again, so that nothing shares its commits (the worst case per step);
- `empty_drain`: one `engine.drain` call with nothing due: the look for more work that ends
  a worker's drain (once per wake, not per step).

Statements are those Django executes, in every thread (counted where all of Django's cursors
pass): BEGIN and COMMIT, which psycopg sends itself, and Django's connection health check are
not among them. Commits are PostgreSQL's own count for the database
(`pg_stat_database.xact_commit`), read before and after (after a second's wait, so that the
engine's other connections have flushed their statistics), so every autocommit read counts
as a transaction too; the cost of reading the counter itself is measured and subtracted.
Prints one JSON line.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
# Run on the bench's own database: any key will do, but Django needs one without DEBUG.
os.environ.setdefault("SECRET_KEY", "stepward-bench-key-not-a-secret")

import django

django.setup()

from django.db import connection  # noqa: E402
from django.db.backends.utils import CursorWrapper  # noqa: E402
from django.test import Client  # noqa: E402

from executor import engine  # noqa: E402

WORKER = "bench-counts"
BATCH = 500


class BatchUnavailable(Exception):
    pass


# Statements are counted in every thread (the engine runs write tools on a pool of threads,
# each with its own connection), at the one place all of Django's cursors pass through.
_counting: Counter[str] | None = None
_counting_lock = threading.Lock()
_execute_with_wrappers = CursorWrapper._execute_with_wrappers


def _counted(self: CursorWrapper, sql: str, params: Any, many: bool, executor: Any) -> Any:
    kinds = _counting
    if kinds is not None:
        with _counting_lock:
            kinds[sql.lstrip(" (").split(None, 1)[0].upper()] += 1
    return _execute_with_wrappers(self, sql, params, many, executor)


CursorWrapper._execute_with_wrappers = _counted  # type: ignore[method-assign]

# PostgreSQL flushes another backend's statistics at most once a second: wait that long
# before reading the commit count, so the engine's other connection (its lease keeper's,
# closed at the end of each drain, which flushes it) is in it. Every other statement of a
# drain runs on this thread's connection (DESIGN.md §16), which flushes its own.
SETTLE_SECONDS = 1.2


def xact_commit(settle: bool = True) -> int:
    if settle:
        time.sleep(SETTLE_SECONDS)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        return int(cursor.fetchone()[0])


def reading_cost() -> int:
    """Commits that one xact_commit() call adds to the next reading."""
    xact_commit()
    first = xact_commit()
    return xact_commit() - first


class Meter:
    """Counts statements (by kind, all threads), commits and time inside `on()`."""

    def __init__(self, overhead: int) -> None:
        self.overhead = overhead
        self.kinds: Counter[str] = Counter()
        self.commits = 0
        self.seconds = 0.0

    @contextlib.contextmanager
    def on(self, settle: bool = True) -> Iterator[None]:
        """`settle=False` when only this thread has used the database since the last
        settled reading."""
        global _counting
        before = xact_commit(settle=settle)
        started = time.perf_counter()
        _counting = self.kinds
        try:
            yield
        finally:
            _counting = None
        self.seconds += time.perf_counter() - started
        self.commits += xact_commit() - before - self.overhead

    def result(self, units: int, reads: int = 0) -> dict[str, Any]:
        """Per unit; `reads` progress reads of the bench's own (one SELECT, one autocommit
        transaction each) are taken off."""
        kinds = Counter(self.kinds)
        kinds["SELECT"] -= reads
        return {
            "units": units,
            "statements": round(sum(kinds.values()) / units, 2),
            "by_kind": {k: round(v / units, 2) for k, v in sorted(kinds.items()) if v},
            "commits": round((self.commits - reads) / units, 2),
            "ms_per_unit_in_process": round(1000 * self.seconds / units, 2),
        }


def measure(work: Callable[[], None], units: int, overhead: int) -> dict[str, Any]:
    meter = Meter(overhead)
    with meter.on():
        work()
    return meter.result(units)


class Api:
    def __init__(self, token: str) -> None:
        self.client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def post(self, path: str, body: Any) -> Any:
        response = self.client.post(f"/api/v1{path}", body, content_type="application/json")
        if path.endswith("/batch") and response.status_code in (404, 405):
            raise BatchUnavailable(f"batch endpoint not available ({response.status_code})")
        if response.status_code >= 300:
            raise RuntimeError(f"POST {path}: {response.status_code} {response.content[:300]!r}")
        return response.json()

    def run(self, name: str) -> str:
        return str(self.post("/runs", {"name": f"{name} {time.time()}"})["id"])

    def single(self, run_id: str, key: str, tool: str, data: dict[str, Any]) -> None:
        self.post(f"/runs/{run_id}/steps", {"key": key, "tool": tool, "input": data})

    def cancel(self, run_id: str) -> None:
        self.post(f"/runs/{run_id}/cancel", {"reason": "bench"})

    def batch(self, run_id: str, items: list[dict[str, Any]]) -> None:
        self.post(f"/runs/{run_id}/steps/batch", {"steps": items})

    def post_steps(self, run_id: str, prefix: str, n: int, tool: str) -> None:
        """Posts n steps, by batches where the endpoint exists, else one by one."""
        items = [
            {"key": f"{prefix}{i}", "tool": tool, "input": {"title": f"t{i}"}} for i in range(n)
        ]
        try:
            for start in range(0, n, BATCH):
                self.batch(run_id, items[start : start + BATCH])
        except BatchUnavailable:
            for item in items:
                self.single(run_id, item["key"], tool, item["input"])


def count_states(run_id: str) -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT state, count(*) FROM executor_step WHERE run_id = %s GROUP BY state",
            [run_id],
        )
        return dict(cursor.fetchall())


def others_due(run_id: str | None) -> int:
    """Steps of other runs still pending: a drain would take them too, so there must be none."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM executor_step WHERE state = 'pending' AND run_id IS DISTINCT "
            "FROM %s",
            [run_id],
        )
        return int(cursor.fetchone()[0])


def main(n: int, token: str) -> None:
    api = Api(token)
    overhead = reading_cost()
    out: dict[str, Any] = {"steps": n, "xact_reading_cost": overhead}

    run_id = api.run("counts single")
    for i in range(5):
        api.single(run_id, f"warm{i}", "echo", {"i": i})

    def singles() -> None:
        for i in range(n):
            api.single(run_id, f"s{i}", "echo", {"i": i})

    out["single_post"] = measure(singles, n, overhead)
    api.cancel(run_id)  # its steps must not be drained below

    try:
        run_id = api.run("counts batch")
        api.batch(run_id, [{"key": "warm", "tool": "echo", "input": {}}])
        size = min(BATCH, n)
        batches = max(1, n // size)

        def batches_post() -> None:
            for b in range(batches):
                api.batch(
                    run_id,
                    [{"key": f"b{b}-{i}", "tool": "echo", "input": {"i": i}} for i in range(size)],
                )

        result = measure(batches_post, batches * size, overhead)
        result["batch_size"] = size
        result["statements_per_request"] = round(result["statements"] * size, 1)
        out["batch_post"] = result
    except BatchUnavailable as error:
        out["batch_post"] = {"error": str(error)}
    api.cancel(run_id)

    jobs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("empty_drain", lambda: empty(overhead))
    ]
    for name, tool in (("pure_step", "echo"), ("write_step", "ticketdesk.create_keyed")):
        jobs.append((name, lambda tool=tool: drained(api, tool, n, overhead)))
        jobs.append((f"{name}_alone", lambda tool=tool: drained_alone(api, tool, n, overhead)))
    for name, job in jobs:
        try:
            out[name] = job()
        except Exception as error:  # noqa: BLE001 - reported, never an invented figure
            out[name] = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(out))


def empty(overhead: int) -> dict[str, Any]:
    """engine.drain with nothing due: the look that ends a worker's drain, once per wake."""
    if others_due(None):
        raise RuntimeError("steps are due: the empty drain would not be empty")
    meter = Meter(overhead)
    with meter.on():
        for _ in range(10):
            engine.drain(worker=WORKER, limit=1)
    return meter.result(10)


def warm_up(api: Api, tool: str) -> None:
    warm = api.run(f"counts warm {tool}")
    api.post_steps(warm, "w", 3, tool)
    drain_loop(warm, 3, limit=3)


def drained(api: Api, tool: str, n: int, overhead: int) -> dict[str, Any]:
    """n steps posted, then drained together: the engine batches them as a worker does."""
    warm_up(api, tool)
    run_id = api.run(f"counts {tool}")
    api.post_steps(run_id, "s", n, tool)
    if others_due(run_id):
        raise RuntimeError("steps of other runs are due: they would be counted too")
    meter = Meter(overhead)
    with meter.on():
        reads = drain_loop(run_id, n, limit=n)
    return meter.result(n, reads) | {"drain_calls": reads}


# A statement is prepared on its connection at its fifth run (DATABASE_PREPARED_STATEMENTS):
# PostgreSQL counts the preparing as a transaction of its own (the extended protocol's
# implicit one), once a statement and connection. Runs of the path first, as a worker that
# has been up a while has made them.
PREPARED_AFTER = 5


def drained_alone(api: Api, tool: str, n: int, overhead: int) -> dict[str, Any]:
    """One step posted, then `engine.drain(limit=1)`, and again: nothing shares its commits,
    and the drain stops at its limit, without the closing look for more (see empty())."""
    warm_up(api, tool)
    warm = api.run(f"counts warm alone {tool}")
    for i in range(PREPARED_AFTER + 1):
        api.single(warm, f"w{i}", tool, {"title": f"w{i}"})
        drain_loop(warm, i + 1, limit=1)
    run_id = api.run(f"counts alone {tool}")
    alone = max(5, min(10, n // 20))
    meter = Meter(overhead)
    reads = 0
    for i in range(alone):
        api.single(run_id, f"a{i}", tool, {"title": f"t{i}"})
        if others_due(run_id):
            raise RuntimeError("steps of other runs are due: they would be counted too")
        with meter.on(settle=i == 0):
            reads += drain_loop(run_id, i + 1, limit=1)
    return meter.result(alone, reads) | {"drain_calls": reads}


def drain_loop(run_id: str, n: int, *, limit: int) -> int:
    """engine.drain until the run has n completed steps; returns how many progress reads."""
    reads = idle = 0
    while True:
        claimed = engine.drain(worker=WORKER, limit=limit)
        reads += 1
        states = count_states(run_id)
        if states.get("completed", 0) >= n:
            return reads
        idle = idle + 1 if claimed == 0 else 0
        if idle > 50:
            raise RuntimeError(f"drain stopped short: {states}")
        if claimed == 0:
            time.sleep(0.05)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
