"""Requests in flight per adapter name, on this proxy and, for replaced adapters, on the others.

The registry (registry.py) counts every routed request here. When an adapter is
replaced, it is unloaded only after this proxy's requests on it finished (or the drain
timeout) and after no other proxy on the data directory still reports requests on it
(`Marks`: alias/state_file.DrainMarks, passed in by the registry, which sits above): a
request another proxy routed to it just before that proxy saw the promotion must not
lose its adapter mid-answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path
from typing import Protocol

log = logging.getLogger("overnight.proxy")


class Marks(Protocol):
    """Where each proxy says which replaced adapters it still has requests on."""

    path: Path

    def publish(self, names: set[str]) -> None: ...

    def elsewhere(self) -> dict[str, list[str]]: ...


class InFlight:
    def __init__(self, marks: Marks):
        self.counts: Counter[str] = Counter()
        self.marks = marks
        self._idle: dict[str, asyncio.Event] = {}
        self._draining: set[str] = set()  # replaced names this proxy still has requests on

    def add(self, name: str) -> None:
        self.counts[name] += 1

    def done(self, name: str) -> None:
        left = self.counts[name] - 1
        if left > 0:
            self.counts[name] = left
            return
        del self.counts[name]
        idle = self._idle.get(name)
        if idle is not None:
            idle.set()
        if name in self._draining:
            self._draining.discard(name)
            self._publish()

    def replaced(self, name: str) -> None:
        """`name` no longer takes new requests here: tell the other proxies while this one
        still has requests on it, so that they do not unload it under them."""
        if self.counts.get(name):
            self._draining.add(name)
            self._publish()

    async def drained(self, name: str, timeout: float) -> None:
        """Until this proxy has no request in flight on `name`, or `timeout` seconds."""
        if not self.counts.get(name):
            return
        idle = self._idle.setdefault(name, asyncio.Event())
        try:
            await asyncio.wait_for(idle.wait(), timeout)
        except TimeoutError:
            log.warning(
                "%s still had %d request(s) after %.0f s; unloading anyway",
                name,
                self.counts.get(name, 0),
                timeout,
            )
        finally:
            self._idle.pop(name, None)
            if name in self._draining:
                self._draining.discard(name)
                self._publish()

    async def elsewhere_drained(self, name: str, timeout: float, tick: float) -> None:
        """Until no other proxy reports requests in flight on `name`, or `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while proxies := self.marks.elsewhere().get(name):
            if loop.time() >= deadline:
                log.warning(
                    "%s: proxies %s still report requests on it after %.0f s; unloading anyway",
                    name,
                    ", ".join(proxies),
                    timeout,
                )
                return
            await asyncio.sleep(tick)

    def close(self) -> None:
        self._draining.clear()
        self._publish()

    def _publish(self) -> None:
        try:
            self.marks.publish(self._draining)
        except OSError as e:  # the others then wait only for the poll interval, as before
            log.warning("could not write %s: %s", self.marks.path, e)
