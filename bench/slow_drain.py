"""A slow-tool drain, Stepward beside DBOS Transact in the same run (issue 21, item 5).

    .venv/bin/python bench/slow_drain.py                    # 2,000 steps at 0, 250 and 1,000 ms
    .venv/bin/python bench/slow_drain.py --steps 200 --latencies 250          # a smoke run
    .venv/bin/python bench/slow_drain.py --latencies 250 --rounds 5      # medians of 5 rounds

Against a neutral asyncio service (tests/support/slow_service.py, run as a program: every
POST answers after the latency, deduplicates on `Idempotency-Key` and counts), for each
latency, back to back:
1. Stepward: an HTTP tool declared as data (`bench.slow`: effect write, POST, idempotency =
   "header"), loaded with `manage.py load_tools`; N steps posted by the batch endpoint with
   no worker running, then `celery -A console worker -c C` with the engine's defaults
   (EXECUTOR_MAX_IN_FLIGHT, EXECUTOR_DB_CONNECTIONS). steps/s from the ledger as in
   bench/throughput.py (first Attempt's claimed_at -> last completed step's updated_at).
   While the workers run, pg_stat_activity is sampled every ~50 ms for the backends they
   opened (their connections carry an application_name of their own, PGAPPNAME): the most
   at once and the distinct pids seen. The service's stats give its peak in flight and any
   duplicate (an effect per key more than once, an operation requested more than once).
2. DBOS Transact (bench/peer_dbos.py with BENCH_DBOS_SLOW_URL): N one-step workflows whose
   step POSTs to the same service with Idempotency-Key = the workflow id, C processes.

With `--rounds R` each latency is measured R times, the two sides alternating (Stepward,
DBOS, Stepward, …): a side's figures are those of its median round by steps/s, every round's
steps/s is listed beside them, and the backends and duplicates goals take the worst round.
This VM's speed moves by a quarter from one minute to the next; one round cannot settle a goal.

It reuses bench/throughput.py's helpers (processes in groups of their own, the API client,
`stepward_drain`, `dbos_peer`, the peers' virtualenv), pointed at its own databases
(stepward_bench_slow, stepward_bench_slow_dbos), Redis DB 11, a Celery queue named after its
process and a temporary STEPWARD_VAR_DIR. It asserts nothing and never makes a figure up: a
measurement that fails is printed as "not measured: why".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import redis
import throughput as tp

DB = "stepward_bench_slow"
DB_DBOS = "stepward_bench_slow_dbos"
REDIS_DB = 11
QUEUE = f"stepward-bench-slow-{tp.TAG}"
TOOL = "bench.slow"
SERVICE = tp.ROOT / "tests" / "support" / "slow_service.py"
# The application_name of the connections: the workers' own, so that pg_stat_activity tells
# them from gunicorn's and the bench's.
WORKER_APP = f"stepward-bench-slow-worker-{tp.TAG}"
SETUP_APP = f"stepward-bench-slow-setup-{tp.TAG}"
DB_CONNECTIONS = int(os.environ.get("EXECUTOR_DB_CONNECTIONS", "4"))  # the engine's default

# throughput.py's helpers read these module constants when they run: point them at this
# bench's own database, Redis DB and queue (its own bench is never run in this process).
tp.DB, tp.DB_DBOS, tp.REDIS_STEPWARD, tp.QUEUE = DB, DB_DBOS, REDIS_DB, QUEUE

log = tp.log


class SlowBench(tp.Bench):
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        super().__init__(args, tmp)
        self.service_port = tp.free_port()
        self.service = f"http://127.0.0.1:{self.service_port}"
        self.app_name = SETUP_APP

    def env(self, database: str = DB, **extra: str) -> dict[str, str]:
        return super().env(
            database,
            EXECUTOR_HTTP_ALLOWED_HOSTS=f"127.0.0.1:{self.service_port}",
            PGAPPNAME=self.app_name,
            **extra,
        )


# --- the service and what it saw ------------------------------------------------------------


def start_service(bench: SlowBench, latency_ms: int) -> tp.Proc:
    """tests/support/slow_service.py as a program, on the bench's port, in its own group."""
    proc = bench.proc(
        f"slow-service-{latency_ms}ms",
        [
            tp.PY,
            str(SERVICE),
            "--port",
            str(bench.service_port),
            "--latency",
            str(latency_ms / 1000),
        ],
        bench.env(),
    )
    end = time.monotonic() + 30
    while "listening on" not in proc.tail(5):
        if not proc.alive() or time.monotonic() > end:
            proc.stop()
            raise RuntimeError(f"the slow service did not start:\n{proc.tail()}")
        time.sleep(0.05)
    return proc


