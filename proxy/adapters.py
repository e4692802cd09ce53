"""The alias and the adapters behind it: promote, drain, unload, roll back.

Agents ask for a stable alias (default `policy`). Before the first promotion it
means the base model; after, the adapter on top of the promotion stack. vLLM caches
adapters by name, so reloading new weights under an old name is unsafe: every
promotion loads under a fresh versioned name (`policy-v7`), switches the alias in one
step on the event loop (a request routed before the switch finishes on the old
adapter), then unloads the old adapter once its in-flight requests have drained.

State survives restarts in `adapters.json` (written atomically). A restarted vLLM
has no adapters: `restore` loads the current one again under a new name at the
proxy's start, and a watch does the same whenever vLLM stops listing it while the
proxy runs (vLLM restarted under it): every `check_interval` seconds, or at once when
a request for the alias was answered 404 (`notice_missing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import secrets
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from overnight.errors import OvernightError

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
        upstream: str,
        session_headers: dict[str, str],
        drain_timeout: float,
        base_model: str | None = None,
        check_interval: float = 10.0,
    ):
        self.alias = alias
        self.state_path = state_path
        self.upstream = upstream
        self.headers = session_headers
        self.drain_timeout = drain_timeout
        self.base_model = base_model
        self.base_model_path: str | None = None
        self.stack: list[Adapter] = []  # promotions; the top serves the alias
        self.history: list[Adapter] = []  # every adapter ever loaded, oldest first
        self.in_flight: Counter[str] = Counter()
        self._idle: dict[str, asyncio.Event] = {}
        self._lock = asyncio.Lock()
        self._drains: set[asyncio.Task] = set()
        self.session: aiohttp.ClientSession | None = None
        # Seconds between checks that vLLM still serves the current adapter; 0: no watch.
        self.check_interval = check_interval
        self._watch: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._load_state()

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
        async with self._lock:
            adapter = await self._load(path, reason)
            old = self.current
            self.stack.append(adapter)
            self._save_state()
            if old is not None:
                self._start_drain(old)
            log.info("alias %s now serves %s (%s)", self.alias, adapter.name, path)
            return adapter

    async def rollback(self) -> Adapter | None:
        """Serve the previous adapter again (or the base model); returns what serves now."""
        async with self._lock:
            if not self.stack:
                raise AdapterError("nothing to roll back: the alias already serves the base model")
            old = self.stack.pop()
            previous = self.stack.pop() if self.stack else None
            if previous is not None:
                self.stack.append(await self._load(previous.path, "rollback"))
            self._save_state()
            self._start_drain(old)
            now = self.current
            log.info("rolled back %s: alias now serves %s", old.name, now.name if now else "base")
            return now

    async def restore(self) -> None:
        """After a (re)start: learn the base model, reload the current adapter, and
        start watching for a vLLM restart. An unreachable vLLM is not fatal: the watch
        loads the adapter once vLLM answers."""
        served = await self._served_models()
        bases = [m for m in served or [] if not m.get("parent")]
        if self.base_model is None and bases:
            self.base_model = bases[0]["id"]
        # Where vLLM loaded the base from: what a trainer must load too.
        self.base_model_path = next(
            (m.get("root") for m in bases if m["id"] == self.base_model), None
        )
        if served is not None:
            await self._reload_if_missing(served)
        if self.check_interval > 0 and self._watch is None:
            self._watch = asyncio.create_task(self._watch_upstream())

    def notice_missing(self, served: str) -> None:
        """A request routed to `served` got a 404 from vLLM: check now, not at the next tick.
        (Call from the relay; cheap and safe to call for any name.)"""
        current = self.current
        if current is not None and current.name == served:
            self._wake.set()

    async def check_upstream(self) -> bool:
        """Does vLLM still serve the current adapter? If not (restarted), load it again
        under a new name and serve that. True when it reloaded."""
        served = await self._served_models()
        return served is not None and await self._reload_if_missing(served)

    async def _reload_if_missing(self, served: list[dict]) -> bool:
        current = self.current
        if current is None or current.name in {m.get("id") for m in served}:
            return False
        async with self._lock:
            if self.current is not current:
                return False  # promoted or rolled back meanwhile: that loaded what serves
            self.stack[-1] = await self._load(current.path, "restore")
            self._save_state()
        log.warning(
            "vLLM no longer served %s (restarted?): loaded %s again as %s",
            current.name,
            current.path,
            self.stack[-1].name,
        )
        return True

    async def _watch_upstream(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):  # a tick, or woken by notice_missing
                await asyncio.wait_for(self._wake.wait(), self.check_interval)
            self._wake.clear()
            try:
                await self.check_upstream()
            except AdapterError as e:  # vLLM came back but refused: say so, try again later
                log.error("could not load the promoted adapter again: %s", e)
            except Exception:  # the watch must outlive any surprise
                log.exception("checking the upstream's adapters failed")

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
        }

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None
        for task in list(self._drains):
            task.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)

    # -- talking to vLLM ---------------------------------------------------------------

    def _next_version(self) -> int:
        return max((a.version for a in self.history), default=0) + 1

    async def _load(self, path: str, reason: str) -> Adapter:
        version = self._next_version()
        # A random tail: vLLM serves stale weights for a name it loaded before, even after
        # an unload (seen when a new proxy reused "policy-v1" against a running vLLM), and
        # a proxy cannot know every name a vLLM it did not start has seen.
        name = f"{self.alias}-v{version}-{secrets.token_hex(3)}"
        status, text = await self._post(
            "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}
        )
        if status != 200:
            raise AdapterError(
                f"vLLM refused to load {path} as {name} (HTTP {status}): {text[:500]}",
                status=502 if status >= 500 else 400,
            )
        now = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
        adapter = Adapter(name=name, version=version, path=path, promoted_at=now, reason=reason)
        self.history.append(adapter)
        return adapter

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
        if self.current is not None and self.current.name == old.name:
            return  # serving again; cannot happen today (names are never reused), kept as a guard
        status, text = await self._post("/v1/unload_lora_adapter", {"lora_name": old.name})
        if status != 200:
            log.warning("vLLM did not unload %s (HTTP %d): %s", old.name, status, text[:300])
        else:
            log.info("unloaded %s", old.name)

    async def _post(self, path: str, payload: dict) -> tuple[int, str]:
        assert self.session is not None, "registry used before the app started"
        try:
            async with self.session.post(
                self.upstream + path, json=payload, headers=self.headers
            ) as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise AdapterError(f"vLLM unreachable at {self.upstream}: {e}", status=502) from e

    async def _served_models(self) -> list[dict] | None:
        """vLLM's /v1/models entries; None when it cannot be asked (down, restarting)."""
        assert self.session is not None
        try:
            async with self.session.get(
                self.upstream + "/v1/models",
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=10),
            ) as r:
                if r.status == 200:
                    return (await r.json()).get("data", [])
                log.warning("listing the upstream's models answered HTTP %d", r.status)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.warning("could not list upstream models: %s", e)
        return None

    # -- state on disk -----------------------------------------------------------------

    def _load_state(self) -> None:
        if not self.state_path.exists():
            return
        state = json.loads(self.state_path.read_text())
        self.history = [Adapter(**a) for a in state.get("adapters", [])]
        by_name = {a.name: a for a in self.history}
        self.stack = [by_name[n] for n in state.get("stack", []) if n in by_name]

    def _save_state(self) -> None:
        state = {
            "alias": self.alias,
            "stack": [a.name for a in self.stack],
            "adapters": [asdict(a) for a in self.history],
        }
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.state_path)


def rollback_on_disk(state_path: Path) -> Adapter | None:
    """The rollback for when no proxy runs on this data directory: drop the newest
    promotion from `adapters.json`, so the next `overnight serve` restores the one
    before it (or serves the base model). Returns what will serve."""
    if not state_path.exists():
        raise AdapterError("nothing to roll back: no adapter was ever promoted here")
    state = json.loads(state_path.read_text())
    if not state.get("stack"):
        raise AdapterError("nothing to roll back: the alias already serves the base model")
    state["stack"].pop()
    tmp = state_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, state_path)
    by_name = {a["name"]: a for a in state.get("adapters", [])}
    current = by_name.get(state["stack"][-1]) if state["stack"] else None
    return Adapter(**current) if current else None
