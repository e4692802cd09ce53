"""What this proxy serves under the alias, and the one way that changes: written down first.

`Serving` holds this proxy's copy of the promotion state (the stack, the canary and its
share, every adapter loaded, the events) and routes each request by it (`route`, the hot
path). A change is loaded on the replicas before it is written to the shared state
(`_load_everywhere`, all or none), and served only once written (`_switch`, in one step
on the event loop: a request routed before it finishes on the old adapter). What no
longer serves is drained, then unloaded (`_retire`). The registry (registry.py) builds
its promotions, rollbacks and the following of other proxies on these.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from overnight.errors import ConfigError
from overnight.proxy.forward.balancer import Balancer, Replica

from . import loading, promotions
from .bucket_state import AdapterFiles
from .in_flight import InFlight
from .lora_client import LoraClient
from .promotions import EVENTS_KEPT, Adapter, Route, in_canary, open_state
from .state_file import DrainMarks


class Serving:
    """The registry's state, all of it set here, and the steps every change takes."""

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
        # Seconds between looks at the shared state; 0: follow nobody. Another proxy
        # switches within this, so an old adapter is unloaded no sooner than twice it
        # after this proxy stopped routing to it.
        self.follow_interval = follow_interval
        self._tasks: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        # The registries sharing these replicas (one per policy, policies.py): a replica
        # is live only once it serves what each of them serves.
        self.siblings: list[Serving] = [self]
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
        # A random tail: vLLM serves stale weights for a name it loaded before, even after
        # an unload (seen when a new proxy reused "policy-v1" against a running vLLM), and
        # a proxy cannot know every name a vLLM it did not start has seen.
        name = f"{self.alias}-v{version}-{secrets.token_hex(3)}"
        replicas = self.balancer.replicas
        targets = targets or [r for r in replicas if r.healthy and not r.asleep] or list(replicas)
        await loading.load_on_all(self.lora, targets, name, load, path)
        now = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
        adapter = Adapter(name, version, path, now, reason, source)
        self.history.append(adapter)
        return adapter

    async def _load_missing(self, adapter: Adapter | None) -> None:
        """Load `adapter` under its name on each healthy replica that lacks it."""
        await loading.load_missing(self.lora, self.files, self.balancer.replicas, adapter)

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