def service_stats(bench: SlowBench) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.get(f"{bench.service}/stats", timeout=30).json()
    return answer


def reset_service(bench: SlowBench) -> None:
    httpx.post(f"{bench.service}/reset", timeout=30).raise_for_status()


def seen(stats: dict[str, Any], n: int) -> dict[str, Any]:
    """What the service saw of one drain of n keyed calls: effects, peak, duplicates."""
    by_key: dict[str, int] = stats["effects_by_key"]
    by_operation: dict[str, int] = stats["requests_by_operation"]
    return {
        "requests": stats["requests"],
        "effects": stats["effects"],
        "peak_in_flight": stats["peak_in_flight"],
        "keys": len(by_key),
        "keys_with_more_than_one_effect": sum(1 for v in by_key.values() if v > 1),
        "operations_requested_more_than_once": sum(
            1 for op, v in by_operation.items() if op and v > 1
        ),
        "requests_without_operation": by_operation.get("", 0),
        "effects_missing": max(0, n - stats["effects"]),
    }


def duplicates(service: dict[str, Any]) -> int | None:
    if "keys_with_more_than_one_effect" not in service:
        return None
    return int(
        service["keys_with_more_than_one_effect"] + service["operations_requested_more_than_once"]
    )


# --- the workers' database backends ------------------------------------------------------------

BACKENDS = """
SELECT pid FROM pg_stat_activity
WHERE datname = %s AND application_name = %s AND backend_type = 'client backend'
  AND pid <> pg_backend_pid()
"""


class Backends:
    """Samples pg_stat_activity every `every` seconds, on a thread and connection of its own,
    for the backends whose application_name is the workers': the most at once and every
    pid seen (a connection that lives less than a sampling interval may be missed)."""

    def __init__(self, database: str, app_name: str, every: float = 0.05) -> None:
        self.database, self.app_name, self.every = database, app_name, every
        self.most = 0
        self.pids: set[int] = set()
        self.samples = 0
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backends", daemon=True)

    def __enter__(self) -> Backends:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        try:
            with psycopg.connect(f"{tp.PG}/{self.database}", autocommit=True) as conn:
                while not self._stop.is_set():
                    rows = conn.execute(BACKENDS, (self.database, self.app_name)).fetchall()
                    pids = {int(row[0]) for row in rows}
                    self.samples += 1
                    self.most = max(self.most, len(pids))
                    self.pids |= pids
                    self._stop.wait(self.every)
        except psycopg.Error as error:
            self.error = f"{type(error).__name__}: {error}"

    def result(self) -> dict[str, Any]:
        if self.error or not self.samples:
            return {"error": self.error or "no sample taken"}
        return {"max": self.most, "distinct": len(self.pids), "samples": self.samples}


# --- the two sides ------------------------------------------------------------------------------


def stepward_side(bench: SlowBench, api: tp.Api, n: int, workers: int) -> dict[str, Any]:
    reset_service(bench)
    bench.app_name = WORKER_APP  # the worker stepward_drain starts is labelled so
    try:
        with Backends(DB, WORKER_APP) as backends:
            result = tp.stepward_drain(bench, api, TOOL, n, workers)
    finally:
        bench.app_name = SETUP_APP
    result["backends"] = backends.result()
    result["service"] = seen(service_stats(bench), n)
    return result


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """os.environ with `values` set (throughput.dbos_peer hands its peers os.environ)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dbos_side(bench: SlowBench, n: int, processes: int) -> dict[str, Any]:
    reset_service(bench)
    with environ(BENCH_DBOS_SLOW_URL=f"{bench.service}/effects"):
        result = tp.dbos_peer(bench, n, processes)
    result["service"] = seen(service_stats(bench), n)
    return result


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A side's figures over its rounds: those of the round whose steps/s is the median (the
    lower of the two middle ones for an even count), with every round's steps/s, and the
    worst round's backends and duplicates. A round that was not measured counts as none."""
    measured = [r for r in rounds if r.get("steps_per_second") is not None]
    if not measured:
        return rounds[-1] if rounds else {"error": "no round ran"}
    middle = statistics.median_low(r["steps_per_second"] for r in measured)
    side = dict(next(r for r in measured if r["steps_per_second"] == middle))
    if len(rounds) > 1:
        side["rounds_steps_per_second"] = [r.get("steps_per_second") for r in rounds]
        backends = [tp.get(r, "backends", "distinct") for r in measured]
        if None not in backends:
            side["worst_backends_distinct"] = max(backends)
        dups = [duplicates(r.get("service", {})) for r in measured]
        if None not in dups:
            side["duplicates_all_rounds"] = sum(d for d in dups if d is not None)
    return side


