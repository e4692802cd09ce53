"""Several vLLM replicas behind one proxy: which one a completion goes to.

- A rollout sticks to one replica: rendezvous hashing on its id (each replica scores
  hash(replica, id); the highest live one wins), so every turn finds the rollout's
  prefix in that replica's cache. When a replica leaves, only its rollouts move, and
  they come back with it. The hash is the same in every process, so several proxies
  (or `--workers`) send a rollout to the same replica too.
- A request without ids goes to the live replica with the fewest requests outstanding.
- Live: answered its last health check and serves the promoted adapter (alias/registry.py
  decides both; a replica that comes back gets the adapter before it is live again).
  With none live every replica is tried, so one upstream behaves as before replicas
  existed: a down vLLM answers each request with a 502.
- A request that failed before the upstream answered anything (connection refused,
  closed before the response head) goes to the next replica, and the one that failed
  is out until a health check puts it back. The client got nothing yet, so it never
  sees the retry; a failure after the head is the relay's (a partial record).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence

import aiohttp

from .upstream import UpstreamPool, UpstreamResponse

log = logging.getLogger("overnight.proxy")


class Replica:
    """One vLLM server: its connection pool and what the proxy knows of it."""

    __slots__ = ("url", "pool", "outstanding", "healthy", "synced", "asleep", "served",
                 "failures", "_salt")  # fmt: skip

    def __init__(self, url: str, connect_timeout: float, keepalive_timeout: float):
        self.url = url
        self.pool = UpstreamPool(url, connect_timeout, keepalive_timeout)
        self.outstanding = 0  # requests sent and not yet released
        self.healthy = True  # its last health check passed (assumed until the first)
        self.synced = True  # it serves the promoted adapter (or none is promoted)
        self.asleep = False  # put to sleep for a colocated night (vllm_sleep.py)
        self.served: set[str] = set()  # model names it listed at its last check
        # Requests that failed on it (mark_down): a health check under way when one
        # failed answered before it, so it is no evidence that the replica is back.
        self.failures = 0
        self._salt = url.encode() + b"\0"

    @property
    def live(self) -> bool:
        return self.healthy and self.synced and not self.asleep

    def score(self, key: bytes) -> bytes:
        return hashlib.blake2b(self._salt + key, digest_size=8).digest()

    def describe(self) -> dict:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "synced": self.synced,
            "asleep": self.asleep,
            "outstanding": self.outstanding,
        }


class Balancer:
    def __init__(
        self,
        urls: Sequence[str],
        connect_timeout: float,
        keepalive_timeout: float,
        passive_checks: bool = True,
    ):
        if not urls:
            raise ValueError("at least one upstream")
        self.replicas = [Replica(u, connect_timeout, keepalive_timeout) for u in urls]
        self.live: list[Replica] = list(self.replicas)
        # One replica: no choice to make, nothing to retry (the hot path stays as short
        # as it was with a single upstream).
        self.single = self.replicas[0] if len(self.replicas) == 1 else None
        # Without health checks nothing would ever put a replica back: take none out.
        self.passive_checks = passive_checks
        self.on_down: Callable[[Replica], None] | None = None
        self._turn = 0

    def refresh(self) -> None:
        """Recompute the live list after a replica's health or adapter changed."""
        self.live = [r for r in self.replicas if r.live]

    def pick(self, key: str | None, exclude: Sequence[Replica] = ()) -> Replica | None:
        """The replica for a request with affinity `key` (None: least outstanding)."""
        candidates = self.live or self.replicas
        if exclude:
            candidates = [r for r in candidates if r not in exclude] or [
                r for r in self.replicas if r not in exclude
            ]
            if not candidates:
                return None
        if len(candidates) == 1:
            return candidates[0]
        if key is not None:
            k = key.encode()
            return max(candidates, key=lambda r: r.score(k))
        # Least outstanding; the scan starts one further each time so that ties spread.
        n = len(candidates)
        self._turn = start = (self._turn + 1) % n
        best = candidates[start]
        for i in range(1, n):
            r = candidates[(start + i) % n]
            if r.outstanding < best.outstanding:
                best = r
        return best

    async def post(
        self, path: str, body: bytes, headers: dict[str, str], key: str | None = None
    ) -> UpstreamResponse:
        """POST to the chosen replica and wait for the response head, retrying on the next
        replica what failed before any answer. The response counts as outstanding on its
        replica until released."""
        single = self.single
        if single is not None:
            return await self._send(single, path, body, headers)
        tried: list[Replica] = []
        replica = self.pick(key)
        while True:
            try:
                return await self._send(replica, path, body, headers)
            except aiohttp.ClientConnectionError as e:
                tried.append(replica)
                self.mark_down(replica, e)
                replica = self.pick(key, tried)
                if replica is None:  # every replica failed: the client gets the last error
                    raise

    async def _send(
        self, replica: Replica, path: str, body: bytes, headers: dict[str, str]
    ) -> UpstreamResponse:
        replica.outstanding += 1
        try:
            response = await replica.pool.post(path, body, headers)
        except BaseException:
            replica.outstanding -= 1
            raise
        response.replica = replica
        return response

    def mark_down(self, replica: Replica, error: BaseException) -> None:
        if not self.passive_checks or not replica.healthy:
            return
        log.warning(
            "replica %s failed (%s): out until it answers a health check", replica.url, error
        )
        replica.healthy = False
        replica.failures += 1
        self.refresh()
        if self.on_down is not None:
            self.on_down(replica)

    def url(self) -> str:
        """A base URL for a request that is not a completion (the pass-through)."""
        replica = self.pick(None)
        assert replica is not None
        return replica.url

    @property
    def idle(self) -> list:
        """Every replica's idle keep-alive connections (what a leak check counts)."""
        return [c for r in self.replicas for c in r.pool.idle]

    def close(self) -> None:
        for replica in self.replicas:
            replica.pool.close()
