"""Scoped client keys and per-policy admin tokens: the `--keys-file` TOML and what it means.

Plain `--api-key` keys may call everything under /v1, as they always could. A scoped key
is a table of the keys file, limited to some policies (the aliases a client asks for in
`model`) and group-id prefixes, with an optional request rate and concurrency cap:

    [[key]]
    name = "support"            # what the proxy calls it: metrics, /admin/stats, logs
    sha256 = "5e88...42d8"      # printf %s "$KEY" | sha256sum; or key_env = "SUPPORT_KEY"
    policies = ["policy"]       # absent: every policy (a key with limits only)
    models = ["Qwen/Qwen2.5-0.5B"]  # other model names it may ask for (the base model)
    group_prefixes = ["support/"]   # absent: any group
    rate = 5.0                  # requests a second, sustained; burst = 10 (default 2x rate)
    concurrency = 4             # requests in flight at once

    [[admin]]                   # may promote, roll back and read the adapters of one policy
    name = "support-ops"
    policy = "policy"
    sha256 = "..."              # or key_env

Keys are kept as sha256 digests only, so a leaked keys file leaks no key; a `key_env`
key is read from the environment at start and hashed there. Names are the only thing
about a key that leaves the proxy (never the key or its hash).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tomllib
from dataclasses import dataclass

from ..errors import ConfigError

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a metrics label: bounded, printable
_SHA256 = re.compile(r"[0-9a-f]{64}")
KEY_FIELDS = frozenset(
    {"name", "sha256", "key_env", "policies", "models", "group_prefixes", "rate", "burst"}
    | {"concurrency"}
)
ADMIN_FIELDS = frozenset({"name", "sha256", "key_env", "policy"})
MIN_RATE = 1e-6  # requests a second: one in about eleven days
MAX_COUNT = 1_000_000  # the most a rate, a burst or a concurrency may say
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


def key_digest(key: str) -> str:
    """The sha256 hex digest the keys file holds for `key` (= `printf %s KEY | sha256sum`)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class ScopedKey:
    name: str
    sha256: str  # hex digest of the key
    policies: tuple[str, ...] | None = None  # None: every policy
    models: tuple[str, ...] = ()  # other model names allowed (with `policies` only)
    group_prefixes: tuple[str, ...] | None = None  # None: any group
    rate: float | None = None  # requests per second, a token bucket
    burst: int | None = None  # the bucket's size (default: twice the rate, at least 1)
    concurrency: int | None = None  # requests in flight at once

    @property
    def bucket(self) -> int:
        if self.burst is not None:
            return self.burst
        return max(1, math.ceil(2 * self.rate)) if self.rate else 0


@dataclass(frozen=True)
class PolicyToken:
    name: str
    sha256: str
    policy: str


def policy_names(config) -> tuple[str, ...]:
    """The policies a proxy serves: the model names that follow promotions. The first is
    the default (an admin request without `?policy=`)."""
    return config.policy_names


