"""A real OpenID Connect provider for the company sign-in tests: django-oauth-toolkit's, in a
tiny Django project of its own, run by `python -m tests.oidc_provider.serve` in its own
process with its own SQLite database and port (tests/support/oidc.py starts it)."""
