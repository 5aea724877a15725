"""The signed JSON webhook (docs/notifications.md): Apprise's own `json://` and `jsons://`
plugin, its URL syntax kept (`+Header=value`, `-param=value`, `?method=`, user and
password), except that the body is Stepward's payload, sent as it is and signed with
HMAC-SHA256 in `X-Stepward-Signature`. Apprise's JSON body is its own envelope, unsigned.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import requests
from apprise.exception import AppriseException
from apprise.plugins.custom_json import NotifyJSON

SIGNATURE_HEADER = "X-Stepward-Signature"


def signature(body: bytes, key: str) -> str:
    """`sha256=<hex HMAC-SHA256 of the body>`: the X-Stepward-Signature header's value."""
    return "sha256=" + hmac.new(key.encode(), body, hashlib.sha256).hexdigest()


class SignedJSON(NotifyJSON):
    service_name = "Stepward signed JSON webhook"

    def __init__(self, signing_key: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.signing_key = signing_key

    def masked_url(self) -> str:
        """Where it posts, with the password and the headers' values hidden."""
        scheme = self.secure_protocol if self.secure else self.protocol
        login = f"{self.user}:****@" if self.user and self.password else ""
        if self.user and not self.password:
            login = f"{self.user}@"
        port = f":{self.port}" if isinstance(self.port, int) else ""
        headers = "".join(f" +{name}=****" for name in self.headers)
        return f"{scheme}://{login}{self.host}{port}{self.fullpath or '/'}{headers}"

    def send(
        self, body: Any, title: Any = "", notify_type: Any = None, attach: Any = None, **kwargs: Any
    ) -> bool:
        data = str(body).encode()
        headers = {
            "User-Agent": self.app_id,
            "Content-Type": "application/json",
            **self.headers,
            SIGNATURE_HEADER: signature(data, self.signing_key),
        }
        scheme = "https" if self.secure else "http"
        url = f"{scheme}://{self.host}"
        if isinstance(self.port, int):
            url += f":{self.port}"
        url += self.fullpath or "/"
        self.throttle()
        try:
            response = requests.request(
                str(self.method),
                url,
                data=data,
                params=self.params,
                headers=headers,
                auth=(str(self.user), str(self.password or "")) if self.user else None,
                verify=self.verify_certificate,
                timeout=self.request_timeout,
                allow_redirects=False,
            )
        except requests.RequestException as error:
            self.logger.warning("the webhook at %s did not answer: %s", self.host, error)
            return False
        if not 200 <= response.status_code < 300:
            self.logger.warning("the webhook at %s answered %s", self.host, response.status_code)
            return False
        return True


def instantiate(url: str, *, signing_key: str) -> SignedJSON | None:
    """The plugin for a json:// or jsons:// URL, or None when Apprise cannot read it."""
    parsed = SignedJSON.parse_url(url)
    if not parsed:
        return None
    try:
        return SignedJSON(signing_key=signing_key, **parsed)
    except (AppriseException, TypeError, ValueError):  # a bad method, port…
        return None
