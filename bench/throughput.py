"""Stepward's throughput side by side with pgbench, raw Celery and DBOS Transact, in one run.

    .venv/bin/python bench/throughput.py                 # everything, default sizes
    .venv/bin/python bench/throughput.py --setup         # only make bench/.peers
    .venv/bin/python bench/throughput.py --steps 200 --workers 2 --single-steps 100 \\
        --batch-steps 1000 --desk-steps 100 --count-steps 50 --pgbench-seconds 3   # a smoke run

On the same PostgreSQL, one after the other, it measures:
1. pgbench: one client, one single-row INSERT per transaction (the reference for ingest);
2. statements and commits per single post, per batch-posted step, per pure step and per write
   step, Stepward run in-process (bench/engine_counts.py);
3. ingest through the HTTP API (gunicorn, gthread) with no worker running: single posts from
   several clients, then `POST /runs/{id}/steps/batch`; the single post's server time comes
   from gunicorn's own access log (`%(D)s`);
4. for each worker count C: drain of N `echo` steps posted beforehand (`celery -A console
   worker --concurrency C`, Redis), timed from the ledger (first Attempt's `claimed_at` to the
   last completed step's `updated_at`, so worker boot is excluded); then raw Celery doing N
   no-op tasks (`--concurrency C`, Stepward's Celery settings), timed by the tasks themselves;
   then DBOS Transact doing N one-step workflows from a queue (C processes), timed from DBOS's
   own table (first dequeue to last completion);
5. `ticketdesk.create_keyed` against the ticket desk (default latency), drained the same way.
Then it prints a markdown table, the goals of issue 8 as met / not met, how each figure was
obtained, and one JSON line.

Peers (DBOS, raw Celery) run in bench/.peers, a virtualenv of their own made on first use;
never in the project's. If a peer cannot be installed or run, the output says so.
Databases: stepward_bench, stepward_bench_counts, stepward_bench_dbos (dropped at the end,
but for `--keep-db`);
Redis DBs 12 (Stepward's broker), 13 (raw Celery), 14 (the in-process counts).

One script on purpose (about 1,200 lines): the bench's whole procedure, peers included,
can be read and rerun from one file.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import redis

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PY = sys.executable
PEERS = BENCH / ".peers"
PEER_PY = PEERS / "bin" / "python"
PEER_PACKAGES = ["dbos", "psycopg[binary]", "celery[redis]"]
PG = "postgres://postgres@127.0.0.1:5432"
DB = "stepward_bench"
DB_COUNTS = "stepward_bench_counts"
DB_DBOS = "stepward_bench_dbos"
REDIS = "redis://127.0.0.1:6379"
REDIS_STEPWARD, REDIS_PEER, REDIS_COUNTS = 12, 13, 14
TAG = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
QUEUE = f"stepward-bench-{TAG}"
ACCESS_FORMAT = "%(m)s %(U)s %(s)s %(D)s"
TODAY_DESK = 19.0  # issue 8: today's ticketdesk.create_keyed figure, end to end (about 14 to 19/s)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- processes ----------------------------------------------------------------------------


class Proc:
    """A child in a process group of its own, so that stopping it stops its children too."""

    running: list[Proc] = []

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path, logs: Path):
        self.name = name
        self.log_path = logs / f"{name}.log"
        with open(self.log_path, "wb") as out:
            self.popen = subprocess.Popen(
                argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        Proc.running.append(self)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout: float = 20) -> None:
        if self in Proc.running:
            Proc.running.remove(self)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"{self.name} ignored SIGTERM; killing its group")
        # The group's other members (pool children) may outlive the leader.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)

    @classmethod
    def stop_all(cls) -> None:
        for proc in list(cls.running):
            proc.stop(timeout=10)


@contextlib.contextmanager
def started(*procs: Proc) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in procs:
            proc.stop()


def on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(f"stopped by signal {signum}")


# --- the environment --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.web_port, self.desk_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.web_port}"
        self.desk = f"http://127.0.0.1:{self.desk_port}"
        self.access_log = self.logs / "access.log"
        self.token = ""
        self.batch_available: bool | None = None
        self.notes: list[str] = []
        self.results: dict[str, Any] = {}
        self.failed = False

    def env(self, database: str = DB, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "DATABASE_URL": f"{PG}/{database}",
            "CELERY_BROKER_URL": f"{REDIS}/{REDIS_STEPWARD}",
            "CELERY_QUEUE": QUEUE,
            "STEPWARD_VAR_DIR": str(self.tmp / "var"),
            "TICKETDESK_URL": self.desk,
            "LOG_LEVEL": "WARNING",
            # Its own throwaway databases: any key will do, but Django needs one.
            "SECRET_KEY": os.environ.get("SECRET_KEY") or "stepward-bench-key-not-a-secret",
            # The bench measures the ledger, not the per-token rate limit.
            "API_RATE_LIMIT": "100000000/min",
            **extra,
        }

    def manage(self, *argv: str) -> str:
        out = subprocess.run(
            [PY, "manage.py", *argv],
            cwd=ROOT,
            env=self.env(),
            check=True,
            capture_output=True,
            text=True,
        )
        return out.stdout

    def proc(self, name: str, argv: list[str], env: dict[str, str], cwd: Path = ROOT) -> Proc:
        return Proc(name, argv, env, cwd, self.logs)


def recreate(database: str, template: str | None = None) -> None:
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {database}" + (f" TEMPLATE {template}" if template else ""))


def drop(database: str) -> None:
    with (
        contextlib.suppress(psycopg.Error),
        psycopg.connect(f"{PG}/postgres", autocommit=True) as conn,
    ):
        conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")


def xact_commit(database: str) -> int:
    """PostgreSQL's commit count for `database` (read from another database)."""
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (database,)
        ).fetchone()
        assert row is not None
        return int(row[0])


