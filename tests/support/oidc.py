"""The test OpenID Connect provider (tests/oidc_provider/) as a process, and a sign-in through
it the way a browser makes one: the console's redirect, the provider's own sign-in form, the
provider's redirect back with a code."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from django.test import Client

ROOT = Path(__file__).resolve().parents[2]
CLIENT_ID = "stepward-console"
CLIENT_SECRET = "stepward-console-secret-for-tests-only"
COMPANY = "Example Corp"
CALLBACK = "/accounts/oidc/callback/"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Provider:
    port: int
    process: subprocess.Popen[bytes]
    control_token: str
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def issuer(self) -> str:
        return f"{self.url}/o"

    def person(
        self, username: str, password: str, groups: list[str], *, email: str = "", **names: str
    ) -> str:
        """Creates or changes a person at the provider; returns their subject (`sub`)."""
        answer = httpx.post(
            f"{self.url}/control/users/",
            json={"username": username, "password": password, "groups": groups, "email": email}
            | names,
            headers={"X-Control-Token": self.control_token},
            timeout=10,
        )
        answer.raise_for_status()
        return str(answer.json()["sub"])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_provider(workdir: Path, redirect_uris: list[str]) -> Provider:
    """Starts the provider on a free port with a new database and signing key; returns when
    its discovery document answers."""
    workdir.mkdir(parents=True, exist_ok=True)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    key_path = workdir / "provider-key.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    port = free_port()
    token = secrets.token_urlsafe(16)
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"DJANGO_SETTINGS_MODULE", "DATABASE_URL"}
    }
    env |= {"PYTHONPATH": str(ROOT), "OIDC_PROVIDER_CONTROL_TOKEN": token}
    log_path = workdir / "provider.log"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.oidc_provider.serve",
            f"--port={port}",
            f"--db={workdir / 'provider.sqlite3'}",
            f"--key={key_path}",
            f"--redirect-uri={' '.join(redirect_uris)}",
            f"--client-id={CLIENT_ID}",
            f"--client-secret={CLIENT_SECRET}",
        ],
        cwd=ROOT,
        env=env,
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
    )
    provider = Provider(port=port, process=process, control_token=token, log_path=log_path)
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the test provider exited: {provider.log()}")
        try:
            if httpx.get(f"{provider.issuer}/.well-known/openid-configuration").is_success:
                return provider
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            provider.stop()
            raise RuntimeError(f"the test provider did not answer in 60 s: {provider.log()}")
        time.sleep(0.05)


def provider_sign_in(authorize_url: str, username: str, password: str, *, back_to: str) -> str:
    """Follows the provider's redirects and fills its sign-in form as a browser would;
    returns the URL the provider sends the browser back to (on `back_to`)."""
    with httpx.Client(timeout=10) as browser:
        url = authorize_url
        for _ in range(10):
            if url.startswith(back_to):
                return url
            answer = browser.get(url)
            if answer.status_code == 200 and 'data-testid="provider-login"' in answer.text:
                csrf = browser.cookies["provider_csrf"]
                next_url = dict(httpx.URL(url).params).get("next", "")
                answer = browser.post(
                    url,
                    data={
                        "csrfmiddlewaretoken": csrf,
                        "username": username,
                        "password": password,
                        "next": next_url,
                    },
                    headers={"Referer": url},
                )
            if not answer.is_redirect:
                raise AssertionError(f"the provider answered {answer.status_code}: {answer.text}")
            url = urljoin(url, answer.headers["location"])
    raise AssertionError("the provider redirected more than 10 times")


def console_sign_in(
    client: Client, username: str, password: str, *, next_url: str = "/"
) -> tuple[str, str]:
    """Starts company sign-in on the console (the test client), signs in at the provider;
    returns the callback's path and query, for the test to send (or not)."""
    start = client.get("/accounts/oidc/start/", {"next": next_url})
    assert start.status_code == 302, start.content
    back = provider_sign_in(
        start["Location"], username, password, back_to=f"http://testserver{CALLBACK}"
    )
    parts = urlsplit(back)
    return parts.path, parts.query
