"""SQL statements (by kind) and transactions per step, the engine run in this process.

    DATABASE_URL=postgres://... .venv/bin/python bench/engine_counts.py TOOL N AGENT_NAME

Prints one JSON line. Transactions are PostgreSQL's own count (pg_stat_database), read
before and after with statistics flushed, so reads in autocommit count too.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django

django.setup()

from django.db import connection  # noqa: E402

from executor import engine, services, tasks  # noqa: E402
from executor.models import Agent  # noqa: E402


def transactions() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        return int(cursor.fetchone()[0])


def main(tool: str, n: int, agent_name: str) -> None:
    agent = Agent.objects.get(name=agent_name)
    run, _ = services.run_create(agent=agent, name=f"statements {tool}")
    kinds: Counter[str] = Counter()

    def count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        kinds[sql.lstrip().split(None, 1)[0].upper()] += 1
        return execute(sql, params, many, context)

    with tasks.publish_suppressed():
        ids = [
            services.step_post(
                agent=agent, run=run, key=f"q{i}", tool_name=tool, input={"title": "x"}
            )[0].pk
            for i in range(n)
        ]
        before = transactions()
        with connection.execute_wrapper(count):
            for step_id in ids:
                engine.process(step_id, worker="bench")
        after = transactions()
    # The three statements of each transactions() call are not the engine's.
    total = sum(kinds.values())
    print(
        json.dumps(
            {
                "statements": round(total / n, 1),
                "by_kind": {k: round(v / n, 2) for k, v in sorted(kinds.items())},
                "transactions": round((after - before - 3) / n, 2),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