def flush_redis(db: int) -> None:
    redis.Redis.from_url(f"{REDIS}/{db}").flushdb()


def wait_http(url: str, proc: Proc, deadline: float = 60) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up:\n{proc.tail()}")


def wait_until(
    done: Callable[[], bool], *, timeout: float, procs: list[Proc], what: str, poll: float = 0.2
) -> None:
    end = time.monotonic() + timeout
    while not done():
        for proc in procs:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited during {what}:\n{proc.tail()}")
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not done after {timeout:.0f} s")
        time.sleep(poll)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# --- 1. pgbench ---------------------------------------------------------------------------


def find_pgbench() -> str | None:
    return shutil.which("pgbench") or next(
        iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/pgbench"), reverse=True)), None
    )


def pgbench(bench: Bench) -> dict[str, Any]:
    binary = find_pgbench()
    if not binary:
        return {"error": "pgbench not found (apt-get install postgresql-client)"}
    with psycopg.connect(f"{PG}/{DB}", autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_insert (id bigserial primary key, v int)")
    script = bench.tmp / "insert.sql"
    script.write_text("INSERT INTO bench_insert (v) VALUES (1);\n")
    seconds = bench.args.pgbench_seconds
    argv = [binary, "-h", "127.0.0.1", "-U", "postgres", "-n", "-f", str(script)]
    argv += ["-c", "1", "-j", "1", "-T", str(seconds), DB]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    match = re.search(r"tps = ([\d.]+)", out.stdout)
    if out.returncode or not match:
        return {"error": f"pgbench failed: {out.stdout[-300:]} {out.stderr[-300:]}"}
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    return {
        "tps": round(float(match.group(1)), 1),
        "clients": 1,
        "seconds": seconds,
        "version": version.stdout.strip(),
    }


# --- 2. statements and commits, in-process -----------------------------------------------


def engine_counts(bench: Bench) -> dict[str, Any]:
    env = bench.env(
        DB_COUNTS,
        CELERY_BROKER_URL=f"{REDIS}/{REDIS_COUNTS}",
        CELERY_QUEUE=f"{QUEUE}-counts",
    )
    try:
        out = subprocess.run(
            [PY, str(BENCH / "engine_counts.py"), str(bench.args.count_steps), bench.token],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
    finally:
        flush_redis(REDIS_COUNTS)
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines:
        return {"error": f"engine_counts.py failed: {out.stderr[-800:]}"}
    return dict(json.loads(lines[-1]))


# --- 3. ingest through the API -----------------------------------------------------------


class Api:
    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.headers = {"Authorization": f"Bearer {bench.token}"}
        self.local = threading.local()
        self.lock = threading.Lock()
        self.retries = 0  # 409 "posted to concurrently; try again" answers, retried

    def client(self) -> httpx.Client:
        client = getattr(self.local, "client", None)
        if client is None:
            client = httpx.Client(base_url=self.bench.base, headers=self.headers, timeout=120)
            self.local.client = client
        return client

    def run(self, name: str) -> str:
        response = self.client().post("/api/v1/runs", json={"name": f"{name} {TAG}"})
        check(response)
        return str(response.json()["id"])

    def cancel(self, run_id: str) -> None:
        self.client().post(f"/api/v1/runs/{run_id}/cancel", json={"reason": "bench"})

    def post(self, path: str, body: Any) -> httpx.Response:
        """POST; a 409 that says the run is posted to concurrently is retried, as it asks."""
        for _ in range(50):
            response = self.client().post(path, json=body)
            if response.status_code == 409 and "concurrently" in response.text:
                with self.lock:
                    self.retries += 1
                time.sleep(0.005)
                continue
            return response
        return response

    def single(self, run_id: str, item: dict[str, Any]) -> float:
        started = time.perf_counter()
        response = self.post(f"/api/v1/runs/{run_id}/steps", item)
        check(response)
        return time.perf_counter() - started

    def batch(self, run_id: str, items: list[dict[str, Any]]) -> bool:
        """Posts one batch; False when the endpoint does not exist."""
        response = self.post(f"/api/v1/runs/{run_id}/steps/batch", {"steps": items})
        if response.status_code in (404, 405):
            if self.bench.batch_available is None:
                self.bench.batch_available = False
                self.bench.notes.append(
                    f"batch endpoint not available (HTTP {response.status_code}): batch ingest "
                    "not measured, drain set-ups posted one step at a time"
                )
            return False
        check(response)
        self.bench.batch_available = True
        return True


def check(response: httpx.Response) -> None:
    if response.status_code >= 300:
        raise RuntimeError(
            f"{response.request.method} {response.request.url.path}: "
            f"HTTP {response.status_code} {response.text[:300]}"
        )


def items(tool: str, n: int, prefix: str = "s") -> list[dict[str, Any]]:
    return [{"key": f"{prefix}{i}", "tool": tool, "input": {"title": f"t{i}"}} for i in range(n)]


def post_singles(api: Api, run_id: str, steps: list[dict[str, Any]], clients: int) -> list[float]:
    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda item: api.single(run_id, item), steps))


def post_batches(
    api: Api, run_id: str, steps: list[dict[str, Any]], size: int, clients: int
) -> bool:
    chunks = [steps[i : i + size] for i in range(0, len(steps), size)]
    if not api.batch(run_id, chunks[0]):
        return False
    with ThreadPoolExecutor(clients) as pool:
        return all(pool.map(lambda chunk: api.batch(run_id, chunk), chunks[1:]))


