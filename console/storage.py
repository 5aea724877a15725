"""Static files storage: hashed, compressed names, without failing where collectstatic has
not run yet (a fresh checkout, the test suite): missing entries fall back to plain names,
which whitenoise serves from the finders."""

from __future__ import annotations

from whitenoise.storage import CompressedManifestStaticFilesStorage


class StaticStorage(CompressedManifestStaticFilesStorage):
    manifest_strict = False
