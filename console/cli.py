"""`stepward <command>`: manage.py's commands from any directory (`[project.scripts]`)."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    from django.core.management import execute_from_command_line

    arguments = list(sys.argv if argv is None else argv)
    # Django's usage lines name the program: name it as the operator typed it.
    arguments[0] = "stepward"
    execute_from_command_line(arguments)


if __name__ == "__main__":
    main()
