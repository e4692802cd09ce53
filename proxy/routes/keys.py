"""Scoped client keys at the proxy: which key a request carries, what it may ask for,
which rollouts it may reward or finish, and its limits (issue 27; the keys file:
overnight/config/keys.py).

Without a scope a key may do what any client key could (plain `--api-key` keys always).
A scoped key:
- asks only for its policies (the aliases) and the other model names it lists, in groups
  that start with one of its prefixes; anything else is refused with 403 before it is
  forwarded (no record: nothing was served; the refusal is counted); nor in a group this
  process first served under a model the key may not use (its rollouts would train that
  policy; remembered beside the rollouts, bounded: the nights train a group mixing two
  policies for neither, storage/read/policy_scope.py);
- posts a reward or finish only for a rollout served under one of those, in one of those
  groups. Which model and group a rollout was served under is remembered here for the
  rollouts this process served (bounded), and looked up in the store (storage/
  rollout_lookup.py, off the event loop) for the others, and once for each of its own
  too: another worker, or this directory before a restart, may have served the same id.
  A rollout not found, or served under two models or groups (a branch `r.1` of an n > 1
  request and an `r.1` of its own included), is refused like another policy's: one
  answer, after the same store lookup, for both, so a key cannot probe which rollout ids
  other teams use, by the answer nor by its time (`ServedRollouts`);
- continues (`previous_response_id`) only a Responses chain begun under a model it may
  use, and reads no stored response (`GET /v1/responses/{id}`) when limited to policies;
- is limited, when its table says so, to a request rate (a token bucket: `rate` a
  second, `burst` at once) and a number of requests in flight; over either it gets 429
  with `Retry-After`, as OpenAI and LiteLLM answer, and the refusal is counted.

Counted in the metrics and /admin/stats, and in the records: each completion record a
scoped key made names it in its `notes` (`key`), and its first row carries the key's
refusals by reason since its previous record in this process (`key_refused`), so
`overnight sql` sums them per key (`record_note`; docs/operations.md).

Under `--workers N` the rate holds across the workers (one bucket per key in a file they
all map: key_buckets.py); the concurrency cap, and the counts, are per worker.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math

from aiohttp import web
from prometheus_client import Counter

from overnight.config import ProxyConfig
from overnight.config.keys import ScopedKey
from overnight.errors import OvernightError
from overnight.proxy.capture.attribution import Attribution
from overnight.proxy.observe.metrics import METRICS, Metrics
from overnight.storage.read.rollout_lookup import DAYS

from .key_buckets import LocalBucket, SharedSlot, buckets_for
from .served_rollouts import SERVED, ServedRollouts

log = logging.getLogger("overnight.proxy")

REASONS = ("model", "group", "rollout", "path", "rate", "concurrency")
# Where the proxy reads the model asked for (and records the answer). Elsewhere a POST
# passes through unread (embeddings, tokenize, ...): its model could be another
# policy's adapter by its versioned name, so a key limited to policies may not POST there.
SCOPED_POSTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


class KeyForbidden(OvernightError):
    status = 403
    code = "permission_denied"


class RateLimited(OvernightError):
    status = 429
    type = "requests"  # OpenAI's type for a request-rate limit
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: int, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.retry_after = retry_after  # auth.error_response sends it as Retry-After
        self.headers = headers or {}


class LiveKey:
    """One scoped key while the proxy runs: its scope, its bucket, its requests in flight
    and what it was refused."""

    __slots__ = ("name", "allowed", "prefixes", "rate", "size", "bucket", "cap")
    __slots__ += ("in_flight", "requests", "refused", "scoped", "unrecorded")

    def __init__(self, spec: ScopedKey, bucket: LocalBucket | SharedSlot | None = None):
        self.name = spec.name
        self.allowed = (
            None if spec.policies is None else frozenset(spec.policies) | frozenset(spec.models)
        )
        self.prefixes = spec.group_prefixes
        self.scoped = self.allowed is not None or self.prefixes is not None
        self.rate, self.size = spec.rate, spec.bucket
        # Its rate's (key_buckets.py): under --workers N the one every worker shares.
        self.bucket = bucket
        self.cap = spec.concurrency
        self.in_flight = self.requests = 0
        self.refused = dict.fromkeys(REASONS, 0)
        self.unrecorded: dict[str, int] = {}  # refusals not yet on a record, by reason

    def may_use(self, model: str | None) -> bool:
        return self.allowed is None or model in self.allowed

    def may_group(self, group: str | None) -> bool:
        return self.prefixes is None or (group is not None and group.startswith(self.prefixes))

    def admit(self, request: web.Request) -> None:
        """Count the request in, or raise RateLimited. The cap first: a request refused
        for it takes no token from the bucket."""
        if self.cap is not None and self.in_flight >= self.cap:
            raise refuse(
                request,
                self,
                "concurrency",
                RateLimited(
                    f"key {self.name!r} has {self.in_flight} requests in flight, its limit "
                    f"(concurrency {self.cap}); retry when one has finished",
                    retry_after=1,
                ),
            )
        if self.bucket is not None:
            wait = self.bucket.take()
            if wait > 0.0:
                headers = {
                    "x-ratelimit-limit-requests": str(self.size),
                    "x-ratelimit-remaining-requests": "0",
                    "x-ratelimit-reset-requests": f"{wait:.3f}s",
                }
                error = RateLimited(
                    f"key {self.name!r} is over its rate of {self.rate:g} requests a second "
                    f"(burst {self.size}); retry in {wait:.2f} s",
                    retry_after=max(1, math.ceil(wait)),
                    headers=headers,
                )
                raise refuse(request, self, "rate", error)
        self.in_flight += 1
        self.requests += 1

    def leave(self) -> None:
        self.in_flight -= 1


class KeyRing:
    """The client keys, plain and scoped, encoded once; `match` finds a request's."""

    def __init__(self, config: ProxyConfig):
        self.plain = tuple(k.encode("utf-8", "surrogatepass") for k in config.api_keys)
        buckets = buckets_for(config)  # shared by the workers under --workers N
        self.live = tuple(LiveKey(k, b) for k, b in zip(config.keys, buckets, strict=True))
        self.digests = tuple(bytes.fromhex(k.sha256) for k in config.keys)
        self.required = bool(self.plain or self.live)  # else no client auth at all
        self._counter: Counter | None = None

    def counter(self, metrics: Metrics) -> Counter:
        """`overnight_key_refusals_total` on the proxy's registry, made at the first
        refusal. Its `key` label is a name from the keys file (bounded), never a key."""
        if self._counter is None:
            self._counter = Counter(
                "overnight_key_refusals",
                "Requests of a scoped key refused, by key name and reason (model, group, "
                "rollout, path: 403, outside its scope; rate, concurrency: 429, over its "
                "limits).",
                ["key", "reason"],
                registry=metrics.registry,
            )
        return self._counter

    def match(self, token: str | None) -> tuple[bool, LiveKey | None]:
        """(a key matched, its live state when it is a scoped one). Every key is compared,
        plain and hashed: the time does not say which matched."""
        if token is None:
            return False, None
        given = token.encode("utf-8", "surrogatepass")
        matched = False
        for key in self.plain:
            matched |= hmac.compare_digest(given, key)
        found = None
        if self.digests:
            digest = hashlib.sha256(given).digest()
            for live, key in zip(self.live, self.digests, strict=True):
                if hmac.compare_digest(digest, key):
                    found = live
        return matched or found is not None, found

    def snapshot(self) -> dict:
        """/admin/stats: each scoped key's requests admitted, in flight, and refusals."""
        return {
            k.name: {"requests": k.requests, "in_flight": k.in_flight, "refused": dict(k.refused)}
            for k in self.live
        }


