"""Grows a ledger through the API and measures, at each size, what an agent, a reviewer, a
scraper and an auditor feel (issue 25): a single post, batch ingest and the drain as the
ledger grows, the drain of `--drain-steps` more posted at each size (the same work at every
size), the console's pages, /metrics, verify_ledger (whole and --since the newest checkpoint
covering `--since-steps` changed steps: time and the process's own peak memory) and the
bytes each completed step costs.

    .venv/bin/python bench/scale.py --sizes 2000                    # a smoke run
    .venv/bin/python bench/scale.py --sizes 250000,1000000 --own-cluster

Batches of `echo` steps are posted by `--posters` clients while a Celery worker
(`--concurrency`) and the sweeper drain them, `--run-steps` steps a run (so the runs list
grows too), until the ledger holds each size; then everything is measured on the quiet
ledger. `--own-cluster` starts a throwaway PostgreSQL cluster with the default settings
(autovacuum on, nothing tuned) on a free port, as the issue asks; otherwise the database
`--db` on `--pg` is dropped and made anew. Nothing is vacuumed by hand. Prints a markdown
table and one `JSON {...}` line. It is not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
import redis
from throughput import PY, ROOT, Proc, check, free_port, log, on_signal, started, wait_http

TAG = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
# Runs a script (argv[2:]) in this process and, as it exits however it exits, writes the
# process's peak resident memory (VmHWM, kB) to argv[1].
PEAK_WRAPPER = """
import runpy, sys
peak_file, sys.argv = sys.argv[1], sys.argv[2:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    with open("/proc/self/status") as status:
        hwm = next(line for line in status if line.startswith("VmHWM:")).split()[1]
    with open(peak_file, "w") as out:
        out.write(hwm)
"""
QUEUE = f"stepward-scale-{TAG}"
PASSWORD = "scale-bench-password"


class Scale:
    def __init__(self, args: argparse.Namespace, tmp: Path, pg: str) -> None:
        self.args = args
        self.tmp = tmp
        self.logs = tmp / "logs"
        self.logs.mkdir(exist_ok=True)
        self.pg = pg
        self.dsn = f"{pg}/{args.db}"
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.token = ""
        self.export = tmp / "checkpoints.log"

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "DATABASE_URL": self.dsn,
            "CELERY_BROKER_URL": f"redis://127.0.0.1:6379/{self.args.redis_db}",
            "CELERY_QUEUE": QUEUE,
            "STEPWARD_VAR_DIR": str(self.tmp / "var"),
            "LOG_LEVEL": "WARNING",
            "SECRET_KEY": os.environ.get("SECRET_KEY") or "stepward-scale-key-not-a-secret",
            "API_RATE_LIMIT": "100000000/min",
            "EXECUTOR_CHECKPOINT_SECONDS": str(self.args.checkpoint_seconds),
            "EXECUTOR_CHECKPOINT_EXPORT": str(self.export),
            **extra,
        }

    def manage(self, *argv: str) -> str:
        out = subprocess.run(
            [PY, "manage.py", *argv], cwd=ROOT, env=self.env(), capture_output=True, text=True
        )
        if out.returncode:
            raise RuntimeError(
                f"manage.py {' '.join(argv)}: {out.stdout[-600:]}{out.stderr[-600:]}"
            )
        return out.stdout

    def timed_manage(self, *argv: str) -> dict[str, Any]:
        """Runs a command; its wall seconds, its process's own peak resident memory (VmHWM,
        written by the process as it exits) and the last line it printed.

        Not `wait4`'s ru_maxrss: a child started by vfork (as subprocess does) carries the
        parent's high-water mark across exec, so that figure was this bench's own memory
        (443 MB at 1M on 2026-12-06, where verification itself peaked at 126 MB)."""
        peak_file = self.tmp / f"peak-{uuid.uuid4().hex[:8]}"
        started_at = time.perf_counter()
        out = subprocess.run(
            [PY, "-c", PEAK_WRAPPER, str(peak_file), "manage.py", *argv],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - started_at
        with open(self.logs / "verify.log", "a") as log_file:
            log_file.write(out.stdout + out.stderr)
        lines = out.stdout.strip().splitlines()
        peak_kb = int(peak_file.read_text()) if peak_file.exists() else 0
        return {
            "seconds": round(seconds, 2),
            "peak_mb": round(peak_kb / 1024, 1),
            "exit": out.returncode,
            "said": lines[-2] if len(lines) > 1 else (lines[-1] if lines else ""),
        }

    def proc(self, name: str, argv: list[str]) -> Proc:
        return Proc(name, argv, self.env(), ROOT, self.logs)


# --- a throwaway cluster with PostgreSQL's defaults ---------------------------------------


class Cluster:
    """initdb + pg_ctl as the `postgres` OS user (initdb refuses root), on a free port."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp / "pgdata"
        self.port = free_port()
        bindir = subprocess.run(
            ["pg_config", "--bindir"], capture_output=True, text=True, check=True
        ).stdout.strip()
        self.bin = Path(bindir)

    def as_postgres(self, *argv: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*prefix, *argv], check=True, capture_output=True)

    def start(self) -> str:
        self.dir.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")
            shutil.chown(self.dir.parent, "postgres")
        self.as_postgres(str(self.bin / "initdb"), "-D", str(self.dir), "-U", "postgres",
                         "--auth=trust")  # fmt: skip
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.dir}"
        )
        self.as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.dir), "-o", options, "-w",
                         "-l", str(self.dir / "server.log"), "start")  # fmt: skip
        return f"postgres://postgres@127.0.0.1:{self.port}"

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.dir), "-m", "fast", "stop")


