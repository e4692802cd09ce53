"""The hop to a hosted API (issue 28): the key it gets, and the bytes it is sent.

A hosted upstream (overnight/config/upstream_kind.py) is sent the client's request as
the client sent it: no field added, the body's own bytes wherever the proxy changed
nothing in it (the alias becomes `--upstream-model`, the rollout ids leave `metadata`:
then it is encoded again), and the client's headers less the hop's and the proxy's own.

Its key is the operator's choice, never both:
- `configured`: `--upstream-api-key`, as `Authorization: Bearer` (openai) or `x-api-key`
  with an `anthropic-version` where the client sent none (anthropic); whatever key the
  client sent goes nowhere (it is the proxy's own, checked by auth.py), nor anything of
  the client's that would choose the account the key bills (ACCOUNT_HEADERS).
- `client`: the client's own `Authorization` (openai) or `x-api-key` (anthropic) goes
  upstream as it came. That header is then the upstream's, so the proxy's own client
  keys (`--api-key`, `--keys-file`) are read from `X-Overnight-Key` instead.
No key is ever written to a record, the log, a span or an error message.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from aiohttp import web

from overnight.config import ProxyConfig
from overnight.config.upstream_kind import ANTHROPIC, CLIENT, HOSTED_KINDS, upstream_label
from overnight.errors import OvernightError

# The proxy's own client key, where the client's Authorization belongs to the upstream.
PROXY_KEY_HEADER = "X-Overnight-Key"
# The Messages API refuses a request without one; the SDKs send their own.
ANTHROPIC_VERSION = "2023-06-01"
# Credentials of the client's that a hosted upstream never gets unless chosen (below).
CLIENT_CREDENTIALS = frozenset({"authorization", "x-api-key", PROXY_KEY_HEADER.lower()})
# Nor, with the configured key, what else of the client's would choose the account or carry
# a credential: an organisation or project would bill the operator's key there (a key may
# belong to several), a key under another provider's header name would go with ours
# (Azure's, Gemini's: never both), and cookies are the client's own sessions (ours: /ui).
ACCOUNT_HEADERS = frozenset(
    {"openai-organization", "openai-project", "api-key", "x-goog-api-key", "cookie"}
)
NO_IDS = "no token ids: a hosted upstream ({}) gives none"


def separate_proxy_key(config: ProxyConfig) -> bool:
    """Whether the proxy's client keys come in X-Overnight-Key (the client's own
    Authorization or x-api-key being the upstream's)."""
    return config.upstream_kind in HOSTED_KINDS and config.upstream_auth == CLIENT


class UpstreamAuth:
    """The credentials every request upstream gets, worked out once per app (the hot
    path only copies them): one key at most."""

    __slots__ = ("hosted", "fixed", "from_client", "anthropic", "withheld")

    def __init__(self, config: ProxyConfig):
        kind, key = config.upstream_kind, config.upstream_api_key
        self.hosted = kind in HOSTED_KINDS  # else vLLM (`auto` unsettled included)
        self.anthropic = kind == ANTHROPIC
        name = "x-api-key" if self.anthropic else "Authorization"
        # `client`: the client's own header of that name, passed on; else the configured key.
        self.from_client = name if self.hosted and config.upstream_auth == CLIENT else None
        value = key if self.anthropic else f"Bearer {key}"
        self.fixed = {name: value} if key and self.from_client is None else {}
        # The client's headers it never gets (beside the hop's: relay.py): against vLLM,
        # only the proxy's own key's.
        self.withheld = frozenset({PROXY_KEY_HEADER.lower()})
        if self.hosted:
            self.withheld |= CLIENT_CREDENTIALS
            if self.from_client is None:  # the operator's key: the operator's account
                self.withheld |= ACCOUNT_HEADERS

    def add(self, headers: dict[str, str], client: Mapping[str, str]) -> None:
        """Put the credentials into `headers` (`client`: the client's headers)."""
        if self.from_client is not None:
            value = client.get(self.from_client)
            if value:
                headers[self.from_client] = value
        elif self.fixed:
            headers.update(self.fixed)
        if self.anthropic and "anthropic-version" not in client:
            headers["anthropic-version"] = ANTHROPIC_VERSION


def request_bytes(raw: bytes, body: dict) -> bytes | None:
    """The client's own bytes when `body` (what goes upstream) is what they say, else
    None: the body must be encoded again."""
    try:
        return raw if orjson.loads(raw) == body else None
    except ValueError:
        return None


class HostedUpstream:
    """What the app knows of its hosted upstream: its kind and how records name it."""

    __slots__ = ("kind", "label", "note")

    def __init__(self, config: ProxyConfig):
        self.kind = config.upstream_kind
        self.label = upstream_label(self.kind, config.upstream)
        self.note = NO_IDS.format(self.kind)  # why its records have no token ids


# Absent against vLLM (`request.app.get(HOSTED)` is None): set by `install`.
HOSTED = web.AppKey("hosted", HostedUpstream)
UPSTREAM_AUTH = web.AppKey("upstream_auth", UpstreamAuth)  # every app's


def install(app: web.Application, config: ProxyConfig) -> bool:
    """The app's upstream credentials, and whether it fronts a hosted upstream (then
    marked so)."""
    app[UPSTREAM_AUTH] = UpstreamAuth(config)
    if config.upstream_kind not in HOSTED_KINDS:
        return False
    app[HOSTED] = HostedUpstream(config)
    return True


def refuse_if_hosted(app: web.Application, what: str) -> None:
    """409 for what only vLLM does (adapters, sleeping), against a hosted upstream."""
    hosted = app.get(HOSTED)
    if hosted is not None:
        raise OvernightError(
            f"the upstream is hosted ({hosted.label}): it serves no adapters and never "
            f"sleeps, so there is nothing to {what}",
            status=409,
            code="hosted_upstream",
        )
