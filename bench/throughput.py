"""End-to-end throughput of the executor, and PostgreSQL's own ceiling on this machine.

Steps are posted through the API (gunicorn) and timed until every one is `completed`,
for `echo` and `ticketdesk.create_keyed`, with 1, 2 and 4 worker processes, on PostgreSQL
with Redis. In the same run: SQL statements and commits per step (the engine in-process,
counted with a query wrapper) and pgbench with one single-row INSERT per transaction at
the same client count, printed as a ratio.

    .venv/bin/python bench/throughput.py [--steps 1000] [--workers 1,2,4]

Needs PostgreSQL at 127.0.0.1:5432 (user postgres), Redis at 127.0.0.1:6379 and pgbench.
It creates and drops its own database `stepward_bench`. Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
PG = "postgres://postgres@127.0.0.1:5432"
DB = "stepward_bench"
REDIS = "redis://127.0.0.1:6379/11"
QUEUE = "stepward-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": f"{PG}/{DB}",
        "CELERY_BROKER_URL": REDIS,
        "CELERY_QUEUE": QUEUE,
        "LOG_LEVEL": "WARNING",
        **extra,
    }


def recreate_database() -> None:
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DB}")


def manage(*args: str, **extra: str) -> str:
    out = subprocess.run(
        [PY, "manage.py", *args],
        cwd=ROOT,
        env=env(**extra),
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout


@contextlib.contextmanager
def process(argv: list[str], **extra: str) -> Iterator[subprocess.Popen[bytes]]:
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env(**extra), stdout=log, stderr=log)
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_http(url: str, deadline: float = 30) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code < 500:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def pg_commits() -> int:
    with psycopg.connect(f"{PG}/postgres") as conn:
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (DB,)
        ).fetchone()
        assert row is not None
        return int(row[0])


def post_and_wait(base: str, token: str, tool: str, steps: int, clients: int) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=base, headers=headers, timeout=30) as client:
        run = client.post("/api/v1/runs", json={"name": f"bench {tool} {time.time()}"}).json()
        run_id = run["id"]

        def post(i: int) -> None:
            body: dict[str, Any] = {"key": f"s{i}", "tool": tool, "input": {"title": f"t{i}"}}
            with httpx.Client(base_url=base, headers=headers, timeout=30) as c:
                response = c.post(f"/api/v1/runs/{run_id}/steps", json=body)
                response.raise_for_status()

        commits_before = pg_commits()
        start = time.monotonic()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(post, range(steps)))
        posted = time.monotonic()
        while True:
            counts = client.get(f"/api/v1/runs/{run_id}").json()["counts"]
            if counts.get("completed", 0) == steps:
                break
            if time.monotonic() - start > 600:
                raise RuntimeError(f"not done after 600 s: {counts}")
            time.sleep(0.05)
        done = time.monotonic()
        commits = pg_commits() - commits_before
    return {
        "tool": tool,
        "steps": steps,
        "post_seconds": round(posted - start, 2),
        "total_seconds": round(done - start, 2),
        "steps_per_second": round(steps / (done - start), 1),
        "commits_per_step_all_processes": round(commits / steps, 2),
    }


def statements_per_step(tool: str, n: int, desk_url: str) -> dict[str, Any]:
    """The engine in a process of its own on `n` steps (see engine_counts.py)."""
    out = subprocess.run(
        [PY, "bench/engine_counts.py", tool, str(n), "bench"],
        cwd=ROOT,
        env=env(TICKETDESK_URL=desk_url),
        check=True,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def pgbench_tps(clients: int, seconds: int = 10) -> float:
    with psycopg.connect(f"{PG}/{DB}", autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_insert (id bigserial primary key, v int)")
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as script:
        script.write("INSERT INTO bench_insert (v) VALUES (1);\n")
    out = subprocess.run(
        [
            "pgbench",
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-n",
            "-f",
            script.name,
            "-c",
            str(clients),
            "-j",
            str(clients),
            "-T",
            str(seconds),
            DB,
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    os.unlink(script.name)
    match = re.search(r"tps = ([\d.]+)", out.stdout)
    assert match, out.stdout
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--clients", type=int, default=8, help="concurrent API posters")
    args = parser.parse_args()
    if not shutil.which("pgbench"):
        sys.exit("pgbench is needed (apt-get install postgresql-client)")
    recreate_database()
    manage("migrate", "--no-input")
    manage("collectstatic", "--no-input")
    token = manage("create_agent", "bench", "--workspace", "bench").strip().splitlines()[-1]
    web_port, desk_port = free_port(), free_port()
    base, desk = f"http://127.0.0.1:{web_port}", f"http://127.0.0.1:{desk_port}"
    results = []
    desk_db = tempfile.mktemp(suffix=".sqlite3")
    with (
        process([PY, "manage.py", "ticketdesk", "--port", str(desk_port), "--db", desk_db]),
        process(
            [
                PY,
                "-m",
                "gunicorn",
                "console.wsgi",
                "--bind",
                f"127.0.0.1:{web_port}",
                "--workers",
                "2",
                "--threads",
                "8",
                "--worker-class",
                "gthread",
            ],
            API_RATE_LIMIT="1000000/min",
        ),
    ):
        wait_http(f"{base}/api/v1/openapi.json")
        wait_http(f"{desk}/health")
        figures = {
            tool: statements_per_step(tool, 200, desk)
            for tool in ("echo", "ticketdesk.create_keyed")
        }
        for workers in [int(w) for w in args.workers.split(",")]:
            with process(
                [
                    PY,
                    "-m",
                    "celery",
                    "-A",
                    "console",
                    "worker",
                    "--concurrency",
                    str(workers),
                    "--loglevel",
                    "WARNING",
                    "-n",
                    f"bench{workers}@%h",
                ],
                TICKETDESK_URL=desk,
            ):
                time.sleep(3)  # let the pool start before the clock does
                for tool in ("echo", "ticketdesk.create_keyed"):
                    result = post_and_wait(base, token, tool, args.steps, args.clients)
                    result["workers"] = workers
                    result["pgbench_tps_same_clients"] = pgbench_tps(workers)
                    result["ratio_to_pgbench"] = round(
                        result["steps_per_second"] / result["pgbench_tps_same_clients"], 3
                    )
                    result["engine_statements_per_step"] = figures[tool]["statements"]
                    result["engine_statements_by_kind"] = figures[tool]["by_kind"]
                    result["engine_transactions_per_step"] = figures[tool]["transactions"]
                    results.append(result)
                    print(json.dumps(result), flush=True)
    print("\n| tool | workers | steps/s | pgbench tps | ratio | SQL/step | transactions/step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['tool']} | {r['workers']} | {r['steps_per_second']} | "
            f"{r['pgbench_tps_same_clients']:.0f} | {r['ratio_to_pgbench']} | "
            f"{r['engine_statements_per_step']} | {r['engine_transactions_per_step']} |"
        )


if __name__ == "__main__":
    main()
