"""A deliberately broken engine for the drill's own test: proof that the drill can fail.

Never installed by the application. The drill starts its worker and sweeper processes
through `python -m executor.drill.broken <celery ...|manage.py command ...>` only
when asked to break something; that entry point installs the break and then runs the
ordinary command. `EXECUTOR_BREAK=lookup` is honoured only with `EXECUTOR_ALLOW_FAULTS=1`.

`lookup`: `ticketdesk.create`'s authoritative lookup always answers `not_found`, and so
does the lookup of every HTTP tool that has one (`lookup_url`, e.g. from `drill
--tools-file`), so an ambiguous submission is sent again and the desk gets a second ticket
(DESIGN.md §7, §13.3).

`repeat`: the engine takes every tool for safe to repeat, so a write whose answer was lost
(a crash after submission, an upstream that died mid-call) is sent again instead of waiting
for a person: the desk gets a second ticket, the drill's repository a second commit.
"""

from __future__ import annotations

import os
import sys

# What `--break` may name; imported by the drill's options, so that there is one list.
BREAKS = ("lookup", "repeat")


def requested_break() -> str:
    """The break named by EXECUTOR_BREAK; refuses one that is unknown or not allowed."""
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    name = os.environ.get("EXECUTOR_BREAK", "").strip()
    if not name:
        return ""
    if name not in BREAKS:
        raise ImproperlyConfigured(f"EXECUTOR_BREAK={name!r} is not one of {', '.join(BREAKS)}")
    if not settings.EXECUTOR_ALLOW_FAULTS:
        raise ImproperlyConfigured(
            "EXECUTOR_BREAK is set but fault injection is not allowed: "
            "set EXECUTOR_ALLOW_FAULTS=1 (drill machines only)"
        )
    return name


def install() -> str:
    """Puts the requested break in place in this process; returns its name ("" for none)."""
    name = requested_break()
    if name == "lookup":
        _install_lying_lookup()
    if name == "repeat":
        _install_blind_repeats()
    return name


def _install_blind_repeats() -> None:
    import executor.engine.common as engine_common
    from executor.contract.tool import Tool
    from executor.engine import recovery

    def always(tool: Tool) -> bool:
        return True

    engine_common.safe_to_repeat = always
    recovery.safe_to_repeat = always


def _install_lying_lookup() -> None:
    from executor.contract.tool import Invocation, Lookup, LookupOutcome, register, unregister
    from executor.tools.ticketdesk import TicketCreate

    class LyingLookupTicketCreate(TicketCreate):
        """Same declarations (so the same policy version and approvals), a lookup that lies."""

        def lookup(self, call: Invocation) -> Lookup:
            return Lookup(LookupOutcome.NOT_FOUND, evidence={"broken": "EXECUTOR_BREAK=lookup"})

    unregister(TicketCreate.name)
    register(LyingLookupTicketCreate)

    from executor.tools.http import HttpTool

    def lying_lookup(self: HttpTool, call: Invocation) -> Lookup:
        return Lookup(LookupOutcome.NOT_FOUND, evidence={"broken": "EXECUTOR_BREAK=lookup"})

    # Every HTTP tool class is made from HttpTool when the registry refreshes (after this);
    # one with a `lookup_url` inherits this lookup, so its declarations and policy version
    # stay the same.
    HttpTool.lookup = lying_lookup  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    """Installs the break, then runs `celery ...` or a `manage.py` command in this process."""
    if not argv:
        raise SystemExit("usage: python -m executor.drill.broken celery|COMMAND [ARGS...]")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    import django

    django.setup()
    name = install()
    print(f"drill_broken: EXECUTOR_BREAK={name or '(none)'} installed", flush=True)
    if argv[0] == "celery":
        from celery.bin.celery import main as celery_main

        sys.argv = argv
        celery_main()
    else:
        from django.core.management import execute_from_command_line

        execute_from_command_line(["manage.py", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
