"""The settings a deployment gives through the environment: the secret key that Django and the
ledger's chains need outside DEBUG, and HTTPS_ONLY with `check --deploy`.

Each case loads the settings in a fresh process, with the environment the case names (the
rest of this process's environment, less every variable these settings read).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings

ROOT = Path(django_settings.BASE_DIR)
# Every variable that decides what these tests look at: none leaks in from the outside.
READ = {
    "DEBUG",
    "SECRET_KEY",
    "SECRET_KEY_FILE",
    "EXECUTOR_LEDGER_KEY",
    "ALLOWED_HOSTS",
    "HTTPS_ONLY",
    "SECURE_SSL_REDIRECT",
    "SECURE_HSTS_SECONDS",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS",
    "SECURE_HSTS_PRELOAD",
    "SESSION_COOKIE_SECURE",
    "CSRF_COOKIE_SECURE",
    "SECURE_PROXY_SSL_HEADER",
    "DATABASE_URL",
    "DATABASE_PREPARED_STATEMENTS",
    # The tests' own (for the live server); check --deploy rightly refuses it.
    "DJANGO_ALLOW_ASYNC_UNSAFE",
}
DEVELOPMENT_KEY = "stepward-insecure-development-key-change-me"
SHOWN = [
    "DEBUG",
    "SECRET_KEY",
    "EXECUTOR_LEDGER_KEY",
    "SECURE_SSL_REDIRECT",
    "SECURE_HSTS_SECONDS",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS",
    "SESSION_COOKIE_SECURE",
    "CSRF_COOKIE_SECURE",
    "SECURE_PROXY_SSL_HEADER",
]


def real_key() -> str:
    return secrets.token_urlsafe(50)


def environment(tmp_path: Path, **given: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in READ}
    env.update(
        DJANGO_SETTINGS_MODULE="console.settings",
        STEPWARD_VAR_DIR=str(tmp_path / "var"),
        PYTHONWARNINGS="ignore",
    )
    env.update(given)
    return env


def manage(tmp_path: Path, *argv: str, **given: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *argv],
        cwd=ROOT,
        env=environment(tmp_path, **given),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def loaded(tmp_path: Path, shown: list[str] = SHOWN, **given: str) -> dict[str, Any]:
    """The settings as a process with this environment sees them."""
    code = (
        "import json, django; django.setup(); from django.conf import settings; "
        f"print(json.dumps({{name: getattr(settings, name) for name in {shown!r}}}, default=str))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=environment(tmp_path, **given),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout.splitlines()[-1]))


# --- the secret key -------------------------------------------------------------------------


def test_without_debug_and_without_a_secret_key_django_refuses_to_start(tmp_path: Path) -> None:
    out = manage(tmp_path, "check", DEBUG="0")
    assert out.returncode != 0
    assert "ImproperlyConfigured" in out.stderr
    assert "SECRET_KEY is not set" in out.stderr


def test_without_debug_the_public_development_key_is_refused(tmp_path: Path) -> None:
    out = manage(tmp_path, "check", SECRET_KEY=DEVELOPMENT_KEY)
    assert out.returncode != 0
    assert "SECRET_KEY" in out.stderr


def test_without_debug_a_ledger_key_that_is_the_development_key_is_refused(
    tmp_path: Path,
) -> None:
    out = manage(
        tmp_path, "check", SECRET_KEY=real_key(), EXECUTOR_LEDGER_KEY=f"ledger:{DEVELOPMENT_KEY}"
    )
    assert out.returncode != 0
    assert "EXECUTOR_LEDGER_KEY" in out.stderr


def test_with_a_real_key_the_ledger_key_derives_from_it(tmp_path: Path) -> None:
    key = real_key()
    seen = loaded(tmp_path, SECRET_KEY=key)
    assert seen["DEBUG"] is False
    assert seen["SECRET_KEY"] == key
    assert seen["EXECUTOR_LEDGER_KEY"] == f"ledger:{key}"
    assert loaded(tmp_path, SECRET_KEY=key, EXECUTOR_LEDGER_KEY="own")["EXECUTOR_LEDGER_KEY"] == (
        "own"
    )


def test_the_key_can_come_from_a_file(tmp_path: Path) -> None:
    key = real_key()
    key_file = tmp_path / "secret.key"
    key_file.write_text(key + "\n")
    assert loaded(tmp_path, SECRET_KEY_FILE=str(key_file))["SECRET_KEY"] == key

    out = manage(tmp_path, "check", SECRET_KEY_FILE=str(tmp_path / "missing.key"))
    assert out.returncode != 0
    assert "SECRET_KEY_FILE" in out.stderr


def test_with_debug_the_development_key_may_be_used(tmp_path: Path) -> None:
    seen = loaded(tmp_path, DEBUG="1")
    assert seen["SECRET_KEY"] == DEVELOPMENT_KEY
    assert seen["EXECUTOR_LEDGER_KEY"] == f"ledger:{DEVELOPMENT_KEY}"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_run_makes_a_private_key_once_and_the_settings_accept_it(tmp_path: Path) -> None:
    var = tmp_path / "var"

    def make_key() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["make", "--no-print-directory", "secret-key"],
            cwd=ROOT,
            env=environment(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )

    assert "made a secret key" in make_key().stdout
    key_file = var / "secret.key"
    key = key_file.read_text()
    assert len(key) >= 50
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert make_key().stdout == ""  # kept, not made again
    assert key_file.read_text() == key

    # `make run` hands it to every process as SECRET_KEY_FILE...
    assert loaded(tmp_path, SECRET_KEY_FILE=str(key_file))["SECRET_KEY"] == key
    # ...and every other command (an operator's, or `manage.py mcp` started by a desktop
    # assistant that passes on only what its configuration names) finds it by itself.
    assert loaded(tmp_path)["SECRET_KEY"] == key
    checked = manage(tmp_path, "check")
    assert checked.returncode == 0, checked.stderr
    # What is set still wins over the machine's file.
    other = real_key()
    assert loaded(tmp_path, SECRET_KEY=other)["SECRET_KEY"] == other


# --- HTTPS_ONLY ---------------------------------------------------------------------------


def deploy_check(tmp_path: Path, **given: str) -> subprocess.CompletedProcess[str]:
    return manage(
        tmp_path,
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        DEBUG="0",
        SECRET_KEY=real_key(),
        ALLOWED_HOSTS="stepward.example.com",
        **given,
    )


def test_check_deploy_passes_with_https_only_a_real_key_and_real_mail(tmp_path: Path) -> None:
    smtp = "django.core.mail.backends.smtp.EmailBackend"
    out = deploy_check(tmp_path, HTTPS_ONLY="1", EMAIL_BACKEND=smtp)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no issues" in out.stdout


def test_check_deploy_says_mail_to_files_is_for_development(tmp_path: Path) -> None:
    out = deploy_check(tmp_path, HTTPS_ONLY="1")
    assert out.returncode != 0
    assert "mail.E001" in out.stderr + out.stdout


def test_check_deploy_fails_without_https_only(tmp_path: Path) -> None:
    out = deploy_check(tmp_path)
    assert out.returncode != 0
    for warning in ("W004", "W008", "W012", "W016"):  # HSTS, redirect, both cookies
        assert f"security.{warning}" in out.stderr, out.stderr


def test_https_only_turns_on_each_https_setting(tmp_path: Path) -> None:
    off = loaded(tmp_path, SECRET_KEY=real_key())
    on = loaded(tmp_path, SECRET_KEY=real_key(), HTTPS_ONLY="1")

    assert (off["SECURE_HSTS_SECONDS"], on["SECURE_HSTS_SECONDS"]) == (0, 365 * 24 * 3600)
    for name in (
        "SECURE_SSL_REDIRECT",
        "SECURE_HSTS_INCLUDE_SUBDOMAINS",
        "SESSION_COOKIE_SECURE",
        "CSRF_COOKIE_SECURE",
    ):
        assert (off[name], on[name]) == (False, True), name
    assert off["SECURE_PROXY_SSL_HEADER"] is None
    assert on["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]


def test_each_https_setting_can_be_set_on_its_own(tmp_path: Path) -> None:
    # Behind HTTPS_ONLY, a proxy that redirects by itself and sends no X-Forwarded-Proto.
    seen = loaded(
        tmp_path,
        SECRET_KEY=real_key(),
        HTTPS_ONLY="1",
        SECURE_SSL_REDIRECT="0",
        SECURE_PROXY_SSL_HEADER="0",
        SECURE_HSTS_SECONDS="600",
    )
    assert seen["SECURE_SSL_REDIRECT"] is False
    assert seen["SECURE_PROXY_SSL_HEADER"] is None
    assert seen["SECURE_HSTS_SECONDS"] == 600
    assert seen["SESSION_COOKIE_SECURE"] is True

    # Without it, one setting alone.
    alone = loaded(tmp_path, SECRET_KEY=real_key(), SESSION_COOKIE_SECURE="1")
    assert alone["SESSION_COOKIE_SECURE"] is True
    assert alone["CSRF_COOKIE_SECURE"] is False
    assert alone["SECURE_SSL_REDIRECT"] is False


# --- the database ---------------------------------------------------------------------------


def test_postgresql_binds_and_prepares_statements_on_the_server_unless_turned_off(
    tmp_path: Path,
) -> None:
    url = "postgres://stepward@db.example:5432/stepward"

    def options(**given: str) -> dict[str, Any]:
        seen = loaded(tmp_path, ["DATABASES"], SECRET_KEY=real_key(), DATABASE_URL=url, **given)
        return dict(seen["DATABASES"]["default"].get("OPTIONS", {}))

    assert options() == {"server_side_binding": True, "prepare_threshold": 5}
    off = options(DATABASE_PREPARED_STATEMENTS="0")
    assert not {"server_side_binding", "prepare_threshold"} & off.keys()