def parse_keys(
    text: str, source: str = "keys file"
) -> tuple[tuple[ScopedKey, ...], tuple[PolicyToken, ...]]:
    """The `[[key]]` and `[[admin]]` tables of a keys file; ConfigError naming what is wrong."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not TOML: {e}") from e
    unknown = set(data) - {"key", "admin"}
    if unknown:
        raise ConfigError(f"{source}: only [[key]] and [[admin]] tables, got {sorted(unknown)}")
    keys = tuple(
        _key(t, f"{source}: [[key]] {i + 1}") for i, t in enumerate(_tables(data, "key", source))
    )
    admins = []
    for i, t in enumerate(_tables(data, "admin", source)):
        where = f"{source}: [[admin]] {i + 1}"
        _fields(t, ADMIN_FIELDS, where)
        policy = _text(t.get("policy"), where, "policy")
        admins.append(PolicyToken(_name(t, where), _digest(t, where), policy))
    return keys, tuple(admins)


def check_keys(keys, admins, api_keys, policies: tuple[str, ...]) -> None:
    """Names unique, every policy named served, no key or token given twice."""
    names = [k.name for k in keys] + [a.name for a in admins]
    twice = {n for n in names if names.count(n) > 1}
    if twice:
        raise ConfigError(f"keys: names must be unique, given twice: {sorted(twice)}")
    digests = [k.sha256 for k in keys] + [a.sha256 for a in admins]
    digests += [key_digest(k) for k in api_keys]
    if len(set(digests)) != len(digests):
        raise ConfigError("keys: the same key is given twice (a key has one scope)")
    for k in keys:
        unknown = set(k.policies or ()) - set(policies)
        if unknown:
            raise ConfigError(f"key {k.name!r}: no policy named {sorted(unknown)} ({policies})")
    for a in admins:
        if a.policy not in policies:
            raise ConfigError(f"admin token {a.name!r}: no policy named {a.policy!r}")


def _tables(data: dict, kind: str, source: str) -> list[dict]:
    tables = data.get(kind, [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{source}: {kind} must be [[{kind}]] tables")
    return tables


def _fields(table: dict, allowed: frozenset[str], where: str) -> None:
    unknown = set(table) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown fields {sorted(unknown)} (allowed: {sorted(allowed)})")


def _key(t: dict, where: str) -> ScopedKey:
    _fields(t, KEY_FIELDS, where)
    name = _name(t, where)
    where = f"key {name!r}"
    policies = _texts(t, "policies", where)
    models = _texts(t, "models", where) or ()
    if models and policies is None:
        raise ConfigError(f"{where}: models widen a key limited to policies; give policies too")
    rate, burst, concurrency = t.get("rate"), t.get("burst"), t.get("concurrency")
    # Bounded both ways: nan or inf would be no limit at all, and a tiny or huge rate
    # overflows the wait a 429 names (math.ceil).
    if rate is not None and (_not_number(rate, int | float) or not MIN_RATE <= rate <= MAX_COUNT):
        raise ConfigError(
            f"{where}: rate must be a number of requests a second from {MIN_RATE:g} to "
            f"{MAX_COUNT:g}"
        )
    for label, value in (("burst", burst), ("concurrency", concurrency)):
        if value is not None and (_not_number(value, int) or not 1 <= value <= MAX_COUNT):
            raise ConfigError(f"{where}: {label} must be a whole number from 1 to {MAX_COUNT}")
    if burst is not None and rate is None:
        raise ConfigError(f"{where}: burst needs a rate")
    return ScopedKey(
        name=name,
        sha256=_digest(t, where),
        policies=policies,
        models=models,
        group_prefixes=_texts(t, "group_prefixes", where),
        rate=None if rate is None else float(rate),
        burst=burst,
        concurrency=concurrency,
    )


def _not_number(value, kind) -> bool:
    return isinstance(value, bool) or not isinstance(value, kind)  # TOML's true is no count


def _name(t: dict, where: str) -> str:
    name = t.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: name must be 1-64 characters of [A-Za-z0-9._-]")
    return name


def _digest(t: dict, where: str) -> str:
    """The key's sha256: given, or of the plain key in the environment variable named."""
    digest, env = t.get("sha256"), t.get("key_env")
    if (digest is None) == (env is None):
        raise ConfigError(f"{where}: give sha256 or key_env (one of them)")
    if env is not None:
        value = os.environ.get(_text(env, where, "key_env"))
        if not value:
            raise ConfigError(f"{where}: environment variable {env} is not set (key_env)")
        return key_digest(value)
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest.strip().lower()):
        raise ConfigError(f'{where}: sha256 must be 64 hex digits (printf %s "$KEY" | sha256sum)')
    if digest.strip().lower() == EMPTY_DIGEST:  # `Authorization: Bearer ` would match it
        raise ConfigError(f"{where}: sha256 is the digest of the empty key; hash the key itself")
    return digest.strip().lower()


def _text(value, where: str, label: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {label} must be a non-empty string")
    return value


def _texts(t: dict, label: str, where: str) -> tuple[str, ...] | None:
    value = t.get(label)
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: {label} must be a non-empty list of strings")
    return tuple(_text(v, where, label) for v in value)