KEY = web.RequestKey("overnight_key", LiveKey)  # set by auth.make_guard for a scoped key
KEYS = web.AppKey("keys", KeyRing)


def refuse(request: web.Request, key: LiveKey, reason: str, error: OvernightError):
    """Count a refusal (here and in the metrics); the error, for the caller to raise."""
    key.refused[reason] += 1
    key.unrecorded[reason] = key.unrecorded.get(reason, 0) + 1
    ring, metrics = request.app.get(KEYS), request.app.get(METRICS)  # no METRICS: --no-metrics
    if ring is not None and metrics is not None:
        try:
            ring.counter(metrics).labels(key.name, reason).inc()
        except Exception:  # metrics never fail a request
            log.exception("metrics: could not count a refusal of key %s", key.name)
    return error


def record_note(request: web.Request) -> dict | None:
    """What a completion's record says of its scoped key: its name, and its refusals since
    its previous record (taken: the next record starts from none). None for no such key
    (plain `--api-key` keys have no name)."""
    key = request.get(KEY)
    if key is None:
        return None
    note: dict = {"key": key.name}
    if key.unrecorded:
        note["key_refused"], key.unrecorded = key.unrecorded, {}
    return note


def check_path(request: web.Request, key: LiveKey, path: str) -> None:
    """Refuse a POST of a key limited to policies outside the routes that check them, and
    any request for a stored response (`/v1/responses/{id}`: vLLM answers any policy's)."""
    if key.allowed is None:
        return
    if request.method != "POST" and not path.startswith("/v1/responses/"):
        return
    if path.endswith(SCOPED_POSTS) or path.startswith("/v1/rollouts/"):
        return
    message = (
        f"key {key.name!r} is limited to policies; it may POST completions, rewards and "
        f"finishes only, not {path!r:.100}"
    )
    raise refuse(request, key, "path", KeyForbidden(message))


