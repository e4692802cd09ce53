"""The alias and the adapters behind it: promote, drain, unload, roll back, on every replica.

Agents ask for a stable alias (default `policy`). Before the first promotion it
means the base model; after, the adapter on top of the promotion stack. vLLM caches
adapters by name, so reloading new weights under an old name is unsafe: every
promotion loads under a fresh versioned name (`policy-v7-3fa2c1`), switches the alias
in one step on the event loop (a request routed before the switch finishes on the old
adapter), then unloads the old adapter once its in-flight requests have drained.

Everywhere or nowhere: a promotion loads the adapter on every healthy replica before
the alias switches; if any refuses, it is unloaded from the others and the alias stays.
A replica that was down, or restarted, gets the promoted adapter (under the same name:
a name always means one path) before it is live again (balancer.py).

One truth for every proxy: the state lives in DATA/adapters.json (shared_state.py).
Each proxy polls it every `follow_interval` seconds; when another proxy promoted, it
loads the adapter where its replicas lack it and switches its alias. A watch checks
the replicas every `check_interval` seconds (or at once after a 404 for the alias,
`notice_missing`): health, and whether they still serve the adapter. When none does
(vLLM restarted under every proxy), it is loaded again under a new version, as at a
proxy's start (`restore`).

A canary (`promote(path, canary=0.1)`): the candidate is loaded on every replica like a
promotion, but the alias sends it only that share of its rollouts (sticky: a hash of
the rollout id, the same in every proxy), recorded under the canary's own name so that
live rewards per adapter are known. Promoting the same path later makes it the alias's
adapter without loading it again; `rollback(canary=True)` drops it.

Every promotion, rollback and canary decision is kept in the shared state's `events`,
with the reason given (the watch's numbers, `overnight rollback --reason`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import logging
import os
import secrets
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from .balancer import Balancer, Replica
from .in_flight import InFlight
from .lora_client import AdapterError, LoraClient
from .shared_state import DrainMarks, StateFile

log = logging.getLogger("overnight.proxy")
EVENTS_KEPT = 200  # promotions, rollbacks and canary decisions kept in adapters.json


@dataclass(frozen=True)
class Adapter:
    name: str  # the name vLLM serves it under
    version: int
    path: str
    promoted_at: str
    reason: str = "promote"  # promote | rollback | restore | canary


def in_canary(key: str, fraction: float) -> bool:
    """Whether the rollout `key` is in the canary's share: a hash, the same in every process."""
    point = int.from_bytes(hashlib.blake2b(b"canary\0" + key.encode(), digest_size=8).digest())
    return point < fraction * 2**64


@dataclass(frozen=True)
class Route:
    served: str  # model name sent upstream
    version: int | None  # adapter version, None for the base model or a pass-through


