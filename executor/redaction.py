"""What no surface ever shows (DESIGN.md §15): one function for every surface.

The executor needs a step's raw input to call its tool, so the ledger keeps it in one column
(`Step.input`); everything else — summaries, results, attempt evidence, Event data, failure
messages, API answers, the console, admin, logs, reports — goes through `redact` first.

A value is redacted when its key looks like a secret (`SECRET_WORDS`, case-insensitive, any
nesting level, in dicts inside lists too) or is one of the fields its tool declares in
`redact`. And since a secret can travel on into text (an error message quoting the request,
a result echoing the input), every string is also scrubbed of the secret values that the
step's own input holds under such keys.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

REDACTED = "[redacted]"
# A key is a secret's when, lower-cased and stripped of everything but letters and digits,
# it contains one of these (so `X-Api-Key`, `access_token`, `Set-Cookie`, `DB_PASSWORD`).
SECRET_WORDS = (
    "password",
    "passwd",
    "secret",
    "token",
    "apikey",
    "authorization",
    "cookie",
    "privatekey",
    "credential",
)
# Shorter secret values are not scrubbed out of text: "ab" would blank out half the words.
MIN_SCRUBBED_LENGTH = 4

_NOT_ALNUM = re.compile(r"[^a-z0-9]")


def is_secret_key(key: object, fields: Iterable[str] = ()) -> bool:
    text = str(key)
    if text in fields:
        return True
    squashed = _NOT_ALNUM.sub("", text.lower())
    return any(word in squashed for word in SECRET_WORDS)


def secret_values(value: Any, fields: frozenset[str] = frozenset()) -> frozenset[str]:
    """Every string held under a secret key anywhere in `value` (to scrub from text)."""
    found: set[str] = set()

    def walk(item: Any, secret: bool) -> None:
        if isinstance(item, Mapping):
            for key, inner in item.items():
                walk(inner, secret or is_secret_key(key, fields))
        elif isinstance(item, list | tuple):
            for inner in item:
                walk(inner, secret)
        elif secret and isinstance(item, str | int) and not isinstance(item, bool):
            text = str(item)
            if len(text) >= MIN_SCRUBBED_LENGTH:
                found.add(text)
                # `Authorization: Bearer <token>`: the token alone may travel on too.
                found.update(p for p in text.split() if len(p) >= MIN_SCRUBBED_LENGTH)

    walk(value, False)
    return frozenset(found)


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with every occurrence of each secret replaced by REDACTED (longest first)."""
    for secret in sorted(secrets, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def scrub_strings(value: Any, secrets: Iterable[str]) -> Any:
    """A copy of `value` with every string in it scrubbed of `secrets`, keys left as they are:
    for what a tool returns, before it is stored (values a tool read from its environment)."""
    secrets = frozenset(secrets)
    if not secrets:
        return value
    if isinstance(value, Mapping):
        return {key: scrub_strings(item, secrets) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [scrub_strings(item, secrets) for item in value]
    if isinstance(value, str):
        return scrub(value, secrets)
    return value


def redact(
    value: Any, *, fields: frozenset[str] = frozenset(), secrets: frozenset[str] = frozenset()
) -> Any:
    """A copy of `value` with secrets replaced by REDACTED: by key at every level, by the
    tool's declared `fields`, and in every string by the `secrets` values."""
    if isinstance(value, Mapping):
        return {
            key: REDACTED
            if is_secret_key(key, fields)
            else redact(item, fields=fields, secrets=secrets)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(item, fields=fields, secrets=secrets) for item in value]
    if isinstance(value, str) and secrets:
        return scrub(value, secrets)
    return value


@dataclass(frozen=True)
class Redactor:
    """`redact` bound to what one step holds: its tool's fields and its input's secrets."""

    fields: frozenset[str] = frozenset()
    secrets: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def for_input(cls, value: Any, fields: Iterable[str] = ()) -> Redactor:
        declared = frozenset(fields)
        return cls(fields=declared, secrets=secret_values(value, declared))

    def __call__(self, value: Any) -> Any:
        return redact(value, fields=self.fields, secrets=self.secrets)

    def text(self, value: str) -> str:
        return scrub(value, self.secrets) if self.secrets else value
