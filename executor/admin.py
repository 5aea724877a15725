"""Where Django's admin looks for the app's registrations: they live in
executor/surfaces/admin.py."""

from __future__ import annotations

import executor.surfaces.admin  # noqa: F401
