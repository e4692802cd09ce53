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

One truth for every proxy: the state lives in DATA/adapters.json (state_file.py), or
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

Here: `AdapterRegistry`, the changes to what the alias serves, those asked of this proxy
(promote, rollback, a canary) and those it follows (another proxy's promotion, a replica
that came back, a vLLM that restarted). What it serves, routing by it, and how a change
is written down, switched and drained is serving.py's; loads on the replicas are
loading.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging

from overnight.proxy.forward.balancer import Replica
from overnight.storage.location import segment_store

from . import promotions, retention
from .bucket_state import StateUnreachable
from .lora_client import AdapterError
from .promotions import Adapter
from .replica_check import base_model_of, check_replicas
from .serving import Serving

log = logging.getLogger("overnight.proxy")


class AdapterRegistry(Serving):
    """The alias's adapters on every replica of this proxy, as every proxy agrees on them."""

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
