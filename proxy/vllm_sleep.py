"""The maintenance window of a colocated night: vLLM asleep while the trainer uses its GPU.

One card serves by day and trains by night (docs/deployment.md). The night asks the
proxy, through its admin API, to begin: generating requests in flight finish (up to
`drain` seconds), vLLM sleeps (`POST /sleep?level=1`: weights to CPU memory, the KV
cache freed), and the night trains. Meanwhile a generating request is held up to
`hold` seconds, then answered 503 with `Retry-After` (recorded as such): vLLM asleep
never answers, so nothing may reach it. The night ends the window: vLLM wakes, the
adapters it served are loaded again where missing, held requests go on.

With several replicas only one sleeps at a time, taken out of rotation: the others
serve and nothing is held.

Never stuck asleep: the window is a lease the night renews. One whose holder stopped
renewing (a night killed at any stage) expires, and the proxy wakes vLLM itself; so
does a replica found asleep with no window open (`recover`).

vLLM's sleep routes exist only with `VLLM_SERVER_DEV_MODE=1` (the launcher sets it when
sleep is asked for; on a GPU also `--enable-sleep-mode`); the pass-through allowlist
(forward/paths.py) keeps clients away from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from overnight.errors import OvernightError
from overnight.proxy.forward.balancer import Balancer, Replica

log = logging.getLogger("overnight.proxy")

# How often the lease and the replicas' sleep are looked at.
WATCH_SECONDS = 1.0


class Unavailable(OvernightError):
    """A generating request that waited out the hold: the client is told when to retry."""

    status = 503
    code = "maintenance"

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Window:
    holder: str
    lease_seconds: float
    expires: float  # time.monotonic()
    began_at: float = field(default_factory=time.time)
    asleep: list[str] = field(default_factory=list)  # replica URLs put to sleep
    # ... and those it is putting to sleep, from the moment it opens: a request that came
    # while they drain or fall asleep must wait too, not reach a vLLM going to sleep.
    sleepers: list[str] = field(default_factory=list)
    held: int = 0  # requests that waited for the window to end
    refused: int = 0  # ... and those answered 503 after the hold

    def describe(self) -> dict:
        return {
            "holder": self.holder,
            "lease_seconds": self.lease_seconds,
            "expires_in": round(self.expires - time.monotonic(), 1),
            "began_at": self.began_at,
            "asleep": self.asleep,
            "held": self.held,
            "refused": self.refused,
        }


class Maintenance:
    def __init__(
        self,
        balancer: Balancer,
        headers: dict[str, str],
        *,
        hold: float,
        drain: float,
        after_wake: Callable[[], Awaitable[None]] | None = None,
        workers: int = 1,
    ):
        self.balancer = balancer
        self.headers = headers
        self.hold = hold
        self.drain = drain
        self.after_wake = after_wake  # the registry loads what vLLM lost while asleep
        self.workers = workers  # several proxy processes: none could hold for the others
        self.session: aiohttp.ClientSession | None = None  # set once the app runs
        self.window: Window | None = None
        self.in_flight = 0  # generating requests admitted and not finished
        self._ended = asyncio.Event()
        self._ended.set()
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task | None = None
        self.last: dict | None = None  # the last window, as it ended

    # -- requests --------------------------------------------------------------------

    def serving(self) -> _Serving:
        """Around a generating request (`async with`): held while the only replicas
        sleep, refused 503 after `hold` seconds, counted in flight otherwise."""
        return _Serving(self)

    def _some_awake(self) -> bool:
        window = self.window
        return window is not None and any(
            r.url not in window.sleepers for r in self.balancer.replicas
        )

    async def _wait_out(self) -> None:
        window = self.window
        if window is not None:
            window.held += 1
        try:
            await asyncio.wait_for(self._ended.wait(), self.hold)
        except TimeoutError:
            if window is not None:
                window.refused += 1
            left = max(1, round(window.expires - time.monotonic())) if window else 1
            raise Unavailable(
                f"the model is asleep while tonight's training runs (held {self.hold:g} s); "
                f"retry after {left} s",
                retry_after=left,
            ) from None

    # -- the window ------------------------------------------------------------------

    async def begin(self, holder: str, lease_seconds: float) -> dict:
        """Drain, put vLLM to sleep (one replica of several), and hold the lease."""
        if self.workers > 1:
            raise OvernightError(
                f"this proxy runs {self.workers} worker processes, and each would hold "
                "requests on its own: a colocated night needs `overnight serve --workers 1`",
                status=409,
                code="maintenance_workers",
            )
        async with self._lock:
            if self.window is not None:
                if self.window.holder != holder:
                    raise OvernightError(
                        f"a maintenance window is held by {self.window.holder}",
                        status=409,
                        code="maintenance_held",
                    )
                return self._renew(lease_seconds)
            window = Window(holder, lease_seconds, time.monotonic() + lease_seconds)
            sleepers = self.balancer.replicas[:1]  # several: the rest keep serving
            window.sleepers = [r.url for r in sleepers]
            self.window = window
            if len(self.balancer.replicas) == 1:
                self._ended.clear()  # new requests wait from now on
            await self._drain(sleepers)
            try:
                for replica in sleepers:
                    await self._call(replica, "POST", "/sleep?level=1")
                    window.asleep.append(replica.url)
                    replica.asleep = True
                self.balancer.refresh()
            except BaseException:
                await self._wake()
                raise
            log.info("maintenance: %s asleep for %s", ", ".join(window.asleep), holder)
            self._start_watch()
            return window.describe()

    def renew(self, holder: str, lease_seconds: float) -> dict:
        if self.window is None or self.window.holder != holder:
            raise OvernightError(
                "no maintenance window is held by " + holder, status=409, code="no_window"
            )
        return self._renew(lease_seconds)

    def _renew(self, lease_seconds: float) -> dict:
        assert self.window is not None
        self.window.lease_seconds = lease_seconds
        self.window.expires = time.monotonic() + lease_seconds
        return self.window.describe()

    async def end(self, holder: str | None) -> dict:
        """Wake vLLM, load what it lost, let held requests go on; the window's figures.
        `holder` None: the proxy's own decision (a lease that expired)."""
        async with self._lock:
            window = self.window
            if window is None:
                return {"state": "serving", "last": self.last}
            if holder is not None and holder != window.holder:
                raise OvernightError(
                    f"the maintenance window is held by {window.holder}",
                    status=409,
                    code="maintenance_held",
                )
            await self._wake()
            return {"state": "serving", "last": self.last}

    async def _wake(self) -> None:
        window = self.window
        assert window is not None
        for replica in self.balancer.replicas:
            if replica.url in window.asleep:
                await self._wake_replica(replica)
        if self.after_wake is not None:
            try:
                await self.after_wake()
            except Exception:
                log.exception("maintenance: could not load the adapters again after waking")
        self.last = {**window.describe(), "seconds": round(time.time() - window.began_at, 3)}
        self.window = None
        self.balancer.refresh()
        self._ended.set()
        log.info("maintenance: awake after %.1f s", self.last["seconds"])

    async def _wake_replica(self, replica: Replica) -> None:
        # Weights first, then the KV cache: on a GPU the cache is allocated into what the
        # weights left free, as vLLM's own colocated trainers wake it.
        await self._call(replica, "POST", "/wake_up?tags=weights")
        await self._call(replica, "POST", "/wake_up?tags=kv_cache")
        replica.asleep = False

    async def _drain(self, sleepers: list[Replica]) -> None:
        """Wait for the requests in flight on `sleepers` (all of them with one replica)."""
        deadline = time.monotonic() + self.drain
        while time.monotonic() < deadline:
            busy = sum(r.outstanding for r in sleepers)
            if len(self.balancer.replicas) == 1:
                busy = max(busy, self.in_flight)
            if not busy:
                return
            await asyncio.sleep(0.05)
        log.warning("maintenance: %d request(s) still in flight after %.0f s", busy, self.drain)

    # -- never stuck asleep ----------------------------------------------------------

    def _start_watch(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.create_task(self._watch_lease())

    async def _watch_lease(self) -> None:
        while self.window is not None:
            await asyncio.sleep(WATCH_SECONDS)
            window = self.window
            if window is not None and time.monotonic() > window.expires:
                log.warning("maintenance: %s stopped renewing its lease: waking", window.holder)
                await self.end(None)

    async def recover(self) -> None:
        """Wake a replica found asleep with no window open (a proxy restarted during a
        night, or a sleep asked of vLLM by someone else)."""
        if self.window is not None:
            return
        for replica in self.balancer.replicas:
            answer = await self._call(replica, "GET", "/is_sleeping", quiet=True)
            if answer and answer.get("is_sleeping"):
                log.warning("maintenance: %s asleep with no night holding it: waking", replica.url)
                await self._wake_replica(replica)
                if self.after_wake is not None:
                    await self.after_wake()

    def describe(self) -> dict:
        state = "serving" if self.window is None else "maintenance"
        return {
            "state": state,
            "window": self.window.describe() if self.window else None,
            "last": self.last,
            "hold_seconds": self.hold,
        }

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch

    async def _call(self, replica: Replica, method: str, path: str, quiet: bool = False):
        assert self.session is not None, "maintenance used before the app started"
        try:
            async with self.session.request(
                method, replica.url + path, headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=120),
            ) as r:  # fmt: skip
                if r.status == 404 and quiet:
                    return None  # no dev-mode routes: nothing can be asleep
                if r.status != 200:
                    raise OvernightError(
                        f"vLLM at {replica.url} answered {r.status} to {path}: "
                        f"{(await r.text())[:300]} (sleep needs VLLM_SERVER_DEV_MODE=1; "
                        "`overnight serve --model` sets it with --sleep-mode)",
                        status=502,
                        code="sleep_failed",
                    )
                return await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as e:
            if quiet:
                return None
            raise OvernightError(
                f"vLLM unreachable at {replica.url} for {path}: {e}", status=502
            ) from e


class _Serving:
    """`Maintenance.serving()`: a plain async context manager, not a generator one, since
    every completion enters it (contextlib's costs a generator and two frames each)."""

    __slots__ = ("maintenance",)

    def __init__(self, maintenance: Maintenance):
        self.maintenance = maintenance

    async def __aenter__(self) -> None:
        m = self.maintenance
        if not m._ended.is_set() and not m._some_awake():
            await m._wait_out()
        m.in_flight += 1

    async def __aexit__(self, *exc_info) -> None:
        self.maintenance.in_flight -= 1
