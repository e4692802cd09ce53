"""Which model and group each rollout was served under, for scoped keys' rewards and
finishes (proxy/routes/keys.py): remembered for the rollouts this process served
(bounded), looked up in the store (storage/read/rollout_lookup.py, off the event loop) for the
others and once for each of its own, with the lookups bounded in number and time.
"""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from overnight.errors import OvernightError
from overnight.storage.read.rollout_lookup import find_rollout

BRANCH = re.compile(r"\.\d+$")  # `r.3`: the fourth choice of rollout `r` (attribution.py)
CACHE_SECONDS = 5.0  # a store answer is looked up again after this (it may be written since)
QUEUE = 64  # store lookups waiting at most (one runs at a time, ~20-50 ms each)
PER_KEY = 16  # of one key: a key flooding unknown ids leaves room for the others
LOOKUP_SECONDS = 5.0  # one lookup at most; longer is a 503 (the thread finishes it)


class LookupsBusy(OvernightError):
    """Too many store lookups waiting (or one too slow): retry, nothing was recorded."""

    status = 503
    code = "rollout_lookups_busy"
    retry_after = 1


Found = tuple[str | None, str | None]
NOBODYS: Found = (None, None)


def merged(*answers: Found | None) -> Found | None:
    """One answer of several (memory's, the store's): nobody's when two disagree."""
    known = {a for a in answers if a is not None}
    return None if not known else known.pop() if len(known) == 1 else NOBODYS


class ServedRollouts:
    """Rollout id -> (model asked for, group) of the rollouts served here, bounded, most
    recent last; the store for the others. A rollout served under two models or groups
    is remembered as (None, None): no scoped key may post for it.

    Memory alone is never trusted for an id: another worker, or this directory before a
    restart, may have served it too. The first time an id is asked for, the store's
    answer is merged in (then the id is `verified`); a refusal consults the store the
    same way whatever memory said, and the store's answers (found or not) are kept
    `CACHE_SECONDS`, so a refusal of another team's id and of an unknown one take the
    same time. The lookups are bounded: `QUEUE` waiting at most (503 and Retry-After
    beyond), `PER_KEY` of one key, `LOOKUP_SECONDS` each."""

    def __init__(self, data_dir, capacity: int = 100_000, names: frozenset[str] = frozenset()):
        self.data_dir = data_dir
        self.capacity = capacity
        # The model names a scoped key may be let use (the policies, the keys' `models`):
        # any other is kept as "" (no limited key's), never as the client's string.
        self.names = names
        self.seen: dict[str, Found] = {}
        self.verified: set[str] = set()  # ids whose store answer is merged into `seen`
        self.groups: dict[str, str | None] = {}  # group -> the model its first turn asked for
        self.store: dict[str, tuple[float, Found | None]] = {}  # id -> (when, answer)
        self.waiting = 0
        self.by_key: dict[str, int] = {}  # lookups in flight, by key name
        self._pool: ThreadPoolExecutor | None = None  # one lookup at a time

    def remember(self, rollout_id: str, model: str | None, group: str) -> None:
        """Called for every completion routed (any key's), when scoped keys exist."""
        model = model if model in self.names else ""
        before = self.seen.pop(rollout_id, None)
        self.seen[rollout_id] = (model, group) if before in (None, (model, group)) else NOBODYS
        if before is None:  # first served here: the store's answer is merged in at `find`
            self.store.pop(rollout_id, None)
            self.verified.discard(rollout_id)
        self._bound(self.seen)
        if group not in self.groups:
            self.groups[group] = model  # "": no model said, or none a limited key may use
            self._bound(self.groups)

    def _bound(self, table: dict) -> None:
        while len(table) > self.capacity:
            gone = next(iter(table))
            del table[gone]
            if table is self.seen:
                self.verified.discard(gone)

    def in_memory(self, rollout_id: str) -> Found | None:
        """Memory's answer: `r.2` of a request with n > 1 was remembered as `r`, and `r.2`
        served by its own id too is two rollouts under one id: nobody's."""
        literal = self.seen.get(rollout_id)
        base = BRANCH.sub("", rollout_id)
        return merged(literal, self.seen.get(base) if base != rollout_id else None)

    async def find(self, rollout_id: str, key: str = "") -> tuple[Found | None, bool]:
        """(the answer, whether the store was consulted for it)."""
        remembered = self.in_memory(rollout_id)
        if remembered is not None and rollout_id in self.verified:
            return remembered, False
        stored = await self.from_store(rollout_id, key)
        found = merged(remembered, stored)
        if found is not None:  # kept, and evicted, as what it served itself
            self.seen.pop(rollout_id, None)
            self.seen[rollout_id] = found
            self.verified.add(rollout_id)
            self._bound(self.seen)
        return found, True

    async def from_store(self, rollout_id: str, name: str = "") -> Found | None:
        """The store's answer for `rollout_id` (storage/read/rollout_lookup.py), kept a while;
        `name`: the asking key's (its lookups in flight are capped)."""
        cached = self.store.get(rollout_id)
        if cached is not None and time.monotonic() - cached[0] < CACHE_SECONDS:
            return cached[1]
        if self.waiting >= QUEUE or self.by_key.get(name, 0) >= PER_KEY:
            raise LookupsBusy(
                f"too many rollout lookups waiting ({self.waiting}); retry in a second"
            )
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="overnight-rollouts")
        loop = asyncio.get_running_loop()
        self.waiting += 1
        self.by_key[name] = self.by_key.get(name, 0) + 1
        try:
            lookup = loop.run_in_executor(self._pool, find_rollout, self.data_dir, rollout_id)
            found = await asyncio.wait_for(lookup, LOOKUP_SECONDS)
        except TimeoutError:
            raise LookupsBusy(
                f"the rollout lookup took over {LOOKUP_SECONDS:g} s; retry in a second"
            ) from None
        finally:
            self.waiting -= 1
            self.by_key[name] -= 1
            if not self.by_key[name]:
                del self.by_key[name]
        if found is not None and found != NOBODYS and found[0] not in self.names:
            found = ("", found[1])  # as `remember` keeps it
        self.store.pop(rollout_id, None)
        self.store[rollout_id] = (time.monotonic(), found)
        while len(self.store) > 10_000:
            del self.store[next(iter(self.store))]
        return found

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


SERVED = web.AppKey("served_rollouts", ServedRollouts)
