"""The demo agent that `manage.py up` runs once, so a newcomer opens the console to a real
inbox. It uses only the agents' client and the desk's fault switch, as an outside program
would:

    python -m executor.demo --url http://127.0.0.1:8000 --token TOKEN --desk http://127.0.0.1:8765

The desk drops some connections after creating a ticket (unknown outcomes, then settled by
the lookup: see the timelines), answers 503 now and then (retries), and the run's call
budget is too small for all it wants (a paused run waits in the inbox for a person).
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx

from executor.client import InvalidRequest, Stepward, StepwardError, WaitTimeout

CUSTOMERS = ["Ada Byron", "Grace Hopper", "Alan Turing", "Edsger Dijkstra", "Barbara Liskov"]


def set_desk_faults(desk: str, faults: dict[str, object]) -> None:
    try:
        httpx.post(f"{desk}/faults", json=faults, timeout=5).raise_for_status()
    except httpx.HTTPError as error:
        print(f"demo: could not set the desk's faults: {error}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Post a realistic demo run through the API.")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--token", required=True)
    parser.add_argument("--desk", default="http://127.0.0.1:8765")
    args = parser.parse_args(argv)

    set_desk_faults(
        args.desk, {"drop_after_commit_rate": 0.35, "error_503_rate": 0.2, "seed": 4471}
    )
    try:
        with Stepward(args.url, args.token) as client:
            run = client.run(
                f"Refund follow-ups {time.strftime('%Y-%m-%d %H:%M')}",
                budget={"max_calls": 6, "deadline_seconds": 3600},
            )
            plan = [run.step("summarize", "echo", {"batch": 4471, "customers": len(CUSTOMERS)})]
            for number, customer in enumerate(CUSTOMERS):
                plan.append(
                    run.step(
                        f"ticket-{number}",
                        "ticketdesk.create" if number % 2 else "ticketdesk.create_keyed",
                        {"title": f"Refund follow-up for {customer}", "body": "Order 4471"},
                        depends_on=["summarize"],
                    )
                )
            try:
                # `manage.py up` allow-lists the desk for http.get; elsewhere it may not be.
                plan.append(run.step("read-desk-stats", "http.get", {"url": f"{args.desk}/stats"}))
            except InvalidRequest as refused:
                print(f"demo: http.get refused: {refused}")
            for step in plan:
                try:
                    settled = step.wait(timeout=20)
                    print(f"demo: {settled.key}: {settled.state} {settled.external_id}")
                except WaitTimeout as stuck:
                    print(f"demo: {stuck.step.key}: still {stuck.step.state}")
            print(f"demo: {run.report().summary}")
    except StepwardError as error:
        print(f"demo: the API refused: {error}", file=sys.stderr)
        return 1
    finally:
        set_desk_faults(args.desk, {"reset": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
