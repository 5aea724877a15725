"""What no surface ever shows (DESIGN.md §15): one function for every surface.

The executor needs a step's raw input to call its tool, so the ledger keeps it in one column
(`Step.input`); everything else — summaries, results, attempt evidence, Event data, failure
messages, API answers, the console, admin, logs, reports — goes through `redact` first.

A value is redacted when its key looks like a secret (`SECRET_WORDS`, case-insensitive, any
nesting level, in dicts inside lists too) or is one of the fields its tool declares in
`redact`. And since a secret can travel on into text (an error message quoting the request,
a result echoing the input), every string is also scrubbed of the secret values that the
step's own input holds under such keys.

Secrets also come in shapes no key names (DESIGN.md §15, redaction by value): a header list
(`[["Authorization", "Bearer …"]]`, `[{"name": "Authorization", "value": …}]`), a value that
says what it is (`Basic …`, a DSN's password, `api_key=` in a URL, a PEM private key), a
service's own token format (AWS, GitHub, Stripe, Slack, JWT, …: detect-secrets' detectors),
JSON inside a string, a sentence that quotes a header. Every string is searched for them
(`redact_text`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache
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
    "passphrase",
    "sshkey",
    "stripekey",
    "accesskey",
    "signingkey",
    "jwt",
)
# Words a key is a secret's by, whose value may also be a container of other things (`auth`
# holding a user name and a password, `session` a cookie jar): a container under them is
# searched, not blanked; a scalar is blanked.
CONTAINER_WORDS = ("session",)
# Short words a key is a secret's when it is, or ends with, one of (`db_pwd`, `basic_auth`),
# not when it merely contains it (`author`, `pwdless`).
SECRET_ENDINGS = ("pwd", "auth", "pass")
# `*_key` (`stripe_key`, `signingKey`, `license-key`) is a secret's, but for keys that name
# a thing rather than hold one.
_A_KEY = re.compile(r".[_\-. ][kK]ey$|[a-z0-9]Key$")
KEYS_NOT_SECRET = frozenset(
    {"idempotencykey", "stepkey", "runkey", "sortkey", "primarykey", "foreignkey", "cachekey"}
)
# In a pair or a {name, value} object, the fields that name what the other holds.
NAME_FIELDS = ("name", "key", "header")
VALUE_FIELDS = ("value", "val")
# Shorter secret values are not scrubbed out of text: "ab" would blank out half the words.
MIN_SCRUBBED_LENGTH = 4

_NOT_ALNUM = re.compile(r"[^a-z0-9]")


def is_secret_key(key: object, fields: Iterable[str] = ()) -> bool:
    text = str(key)
    return text in fields or _kind_of_key(text) != ""


@lru_cache(maxsize=4096)
def _kind_of_key(text: str) -> str:
    """ "strong" (its value is blanked whole), "weak" (a container under it is searched), or
    "" (no secret's key); keys repeat, so each is worked out once."""
    squashed = _NOT_ALNUM.sub("", text.lower())
    if any(word in squashed for word in SECRET_WORDS) or squashed.startswith("aws"):
        return "strong"
    if _A_KEY.search(text) and squashed not in KEYS_NOT_SECRET:
        return "strong"
    if any(word in squashed for word in CONTAINER_WORDS) or squashed.endswith(SECRET_ENDINGS):
        return "weak"
    return ""


def _blanked(key: object, item: Any, fields: Iterable[str]) -> bool:
    """Whether the value under `key` is replaced whole (a container under a weaker word is
    searched instead)."""
    text = str(key)
    if text in fields:
        return True
    kind = _kind_of_key(text)
    return kind == "strong" or (kind == "weak" and not isinstance(item, Mapping | list | tuple))


# --- secrets by their shape ------------------------------------------------------------------

# A credential after its scheme: `Bearer …`, `Basic …`, `Token …` (a header's value, or a
# sentence quoting one).
_SCHEMES = re.compile(
    r"(?i)\b(bearer|basic|token|digest|apikey|api-key)(\s+)([A-Za-z0-9._~+/=:-]{8,})"
)
# A header quoted in text: `Authorization: …`, `X-Api-Key: …`.
_HEADER_LINES = re.compile(
    r"(?i)\b(authorization|proxy-authorization|x-api-key|api-key|x-auth-token|cookie)"
    r"(\s*[:=]\s*)(?!bearer\b|basic\b|token\b|digest\b)([^\s,;]{4,})"
)
# A URL's or DSN's password: `scheme://user:password@host`.
_URL_PASSWORDS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]*:)([^/\s@]+)(@)")
# A secret in a query string or `name=value` text: `?api_key=…`, `password=…`.
_ASSIGNMENTS = re.compile(
    r"(?i)\b(api[_-]?key|access[_-]?token|refresh[_-]?token|token|password|passwd|pwd|"
    r"secret|client[_-]?secret|sig|signature|session[_-]?id)(=)([^&\s\"',;]{4,})"
)
_PRIVATE_KEYS = re.compile(
    r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)",
    re.DOTALL,
)
# What every one of the patterns above needs somewhere in the text, looked for first.
_HINTS = (
    "bearer", "basic", "token", "digest", "api", "auth", "cookie", ":", "=", "-----begin",
    "sig", "session",
)  # fmt: skip
# Below this, a string holds no secret worth a search (states, ids, short words).
MIN_SEARCHED_LENGTH = 8