class AdapterRegistry:
    def __init__(
        self,
        alias: str,
        state_path: Path,
        balancer: Balancer,
        session_headers: dict[str, str],
        drain_timeout: float,
        base_model: str | None = None,
        check_interval: float = 10.0,
        follow_interval: float = 1.0,
    ):
        self.alias = alias
        self.shared = StateFile(state_path)
        self.balancer = balancer
        self.lora = LoraClient(session_headers)
        self.drain_timeout = drain_timeout
        self.base_model = base_model
        self.base_model_path: str | None = None
        self.stack: list[Adapter] = []  # promotions; the top serves the alias
        self.history: list[Adapter] = []  # every adapter ever loaded, oldest first
        self.canary: Adapter | None = None  # a candidate serving a share of the alias
        self.canary_fraction = 0.0
        self.events: list[dict] = []  # promotions, rollbacks, canaries, with reasons
        self.version = 0  # of the shared state this proxy follows
        self._lock = asyncio.Lock()  # one change of this proxy's state at a time
        self._drains: set[asyncio.Task] = set()
        proxy_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.flight = InFlight(DrainMarks(state_path, proxy_id))
        self.in_flight = self.flight.counts  # requests in flight here, by served name
        # Seconds between checks of the replicas; 0: no watch.
        self.check_interval = check_interval
        # Seconds between looks at the shared state; 0: follow nobody. Another proxy
        # switches within this, so an old adapter is unloaded no sooner than twice it
        # after this proxy stopped routing to it.
        self.follow_interval = follow_interval
        self._tasks: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        balancer.on_down = lambda _replica: self._wake.set()
        self._stamp = self.shared.stamp()
        self._take(self.shared.read())

    @property
    def session(self) -> aiohttp.ClientSession | None:
        return self.lora.session

    @session.setter
    def session(self, session: aiohttp.ClientSession) -> None:  # set by the app at start
        self.lora.session = session

    # -- routing (hot path) ------------------------------------------------------------

    @property
    def current(self) -> Adapter | None:
        return self.stack[-1] if self.stack else None

    def route(self, requested: str | None, key: str | None = None) -> Route:
        """Resolve the model name and count the request in flight on it. `key` (the
        rollout id, else the group id) decides whether the alias's canary serves it."""
        if requested == self.alias:
            current, canary = self.current, self.canary
            if canary is not None and key is not None and in_canary(key, self.canary_fraction):
                route = Route(canary.name, canary.version)
            elif current is not None:
                route = Route(current.name, current.version)
            else:
                route = Route(self.base_model or requested, None)
        else:
            route = Route(requested or self.base_model or "", None)
        self.flight.add(route.served)
        return route

    def release(self, route: Route) -> None:
        self.flight.done(route.served)

    # -- administration ----------------------------------------------------------------

    async def promote(self, path: str, canary: float | None = None, why: str = "") -> Adapter:
        """Serve `path` under the alias (loaded everywhere first), or with `canary` (a share
        in (0, 1)) only to that share of its rollouts. Promoting the canary's own path makes
        it the alias's adapter as it is loaded; promoting another path drops the canary."""
        path = str(Path(path).expanduser().resolve())
        if not (Path(path) / "adapter_config.json").is_file():
            raise AdapterError(f"{path} is not a peft adapter directory (no adapter_config.json)")
        if canary is not None and not 0 < canary < 1:
            raise AdapterError(f"a canary's share must be between 0 and 1, got {canary}")
        async with self._lock, self.shared.locked():
            self._adopt(self.shared.read())  # another proxy may have promoted meanwhile
            old = self.canary
            if old is not None and old.path != path:  # say so: it ends unsettled
                why = "; ".join(filter(None, [why, f"replaces the canary {old.name}"]))
            if canary is not None:
                adapter = await self._load_everywhere(path, "canary")
                self.canary_fraction = canary
                event = f"canary at {canary:.0%}"
                self._switch(self.stack, adapter, self._event(event, adapter, why, self.current))
                log.info(
                    "alias %s sends %.0f%% to %s (%s)", self.alias, 100 * canary, adapter.name, path
                )
                return adapter
            if old is not None and old.path == path:
                adapter, event = old, "canary promoted"
            else:
                adapter, event = await self._load_everywhere(path, "promote"), "promote"
            self._switch([*self.stack, adapter], None, self._event(event, adapter, why, adapter))
            log.info("alias %s now serves %s (%s)", self.alias, adapter.name, path)
            return adapter

    async def rollback(self, why: str = "", canary: bool = False) -> Adapter | None:
        """Serve the previous adapter again (or the base model), or with `canary` only stop
        the canary; returns what the alias serves now. `why` is kept with the event."""
        async with self._lock, self.shared.locked():
            self._adopt(self.shared.read())
            if canary:
                if self.canary is None:
                    raise AdapterError("no canary runs: nothing to drop")
                event = self._event("canary dropped", self.canary, why, self.current)
                self._switch(self.stack, None, event)
                log.info("dropped the canary: %s", why or "no reason given")
                return self.current
            if not self.stack:
                raise AdapterError("nothing to roll back: the alias already serves the base model")
            stack = self.stack[:-1]
            previous = stack.pop() if stack else None
            if previous is not None:
                stack.append(await self._load_everywhere(previous.path, "rollback"))
            event = self._event("rollback", self.stack[-1], why, stack[-1] if stack else None)
            self._switch(stack, self.canary, event)
            now = self.current
            log.info(
                "rolled back: alias now serves %s (%s)", now.name if now else "the base model", why
            )
            return now

    async def restore(self) -> None:
        """After a (re)start: check the replicas, learn the base model, load the current
        adapter where it is missing, and start the watch and the follower. An unreachable
        vLLM is not fatal: the watch loads the adapter once it answers."""
        await self._check_replicas()
        async with self._lock:
            await self._sync()
        if self.check_interval > 0:
            self._tasks.append(asyncio.create_task(self._watch_upstream()))
        if self.follow_interval > 0:
            self._tasks.append(asyncio.create_task(self._follow_state()))

    def notice_missing(self, served: str) -> None:
        """A request routed to `served` got a 404 from vLLM: check now, not at the next tick.
        (Call from the relay; cheap and safe to call for any name.)"""
        if served in {a.name for a in (self.current, self.canary) if a is not None}:
            self._wake.set()

    async def check_upstream(self) -> bool:
        """Check every replica; load the current adapter where it is missing. True when no
        replica served it any more and it was loaded again under a new name."""
        await self._check_replicas()
        async with self._lock:
            return await self._sync()

    async def follow(self) -> bool:
        """Adopt what another proxy wrote to the shared state; True when it changed."""
        stamp = self.shared.stamp()
        if stamp == self._stamp:
            return False
        async with self._lock:
            self._stamp = self.shared.stamp()
            state = self.shared.read()
            if state.get("version", 0) == self.version:
                return False
            old = (self.current, self.canary)
            self._adopt(state)
            if (self.current, self.canary) != old:
                await self._check_replicas()  # what the other proxy loaded is there already
                # Its own name everywhere: a new one would be a new state for the others
                # to follow, and proxies with replicas of their own would never settle.
                await self._sync(restore=False)
                log.info(
                    "followed the shared state (version %d): alias %s serves %s",
                    self.version,
                    self.alias,
                    self.current.name if self.current else "the base model",
                )
            return True

    def describe(self) -> dict:
        current = self.current
        return {
            "alias": self.alias,
            "base_model": self.base_model,
            "base_model_path": self.base_model_path,
            "current": asdict(current) if current else None,
            "stack": [a.name for a in self.stack],
            "canary": self._canary_state(),
            "adapters": [asdict(a) for a in self.history],
            "events": self.events,
            "in_flight": dict(self.in_flight),
            "draining_elsewhere": self.flight.marks.elsewhere(),
            "state_version": self.version,
            "replicas": [r.describe() for r in self.balancer.replicas],
        }

    async def close(self) -> None:
        for task in [*self._tasks, *self._drains]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._drains, return_exceptions=True)
        self._tasks = []
        self.flight.close()

    # -- the state, shared and local ---------------------------------------------------

    def _take(self, state: dict) -> None:
        self.history = [Adapter(**a) for a in state.get("adapters", [])]
        by_name = {a.name: a for a in self.history}
        self.stack = [by_name[n] for n in state.get("stack", []) if n in by_name]
        canary = state.get("canary") or {}
        self.canary = by_name.get(canary.get("name", ""))
        self.canary_fraction = float(canary.get("fraction", 0.0))
        self.events = list(state.get("events", []))
        self.version = state.get("version", 0)

    def _adopt(self, state: dict) -> None:
        """Take the shared state; drain what this proxy served that it no longer serves."""
        if state.get("version", 0) == self.version:
            return
        old = (self.current, self.canary)
        self._take(state)
        self._retire(*old)

    def _switch(self, stack: list[Adapter], canary: Adapter | None, event: dict) -> None:
        """Serve the top of `stack` and `canary` (loaded on the replicas already) and write
        it down with `event`; call with the file lock held."""
        old = (self.current, self.canary)
        self.stack, self.canary = stack, canary
        self.events = [*self.events, event][-EVENTS_KEPT:]
        written = self.shared.write(
            {
                "alias": self.alias,
                "stack": [a.name for a in self.stack],
                "canary": self._canary_state(),
                "adapters": [asdict(a) for a in self.history],
                "events": self.events,
            }
        )
        self.version = written["version"]
        self._stamp = self.shared.stamp()
        self._mark_synced()
        self._retire(*old)

    def _retire(self, *served: Adapter | None) -> None:
        """Drain, then unload, each of `served` that neither serves the alias nor is its canary."""
        keep = {a.name for a in (self.current, self.canary) if a is not None}
        for adapter in served:
            if adapter is not None and adapter.name not in keep:
                self._start_drain(adapter)

    def _canary_state(self) -> dict | None:
        if self.canary is None:
            return None
        return {"name": self.canary.name, "fraction": self.canary_fraction}

    def _event(self, action: str, adapter: Adapter, why: str, serves: Adapter | None) -> dict:
        """One line of the history of what the alias served (`serves`: after it), and why."""
        return {
            "at": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
            "action": action,
            "adapter": adapter.name,
            "path": adapter.path,
            "serves": serves.name if serves else None,
            "reason": why,
        }

    def _mark_synced(self) -> None:
        current = self.current
        for r in self.balancer.replicas:
            r.synced = current is None or current.name in r.served
        self.balancer.refresh()

    # -- the replicas ------------------------------------------------------------------

    async def _check_replicas(self) -> None:
        """Health and served models of every replica; a replica is live only once it
        serves the current adapter (set here, before it can take traffic)."""
        answers = await asyncio.gather(
            *(self.lora.served_models(r) for r in self.balancer.replicas)
        )
        for replica, served in zip(self.balancer.replicas, answers, strict=True):
            if served is None:
                if replica.healthy:
                    log.warning("replica %s is out: it did not answer", replica.url)
                replica.healthy = False
                continue
            if not replica.healthy:
                log.info("replica %s answers again", replica.url)
            replica.healthy = True
            replica.served = {m.get("id") for m in served}
            self._learn_base_model(served)
        self._mark_synced()

    def _learn_base_model(self, served: list[dict]) -> None:
        bases = [m for m in served if not m.get("parent")]
        if self.base_model is None and bases:
            self.base_model = bases[0]["id"]
        if self.base_model_path is None:
            # Where vLLM loaded the base from: what a trainer must load too.
            self.base_model_path = next(
                (m.get("root") for m in bases if m["id"] == self.base_model), None
            )

    async def _sync(self, restore: bool = True) -> bool:
        """Load the current adapter and the canary on each healthy replica that lacks them
        (call under `_lock`, after `_check_replicas`). When none has the current adapter
        (vLLM restarted) and `restore`, load it under a new name and write that down: True."""
        current = self.current
        healthy = [r for r in self.balancer.replicas if r.healthy]
        if not healthy:
            return False
        if restore and current is not None and not any(current.name in r.served for r in healthy):
            return await self._restore(current, healthy)
        for adapter in (current, self.canary):
            if adapter is None:
                continue
            missing = [r for r in healthy if adapter.name not in r.served]
            results = await asyncio.gather(
                *(self.lora.load_on(r, adapter.name, adapter.path) for r in missing),
                return_exceptions=True,
            )
            for replica, result in zip(missing, results, strict=True):
                if isinstance(result, BaseException):
                    log.error("replica %s could not load %s: %s", replica.url, adapter.name, result)
                else:
                    log.warning(
                        "replica %s lacked %s (restarted?): loaded", replica.url, adapter.name
                    )
        self._mark_synced()
        return False

    async def _restore(self, current: Adapter, healthy: list[Replica]) -> bool:
        """No replica serves the current adapter (vLLM restarted): load it again under a
        new name and write that down, unless another proxy changed the state first."""
        async with self.shared.locked():
            state = self.shared.read()
            if state.get("version", 0) != self.version:
                return False  # another proxy promoted or restored: `follow` adopts it
            try:
                adapter = await self._load_everywhere(current.path, "restore", healthy)
            except AdapterError as e:  # vLLM came back but refused: say so, try again later
                log.error("could not load the promoted adapter again: %s", e)
                return False
            why = f"no replica served {current.name} any more (vLLM restarted?)"
            self._switch(
                [*self.stack[:-1], adapter],
                self.canary,
                self._event("restore", adapter, why, adapter),
            )
        log.warning(
            "vLLM no longer served %s (restarted?): loaded %s again as %s",
            current.name,
            current.path,
            adapter.name,
        )
        return True

    async def _watch_upstream(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):  # a tick, or woken by notice_missing
                await asyncio.wait_for(self._wake.wait(), self.check_interval)
            self._wake.clear()
            try:
                await self.check_upstream()
            except Exception:  # the watch must outlive any surprise
                log.exception("checking the upstream replicas failed")

    async def _follow_state(self) -> None:
        while True:
            await asyncio.sleep(self.follow_interval)
            try:
                await self.follow()
            except Exception:  # a half-written file on a strange filesystem: next time
                log.exception("following %s failed", self.shared.path)

    # -- talking to vLLM ---------------------------------------------------------------

    def _next_version(self) -> int:
        return max((a.version for a in self.history), default=0) + 1

    async def _load_everywhere(
        self, path: str, reason: str, targets: list[Replica] | None = None
    ) -> Adapter:
        """Load `path` under a new name on every healthy replica, or on none: if any
        refuses, unload it from the others and raise."""
        version = self._next_version()
        # A random tail: vLLM serves stale weights for a name it loaded before, even after
        # an unload (seen when a new proxy reused "policy-v1" against a running vLLM), and
        # a proxy cannot know every name a vLLM it did not start has seen.
        name = f"{self.alias}-v{version}-{secrets.token_hex(3)}"
        replicas = self.balancer.replicas
        targets = targets or [r for r in replicas if r.healthy] or list(replicas)
        results = await asyncio.gather(
            *(self.lora.load_on(r, name, path) for r in targets), return_exceptions=True
        )
        failed = [(r, e) for r, e in zip(targets, results, strict=True) if e is not None]
        if failed:
            loaded = [r for r, e in zip(targets, results, strict=True) if e is None]
            await asyncio.gather(*(self.lora.unload_on(r, name) for r in loaded))
            for _, e in failed:
                if not isinstance(e, AdapterError):
                    raise e
            if len(targets) == 1:
                raise failed[0][1]
            raise AdapterError(
                f"{len(failed)} of {len(targets)} replicas did not load {path}; it was unloaded "
                f"from the others and the alias is unchanged: "
                + "; ".join(f"{r.url}: {e}" for r, e in failed),
                status=max(e.status for _, e in failed),
            )
        now = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
        adapter = Adapter(name=name, version=version, path=path, promoted_at=now, reason=reason)
        self.history.append(adapter)
        return adapter

    def _start_drain(self, old: Adapter) -> None:
        self.flight.replaced(old.name)
        task = asyncio.create_task(self._drain_and_unload(old))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _drain_and_unload(self, old: Adapter) -> None:
        await self.flight.drained(old.name, self.drain_timeout)
        # Other proxies on this data directory switch within `follow_interval`; those
        # that still had requests on it then say so (in_flight.py) until those finish.
        await asyncio.sleep(2 * self.follow_interval)
        tick = max(min(self.follow_interval, 1.0), 0.05)
        await self.flight.elsewhere_drained(old.name, self.drain_timeout, tick)
        if old.name in {a.name for a in (self.current, self.canary) if a is not None}:
            return  # serving again (a follower adopted an older state); keep it
        await asyncio.gather(*(self.lora.unload_on(r, old.name) for r in self.balancer.replicas))


def rollback_on_disk(state_path: Path, why: str = "") -> Adapter | None:
    """The rollback for when no proxy runs on this data directory: drop the newest
    promotion from `adapters.json`, so the next `overnight serve` restores the one
    before it (or serves the base model). Returns what will serve. (A proxy that does
    run follows the change too, loading that adapter again.)"""
    shared = StateFile(state_path)
    with shared.locked_blocking():
        state = shared.read()
        if not state:
            raise AdapterError("nothing to roll back: no adapter was ever promoted here")
        if not state.get("stack"):
            raise AdapterError("nothing to roll back: the alias already serves the base model")
        gone = state["stack"].pop()
        now = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
        event = {"at": now, "action": "rollback", "adapter": gone, "reason": why}
        event["serves"] = state["stack"][-1] if state["stack"] else None
        state["events"] = [*state.get("events", []), event][-EVENTS_KEPT:]
        shared.write(state)
    by_name = {a["name"]: a for a in state.get("adapters", [])}
    current = by_name.get(state["stack"][-1]) if state["stack"] else None
    return Adapter(**current) if current else None
