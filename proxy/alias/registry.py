"""The alias and the adapters behind it: promote, drain, unload, roll back, on every replica.

Agents ask for a stable alias (default `policy`): the base model, then the adapter on top
of the promotion stack. vLLM caches adapters by name, so every promotion loads under a
fresh versioned name (`policy-v7-3fa2c1`), switches the alias in one step on the event
loop (a request routed before finishes on the old adapter), then unloads the old one
once its in-flight requests have drained.

Everywhere or nowhere: a promotion loads the adapter on every healthy replica before
the alias switches; if any refuses, it is unloaded from the others and the alias stays.
A replica that was down or restarted gets the promoted adapter (under the same name: a
name always means one path) before it is live again (balancer.py).

One truth for every proxy: the state lives in DATA/adapters.json (state_file.py), or in the
bucket with `--data s3://...` (bucket_state.py: the promoting proxy uploads the adapter, the
others fetch a checked copy). Each proxy polls it every `follow_interval` seconds and
follows another's promotion. A watch checks the replicas every `check_interval` seconds (at
once after a 404 for the alias, `notice_missing`); when none serves the adapter any more
(vLLM restarted), it is loaded again under a new version, as at a proxy's start (`restore`).

A canary (`promote(path, canary=0.1)`) is loaded like a promotion, but the alias sends
it only that share of its rollouts (sticky: a hash of the rollout id, the same in every
proxy), recorded under its own name. Promoting the same path later makes it the alias's
adapter without loading it again; `rollback(canary=True)` drops it. Every promotion,
rollback and canary decision is kept in the shared state's `events`, with its reason
(the watch's numbers, `overnight rollback --reason`).

Here: `AdapterRegistry`, read top to bottom: its state (this proxy's copy of the shared
one) and routing by it (`route`, the hot path); the steps every change takes (loaded
everywhere before it is written down, `_load_everywhere`; served once written, `_switch`;
drained, then unloaded, `_retire`); then the changes, those asked of this proxy (promote,
rollback, a canary) and those it follows (another proxy, a replica back, a vLLM restart).
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
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from overnight.errors import ConfigError
from overnight.proxy.forward.balancer import Balancer, Replica
from overnight.proxy.replicas import loading
from overnight.proxy.replicas.health import base_model_of, check_replicas
from overnight.proxy.replicas.in_flight import InFlight
from overnight.proxy.replicas.lora_client import AdapterError, LoraClient
from overnight.storage.location import segment_store

from . import promotions, retention
from .bucket_state import AdapterFiles, StateUnreachable
from .promotions import EVENTS_KEPT, Adapter, Route, in_canary, open_state
from .state_file import DrainMarks

log = logging.getLogger("overnight.proxy")


class AdapterRegistry:
    """The alias's adapters on every replica of this proxy, as every proxy agrees on them."""

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
        data_dir: Path | None = None,
    ):
        self.alias = alias
        self.state_path = Path(state_path)
        # DATA; a policy other than the default keeps its state below it (policies.py).
        self.data_dir = self.state_path.parent if data_dir is None else Path(data_dir)
        self.shared = open_state(state_path, self.data_dir)
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
        # A handover from a hosted model (policies.py): {"share", "since"}, or None.
        self.handover: dict | None = None
        self.events: list[dict] = []  # promotions, rollbacks, canaries, with reasons
        self.version = 0  # of the shared state this proxy follows
        self._lock = asyncio.Lock()  # one change of this proxy's state at a time
        self._drains: set[asyncio.Task] = set()
        proxy_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.flight = InFlight(DrainMarks(state_path, proxy_id))
        self.in_flight = self.flight.counts  # requests in flight here, by served name
        # Seconds between checks of the replicas; 0: no watch.
        self.check_interval = check_interval
        # Seconds between looks at the shared state; 0: follow nobody. Another proxy switches
        # within this, so an old adapter is unloaded no sooner than twice it after.
        self.follow_interval = follow_interval
        self._tasks: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        # The registries on these replicas (a policy each): a replica is live once it serves all.
        self.siblings: list[AdapterRegistry] = [self]
        # Told when the base model's name is first learned from vLLM (policies.py checks it).
        self.on_base_model: Callable[[], None] | None = None
        balancer.on_down = lambda _replica: self._wake.set()
        self._stamp, state = self.shared.initial()
        if state.get("alias") not in (None, alias):
            # Which file is a policy's follows from which is the default (policies.py):
            # changing --alias would hand the old default's adapters to the new one.
            raise ConfigError(
                f"{self.state_path} is the promotion state of policy {state['alias']!r}, "
                f"not of {alias!r}: the default policy (--alias) keeps DATA/adapters.json; "
                f"start with --alias {state['alias']} (and --policy {alias}), or move the "
                f"file aside to start {alias!r} from the base model"
            )
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
                route = Route(canary.name, canary.version, requested)
            elif current is not None:
                route = Route(current.name, current.version, requested)
            else:
                route = Route(self.base_model or requested, None, requested)
        else:
            route = Route(requested or self.base_model or "", None)
        self.flight.add(route.served)
        return route

    def release(self, route: Route) -> None:
        self.flight.done(route.served)

    # -- for the app: what it serves, and closing --------------------------------------

    def describe(self) -> dict:
        current = self.current
        return {
            "alias": self.alias,
            "base_model": self.base_model,
            "base_model_path": self.base_model_path,
            "current": promotions.stored(current) if current else None,
            "stack": [a.name for a in self.stack],
            "canary": promotions.canary_state(self.canary, self.canary_fraction),
            "handover": self.handover,
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
        self.handover = state.get("handover")
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
            "handover": self.handover,
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
            await loading.unload_on_all(self.lora, self.balancer.replicas, adapter.name)

    async def _io(self, call: Callable[..., Any], *args: Any) -> Any:
        """A call on the shared state: off the event loop when it goes to a bucket (a
        slow or unreachable one must not hold up serving)."""
        if not self.shared.remote:
            return call(*args)
        return await asyncio.to_thread(call, *args)

    def _retire(self, *served: Adapter | None) -> None:
        """Drain, then unload, each of `served` that neither serves the alias nor is its canary."""
        keep = self._serving_names()
        for adapter in served:
            if adapter is not None and adapter.name not in keep:
                self._start_drain(adapter)

    def _serving_names(self) -> set[str]:
        """The names the alias routes to: its adapter and its canary."""
        return {a.name for a in (self.current, self.canary) if a is not None}

    def _mark_synced(self) -> None:
        served = [s.current.name for s in self.siblings if s.current is not None]
        for r in self.balancer.replicas:
            r.synced = all(name in r.served for name in served)
        self.balancer.refresh()

    # -- onto the replicas and off them ------------------------------------------------

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
        # A random tail: vLLM serves stale weights for a name it loaded before, even after an
        # unload (a new proxy reused "policy-v1" against a running vLLM it did not start).
        name = f"{self.alias}-v{version}-{secrets.token_hex(3)}"
        replicas = self.balancer.replicas
        targets = targets or [r for r in replicas if r.healthy and not r.asleep] or list(replicas)
        await loading.load_on_all(self.lora, targets, name, load, path)
        now = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
        adapter = Adapter(name, version, path, now, reason, source)
        self.history.append(adapter)
        return adapter

    async def _load_missing(self, adapter: Adapter | None) -> None:
        if adapter is not None:  # under its name, on each healthy replica that lacks it
            local = partial(self.files.local, adapter.path, adapter.source)
            await loading.load_missing(self.lora, self.balancer.replicas, adapter.name, local)

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
        # The check and the unload under the lock, as a follower's check, load and switch
        # are: one adopting an older state (an offline rollback) loads this very name again
        # where it is missing. Apart, the unload could land after the follower found the
        # name still loaded, and the alias would route to a name its replica lacks.
        async with self._lock:
            if old.name in self._serving_names():
                return  # serving again (a follower adopted an older state); keep it
            await loading.unload_on_all(self.lora, self.balancer.replicas, old.name)

    # -- administration ----------------------------------------------------------------

    async def promote(self, path: str, canary: float | None = None, why: str = "") -> Adapter:
        """Serve `path` under the alias (loaded everywhere first), or with `canary` (a share
        in (0, 1)) only to that share of its rollouts. Promoting the canary's own path makes
        it the alias's adapter as it is loaded; promoting another path drops the canary."""
        if canary is not None and not 0 < canary < 1:
            raise AdapterError(f"a canary's share must be between 0 and 1, got {canary}")
        path, source = await self.files.prepare(path, self.alias)  # a bucket's: uploaded
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

    async def set_handover(self, share: float, why: str = "") -> dict:
        """Serve `share` of the alias's rollouts locally and the rest by the hosted model
        beside vLLM (policies.py): 0 stops a handover (the hosted model serves all), 1
        completes it. Written to the shared state with an event, like a promotion."""
        if not 0.0 <= share <= 1.0:
            raise AdapterError(f"a handover's share must be within [0, 1], got {share}")
        async with self._lock, self.shared.locked():
            self._adopt(await self._io(self.shared.read))
            was = (self.handover or {}).get("share")
            if share == 0.0:
                action = "handover stopped" if was else "handover off"
            else:
                action = "handover complete" if share == 1.0 else f"handover at {share:.0%}"
            now = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
            current = self.current
            event = {"at": now, "action": action, "adapter": current.name if current else None,
                     "serves": current.name if current else None, "reason": why}  # fmt: skip
            old, self.handover = self.handover, {"share": share, "since": now}
            try:
                await self._switch(self.stack, self.canary, event)
            except BaseException:
                self.handover = old
                raise
            log.info("alias %s: %s (%s)", self.alias, action, why or "no reason given")
            return self.handover

    async def prune(
        self, keep: int, dry_run: bool, others: tuple[AdapterRegistry, ...] = ()
    ) -> retention.Pruned:
        """Delete the adapters neither served, a canary, one of the previous `keep` of the
        stack, nor loaded anywhere (retention.py); with `dry_run`, only say which. Under
        the promotion locks: no promotion picks an adapter while it goes. `others`: the
        other policies' registries (policies.py), whose adapters are kept alike; their
        locks are taken too, always in the same order. This registry is the default
        policy's: a night that names no policy is its (each policy keeps its newest)."""
        async with contextlib.AsyncExitStack() as locks:
            states: list[dict] = []
            loaded = {n for r in self.balancer.replicas for n in r.served}
            for registry in (self, *others):
                await locks.enter_async_context(registry._lock)
                await locks.enter_async_context(registry.shared.locked())
                registry._adopt(await registry._io(registry.shared.read))
                states.append(await registry._io(registry.shared.read))
                loaded |= set(registry.in_flight) | {
                    n for names in registry.flight.marks.elsewhere().values() for n in names
                }
            data_dir = self.data_dir
            store = segment_store(data_dir)
            pruned = await asyncio.to_thread(
                retention.plan, data_dir, store, states, keep, loaded, self.alias
            )
            if not dry_run:
                await asyncio.to_thread(retention.delete, data_dir, store, pruned)
            return pruned

    # -- following: the other proxies, the replicas -----------------------------------

    async def restore(self) -> None:
        """After a (re)start: check the replicas, learn the base model, load the current
        adapter where it is missing, and start the watch and the follower. An unreachable
        vLLM is not fatal: the watch loads the adapter once it answers."""
        await self.check_upstream()  # the check and the sync under one lock, as always
        if self.check_interval > 0:
            self._tasks.append(asyncio.create_task(self._watch_upstream()))
        if self.follow_interval > 0:
            self._tasks.append(asyncio.create_task(self._follow_state()))

    def notice_missing(self, served: str) -> None:
        """A request routed to `served` got a 404 from vLLM: check now, not at the next tick.
        (Call from the relay; cheap and safe to call for any name.)"""
        if served in self._serving_names():
            self._wake.set()

    async def check_upstream(self) -> bool:
        """Check every replica; load the current adapter where it is missing. True when no
        replica served it any more and it was loaded again under a new name."""
        # Under the lock, with the sync: a promotion between the two would find its new
        # adapter missing from a list asked for before it was loaded, and "restore" it.
        async with self._lock:
            await self._check_replicas()
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

    # -- the replicas ------------------------------------------------------------------

    async def _check_replicas(self) -> None:
        """Health and served models of every replica; a replica is live only once it
        serves the current adapter (set here, before it can take traffic)."""
        # A replica asleep for a colocated night answers, but is not to be touched.
        awake = [r for r in self.balancer.replicas if not r.asleep]
        known = self.base_model
        for served in await check_replicas(self.lora, awake):
            self.base_model, self.base_model_path = base_model_of(
                served, self.base_model, self.base_model_path
            )
        if known is None and self.base_model is not None and self.on_base_model is not None:
            self.on_base_model()  # learned now: policies.py checks it against their names
        self._mark_synced()

    async def _sync(self, restore: bool = True) -> bool:
        """Load the current adapter and the canary on each healthy replica that lacks them
        (call under `_lock`, after `_check_replicas`). When none has the current adapter
        (vLLM restarted) and `restore`, load it under a new name and write that down: True."""
        current = self.current
        healthy = [r for r in self.balancer.replicas if r.healthy and not r.asleep]
        if not healthy:
            return False
        if restore and current is not None and not any(current.name in r.served for r in healthy):
            return await self._restore(current, healthy)
        for adapter in (current, self.canary):
            await self._load_missing(adapter)
        self._mark_synced()
        return False

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