def check_completion(request: web.Request, model: str | None, who: Attribution) -> None:
    """Refuse a completion a scoped key may not ask for (its model, or its group)."""
    key = request.get(KEY)
    if key is None or not key.scoped:
        return
    if not key.may_use(model):
        allowed = sorted(key.allowed or ())
        message = f"key {key.name!r} may not use model {model!r:.100}; it may use {allowed}"
        raise refuse(request, key, "model", KeyForbidden(message))
    group = who.group_id or who.rollout_id  # the group its records get (Attribution.rows)
    if not key.may_group(group):
        raise refuse(
            request,
            key,
            "group",
            KeyForbidden(
                f"key {key.name!r} may only serve rollout groups starting with "
                f"{list(key.prefixes)}; send X-Rollout-Group with one (got {group!r:.100})"
            ),
        )
    # A rollout added to another policy's group would be trained as that policy's: the
    # group is refused when it was first served under a model this key may not use.
    served = request.app.get(SERVED)
    first = None if served is None or group is None else served.groups.get(group)
    if first is not None and not key.may_use(first):
        raise refuse(
            request,
            key,
            "group",
            KeyForbidden(
                f"key {key.name!r} may not serve in rollout group {group!r:.100}: it was "
                f"started under a model this key may not use; start a group of its own"
            ),
        )


async def check_chain(request: web.Request, body: dict, chains) -> None:
    """Refuse a scoped key's Responses request continuing (`previous_response_id`) a chain
    begun under a model the key may not use: vLLM would prompt with the other team's
    conversation, and its record would hold it. A chain the proxy does not know (not in
    memory nor the store, or not found in time) is refused too: whose it is is unknown."""
    key = request.get(KEY)
    previous = body.get("previous_response_id")
    if key is None or key.allowed is None or not previous:
        return
    chain = await chains.find(previous)
    if chain is None or not key.may_use(chain.model):
        raise refuse(
            request,
            key,
            "model",
            KeyForbidden(
                f"key {key.name!r} may not continue response {previous!r:.100}: it was not "
                f"answered under a model of this key (or is not known to this proxy)"
            ),
        )


async def check_rollout(request: web.Request, rollout_id: str) -> None:
    """Refuse a reward or finish a scoped key may not post for `rollout_id`."""
    key = request.get(KEY)
    if key is None or not key.scoped:
        return
    served = request.app.get(SERVED)
    if served is None:
        found, looked = None, True
    else:
        found, looked = await served.find(rollout_id, key.name)
    if found is None or not (key.may_use(found[0]) and key.may_group(found[1])):
        if not looked:  # the store consulted as for an unknown id: the time tells nothing
            await served.from_store(rollout_id, key.name)
        raise refuse(
            request,
            key,
            "rollout",
            KeyForbidden(
                f"key {key.name!r} may not post for rollout {rollout_id!r:.100}: it was not "
                f"served under a policy and group of this key (by this proxy's data "
                f"directory, in the last {DAYS} days)"
            ),
        )


def remember(request: web.Request, who: Attribution, request_id: str, model: str | None) -> None:
    """Note what this completion's rollout was served under (only with scoped keys)."""
    served = request.app.get(SERVED)
    if served is not None:
        rollout = who.rollout_id or request_id
        served.remember(rollout, model, who.group_id or rollout)


def install(app: web.Application, config: ProxyConfig, keys: KeyRing) -> None:
    """The app's keys (/admin/stats reads their counts) and, with scoped keys, the
    rollouts' memory (closed with the app)."""
    app[KEYS] = keys
    if config.keys:
        names = frozenset(config.policy_names).union(*(k.models for k in config.keys))
        app[SERVED] = served = ServedRollouts(config.data_dir, names=names)

        async def close(_app: web.Application) -> None:
            served.close()

        app.on_cleanup.append(close)
