"""The stall watch's shared ticker (proxy/routes/relay.py): one loop timer for every open
watch, none while no watch is open, and a silent upstream still cut off.

The proxy-level behaviour (a 504 before the head, an error event mid-stream, a slow but
steady stream left alone) is in test_proxy_errors.py; these look at the ticker itself.
"""

from __future__ import annotations

import asyncio

from overnight.proxy.routes.relay import _TICKERS, StallWatch, silence


class FakeUpstream:
    complete = False

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


async def test_open_watches_share_one_timer_and_an_idle_loop_has_none():
    watches = [StallWatch(FakeUpstream(), 60.0) for _ in range(50)]
    ticker = _TICKERS[asyncio.get_running_loop()]
    assert ticker.watches == set(watches)
    assert ticker.handle is not None  # one handle for all fifty
    for watch in watches:
        watch.cancel()
    assert not ticker.watches
    # A short watch makes the ticker tick sooner; once it has gone, the ticker stops.
    short = StallWatch(FakeUpstream(), 0.08)
    short.cancel()
    await asyncio.sleep(0.05)  # more than one tick (0.08 / 8)
    assert ticker.handle is None
    assert not any(w.stalled for w in watches)


async def test_a_silent_upstream_is_closed_and_a_touched_one_is_not():
    silent, touched = FakeUpstream(), FakeUpstream()
    silent_watch = StallWatch(silent, 0.1)
    touched_watch = StallWatch(touched, 0.1)
    for _ in range(10):  # 0.3 s in all, touched every 0.03 s
        await asyncio.sleep(0.03)
        touched_watch.touch()
    assert silent.closed and silent_watch.stalled
    assert silent_watch.describe(TimeoutError()) == silence(0.1)
    assert not touched.closed and not touched_watch.stalled
    ticker = _TICKERS[asyncio.get_running_loop()]
    assert silent_watch not in ticker.watches  # a watch fires once, then is let go
    touched_watch.cancel()
    assert not ticker.watches


async def test_a_head_that_never_comes_is_a_timeout():
    watch = StallWatch(None, 0.1)
    never = asyncio.get_running_loop().create_future()
    try:
        await watch.head(never)
    except TimeoutError:
        pass
    else:
        raise AssertionError("the head's wait was not cut off")
    assert watch.stalled
    watch.cancel()


async def test_a_client_that_leaves_while_the_head_is_awaited_is_not_a_timeout():
    watch = StallWatch(None, 60.0)
    task = asyncio.ensure_future(watch.head(asyncio.get_running_loop().create_future()))
    await asyncio.sleep(0)
    task.cancel()  # what aiohttp does to a handler whose client left
    try:
        await task
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("the cancel was swallowed")
    assert not watch.stalled
    watch.cancel()