# --- the API -------------------------------------------------------------------------------


class Api:
    def __init__(self, scale: Scale) -> None:
        self.scale = scale
        self.local = threading.local()

    def client(self) -> httpx.Client:
        client = getattr(self.local, "client", None)
        if client is None:
            client = httpx.Client(
                base_url=self.scale.base,
                headers={"Authorization": f"Bearer {self.scale.token}"},
                timeout=300,
            )
            self.local.client = client
        return client

    def run(self, name: str) -> str:
        response = self.client().post("/api/v1/runs", json={"name": name})
        check(response)
        return str(response.json()["id"])

    def post(self, path: str, body: Any) -> httpx.Response:
        for _ in range(50):
            response = self.client().post(path, json=body)
            if response.status_code == 409 and "concurrently" in response.text:
                time.sleep(0.005)
                continue
            return response
        return response


def steps(prefix: str, n: int) -> list[dict[str, Any]]:
    return [{"key": f"{prefix}{i}", "tool": "echo", "input": {"n": i}} for i in range(n)]


# --- measurements --------------------------------------------------------------------------

COUNTS = """
SELECT count(*) FILTER (WHERE state = 'completed'),
       count(*) FILTER (WHERE state NOT IN ('completed', 'pending', 'running', 'verifying',
                                            'approved', 'planned'))
FROM executor_step
"""


