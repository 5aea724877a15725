"""The demo agent that `manage.py up` runs once, so a newcomer opens the console to an inbox
with every kind of reviewer job in it. It uses only the agents' client and the desk's fault
switch, as an outside program would:

    python -m executor.desk.demo --url http://127.0.0.1:8000 --token TOKEN --desk http://127.0.0.1:8765

The desk is told which calls to break, by their titles, so the same things happen at
every start (DEMO_FAULTS). Within a minute the inbox holds:

- an unknown outcome: `note-alan` goes through `demo.open_ticket` (a plain webhook that
  `up` loads, with no lookup) and the desk drops the connection after creating the ticket;
  only a person can say whether it happened (the desk's `GET /tickets?client_ref=` answers);
- an approval: `email-ada` is `email.send`, irreversible, which waits for a person;
- a dead letter: `escalate-4471` meets a desk that answers 503 until its retries run out;
  the demo then heals the desk, so a reviewer's replay succeeds;
- a paused run: "Nightly digest" has a budget of two calls for four steps.

`ticket-1` also meets a dropped connection, on `ticketdesk.create`, whose lookup finds the
ticket: it settles by itself (its timeline shows how).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Collection

import httpx

from stepward_client import (
    SETTLED,
    InvalidRequest,
    Run,
    Step,
    Stepward,
    StepwardError,
    WaitTimeout,
)

CUSTOMERS = ["Ada Byron", "Grace Hopper", "Alan Turing", "Edsger Dijkstra", "Barbara Liskov"]
DEMO_TOOL = "demo.open_ticket"
UNKNOWN_TITLE = "Call back Alan Turing about order 4471"
DEAD_TITLE = "Escalate refund 4471 to finance"
SETTLED_BY_LOOKUP_TITLE = f"Refund follow-up for {CUSTOMERS[1]}"
DEMO_FAULTS = {
    "title_faults": {
        UNKNOWN_TITLE: "drop_after_commit",
        SETTLED_BY_LOOKUP_TITLE: "drop_after_commit",
        DEAD_TITLE: "error_503",
    }
}
# The dead letter's retries (ticketdesk.create_keyed: 5 attempts, backoff up to 8 s) end
# well within this.
WAIT_SECONDS = 90.0


def set_desk_faults(desk: str, faults: dict[str, object]) -> bool:
    try:
        httpx.post(f"{desk}/faults", json=faults, timeout=5).raise_for_status()
    except httpx.HTTPError as error:
        print(f"demo: could not set the desk's faults: {error}", file=sys.stderr)
        return False
    return True


def wait_for(step: Step, until: Collection[str] | None = None) -> None:
    try:
        step.wait(timeout=WAIT_SECONDS, until=until)
    except WaitTimeout as stuck:
        print(f"demo: {stuck.step.key}: still {stuck.step.state}")
        return
    print(f"demo: {step.key}: {outcome(step)}")


# The faults the demo plans, by step and the state each leaves, in words for its output.
PLANNED = {
    ("note-alan", "unknown"): (
        "unknown, as planned: the desk dropped the connection after acting and the tool has "
        "no lookup, so it waits in the inbox for a person"
    ),
    ("escalate-4471", "dead"): (
        "dead letter, as planned: the desk answered 503 to every attempt; it waits in the "
        "inbox, and a replay now succeeds"
    ),
}


def outcome(step: Step) -> str:
    """How a step ended, in words that tell a planned fault from a real problem: a completed
    step whose earlier attempt failed is a success, not an error."""
    made = f" (external id {step.external_id})" if step.external_id else ""
    if step.state == "completed":
        if step.failure:
            return (
                f"completed{made}; an earlier attempt met a fault that the executor settled "
                "by itself (the step's timeline shows how)"
            )
        return f"completed{made}"
    if (step.key, step.state) in PLANNED:
        return PLANNED[step.key, step.state]
    failure = f": {step.failure['message']}" if step.failure else ""
    return f"{step.state}{failure}"


def wait_run(run: Run, done: Callable[[Run], bool]) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not done(run.refresh()) and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"demo: run {run.name!r}: {run.status} {run.pause_reason}")


def refund_follow_ups(client: Stepward, desk: str) -> None:
    run = client.run(
        f"Refund follow-ups {time.strftime('%Y-%m-%d %H:%M:%S')}",
        budget={"max_calls": 40, "deadline_seconds": 3600},
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
    plan.append(
        run.step(
            "escalate-4471",
            "ticketdesk.create_keyed",
            {"title": DEAD_TITLE, "body": "Refund over the agent's limit"},
        )
    )
    try:
        plan.append(
            run.step(
                "note-alan",
                DEMO_TOOL,
                {"title": UNKNOWN_TITLE, "body": "He asked twice; see ticket-2"},
            )
        )
    except InvalidRequest as refused:
        print(f"demo: {DEMO_TOOL} refused (was it loaded?): {refused}", file=sys.stderr)
    try:
        # `manage.py up` allow-lists the desk for http.get; elsewhere it may not be.
        plan.append(run.step("read-desk-stats", "http.get", {"url": f"{desk}/stats"}))
    except InvalidRequest as refused:
        print(f"demo: http.get refused: {refused}", file=sys.stderr)
    email = run.step(
        "email-ada",
        "email.send",
        {
            "to": "ada@example.com",
            "subject": "Your refund for order 4471",
            "body": "Dear Ada, your refund is on its way.",
        },
    )
    print(f"demo: {email.key}: {email.state} (a person approves irreversible writes)")
    for step in plan:
        # ticket-1's lookup settles its unknown by itself: wait for that too.
        wait_for(step, SETTLED - {"unknown"} if step.key == "ticket-1" else None)
    print(f"demo: {run.report().summary}")


def nightly_digest(client: Stepward) -> None:
    run = client.run(
        f"Nightly digest {time.strftime('%Y-%m-%d %H:%M:%S')}",
        budget={"max_calls": 2, "deadline_seconds": 3600},
    )
    for number in range(1, 5):
        run.step(f"digest-{number}", "echo", {"part": number, "of": 4})
    wait_run(run, lambda fresh: fresh.status != "open")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Post demo runs through the API.")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--token", required=True)
    parser.add_argument("--desk", default="http://127.0.0.1:8765")
    args = parser.parse_args(argv)

    set_desk_faults(args.desk, {"reset": True, **DEMO_FAULTS})
    try:
        with Stepward(args.url, args.token) as client:
            nightly_digest(client)
            refund_follow_ups(client, args.desk)
    except StepwardError as error:
        print(f"demo: the API refused: {error}", file=sys.stderr)
        return 1
    finally:
        # The desk is well again: a replay of the dead letter now succeeds.
        set_desk_faults(args.desk, {"reset": True})
    print(
        f"demo: done. Open {args.url}/ as reviewer: the inbox has an unknown outcome "
        "(note-alan), an approval (email-ada), a dead letter (escalate-4471) and a "
        "paused run (Nightly digest)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
