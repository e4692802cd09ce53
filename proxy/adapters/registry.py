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

One truth for every proxy: the state lives in DATA/adapters.json (shared_state.py), or
in the bucket with `--data s3://...` (bucket_state.py: the promoting proxy uploads the
adapter, the others fetch a checked copy before they follow). Each proxy polls it every
`follow_interval` seconds; when another proxy promoted, it
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
import logging
import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from overnight.proxy.forward.balancer import Balancer, Replica

from . import promotions
from .bucket_state import AdapterFiles, StateUnreachable
from .in_flight import InFlight
from .lora_client import AdapterError, LoraClient
from .promotions import EVENTS_KEPT, Adapter, Route, in_canary, open_state, rollback_on_disk
from .replica_check import base_model_of, check_replicas
from .state_file import DrainMarks

__all__ = ["Adapter", "AdapterRegistry", "Route", "in_canary", "rollback_on_disk"]
log = logging.getLogger("overnight.proxy")


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
        self.shared = open_state(state_path)
        self.files = AdapterFiles.of(self.shared)  # where replicas load an adapter from
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
        self._stamp, state = self.shared.initial()
        self._take(state)
        self._unreachable = False  # the shared state could not be read at the last look

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
        if canary is not None and not 0 < canary < 1:
            raise AdapterError(f"a canary's share must be between 0 and 1, got {canary}")
        path, source = await self.files.prepare(path)  # with a bucket: uploaded too
        async with self._lock, self.shared.locked():
            # another proxy may have promoted meanwhile
            self._adopt(await self._io(self.shared.read))
            old = self.canary
            if old is not None and old.path != path:  # say so: it ends unsettled
                why = "; ".join(filter(None, [why, f"replaces the canary {old.name}"]))
            if canary is not None:
                adapter = await self._load_everywhere(path, "canary", source=source)
                event = promotions.history_event(
                    f"canary at {canary:.0%}", adapter, why, self.current
                )
                await self._switch(self.stack, adapter, event, fraction=canary)
                log.info(
                    "alias %s sends %.0f%% to %s (%s)", self.alias, 100 * canary, adapter.name, path
                )
                return adapter
            if old is not None and old.path == path:
                adapter, event = old, "canary promoted"
            else:
                adapter = await self._load_everywhere(path, "promote", source=source)
                event = "promote"
            await self._switch(
                [*self.stack, adapter], None, promotions.history_event(event, adapter, why, adapter)
            )
            log.info("alias %s now serves %s (%s)", self.alias, adapter.name, path)
            return adapter

    async def rollback(self, why: str = "", canary: bool = False) -> Adapter | None:
        """Serve the previous adapter again (or the base model), or with `canary` only stop
        the canary; returns what the alias serves now. `why` is kept with the event."""
        async with self._lock, self.shared.locked():
            self._adopt(await self._io(self.shared.read))
            if canary:
                if self.canary is None:
                    raise AdapterError("no canary runs: nothing to drop")
                event = promotions.history_event("canary dropped", self.canary, why, self.current)
                await self._switch(self.stack, None, event)
                log.info("dropped the canary: %s", why or "no reason given")
                return self.current
            if not self.stack:
                raise AdapterError("nothing to roll back: the alias already serves the base model")
            stack = self.stack[:-1]
            previous = stack.pop() if stack else None
            if previous is not None:
                again = self._load_everywhere(previous.path, "rollback", source=previous.source)
                stack.append(await again)
            event = promotions.history_event(
                "rollback", self.stack[-1], why, stack[-1] if stack else None
            )
            await self._switch(stack, self.canary, event)
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
        stamp = await self._io(self.shared.stamp)
        if stamp == self._stamp:
            return False
        async with self._lock:
            seen, self._stamp = self._stamp, await self._io(self.shared.stamp)
            state = await self._io(self.shared.read)
            if state.get("version", 0) == self.version:
                return False
            if not await self.files.ready(state):  # its adapter is not here: keep serving
                self._stamp = seen  # and look again at the next poll
                return False
            old, new = (self.current, self.canary), promotions.serving(state)
            if new != old:
                await self._check_replicas()  # what the other proxy loaded is there already
                # Loaded before the switch, so that no request goes to a name its replica
                # lacks; under its own name: a new one would be a new state for the others
                # to follow, and proxies with replicas of their own would never settle.
                for adapter in new:
                    await self._load_missing(adapter)
            self._adopt(state)
            self._mark_synced()
            if new != old:
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
            "current": promotions.stored(current) if current else None,
            "stack": [a.name for a in self.stack],
            "canary": promotions.canary_state(self.canary, self.canary_fraction),
            "adapters": [promotions.stored(a) for a in self.history],
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

    async def _switch(
        self,
        stack: list[Adapter],
        canary: Adapter | None,
        event: dict,
        fraction: float | None = None,
    ) -> None:
        """Write down `stack` and `canary` (loaded on the replicas already) with `event`,
        then serve them; call with the shared lock held. When the write fails (a bucket
        refused it, or cannot be reached), nothing changes here and what this call
        loaded is unloaded again."""
        old = (self.current, self.canary)
        events = [*self.events, event][-EVENTS_KEPT:]
        fraction = self.canary_fraction if fraction is None else fraction
        state = {
            "alias": self.alias,
            "stack": [a.name for a in stack],
            "canary": promotions.canary_state(canary, fraction),
            "adapters": [promotions.stored(a) for a in self.history],
            "events": events,
        }
        try:
            written = await self._io(self.shared.write, state)
        except BaseException:
            await self._unload_new(stack, canary)
            raise
        self.stack, self.canary, self.canary_fraction = stack, canary, fraction
        self.events = events
        self.version = written["version"]
        self._stamp = await self._io(self.shared.stamp)
        self._mark_synced()
        self._retire(*old)

    async def _unload_new(self, stack: list[Adapter], canary: Adapter | None) -> None:
        """Unload what a failed switch loaded (served by neither the old state nor any
        replica before) and forget it."""
        before = {a.name for a in (*self.stack, self.canary) if a is not None}
        new = [a for a in (*stack[-1:], canary) if a is not None and a.name not in before]
        for adapter in new:
            self.history = [a for a in self.history if a.name != adapter.name]
            await asyncio.gather(
                *(self.lora.unload_on(r, adapter.name) for r in self.balancer.replicas)
            )

    async def _io(self, call: Callable[..., Any], *args: Any) -> Any:
        """A call on the shared state: off the event loop when it goes to a bucket (a
        slow or unreachable one must not hold up serving)."""
        if not self.shared.remote:
            return call(*args)
        return await asyncio.to_thread(call, *args)

    def _retire(self, *served: Adapter | None) -> None:
        """Drain, then unload, each of `served` that neither serves the alias nor is its canary."""
        keep = {a.name for a in (self.current, self.canary) if a is not None}
        for adapter in served:
            if adapter is not None and adapter.name not in keep:
                self._start_drain(adapter)

    def _mark_synced(self) -> None:
        current = self.current
        for r in self.balancer.replicas:
            r.synced = current is None or current.name in r.served
        self.balancer.refresh()

    # -- the replicas ------------------------------------------------------------------

    async def _check_replicas(self) -> None:
        """Health and served models of every replica; a replica is live only once it
        serves the current adapter (set here, before it can take traffic)."""
        for served in await check_replicas(self.lora, self.balancer.replicas):
            self.base_model, self.base_model_path = base_model_of(
                served, self.base_model, self.base_model_path
            )
        self._mark_synced()

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
            await self._load_missing(adapter)
        self._mark_synced()
        return False

    async def _load_missing(self, adapter: Adapter | None) -> None:
        """Load `adapter` under its name on each healthy replica that lacks it."""
        if adapter is None:
            return
        missing = [r for r in self.balancer.replicas if r.healthy and adapter.name not in r.served]
        if not missing:
            return
        try:
            path = await self.files.local(adapter.path, adapter.source)
        except AdapterError as e:  # not here, and the bucket cannot give it now
            log.error("cannot load %s on %d replica(s): %s", adapter.name, len(missing), e)
            return
        results = await asyncio.gather(
            *(self.lora.load_on(r, adapter.name, path) for r in missing), return_exceptions=True
        )
        for replica, result in zip(missing, results, strict=True):
            if isinstance(result, BaseException):
                log.error("replica %s could not load %s: %s", replica.url, adapter.name, result)
            else:
                log.warning("replica %s lacked %s (restarted?): loaded", replica.url, adapter.name)

    async def _restore(self, current: Adapter, healthy: list[Replica]) -> bool:
        """No replica serves the current adapter (vLLM restarted): load it again under a
        new name and write that down, unless another proxy changed the state first."""
        try:
            async with self.shared.locked():
                state = await self._io(self.shared.read)
                if state.get("version", 0) != self.version:
                    return False  # another proxy promoted or restored: `follow` adopts it
                again = self._load_everywhere(current.path, "restore", healthy, current.source)
                adapter = await again
                why = f"no replica served {current.name} any more (vLLM restarted?)"
                await self._switch(
                    [*self.stack[:-1], adapter],
                    self.canary,
                    promotions.history_event("restore", adapter, why, adapter),
                )
        except (StateUnreachable, OSError) as e:  # the bucket is down: serve it as it is
            log.error("cannot write down a new name for %s (%s): loading it again", current.name, e)
            await self._load_missing(current)
            self._mark_synced()
            return False
        except AdapterError as e:  # vLLM came back but refused: say so, try again later
            log.error("could not load the promoted adapter again: %s", e)
            return False
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
            except OSError as e:  # a bucket that is down: serve what is known, say so once
                if not self._unreachable:
                    log.warning("cannot follow %s (%s); serving what is known", self.shared.path, e)
                self._unreachable = True
                continue
            except Exception:  # a half-written file on a strange filesystem: next time
                log.exception("following %s failed", self.shared.path)
            if self._unreachable:
                log.info("following %s again", self.shared.path)
            self._unreachable = False

    # -- talking to vLLM ---------------------------------------------------------------

    def _next_version(self) -> int:
        return max((a.version for a in self.history), default=0) + 1

    async def _load_everywhere(
        self,
        path: str,
        reason: str,
        targets: list[Replica] | None = None,
        source: str | None = None,
    ) -> Adapter:
        """Load `path` (the local copy of `source`, with a bucket) under a new name on
        every healthy replica, or on none: if any refuses, unload it from the others and
        raise."""
        load = await self.files.local(path, source)
        version = self._next_version()
        # A random tail: vLLM serves stale weights for a name it loaded before, even after
        # an unload (seen when a new proxy reused "policy-v1" against a running vLLM), and
        # a proxy cannot know every name a vLLM it did not start has seen.
        name = f"{self.alias}-v{version}-{secrets.token_hex(3)}"
        replicas = self.balancer.replicas
        targets = targets or [r for r in replicas if r.healthy] or list(replicas)
        results = await asyncio.gather(
            *(self.lora.load_on(r, name, load) for r in targets), return_exceptions=True
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
        adapter = Adapter(name, version, path, now, reason, source)
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
