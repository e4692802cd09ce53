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
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import secrets
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from overnight.errors import OvernightError

from .balancer import Balancer, Replica
from .shared_state import StateFile

log = logging.getLogger("overnight.proxy")


class AdapterError(OvernightError):
    status = 400
    code = "adapter_error"


@dataclass(frozen=True)
class Adapter:
    name: str  # the name vLLM serves it under
    version: int
    path: str
    promoted_at: str
    reason: str = "promote"  # promote | rollback | restore


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
        self.headers = session_headers
        self.drain_timeout = drain_timeout
        self.base_model = base_model
        self.base_model_path: str | None = None
        self.stack: list[Adapter] = []  # promotions; the top serves the alias
        self.history: list[Adapter] = []  # every adapter ever loaded, oldest first
        self.version = 0  # of the shared state this proxy follows
        self.in_flight: Counter[str] = Counter()
        self._idle: dict[str, asyncio.Event] = {}
        self._lock = asyncio.Lock()  # one change of this proxy's state at a time
        self._drains: set[asyncio.Task] = set()
        self.session: aiohttp.ClientSession | None = None
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

    # -- routing (hot path) ------------------------------------------------------------

    @property
    def current(self) -> Adapter | None:
        return self.stack[-1] if self.stack else None

    def route(self, requested: str | None) -> Route:
        """Resolve the model name and count the request in flight on it."""
        if requested == self.alias:
            current = self.current
            if current is not None:
                route = Route(current.name, current.version)
            else:
                route = Route(self.base_model or requested, None)
        else:
            route = Route(requested or self.base_model or "", None)
        self.in_flight[route.served] += 1
        return route

    def release(self, route: Route) -> None:
        left = self.in_flight[route.served] - 1
        if left <= 0:
            del self.in_flight[route.served]
            idle = self._idle.get(route.served)
            if idle is not None:
                idle.set()
        else:
            self.in_flight[route.served] = left

    # -- administration ----------------------------------------------------------------

    async def promote(self, path: str, reason: str = "promote") -> Adapter:
        path = str(Path(path).expanduser().resolve())
        if not (Path(path) / "adapter_config.json").is_file():
            raise AdapterError(f"{path} is not a peft adapter directory (no adapter_config.json)")
        async with self._lock, self.shared.locked():
            self._adopt(self.shared.read())  # another proxy may have promoted meanwhile
            adapter = await self._load_everywhere(path, reason)
            self._switch([*self.stack, adapter])
            log.info("alias %s now serves %s (%s)", self.alias, adapter.name, path)
            return adapter

    async def rollback(self) -> Adapter | None:
        """Serve the previous adapter again (or the base model); returns what serves now."""
        async with self._lock, self.shared.locked():
            self._adopt(self.shared.read())
            if not self.stack:
                raise AdapterError("nothing to roll back: the alias already serves the base model")
            stack = self.stack[:-1]
            previous = stack.pop() if stack else None
            if previous is not None:
                stack.append(await self._load_everywhere(previous.path, "rollback"))
            self._switch(stack)
            now = self.current
            log.info("rolled back: alias now serves %s", now.name if now else "the base model")
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
        current = self.current
        if current is not None and current.name == served:
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
            old = self.current
            self._adopt(state)
            if self.current != old:
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
            "adapters": [asdict(a) for a in self.history],
            "in_flight": dict(self.in_flight),
            "state_version": self.version,
            "replicas": [r.describe() for r in self.balancer.replicas],
        }

    async def close(self) -> None:
        for task in [*self._tasks, *self._drains]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._drains, return_exceptions=True)
        self._tasks = []

    # -- the state, shared and local ---------------------------------------------------

    def _take(self, state: dict) -> None:
        self.history = [Adapter(**a) for a in state.get("adapters", [])]
        by_name = {a.name: a for a in self.history}
        self.stack = [by_name[n] for n in state.get("stack", []) if n in by_name]
        self.version = state.get("version", 0)

    def _adopt(self, state: dict) -> None:
        """Take the shared state; drain the adapter this proxy served if it changed."""
        if state.get("version", 0) == self.version:
            return
        old = self.current
        self._take(state)
        if old is not None and (self.current is None or self.current.name != old.name):
            self._start_drain(old)

    def _switch(self, stack: list[Adapter]) -> None:
        """Serve the top of `stack` (loaded on the replicas already) and write it down;
        call with the file lock held."""
        old = self.current
        self.stack = stack
        written = self.shared.write(
            {
                "alias": self.alias,
                "stack": [a.name for a in self.stack],
                "adapters": [asdict(a) for a in self.history],
            }
        )
        self.version = written["version"]
        self._stamp = self.shared.stamp()
        self._mark_synced()
        if old is not None and (self.current is None or self.current.name != old.name):
            self._start_drain(old)

    def _mark_synced(self) -> None:
        current = self.current
        for r in self.balancer.replicas:
            r.synced = current is None or current.name in r.served
        self.balancer.refresh()

    # -- the replicas ------------------------------------------------------------------

    async def _check_replicas(self) -> None:
        """Health and served models of every replica; a replica is live only once it
        serves the current adapter (set here, before it can take traffic)."""
        answers = await asyncio.gather(*(self._served_models(r) for r in self.balancer.replicas))
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
        """Load the current adapter on each healthy replica that lacks it (call under
        `_lock`, after `_check_replicas`). When none has it (vLLM restarted) and `restore`,
        load it under a new name and write that down: True."""
        current = self.current
        healthy = [r for r in self.balancer.replicas if r.healthy]
        if current is None or not healthy:
            return False
        if restore and not any(current.name in r.served for r in healthy):
            return await self._restore(current, healthy)
        missing = [r for r in healthy if current.name not in r.served]
        results = await asyncio.gather(
            *(self._load_on(r, current.name, current.path) for r in missing),
            return_exceptions=True,
        )
        for replica, result in zip(missing, results, strict=True):
            if isinstance(result, BaseException):
                log.error("replica %s stays out: %s", replica.url, result)
            else:
                log.warning("replica %s lacked %s (restarted?): loaded", replica.url, current.name)
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
            self._switch([*self.stack[:-1], adapter])
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
            *(self._load_on(r, name, path) for r in targets), return_exceptions=True
        )
        failed = [(r, e) for r, e in zip(targets, results, strict=True) if e is not None]
        if failed:
            loaded = [r for r, e in zip(targets, results, strict=True) if e is None]
            await asyncio.gather(*(self._unload_on(r, name) for r in loaded))
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

    async def _load_on(self, replica: Replica, name: str, path: str) -> None:
        status, text = await self._post(
            replica, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}
        )
        # Loaded already: by another proxy in front of the same replica, or by a first try
        # whose answer was lost. Names are never reused, so it is this adapter.
        if status != 200 and "already" not in text:
            raise AdapterError(
                f"vLLM refused to load {path} as {name} (HTTP {status}): {text[:500]}",
                status=502 if status >= 500 else 400,
            )
        replica.served.add(name)

    async def _unload_on(self, replica: Replica, name: str) -> None:
        """Unload, logging what fails (a 404: gone already, e.g. unloaded by another proxy)."""
        try:
            status, text = await self._post(replica, "/v1/unload_lora_adapter", {"lora_name": name})
        except AdapterError as e:
            log.warning("could not unload %s from %s: %s", name, replica.url, e)
            return
        replica.served.discard(name)
        if status == 200:
            log.info("unloaded %s from %s", name, replica.url)
        elif status != 404:
            log.warning("vLLM did not unload %s (HTTP %d): %s", name, status, text[:300])

    def _start_drain(self, old: Adapter) -> None:
        task = asyncio.create_task(self._drain_and_unload(old))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _drain_and_unload(self, old: Adapter) -> None:
        if self.in_flight.get(old.name):
            idle = self._idle.setdefault(old.name, asyncio.Event())
            try:
                await asyncio.wait_for(idle.wait(), self.drain_timeout)
            except TimeoutError:
                log.warning(
                    "%s still had %d request(s) after %.0f s; unloading anyway",
                    old.name,
                    self.in_flight.get(old.name, 0),
                    self.drain_timeout,
                )
            finally:
                self._idle.pop(old.name, None)
        # Other proxies on this data directory switch within `follow_interval`.
        await asyncio.sleep(2 * self.follow_interval)
        if self.current is not None and self.current.name == old.name:
            return  # serving again (a follower adopted an older state); keep it
        await asyncio.gather(*(self._unload_on(r, old.name) for r in self.balancer.replicas))

    async def _post(self, replica: Replica, path: str, payload: dict) -> tuple[int, str]:
        assert self.session is not None, "registry used before the app started"
        for attempt in (1, 2):
            try:
                async with self.session.post(
                    replica.url + path, json=payload, headers=self.headers
                ) as r:
                    return r.status, await r.text()
            except aiohttp.ServerDisconnectedError as e:
                # A pooled connection the server closed: once more on a new one
                # (docs/architecture.md; a load that did arrive answers "already loaded").
                if attempt == 2:
                    raise AdapterError(f"vLLM unreachable at {replica.url}: {e}", 502) from e
            except (aiohttp.ClientError, TimeoutError) as e:
                raise AdapterError(f"vLLM unreachable at {replica.url}: {e}", status=502) from e
        raise AssertionError("unreachable")

    async def _served_models(self, replica: Replica) -> list[dict] | None:
        """vLLM's /v1/models entries; None when it cannot be asked (down, restarting)."""
        assert self.session is not None
        try:
            async with self.session.get(
                replica.url + "/v1/models",
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=10),
            ) as r:
                if r.status == 200:
                    return (await r.json()).get("data", [])
                log.warning("listing the models of %s answered HTTP %d", replica.url, r.status)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.warning("could not list the models of %s: %s", replica.url, e)
        return None


def rollback_on_disk(state_path: Path) -> Adapter | None:
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
        state["stack"].pop()
        shared.write(state)
    by_name = {a["name"]: a for a in state.get("adapters", [])}
    current = by_name.get(state["stack"][-1]) if state["stack"] else None
    return Adapter(**current) if current else None
