"""Loads the tool modules a deployment names in STEPWARD_TOOLS (API.md "Your own tools").

Importing a module registers its tools (`@register`). Called once at startup by the app's
`ready()`, so web processes, workers, beat and management commands all know the same tools.
A module that cannot be imported, or a tool that breaks the contract, stops startup with a
message naming it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from django.core.exceptions import ImproperlyConfigured

from executor.contract.tool import RegistrationError


def load_tools(modules: Iterable[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except RegistrationError as error:
            raise ImproperlyConfigured(f"STEPWARD_TOOLS: {name}: {error}") from error
        except Exception as error:
            raise ImproperlyConfigured(
                f"STEPWARD_TOOLS: the tool module {name!r} could not be imported: "
                f"{type(error).__name__}: {error}"
            ) from error