# --- the report ---------------------------------------------------------------------------------


def first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def goals(results: dict[str, Any], latencies: list[int]) -> list[dict[str, Any]]:
    def s(ms: int, *path: str) -> Any:
        return tp.get(results, str(ms), "stepward", *path)

    def d(ms: int, *path: str) -> Any:
        return tp.get(results, str(ms), "dbos", *path)

    rows: list[tuple[str, Any, str, Any]] = []
    if 250 in latencies:
        rows += [
            ("250 ms: Stepward steps/s", s(250, "steps_per_second"), ">= 800", lambda v: v >= 800),
            (
                "250 ms: the service's peak in flight (Stepward)",
                s(250, "service", "peak_in_flight"),
                ">= 200",
                lambda v: v >= 200,
            ),
            (
                "250 ms: Stepward / DBOS",
                tp.ratio(s(250, "steps_per_second"), d(250, "steps_per_second")),
                ">= 5x",
                lambda v: v >= 5,
            ),
        ]
    if 1000 in latencies:
        rows.append(
            ("1 s: Stepward steps/s", s(1000, "steps_per_second"), ">= 400", lambda v: v >= 400)
        )
    limit = 2 * DB_CONNECTIONS + 2
    for ms in latencies:
        rows += [
            (
                f"{ms} ms: backends the workers opened (distinct pids)",
                first(s(ms, "worst_backends_distinct"), s(ms, "backends", "distinct")),
                f"<= {limit} (2 x {DB_CONNECTIONS} + 2)",
                lambda v, limit=limit: v <= limit,
            ),
            (
                f"{ms} ms: duplicates (Stepward)",
                first(s(ms, "duplicates_all_rounds"), duplicates(s(ms, "service") or {})),
                "0",
                lambda v: v == 0,
            ),
        ]
    return tp.goal_rows(rows)


