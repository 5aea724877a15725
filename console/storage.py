"""Static files storage: hashed, compressed names once `collectstatic` has run, and plain
names where it has not (a fresh checkout, the test suite), which whitenoise then serves
from the finders. Without this, every page of a fresh checkout would fail to render."""

from __future__ import annotations

from whitenoise.storage import CompressedManifestStaticFilesStorage


class StaticStorage(CompressedManifestStaticFilesStorage):
    manifest_strict = False

    def stored_name(self, name: str) -> str:
        try:
            return str(super().stored_name(name))
        except ValueError:
            # Not collected: no hashed copy exists to name.
            return name