def ledger_counts(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    row = conn.execute(COUNTS).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def grow(scale: Scale, api: Api, conn: psycopg.Connection[Any], target: int) -> dict[str, Any]:
    """Posts batches until `target` steps are completed, the worker draining meanwhile."""
    args = scale.args
    done, _ = ledger_counts(conn)
    need = target - done
    if need <= 0:
        return {"posted": 0}
    batches: list[tuple[str, list[dict[str, Any]]]] = []
    left = need
    while left > 0:
        run_id = api.run(f"scale {TAG} {target} {len(batches)}")
        in_run = min(left, args.run_steps)
        items = steps(f"g{target}-", in_run)
        for start in range(0, in_run, args.batch_size):
            batches.append((run_id, items[start : start + args.batch_size]))
        left -= in_run
    started_at = time.perf_counter()

    def post(batch: tuple[str, list[dict[str, Any]]]) -> None:
        check(api.post(f"/api/v1/runs/{batch[0]}/steps/batch", {"steps": batch[1]}))

    with ThreadPoolExecutor(args.posters) as pool:
        list(pool.map(post, batches))
    posted = time.perf_counter() - started_at
    end = time.monotonic() + args.timeout + need / 20
    while True:
        completed, ended_otherwise = ledger_counts(conn)
        if ended_otherwise:
            raise RuntimeError(f"{ended_otherwise} steps ended other than completed")
        if completed >= target:
            break
        if time.monotonic() > end:
            raise TimeoutError(f"only {completed} of {target} steps completed")
        time.sleep(0.5)
    drained = time.perf_counter() - started_at
    return {
        "posted": need,
        "batch_ingest_steps_per_second": round(need / posted, 1),
        "drain_steps_per_second": round(need / drained, 1),
    }


def timings(get: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started_at = time.perf_counter()
        response = get()
        times.append(time.perf_counter() - started_at)
        if response.status_code >= 400:
            raise RuntimeError(f"{response.request.url.path}: HTTP {response.status_code}")
    return round(1000 * statistics.median(times), 1)


def console_client(scale: Scale) -> httpx.Client:
    client = httpx.Client(base_url=scale.base, timeout=300, follow_redirects=True)
    client.get("/accounts/login/")
    response = client.post(
        "/accounts/login/",
        data={
            "username": "scale",
            "password": PASSWORD,
            "csrfmiddlewaretoken": client.cookies.get("csrftoken", ""),
        },
        headers={"Referer": f"{scale.base}/accounts/login/"},
    )
    if "sessionid" not in client.cookies:
        raise RuntimeError(f"could not log in to the console (HTTP {response.status_code})")
    return client


def size(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    rows = conn.execute(
        "SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = 'public' AND c.relkind = 'r' ORDER BY 2 DESC"
    ).fetchall()
    completed, _ = ledger_counts(conn)
    total = sum(int(b) for _, b in rows)
    updates = conn.execute(
        "SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
        " WHERE relname IN ('executor_step', 'executor_attempt')"
    ).fetchall()
    return {
        "total_mb": round(total / 2**20, 1),
        "bytes_per_completed_step": round(total / completed) if completed else None,
        "tables_mb": {name: round(int(b) / 2**20, 2) for name, b in rows[:8]},
        "indexes_mb": {
            name: round(int(b) / 2**20, 2)
            for name, b in conn.execute(
                "SELECT indexrelname, pg_relation_size(indexrelid) FROM pg_stat_user_indexes"
                " WHERE relname IN ('executor_step', 'executor_attempt', 'executor_event')"
                " ORDER BY 2 DESC"
            )
        },
        # Updates, and of them HOT ones (no new index entry), since the cluster started.
        "updates_hot": {name: [int(upd), int(hot)] for name, upd, hot in updates},
    }


def measure(scale: Scale, api: Api, conn: psycopg.Connection[Any]) -> dict[str, Any]:
    args = scale.args
    result: dict[str, Any] = {}
    probe = api.run(f"scale probe {TAG} {time.time()}")
    single = []
    for item in steps("p", args.single_posts):
        started_at = time.perf_counter()
        check(api.post(f"/api/v1/runs/{probe}/steps", item))
        single.append(time.perf_counter() - started_at)
    result["single_post_ms_p50"] = round(1000 * statistics.median(single), 1)
    console = console_client(scale)
    try:
        row = conn.execute(
            # The first run grown: the biggest (--run-steps steps).
            "SELECT s.run_id, s.id FROM executor_step s JOIN executor_run r ON r.id = s.run_id "
            "WHERE r.name LIKE 'scale %%' AND r.name NOT LIKE 'scale probe%%' "
            "ORDER BY r.created_at, s.position LIMIT 1"
        ).fetchone()
        pages = {"runs list": "/runs/", "inbox": "/", "nav counts": "/nav/counts/"}
        if row is not None:
            pages["a run's page"] = f"/runs/{row[0]}/"
            pages["a step's page"] = f"/steps/{row[1]}/"
        result["pages_ms_p50"] = {
            name: timings(lambda path=path: console.get(path), args.repeat)
            for name, path in pages.items()
        }
    finally:
        console.close()
    with httpx.Client(base_url=scale.base, timeout=300) as plain:
        result["metrics_ms_p50"] = timings(lambda: plain.get("/metrics"), args.repeat)
    newest = conn.execute("SELECT max(seq) FROM executor_checkpoint").fetchone()
    result["verify_full"] = scale.timed_manage("verify_ledger")
    covering = since_covering(conn, args.since_steps)
    if covering is not None:
        seq, changed = covering
        result[SINCE] = {
            "checkpoint": seq,
            "steps_changed": changed,
            **scale.timed_manage("verify_ledger", "--since", str(seq)),
        }
    # A checkpoint now, so that the next size's --since covers what that size added.
    since = ["--since", str(newest[0])] if newest and newest[0] else []
    scale.manage("verify_ledger", *since, "--checkpoint")
    result["size"] = size(conn)
    return result


# --- the run -------------------------------------------------------------------------------


def run(scale: Scale) -> dict[str, Any]:
    args = scale.args
    with psycopg.connect(f"{scale.pg}/postgres", autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {args.db} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {args.db}")
    log(f"database {scale.dsn}: migrate, agent, reviewer")
    scale.manage("migrate", "--no-input")
    scale.token = scale.manage("create_agent", "scale", "--workspace", "scale").split()[-1]
    scale.manage("create_reviewer", "scale", "--workspace", "scale", "--password", PASSWORD)
    web = scale.proc(
        "gunicorn",
        [
            *(PY, "-m", "gunicorn", "console.wsgi", "--bind", f"127.0.0.1:{scale.port}"),
            *("--worker-class", "gthread", "--workers", "2", "--threads", "8"),
            "--no-control-socket",
        ],
    )
    worker = scale.proc(
        "worker",
        [
            *(PY, "-m", "celery", "-A", "console", "worker", "--concurrency"),
            *(str(args.concurrency), "--loglevel", "WARNING", "-n", f"scale-{TAG}@%h"),
        ],
    )
    sweeper = scale.proc("sweeper", [PY, "manage.py", "sweep", "--loop"])
    sizes: dict[str, Any] = {}
    with started(web, worker, sweeper), psycopg.connect(scale.dsn, autocommit=True) as conn:
        wait_http(f"{scale.base}/api/v1/openapi.json", web)
        api = Api(scale)
        for target in [0, *args.sizes]:
            log(f"growing the ledger to {target} completed steps")
            growth = grow(scale, api, conn, target)
            if args.drain_steps:
                log(f"drain at {target}: {args.drain_steps} steps posted and drained")
                done, _ = ledger_counts(conn)
                probe = grow(scale, api, conn, done + args.drain_steps)
                growth[DRAIN] = probe["drain_steps_per_second"]
            log(f"measuring at {target}")
            sizes[str(target)] = {**growth, **measure(scale, api, conn)}
            log(json.dumps(sizes[str(target)]))
    return sizes


SINCE = "verify_since"
DRAIN = "drain_at_size_steps_per_second"


def since_covering(conn: psycopg.Connection[Any], steps: int) -> tuple[int, int] | None:
    """The newest checkpoint whose `--since` covers at least `steps` changed steps (the
    oldest one if none does), and how many it covers: the steps with an event since it was
    taken, less the five minutes `verify_ledger` reads again."""
    seqs = [row[0] for row in conn.execute("SELECT seq FROM executor_checkpoint ORDER BY seq DESC")]
    found = None
    for seq in seqs:
        (changed,) = conn.execute(
            "SELECT count(DISTINCT e.step_id) FROM executor_event e, executor_checkpoint c "
            "WHERE c.seq = %s AND e.created_at >= c.taken_at - interval '5 minutes'",
            [seq],
        ).fetchone() or (0,)
        found = (seq, int(changed))
        if changed >= steps:
            break
    return found


def report(sizes: dict[str, Any], meta: dict[str, Any]) -> None:
    print(f"# bench/scale.py, {meta['when']}, {meta['where']}\n")
    rows = [
        ("batch ingest (steps/s, while growing)", lambda r: r.get("batch_ingest_steps_per_second")),
        ("drain (steps/s, while growing)", lambda r: r.get("drain_steps_per_second")),
        ("drain at this size (steps/s)", lambda r: r.get(DRAIN)),
        ("single post p50 (ms)", lambda r: r["single_post_ms_p50"]),
        *[
            (f"{page} p50 (ms)", lambda r, page=page: r["pages_ms_p50"].get(page))
            for page in ("runs list", "inbox", "nav counts", "a run's page", "a step's page")
        ],
        ("/metrics p50 (ms)", lambda r: r["metrics_ms_p50"]),
        ("verify_ledger (s)", lambda r: r["verify_full"]["seconds"]),
        ("verify_ledger peak memory (MB)", lambda r: r["verify_full"]["peak_mb"]),
        ("verify_ledger --since: steps changed", lambda r: r.get(SINCE, {}).get("steps_changed")),
        ("verify_ledger --since (s)", lambda r: r.get(SINCE, {}).get("seconds")),
        ("verify_ledger --since peak (MB)", lambda r: r.get(SINCE, {}).get("peak_mb")),
        ("bytes a completed step", lambda r: r["size"]["bytes_per_completed_step"]),
        ("database (MB)", lambda r: r["size"]["total_mb"]),
    ]  # fmt: skip
    print("| at N completed steps | " + " | ".join(sizes) + " |")
    print("| --- |" + " --- |" * len(sizes))
    for label, value in rows:
        cells = []
        for result in sizes.values():
            try:
                cells.append(str(value(result)))
            except (KeyError, TypeError):
                cells.append("-")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("\nJSON " + json.dumps({"meta": meta, "sizes": sizes}))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[2000],
        help="ledger sizes (completed steps) to measure at, comma-separated (0 is measured too)",
    )
    parser.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--db", default="stepward_scale")
    parser.add_argument("--own-cluster", action="store_true", help="a throwaway cluster, defaults")
    parser.add_argument(
        "--keep-db", action="store_true", help="keep the database (with --own-cluster: its data)"
    )
    parser.add_argument("--redis-db", type=int, default=11)
    parser.add_argument(
        "--since-steps",
        type=int,
        default=100_000,
        help="verify_ledger --since the newest checkpoint covering this many changed steps",
    )
    parser.add_argument(
        "--drain-steps",
        type=int,
        default=20_000,
        help="at each size, post this many more and time their drain (0: no such probe)",
    )
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--posters", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--run-steps", type=int, default=5000, help="steps posted to each run")
    parser.add_argument("--single-posts", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3, help="reads of each page (median)")
    parser.add_argument("--checkpoint-seconds", type=float, default=60)
    parser.add_argument("--timeout", type=float, default=300)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, on_signal)
    tmp = Path(tempfile.mkdtemp(prefix="stepward-scale-"))
    cluster = Cluster(tmp) if args.own_cluster else None
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "where": f"{os.cpu_count()} cores, {'own cluster' if cluster else args.pg}",
        "args": vars(args),
    }
    pg = cluster.start() if cluster else args.pg
    scale = Scale(args, tmp, pg)
    try:
        sizes = run(scale)
    finally:
        Proc.stop_all()
        with contextlib.suppress(redis.RedisError):
            redis.Redis.from_url(f"redis://127.0.0.1:6379/{args.redis_db}").flushdb()
        if not args.keep_db and not cluster:
            with (
                contextlib.suppress(psycopg.Error),
                psycopg.connect(f"{pg}/postgres", autocommit=True) as admin,
            ):
                admin.execute(f"DROP DATABASE IF EXISTS {args.db} WITH (FORCE)")
        if cluster:
            cluster.stop()
    report(sizes, meta)
    if args.keep_db and cluster:
        # Stopped; `pg_ctl -D <dir> start` (as postgres) brings the grown ledger back.
        log(f"kept the cluster's data in {cluster.dir} (port {cluster.port})")
        return
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