def report(bench: SlowBench, meta: dict[str, Any], results: dict[str, Any]) -> None:
    a = bench.args

    def err(side: dict[str, Any]) -> str:
        return f"not measured: {side['error']}" if "error" in side else "-"

    def value(side: dict[str, Any], *path: str) -> str:
        v = tp.get(side, *path)
        return tp.fig(v) if v is not None else err(side)

    print(f"\n## Slow-tool drain: Stepward and DBOS Transact, {a.steps} steps\n")
    print(
        "| latency | Stepward steps/s | workers' CPU a step | service peak in flight "
        "| worker backends max / distinct | duplicates | DBOS steps/s | DBOS peak in flight "
        "| Stepward / DBOS |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for ms in a.latencies:
        s = tp.get(results, str(ms), "stepward") or {}
        d = tp.get(results, str(ms), "dbos") or {}
        b = s.get("backends", {})
        backends = (
            f"{b['max']} / {b['distinct']}"
            if "max" in b
            else (f"not measured: {b['error']}" if "error" in b else err(s))
        )
        dup = duplicates(s.get("service", {}))
        print(
            f"| {ms:,} ms | {value(s, 'steps_per_second')} | "
            f"{value(s, 'worker_cpu_ms_per_step')} ms | "
            f"{value(s, 'service', 'peak_in_flight')} | {backends} | "
            f"{tp.fig(dup) if dup is not None else err(s)} | {value(d, 'steps_per_second')} | "
            f"{value(d, 'service', 'peak_in_flight')} | "
            f"{tp.fig(tp.ratio(s.get('steps_per_second'), d.get('steps_per_second')))} |"
        )

    if a.rounds > 1:
        print(f"\nMedians of {a.rounds} rounds; each round's steps/s:\n")
        for ms in a.latencies:
            for name, label in (("stepward", "Stepward"), ("dbos", "DBOS")):
                side = tp.get(results, str(ms), name) or {}
                figures = side.get("rounds_steps_per_second")
                if figures:
                    shown = ", ".join(
                        tp.fig(v) if v is not None else "not measured" for v in figures
                    )
                    print(f"- {ms:,} ms, {label}: {shown}")
    print("\n### Goals (issue 21, item 5)\n")
    print("| goal | measured | target | verdict |")
    print("| --- | --- | --- | --- |")
    for g in results["goals"]:
        print(f"| {g['goal']} | {tp.fig(g['measured'])} | {g['target']} | {g['verdict']} |")

    print("\n### How these figures were obtained\n")
    concurrency = a.dbos_worker_concurrency or "unlimited"
    for line in [
        f"{meta['date']}, {meta['host']}: {meta['cores']} cores ({meta['cpu']}), "
        f"{meta['memory_gib']} GiB, load average {meta['load_before']} before and "
        f"{meta['load_after']} after; PostgreSQL {meta['postgresql']}, Redis {meta['redis']}; "
        f"Stepward at {meta['commit']}; DBOS Transact {meta['peers'].get('dbos', '?')}.",
        "Service: tests/support/slow_service.py (asyncio, one process) at each latency; reset "
        "before each side. Stepward's tool `bench.slow`: effect write, POST /effects, "
        'idempotency = "header", loaded by `manage.py load_tools`; the other keys at their '
        "defaults (timeout 10 s, no max_in_flight, no rate).",
        f"Stepward: {a.steps} steps posted by the batch endpoint, no worker running; then "
        f"`celery -A console worker -c {a.workers}` with the engine's defaults; steps/s = "
        "completed / (last completed step's updated_at - first Attempt's claimed_at). "
        "Workers' CPU a step: user + system time of every process of the worker's group "
        "(/proc), from the last look (every 50 ms) before any step was claimed to the end, / N.",
        "Worker backends: pg_stat_activity for the database, client backends whose "
        "application_name is the workers' (PGAPPNAME in their environment), sampled every "
        "~50 ms from before the worker starts until it is stopped: the most at once, and the "
        "distinct pids seen.",
        "Duplicates: keys with more than one effect at the service, plus operations "
        "(X-Stepward-Operation) requested more than once.",
        f"DBOS: {a.steps} workflows of one `@DBOS.step` that POSTs to the same service "
        "(urllib, Idempotency-Key and X-Stepward-Operation = the workflow id), enqueued first, "
        f"then {a.workers} processes, each running up to {concurrency} workflows at once, "
        f"polling every {a.dbos_polling} s; steps/s from dbos.workflow_status (first dequeue "
        "-> last completion).",
        *(
            [
                f"Rounds: {a.rounds} per latency, Stepward and DBOS alternating; each side's "
                "figures are its median round's by steps/s; backends and duplicates goals "
                "take the worst round."
            ]
            if a.rounds > 1
            else []
        ),
    ]:
        print(f"- {line}")
    print("\nJSON " + json.dumps({"meta": meta, "results": results}))


# --- the run ------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=2000, help="N for each drain and each peer")
    p.add_argument("--latencies", default="0,250,1000", help="the service's, ms, comma-separated")
    p.add_argument("--workers", type=int, default=2, help="Stepward's -c and DBOS's processes")
    p.add_argument(
        "--dbos-worker-concurrency",
        type=int,
        default=256,
        help="workflows at once per DBOS process (0 = unlimited); default: Stepward's "
        "EXECUTOR_MAX_IN_FLIGHT",
    )
    p.add_argument("--dbos-polling", type=float, default=0.01, help="seconds")
    p.add_argument("--no-peers", action="store_true", help="skip DBOS")
    p.add_argument(
        "--rounds", type=int, default=1, help="drains per side and latency (medians reported)"
    )
    p.add_argument("--batch-size", type=int, default=500, help="steps per batch post")
    p.add_argument("--single-clients", type=int, default=8, help="if batches are refused")
    p.add_argument("--web-workers", type=int, default=2)
    p.add_argument("--web-threads", type=int, default=8)
    p.add_argument("--timeout", type=float, default=120, help="extra seconds per drain")
    p.add_argument("--keep-db", action="store_true", help=f"leave {DB} for inspection")
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    args = p.parse_args()
    args.latencies = [int(x) for x in str(args.latencies).split(",") if x.strip()]
    return args


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"


def tool_file(bench: SlowBench) -> Path:
    path = bench.tmp / "slow-tools.toml"
    path.write_text(
        "[[tool]]\n"
        f'name = "{TOOL}"\n'
        'description = "The bench\'s neutral slow service: one keyed effect per call"\n'
        'effect = "write"\n'
        'method = "POST"\n'
        f'url = "{bench.service}/effects"\n'
        'idempotency = "header"\n'
    )
    return path


def run(bench: SlowBench, meta: dict[str, Any], results: dict[str, Any]) -> None:
    args = bench.args
    tp.flush_redis(REDIS_DB)
    log(f"database {DB}: migrate, tool, agent")
    tp.recreate(DB)
    bench.manage("migrate", "--no-input")
    bench.manage("load_tools", str(tool_file(bench)))
    # After load_tools: the agent gets use_tool on every tool, bench.slow included.
    bench.token = bench.manage("create_agent", "bench", "--workspace", "bench").split()[-1]
    web = bench.proc(
        "gunicorn",
        [
            *(tp.PY, "-m", "gunicorn", "console.wsgi", "--bind", f"127.0.0.1:{bench.web_port}"),
            *("--worker-class", "gthread", "--workers", str(args.web_workers)),
            *("--threads", str(args.web_threads), "--no-control-socket"),
        ],
        bench.env(),
    )
    with tp.started(web):
        tp.wait_http(f"{bench.base}/api/v1/openapi.json", web)
        api = tp.Api(bench)
        for ms in args.latencies:
            r: dict[str, Any] = {"load_before": " ".join(f"{x:.2f}" for x in os.getloadavg())}
            results[str(ms)] = r
            try:
                service = start_service(bench, ms)
            except Exception as error:  # noqa: BLE001 - reported as not measured
                r["stepward"] = r["dbos"] = {"error": f"{type(error).__name__}: {error}"}
                bench.failed = True
                continue
            sides: dict[str, list[dict[str, Any]]] = {"stepward": [], "dbos": []}
            with tp.started(service):
                for number in range(1, args.rounds + 1):
                    round_ = f" (round {number} of {args.rounds})" if args.rounds > 1 else ""
                    sides["stepward"].append(
                        tp.attempt(
                            bench,
                            f"{ms} ms: Stepward, {args.steps} steps, -c {args.workers}{round_}",
                            lambda: stepward_side(bench, api, args.steps, args.workers),
                        )
                    )
                    if meta["peers_error"]:
                        sides["dbos"].append({"error": meta["peers_error"]})
                    else:
                        sides["dbos"].append(
                            tp.attempt(
                                bench,
                                f"{ms} ms: DBOS, {args.steps} workflows, "
                                f"{args.workers} processes{round_}",
                                lambda: dbos_side(bench, args.steps, args.workers),
                            )
                        )
            r["stepward"], r["dbos"] = median_round(sides["stepward"]), median_round(sides["dbos"])
            r["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, tp.on_signal)
    tmp = Path(tempfile.mkdtemp(prefix="stepward-bench-slow-"))
    bench = SlowBench(args, tmp)
    meta: dict[str, Any] = {}
    results: dict[str, Any] = {}
    try:
        meta = tp.machine(bench) | {"cpu": cpu_model()}
        versions, error = (None, "skipped (--no-peers)") if args.no_peers else tp.setup_peers()
        meta["peers"], meta["peers_error"] = versions or {}, error
        run(bench, meta, results)
    finally:
        tp.Proc.stop_all()
        for database in (DB_DBOS,) if args.keep_db else (DB, DB_DBOS):
            tp.drop(database)
        with contextlib.suppress(redis.RedisError):
            tp.flush_redis(REDIS_DB)
    meta["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results["goals"] = goals(results, args.latencies)
    report(bench, meta, results)
    if bench.failed or args.keep_logs:
        print(f"\nlogs of the processes kept in {bench.logs}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