@cache
def _detectors() -> tuple[Any, ...]:
    """detect-secrets' detectors of services' own token formats (their regexes, nothing of
    their verification, which would call out): every RegexBasedDetector it ships but public
    IPs (not secrets) and basic auth in URLs (`_URL_PASSWORDS` keeps the user name)."""
    import importlib
    import pkgutil

    import detect_secrets.plugins as plugins
    from detect_secrets.plugins.base import RegexBasedDetector

    skipped = {"IPPublicDetector", "BasicAuthDetector"}
    found = []
    for module in pkgutil.iter_modules(plugins.__path__):
        loaded = importlib.import_module(f"{plugins.__name__}.{module.name}")
        for name in dir(loaded):
            kind = getattr(loaded, name)
            if (
                isinstance(kind, type)
                and issubclass(kind, RegexBasedDetector)
                and kind is not RegexBasedDetector
                and kind.__module__ == loaded.__name__
                and name not in skipped
            ):
                found.append(kind())
    return tuple(found)


# Every token format the detectors know is a run of at least 16 such characters; a string
# with none (words, states, a UUID) is not searched by them (their patterns cost ~20 µs a
# string, and every string every surface shows passes here).
_CANDIDATES = re.compile(r"[A-Za-z0-9_+/=.:-]{16,}")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def _may_hold_a_token(text: str) -> bool:
    return any(not _UUID.fullmatch(run) for run in _CANDIDATES.findall(text))


def _tokens(text: str) -> Iterator[str]:
    """What the detectors' patterns match, whole (`analyze_string` gives a pattern's groups,
    which for some is only the prefix: `ghp`)."""
    for detector in _detectors():
        for pattern in detector.denylist:
            for match in pattern.finditer(text):
                yield match.group(0)


def redact_text(text: str) -> str:
    """`text` with every secret its shape gives away replaced by REDACTED."""
    if len(text) < MIN_SEARCHED_LENGTH:
        return text
    stripped = text.strip()
    if stripped[:1] in ("{", "[") and stripped[-1:] in ("}", "]"):
        try:
            parsed = json.loads(stripped)
        except ValueError:
            pass
        else:
            if isinstance(parsed, dict | list):
                cleaned = redact(parsed)
                if cleaned != parsed:
                    return json.dumps(cleaned, ensure_ascii=False)
    lowered = text.lower()
    if any(hint in lowered for hint in _HINTS):
        text = _PRIVATE_KEYS.sub(REDACTED, text)
        for pattern in (_SCHEMES, _HEADER_LINES):
            text = pattern.sub(_hidden_if_credential, text)
        text = _URL_PASSWORDS.sub(lambda m: f"{m.group(1)}{REDACTED}{m.group(3)}", text)
        text = _ASSIGNMENTS.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    if not _may_hold_a_token(text):
        return text
    for token in sorted(set(_tokens(text)), key=len, reverse=True):
        if len(token) >= MIN_SCRUBBED_LENGTH and token != REDACTED:
            text = text.replace(token, REDACTED)
    return text


def _hidden_if_credential(match: re.Match[str]) -> str:
    """`Bearer <credential>`: a credential has a digit or is long; `token validation` is
    words."""
    scheme, space, value = match.group(1), match.group(2), match.group(3)
    if value == REDACTED or not (any(c.isdigit() for c in value) or len(value) >= 24):
        return match.group(0)
    return f"{scheme}{space}{REDACTED}"


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
        named = _named_secret(value, fields)
        return {
            key: REDACTED
            if _blanked(key, item, fields) or (named and key in VALUE_FIELDS)
            else redact(item, fields=fields, secrets=secrets)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        if (
            len(value) == 2
            and isinstance(value[0], str)
            and isinstance(value[1], str)
            and is_secret_key(value[0], fields)
        ):
            return [value[0], REDACTED]  # a header pair: ("Authorization", "Bearer …")
        return [redact(item, fields=fields, secrets=secrets) for item in value]
    if isinstance(value, str):
        return redact_text(scrub(value, secrets) if secrets else value)
    return value


def _named_secret(value: Mapping[Any, Any], fields: Iterable[str]) -> bool:
    """A {name: "Authorization", value: …} object: its value is the named secret."""
    return any(
        isinstance(value.get(name), str) and is_secret_key(value[name], fields)
        for name in NAME_FIELDS
    ) and any(key in value for key in VALUE_FIELDS)


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
        return redact_text(scrub(value, self.secrets) if self.secrets else value)