def post_for_drain(bench: Bench, api: Api, tool: str, n: int) -> tuple[str, float]:
    """Posts n steps in a new run (batches, else singles); returns the run and seconds."""
    run_id = api.run(f"drain {tool}")
    steps = items(tool, n)
    started = time.perf_counter()
    if bench.batch_available is False or not post_batches(
        api, run_id, steps, bench.args.batch_size, 1
    ):
        post_singles(api, run_id, steps, bench.args.single_clients)
    return run_id, time.perf_counter() - started


def server_times_ms(bench: Bench, run_ids: list[str]) -> list[float]:
    """The single posts' server times into these runs, from gunicorn's access log."""
    paths = {f"/api/v1/runs/{run_id}/steps" for run_id in run_ids}
    times = []
    for line in bench.access_log.read_text(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "POST" and parts[1] in paths and parts[2][0] == "2":
            times.append(int(parts[3]) / 1000)
    return times


def ingest(bench: Bench, api: Api) -> None:
    args = bench.args
    k = args.single_clients
    # Single posts: k concurrent clients, as k agents would be, each posting one step after
    # another into its own run over its own keep-alive connection.
    warm = api.run("ingest warm-up")
    for i in range(2 * args.web_workers * args.web_threads):
        api.single(warm, {"key": f"warm{i}", "tool": "echo", "input": {}})
    # One client alone first: the server time of a post with no queue in front of it.
    alone = api.run("ingest alone")
    for item in items("echo", args.latency_posts):
        api.single(alone, item)
    runs = [api.run(f"ingest single {c}") for c in range(k)]
    steps = items("echo", args.single_steps)
    retries_before = api.retries

    def client(c: int) -> list[float]:
        return [api.single(runs[c], item) for item in steps[c::k]]

    started = time.perf_counter()
    with ThreadPoolExecutor(k) as pool:
        latencies = [t for ts in pool.map(client, range(k)) for t in ts]
    seconds = time.perf_counter() - started
    time.sleep(0.5)  # let gunicorn's access log reach the file
    server = server_times_ms(bench, runs)
    single: dict[str, Any] = {
        "steps": args.single_steps,
        "clients": k,
        "seconds": round(seconds, 2),
        "steps_per_second": round(args.single_steps / seconds, 1),
        "client_ms_p50": round(1000 * statistics.median(latencies), 2),
        "conflicts_retried": api.retries - retries_before,
    }
    if server:
        single |= {
            "server_ms_p50": round(percentile(server, 0.5), 2),
            "server_ms_p95": round(percentile(server, 0.95), 2),
            "server_samples": len(server),
        }
    else:
        single["server_error"] = "no matching lines in gunicorn's access log"
    server = server_times_ms(bench, [alone])
    if server:
        single |= {
            "alone_server_ms_p50": round(percentile(server, 0.5), 2),
            "alone_server_ms_p95": round(percentile(server, 0.95), 2),
            "alone_samples": len(server),
        }
    bench.results["ingest_single"] = single
    for run_id in [warm, alone, *runs]:
        api.cancel(run_id)
    log(f"ingest single: {single}")

    # Batches.
    run_id = api.run("ingest batch")
    if not api.batch(run_id, [{"key": "warm", "tool": "echo", "input": {}}]):
        bench.results["ingest_batch"] = {"error": "batch endpoint not available"}
    else:
        steps = items("echo", args.batch_steps)
        started = time.perf_counter()
        post_batches(api, run_id, steps, args.batch_size, args.batch_clients)
        seconds = time.perf_counter() - started
        bench.results["ingest_batch"] = {
            "steps": args.batch_steps,
            "batch_size": args.batch_size,
            "clients": args.batch_clients,
            "seconds": round(seconds, 2),
            "steps_per_second": round(args.batch_steps / seconds, 1),
        }
    api.cancel(run_id)
    log(f"ingest batch: {bench.results['ingest_batch']}")
    flush_redis(REDIS_STEPWARD)  # the hints for the cancelled steps


# --- 4. drains ----------------------------------------------------------------------------


LEDGER_PROGRESS = """
SELECT count(*) FILTER (WHERE state = 'completed'),
       count(*) FILTER (WHERE state IN ('failed', 'dead', 'unknown', 'blocked', 'cancelled')),
       count(*) FILTER (WHERE state <> 'pending')
FROM executor_step WHERE run_id = %s
"""
LEDGER_SPAN = """
SELECT (SELECT min(a.claimed_at) FROM executor_attempt a
          JOIN executor_step s ON s.id = a.step_id WHERE s.run_id = %(run)s),
       max(updated_at) FILTER (WHERE state = 'completed'),
       count(*) FILTER (WHERE state = 'completed'),
       (SELECT count(*) FROM executor_attempt a
          JOIN executor_step s ON s.id = a.step_id WHERE s.run_id = %(run)s)
FROM executor_step WHERE run_id = %(run)s
"""


def stepward_drain(bench: Bench, api: Api, tool: str, n: int, workers: int) -> dict[str, Any]:
    flush_redis(REDIS_STEPWARD)
    run_id, post_seconds = post_for_drain(bench, api, tool, n)
    queued = redis.Redis.from_url(f"{REDIS}/{REDIS_STEPWARD}").llen(QUEUE)
    before = xact_commit(DB)
    worker = bench.proc(
        f"stepward-worker-{tool}-c{workers}",
        [
            *(PY, "-m", "celery", "-A", "console", "worker", "--concurrency", str(workers)),
            *("--loglevel", "WARNING", "-n", f"bench-{TAG}-{workers}@%h"),
        ],
        bench.env(),
    )
    polls = 0
    # The workers' CPU (user + system, every process of the group) at the last look before
    # anything was claimed, and at the end: what the drain itself cost them.
    cpu_before: float | None = None
    with started(worker), psycopg.connect(f"{PG}/{DB}", autocommit=True) as conn:

        def finished() -> bool:
            nonlocal polls, cpu_before
            polls += 1
            cpu = group_cpu_seconds(worker.popen.pid)
            row = conn.execute(LEDGER_PROGRESS, (run_id,)).fetchone()
            assert row is not None
            if row[2] == 0:
                cpu_before = cpu
            if row[1]:
                raise RuntimeError(f"{row[1]} steps ended other than completed")
            return bool(row[0] >= n)

        wait_until(
            finished,
            timeout=bench.args.timeout + n / 5,
            procs=[worker],
            what=f"drain of {n} {tool} steps, C={workers}",
            poll=0.05,
        )
        cpu_after = group_cpu_seconds(worker.popen.pid)
        row = conn.execute(LEDGER_SPAN, {"run": run_id}).fetchone()
        assert row is not None
    commits = xact_commit(DB) - before - polls - 1
    flush_redis(REDIS_STEPWARD)
    first, last, done, attempts = row
    seconds = (last - first).total_seconds()
    return {
        "steps": n,
        "workers": workers,
        "completed": done,
        "attempts": attempts,
        "messages_queued": queued,
        "post_seconds": round(post_seconds, 2),
        "seconds": round(seconds, 3),
        "steps_per_second": round(done / seconds, 1) if seconds > 0 else None,
        "commits_per_step_all_processes": round(commits / n, 2),
        "worker_cpu_ms_per_step": (
            round((cpu_after - cpu_before) * 1000 / n, 2) if cpu_before is not None else None
        ),
    }


def group_cpu_seconds(group: int) -> float:
    """User + system CPU of the live processes of a process group, from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[2]) == group:  # pgrp; utime and stime follow at 11 and 12
            total += int(fields[11]) + int(fields[12])
    return total / ticks


def celery_peer(bench: Bench, n: int, workers: int) -> dict[str, Any]:
    queue = f"bench-noop-{TAG}"
    env = {
        **os.environ,
        "BENCH_CELERY_BROKER": f"{REDIS}/{REDIS_PEER}",
        "BENCH_CELERY_QUEUE": queue,
    }
    flush_redis(REDIS_PEER)
    subprocess.run(
        [str(PEER_PY), "peer_celery.py", "enqueue", str(n)],
        cwd=BENCH,
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    r = redis.Redis.from_url(f"{REDIS}/{REDIS_PEER}")
    worker = bench.proc(
        f"celery-peer-c{workers}",
        [
            *(str(PEER_PY), "-m", "celery", "-A", "peer_celery", "worker", "--concurrency"),
            *(str(workers), "--loglevel", "WARNING", "-n", f"peer-{TAG}-{workers}@%h"),
        ],
        env,
        cwd=BENCH,
    )
    with started(worker):
        wait_until(
            lambda: int(r.get(f"{queue}:done") or 0) >= n,
            timeout=bench.args.timeout + n / 20,
            procs=[worker],
            what=f"raw Celery, {n} tasks, C={workers}",
        )
    first = min(float(v) for v in r.hvals(f"{queue}:first"))
    last = max(float(v) for v in r.hvals(f"{queue}:last"))
    done = int(r.get(f"{queue}:done") or 0)
    processes = r.hlen(f"{queue}:last")
    flush_redis(REDIS_PEER)
    return {
        "tasks": n,
        "workers": workers,
        "done": done,
        "processes_used": processes,
        "seconds": round(last - first, 3),
        "tasks_per_second": round(done / (last - first), 1),
    }


DBOS_PROGRESS = "SELECT count(*) FILTER (WHERE status = 'SUCCESS') FROM dbos.workflow_status"
DBOS_SPAN = """
SELECT count(*), min(started_at_epoch_ms), max(coalesce(completed_at, updated_at)),
       count(DISTINCT executor_id)
FROM dbos.workflow_status WHERE status = 'SUCCESS'
"""


def dbos_peer(bench: Bench, n: int, workers: int) -> dict[str, Any]:
    args = bench.args
    recreate(DB_DBOS)
    env = {
        **os.environ,
        "BENCH_DBOS_URL": f"postgresql://postgres@127.0.0.1:5432/{DB_DBOS}",
        "BENCH_DBOS_QUEUE": "bench",
        "BENCH_DBOS_WORKER_CONCURRENCY": str(args.dbos_worker_concurrency),
        "BENCH_DBOS_POLLING": str(args.dbos_polling),
    }
    try:
        subprocess.run(
            [str(PEER_PY), "peer_dbos.py", "enqueue", str(n)],
            cwd=BENCH,
            env=env,
            check=True,
            capture_output=True,
            timeout=600,
        )
        before = xact_commit(DB_DBOS)
        procs = [
            bench.proc(
                f"dbos-peer-c{workers}-{i}",
                [str(PEER_PY), "peer_dbos.py", "worker", f"w{i}"],
                env,
                cwd=BENCH,
            )
            for i in range(workers)
        ]
        polls = 0
        with started(*procs), psycopg.connect(f"{PG}/{DB_DBOS}", autocommit=True) as conn:

            def finished() -> bool:
                nonlocal polls
                polls += 1
                row = conn.execute(DBOS_PROGRESS).fetchone()
                return bool(row and row[0] >= n)

            wait_until(
                finished,
                timeout=args.timeout + n / 20,
                procs=procs,
                what=f"DBOS, {n} workflows, {workers} processes",
            )
            row = conn.execute(DBOS_SPAN).fetchone()
            assert row is not None
        commits = xact_commit(DB_DBOS) - before - polls - 1
    finally:
        drop(DB_DBOS)
    done, first, last, executors = row
    seconds = (last - first) / 1000
    return {
        "steps": n,
        "processes": workers,
        "worker_concurrency": args.dbos_worker_concurrency or "unlimited",
        "polling_interval_s": args.dbos_polling,
        "done": done,
        "executors_used": executors,
        "seconds": round(seconds, 3),
        "steps_per_second": round(done / seconds, 1) if seconds > 0 else None,
        "commits_per_step_all_processes": round(commits / n, 2),
    }


def attempt(bench: Bench, label: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Runs one measurement; a failure is recorded as such, never as a figure."""
    try:
        result = work()
    except Exception as error:  # noqa: BLE001 - a failed measurement is reported, not invented
        result = {"error": f"{type(error).__name__}: {str(error)[:600]}"}
        bench.failed = True
    log(f"{label}: {result}")
    return result


# --- peers' environment ----------------------------------------------------------------


def find_python313() -> str | None:
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.13*/bin/python3.13")))
    candidates += [p for p in (shutil.which("python3.13"),) if p]
    for candidate in candidates:
        check = subprocess.run(
            [candidate, "-c", "import sys; sys.exit(sys.version_info[:2] != (3, 13))"],
            capture_output=True,
            check=False,
        )
        if check.returncode == 0:
            return candidate
    return None


def peer_versions() -> dict[str, str] | None:
    if not PEER_PY.exists():
        return None
    out = subprocess.run(
        [
            str(PEER_PY),
            "-c",
            "import json, importlib.metadata as m, dbos, celery, redis, psycopg; "
            "import kombu.transport.redis; "
            "print(json.dumps({p: m.version(p) for p in ('dbos', 'celery', 'redis', 'psycopg')}))",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    return dict(json.loads(out.stdout)) if out.returncode == 0 else None


def setup_peers() -> tuple[dict[str, str] | None, str | None]:
    """Makes bench/.peers if it is missing or incomplete; returns (versions, error)."""
    versions = peer_versions()
    if versions:
        return versions, None
    python = find_python313()
    if python is None:
        return None, "no Python 3.13 found for the peers' virtualenv"
    log(f"making {PEERS} with {python} ({' '.join(PEER_PACKAGES)})")
    steps = [[python, "-m", "venv", str(PEERS)], [str(PEER_PY), "-m", "pip", "install", "-q"]]
    steps[1] += PEER_PACKAGES
    for argv in steps:
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
        if out.returncode:
            return None, f"{' '.join(argv[:4])} failed: {out.stderr[-600:]}"
    versions = peer_versions()
    return (versions, None) if versions else (None, "peers installed but do not import")


# --- the report ---------------------------------------------------------------------------


def fig(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:,}{unit}" if isinstance(value, int | float) else str(value)


def get(results: dict[str, Any], *path: Any) -> Any:
    value: Any = results
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def ratio(a: Any, b: Any) -> float | None:
    return (
        round(a / b, 2) if isinstance(a, int | float) and isinstance(b, int | float) and b else None
    )


def pgbench_reference(results: dict[str, Any]) -> float | None:
    """The higher of the two pgbench readings: the harder reference for ingest."""
    readings = [get(results, key, "tps") for key in ("pgbench", "pgbench_end")]
    return max((t for t in readings if t), default=None)


def goals(results: dict[str, Any], desk_workers: int) -> list[dict[str, Any]]:
    r = results
    pg = pgbench_reference(r)
    drain2 = get(r, "drain", "2", "stepward", "steps_per_second")
    rows = [
        (
            "drain of echo, -c 2, vs DBOS (same run)",
            ratio(drain2, get(r, "drain", "2", "dbos", "steps_per_second")),
            ">= 2x",
            lambda v: v >= 2,
        ),
        (
            "drain of echo, -c 2, vs raw Celery no-op tasks",
            ratio(drain2, get(r, "drain", "2", "celery", "tasks_per_second")),
            ">= 0.9x",
            lambda v: v >= 0.9,
        ),
        (
            "batch ingest vs pgbench one-client INSERT tps / 4",
            ratio(get(r, "ingest_batch", "steps_per_second"), pg / 4 if pg else None),
            ">= 1x",
            lambda v: v >= 1,
        ),
        (
            "single post: SQL statements",
            get(r, "counts", "single_post", "statements"),
            "<= 8",
            lambda v: v <= 8,
        ),
        (
            "single post: p50 server time (ms), one client",
            get(r, "ingest_single", "alone_server_ms_p50"),
            "< 10",
            lambda v: v < 10,
        ),
        (
            "pure step: commits, drained alone",
            get(r, "counts", "pure_step_alone", "commits"),
            "<= 2",
            lambda v: v <= 2,
        ),
        (
            "pure step: commits, drained together",
            get(r, "counts", "pure_step", "commits"),
            "<= 2",
            lambda v: v <= 2,
        ),
        (
            "write step: commits, drained alone",
            get(r, "counts", "write_step_alone", "commits"),
            "<= 4",
            lambda v: v <= 4,
        ),
        (
            "write step: commits, drained together",
            get(r, "counts", "write_step", "commits"),
            "<= 4",
            lambda v: v <= 4,
        ),
        (
            f"ticketdesk.create_keyed, -c {desk_workers}, vs today's {TODAY_DESK:g}/s",
            ratio(get(r, "desk", "steps_per_second"), TODAY_DESK),
            ">= 5x",
            lambda v: v >= 5,
        ),
    ]
    return goal_rows(rows)


def goal_rows(rows: list[tuple[str, Any, str, Callable[[Any], bool]]]) -> list[dict[str, Any]]:
    """(name, measured, target, test) as the report's goal rows, each met / not met / not
    measured."""
    return [
        {
            "goal": name,
            "measured": value,
            "target": target,
            "verdict": "not measured" if value is None else ("met" if test(value) else "not met"),
        }
        for name, value, target, test in rows
    ]


def report(bench: Bench, meta: dict[str, Any]) -> None:
    r, a = bench.results, bench.args
    print("\n## Stepward throughput, side by side\n")
    print("| figure | value | how |")
    print("| --- | --- | --- |")

    def row(name: str, value: Any, how: str) -> None:
        print(f"| {name} | {value} | {how} |")

    def err(*path: Any) -> str:
        e = get(r, *path, "error")
        return f"not measured: {e}" if e else "-"

    for key, when in (("pgbench", "before the ingest"), ("pgbench_end", "after the drains")):
        pg = get(r, key, "tps")
        row(
            f"pgbench, 1 client, single-row INSERT, {when}",
            fig(pg, " tps") if pg else err(key),
            f"`pgbench -n -c 1 -j 1 -T {a.pgbench_seconds}`, one INSERT per transaction",
        )
    single = r.get("ingest_single", {})
    row(
        f"ingest, single posts ({a.single_clients} clients)",
        fig(single.get("steps_per_second"), " steps/s") if single else err("ingest_single"),
        f"{a.single_steps} x `POST /runs/{{id}}/steps` (echo) through gunicorn, no worker",
    )
    row(
        "single post, server time p50 / p95, one client alone",
        f"{fig(single.get('alone_server_ms_p50'))} / {fig(single.get('alone_server_ms_p95'))} ms",
        f"{a.latency_posts} posts one after another; gunicorn's access log `%(D)s`",
    )
    row(
        f"single post, server time p50 / p95, {a.single_clients} clients",
        f"{fig(single.get('server_ms_p50'))} / {fig(single.get('server_ms_p95'))} ms",
        "the ingest posts above; includes waiting for a core behind the other requests",
    )
    batch = r.get("ingest_batch", {})
    row(
        f"ingest, batch posts ({a.batch_size} per batch, {a.batch_clients} client)",
        fig(batch.get("steps_per_second"), " steps/s")
        if "steps_per_second" in batch
        else err("ingest_batch"),
        f"{a.batch_steps} steps by `POST /runs/{{id}}/steps/batch`, no worker",
    )
    for c in a.workers:
        d = get(r, "drain", str(c)) or {}
        s, cel, dbos = d.get("stepward", {}), d.get("celery", {}), d.get("dbos", {})
        row(
            f"drain of `echo`, `-c {c}`",
            fig(s.get("steps_per_second"), " steps/s")
            if "steps_per_second" in s
            else err("drain", str(c), "stepward"),
            f"{a.steps} steps posted first; ledger: first claim -> last completion; "
            f"{fig(s.get('commits_per_step_all_processes'))} commits/step, all processes",
        )
        row(
            f"raw Celery no-op tasks, `-c {c}`",
            fig(cel.get("tasks_per_second"), " tasks/s")
            if "tasks_per_second" in cel
            else err("drain", str(c), "celery"),
            f"{a.steps} tasks queued first; tasks' own first start -> last end",
        )
        row(
            f"DBOS Transact one-step workflows, {c} process{'es' if c != 1 else ''}",
            fig(dbos.get("steps_per_second"), " steps/s")
            if "steps_per_second" in dbos
            else err("drain", str(c), "dbos"),
            f"{a.steps} enqueued first; workflow_status: first dequeue -> last completion; "
            f"{fig(dbos.get('commits_per_step_all_processes'))} commits/step",
        )
    desk = r.get("desk", {})
    row(
        f"drain of `ticketdesk.create_keyed`, `-c {a.desk_workers}`",
        fig(desk.get("steps_per_second"), " steps/s")
        if "steps_per_second" in desk
        else err("desk"),
        f"{a.desk_steps} steps, the desk at its default latency, timed like the echo drain",
    )
    for key, label in (
        ("single_post", "per single post"),
        ("batch_post", "per batch-posted step"),
        ("pure_step", "per pure step (`echo`), drained together"),
        ("pure_step_alone", "per pure step, drained alone"),
        ("write_step", "per write step (`ticketdesk.create_keyed`), drained together"),
        ("write_step_alone", "per write step, drained alone"),
        ("empty_drain", "per `engine.drain` call with nothing due"),
    ):
        c = get(r, "counts", key) or {}
        value = (
            f"{fig(c['statements'])} statements, {fig(c['commits'])} commits"
            if "statements" in c
            else err("counts", key)
        )
        row(f"SQL {label}", value, f"in-process, {c.get('units', a.count_steps)} of them")

    print(
        "\n| C | Stepward echo steps/s | raw Celery tasks/s | DBOS steps/s | "
        "Stepward / Celery | Stepward / DBOS |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for c in a.workers:
        s = get(r, "drain", str(c), "stepward", "steps_per_second")
        cel = get(r, "drain", str(c), "celery", "tasks_per_second")
        dbos = get(r, "drain", str(c), "dbos", "steps_per_second")
        print(
            f"| {c} | {fig(s)} | {fig(cel)} | {fig(dbos)} | "
            f"{fig(ratio(s, cel))} | {fig(ratio(s, dbos))} |"
        )

    print("\n### Goals (issue 8)\n")
    print("| goal | measured | target | verdict |")
    print("| --- | --- | --- | --- |")
    for g in r["goals"]:
        print(f"| {g['goal']} | {fig(g['measured'])} | {g['target']} | {g['verdict']} |")

    print("\n### How these figures were obtained\n")
    for line in method_lines(bench, meta):
        print(f"- {line}")
    if bench.notes:
        print("\n### Notes\n")
        for note in bench.notes:
            print(f"- {note}")
    print("\nJSON " + json.dumps({"meta": meta, "results": r, "notes": bench.notes}))


def method_lines(bench: Bench, meta: dict[str, Any]) -> list[str]:
    a = bench.args
    return [
        f"{meta['date']}, {meta['host']}: {meta['cores']} cores, {meta['memory_gib']} GiB, "
        f"load average {meta['load_before']} before and {meta['load_after']} after; "
        f"PostgreSQL {meta['postgresql']}, Redis {meta['redis']}; Stepward at {meta['commit']}.",
        "Everything ran on this one machine, one phase at a time, against the same PostgreSQL "
        f"(databases {DB}, {DB_COUNTS}, {DB_DBOS}) and Redis (DBs {REDIS_STEPWARD}, "
        f"{REDIS_PEER}, {REDIS_COUNTS}).",
        f"Web: `gunicorn console.wsgi --worker-class gthread --workers {a.web_workers} "
        f"--threads {a.web_threads}`; API rate limit lifted for the bench.",
        f"Ingest: {a.single_steps} single posts from {a.single_clients} concurrent clients, "
        "each posting one step after another into its own run on a keep-alive connection (as "
        "that many agents would; a 409 'posted to concurrently, try again' would be retried "
        f"and counted); {a.batch_steps} steps in batches of {a.batch_size} from "
        f"{a.batch_clients} client(s); no worker running, so posting is measured alone. "
        "Server time is gunicorn's `%(D)s` (request received -> response written), read "
        f"for {a.latency_posts} posts from one client alone (the goal's figure) and for the "
        "concurrent posts (where it includes queueing for the 2 cores).",
        f"Drain: {a.steps} steps posted first (their messages queued in Redis), then "
        "`celery -A console worker --concurrency C` started; steps/s = completed steps / "
        "(last completed step's updated_at - first Attempt's claimed_at), so worker boot "
        "and posting are excluded. Commits/step, all processes = pg_stat_database.xact_commit "
        "over the drain (worker boot included, the bench's own polls excluded) / steps.",
        f"Raw Celery {meta['peers'].get('celery', '?')} (bench/.peers): {a.steps} no-op tasks "
        "queued first, then `celery worker --concurrency C` with Stepward's settings (acks_late, "
        "reject_on_worker_lost, prefetch 1, no results); each task records in Redis (one "
        "pipelined round trip) its process's first start and latest end; tasks/s = tasks / "
        "(last end - first start).",
        f"DBOS Transact {meta['peers'].get('dbos', '?')} (bench/.peers): {a.steps} workflows of "
        "one `@DBOS.step` (returns its input) enqueued first on a DBOS queue, then C worker "
        "processes (distinct executor ids) dequeue them, each running up to "
        f"{a.dbos_worker_concurrency or 'unlimited'} workflows at once on its threads, polling "
        f"every {a.dbos_polling} s (DBOS's default, 1 s, would cap a backlog at "
        "worker_concurrency per second per process); steps/s = workflows / (last completed_at - "
        "first started_at_epoch_ms) from dbos.workflow_status. Same number of OS processes as "
        "Stepward's pool; DBOS overlaps its database round trips on threads, Stepward's "
        "prefork children do one step at a time.",
        f"Statements and commits: bench/engine_counts.py, Stepward in-process on "
        f"{a.count_steps} steps per kind after a warm-up (posts through Django's test client, "
        "the whole request stack; steps by `engine.drain`, all due together so the engine "
        "batches them, and a few one at a time, 'alone'); statements are those Django "
        "executes, in every thread (BEGIN/COMMIT and the connection health check are not "
        "counted); commits are PostgreSQL's xact_commit for the database, read after the "
        "engine's pool threads reconnect (a closing backend flushes its statistics at once) "
        "and a second's wait, so other connections' statistics are in (autocommit reads and "
        "connection health checks count).",
        "Batch ingest is compared with a quarter of the higher of the two pgbench readings "
        "(one right before the ingest, one after the drains). 'Drained alone' is one step "
        "posted, then `engine.drain(limit=1)`, which stops at its limit; a worker's drain "
        "ends with one more look for due work (the `engine.drain` with nothing due row), "
        "once per wake, not per step.",
        f"ticketdesk.create_keyed: {a.desk_steps} steps, `-c {a.desk_workers}`, the desk at its "
        f"default latency; the ratio compares with {TODAY_DESK:g} steps/s, the README's "
        "end-to-end figure before issue 8 (posting and draining mixed).",
    ]


def machine(bench: Bench) -> dict[str, Any]:
    with psycopg.connect(f"{PG}/postgres") as conn:
        row = conn.execute("SHOW server_version").fetchone()
    info = redis.Redis.from_url(f"{REDIS}/0").info("server")
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": f"{platform.node()} ({platform.system()} {platform.release()})",
        "cores": os.cpu_count(),
        "memory_gib": round(mem, 1),
        "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "postgresql": row[0] if row else "?",
        "redis": info.get("redis_version", "?"),
        "commit": commit or "?",
        "python": platform.python_version(),
        "args": vars(bench.args),
    }


# --- main ---------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--setup", action="store_true", help="only make bench/.peers, then exit")
    p.add_argument("--steps", type=int, default=2000, help="N for each drain and each peer")
    p.add_argument("--workers", default="1,2,4", help="worker processes C, comma-separated")
    p.add_argument("--single-steps", type=int, default=500)
    p.add_argument("--single-clients", type=int, default=8)
    p.add_argument("--latency-posts", type=int, default=200, help="one client, one by one")
    p.add_argument("--batch-steps", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=500)
    p.add_argument("--batch-clients", type=int, default=1)
    p.add_argument("--desk-steps", type=int, default=500)
    p.add_argument("--desk-workers", type=int, default=2)
    p.add_argument("--count-steps", type=int, default=200, help="units per in-process count")
    p.add_argument("--pgbench-seconds", type=int, default=10)
    p.add_argument("--web-workers", type=int, default=2)
    p.add_argument("--web-threads", type=int, default=8)
    p.add_argument("--dbos-worker-concurrency", type=int, default=32, help="0 = unlimited")
    p.add_argument("--dbos-polling", type=float, default=0.01, help="seconds")
    p.add_argument("--no-peers", action="store_true", help="skip raw Celery and DBOS")
    p.add_argument("--timeout", type=float, default=120, help="extra seconds per drain")
    p.add_argument("--keep-db", action="store_true", help=f"leave {DB} for inspection")
    args = p.parse_args()
    args.workers = [int(w) for w in str(args.workers).split(",") if w.strip()]
    return args


def run(bench: Bench, meta: dict[str, Any]) -> None:
    args = bench.args
    flush_redis(REDIS_STEPWARD)
    log(f"database {DB}: migrate, agent")
    recreate(DB)
    bench.manage("migrate", "--no-input")
    bench.token = bench.manage("create_agent", "bench", "--workspace", "bench").split()[-1]
    recreate(DB_COUNTS, template=DB)  # same schema and agent, steps of its own

    desk = bench.proc(
        "ticketdesk",
        [
            *(PY, "manage.py", "ticketdesk", "--port", str(bench.desk_port), "--quiet"),
            *("--db", str(bench.tmp / "desk.sqlite3")),
        ],
        bench.env(),
    )
    with started(desk):
        wait_http(f"{bench.desk}/health", desk)
        log("statements and commits, in-process")
        bench.results["counts"] = attempt(bench, "counts", lambda: engine_counts(bench))
        drop(DB_COUNTS)

        web = bench.proc(
            "gunicorn",
            [
                *(PY, "-m", "gunicorn", "console.wsgi", "--bind", f"127.0.0.1:{bench.web_port}"),
                *("--worker-class", "gthread", "--workers", str(args.web_workers)),
                *("--threads", str(args.web_threads), "--access-logfile", str(bench.access_log)),
                *("--access-logformat", ACCESS_FORMAT, "--no-control-socket"),
            ],
            bench.env(),
        )
        with started(web):
            wait_http(f"{bench.base}/api/v1/openapi.json", web)
            api = Api(bench)
            # pgbench right before the ingest it is the reference for, gunicorn idle.
            log("pgbench")
            bench.results["pgbench"] = attempt(bench, "pgbench", lambda: pgbench(bench))
            log("ingest")
            try:
                ingest(bench, api)
            except Exception as error:  # noqa: BLE001 - reported as not measured
                failure = {"error": f"{type(error).__name__}: {str(error)[:600]}"}
                bench.results.setdefault("ingest_single", failure)
                bench.results.setdefault("ingest_batch", failure)
                bench.failed = True
                log(f"ingest failed: {failure}")
            drains: dict[str, dict[str, Any]] = {}
            bench.results["drain"] = drains
            # Per C, the three side by side, one right after the other.
            n = args.steps
            for c in args.workers:
                d = drains[str(c)] = {}
                d["stepward"] = attempt(
                    bench,
                    f"drain of echo, C={c}",
                    lambda c=c: stepward_drain(bench, api, "echo", n, c),
                )
                if meta["peers_error"]:
                    d["celery"] = d["dbos"] = {"error": meta["peers_error"]}
                    continue
                d["celery"] = attempt(
                    bench, f"raw Celery, C={c}", lambda c=c: celery_peer(bench, n, c)
                )
                d["dbos"] = attempt(bench, f"DBOS, C={c}", lambda c=c: dbos_peer(bench, n, c))
            log("pgbench again")
            bench.results["pgbench_end"] = attempt(bench, "pgbench", lambda: pgbench(bench))
            bench.results["desk"] = attempt(
                bench,
                f"drain of ticketdesk.create_keyed, C={args.desk_workers}",
                lambda: stepward_drain(
                    bench, api, "ticketdesk.create_keyed", args.desk_steps, args.desk_workers
                ),
            )


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, on_signal)
    if args.setup:
        versions, error = setup_peers()
        print(json.dumps({"peers": versions, "error": error}))
        sys.exit(1 if error else 0)
    tmp = Path(tempfile.mkdtemp(prefix="stepward-bench-"))
    bench = Bench(args, tmp)
    meta: dict[str, Any] = {}
    try:
        meta = machine(bench)
        versions, error = (None, "skipped (--no-peers)") if args.no_peers else setup_peers()
        meta["peers"], meta["peers_error"] = versions or {}, error
        if error:
            bench.notes.append(f"peers not measured: {error}")
        run(bench, meta)
    finally:
        Proc.stop_all()
        for database in (DB_COUNTS, DB_DBOS) if args.keep_db else (DB, DB_COUNTS, DB_DBOS):
            drop(database)
        for db in (REDIS_STEPWARD, REDIS_PEER, REDIS_COUNTS):
            with contextlib.suppress(redis.RedisError):
                flush_redis(db)
    meta["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    bench.results["goals"] = goals(bench.results, args.desk_workers)
    report(bench, meta)
    if bench.failed:
        print(f"\nlogs of the processes kept in {bench.logs}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
