"""Forwarding: send a request upstream and relay the answer to the client as it comes.

Completions go through the proxy's own client (upstream.py) and are teed into the
request's Capture: a whole answer is read, recorded and passed on as vLLM's bytes (what
the proxy added nulled in place, capture/additions.py); a stream is relayed event by
event (capture/events.py), the events the proxy need not change as the exact upstream
bytes. Where a request goes, what is hidden and which relay: the Capture's shape
(capture/shapes.py), one per API family. A request vLLM refuses with the proxy's
additions is sent again as the client sent it.
Everything else under /v1 passes through aiohttp's client untouched. A `StallWatch`
cuts off an upstream that goes silent; every failure becomes an OpenAI-shaped error,
or, once a stream has started, an error event in the stream.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable

import aiohttp
import orjson
from aiohttp import web

from overnight.errors import OvernightError
from overnight.proxy.capture.captures import Capture
from overnight.proxy.capture.events import learn_fingerprint
from overnight.proxy.capture.shapes import Added
from overnight.proxy.capture.uncaptured import note_passthrough
from overnight.proxy.forward.jsonio import json_dumps
from overnight.proxy.forward.paths import check_forwarded
from overnight.proxy.forward.sse import encode_event
from overnight.proxy.forward.upstream import UpstreamResponse
from overnight.proxy.observe.tracing import TRACING, sent_to
from overnight.proxy.state import CONFIG, FINGERPRINT, SESSION, UPSTREAM

from .hosted import UPSTREAM_AUTH

# Headers that describe one hop, not the message; never forwarded either way.
# accept-encoding included: the proxy reads the answers, so it asks for them uncompressed.
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "authorization",
    "accept-encoding",
    "content-encoding",
}
Upstream = aiohttp.ClientResponse | UpstreamResponse


class UpstreamError(OvernightError):
    status = 502
    code = "upstream_unavailable"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class _ClientLeft(Exception):
    """The client closed its connection before the whole answer was written."""


CLIENT_LEFT = "client disconnected mid-stream"
CLIENT_LEFT_EARLY = "client disconnected before the answer"


def _refused(body: bytes) -> str:
    try:
        message = orjson.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")
    return f"vLLM refused the proxy's additions ({str(message)[:200]}); sent as the client sent it"


def silence(timeout: float) -> str:
    return f"upstream sent nothing for {timeout:g} s"


def upstream_headers(request: web.Request, hop=None) -> dict[str, str]:
    """The client's headers as upstream gets them: ours and the hop's removed, the key
    the operator chose in (hosted.py: configured, the client's own, or `hop`'s: handover.py)."""
    auth = request.app[UPSTREAM_AUTH] if hop is None else hop.auth
    withheld = auth.withheld  # the proxy's own key; hosted: the client's credentials too
    headers = {
        k: v
        for k, v in request.headers.items()
        if (name := k.lower()) not in HOP_BY_HOP
        and name not in withheld
        and not name.startswith("x-rollout-")
    }
    auth.add(headers, request.headers)
    return headers


def client_headers(upstream: Upstream) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}


# -- completions -----------------------------------------------------------------------


async def forward(
    request: web.Request,
    body: dict,
    added: Added,
    capture: Capture,
    affinity: str | None = None,
    raw: bytes | None = None,
    hop=None,
) -> web.StreamResponse:
    """POST `body` upstream and relay the answer, whole or streamed, into `capture`.
    Requests with the same `affinity` (a rollout's id) go to the same replica. `raw`:
    `body`'s own bytes, sent as they are (a hosted upstream, or `hop`: handover.py).
    Where it goes, what is hidden and how its stream is relayed: the capture's shape."""
    app, shape = request.app, capture.shape
    config = app[CONFIG]
    headers = upstream_headers(request, hop)
    headers["Content-Type"] = "application/json"
    if capture.span is not None:  # vLLM's spans nest under the proxy's (observe/tracing.py)
        app[TRACING].forwarded(capture, headers)
    sent = body
    watch = StallWatch(None, config.read_timeout)  # from now to the answer's last byte
    capture.sent()  # where the upstream's part of the time begins (observe/metrics.py)
    try:
        while True:  # twice at most: a request refused with the proxy's additions
            try:
                data = raw if raw is not None and sent is body else json_dumps(sent)
                upstream = await watch.head(
                    (hop or app[UPSTREAM]).post(shape.path, data, headers, affinity)
                )
            except (aiohttp.ClientError, TimeoutError) as e:
                # The record says what the client was told.
                if isinstance(e, TimeoutError):
                    error: UpstreamError = UpstreamTimeout(silence(config.read_timeout))
                else:
                    where = config.upstream if hop is None else hop.url  # the one asked
                    error = UpstreamError(f"upstream {where} unreachable: {e}")
                capture.fail(error.status, str(error))
                raise error from e
            if upstream.status != 400 or added.plain is None or not added.any:
                break
            # vLLM refused the request with what the proxy added (a gpt-oss model takes
            # no Responses logprobs; a validation the additions change): the client's own
            # request is sent instead, and vLLM's answer to it relayed as it comes.
            async with upstream:
                refusal = await upstream.read()
            capture.sent_plain(f"no token ids: {_refused(refusal)}")
            sent = added.plain
            added = shape.nothing_added()
        if sent is not body and upstream.status != 400:
            shape.additions_refused(app, body)  # Responses: asked plainly from now on
        async with upstream:
            capture.first_byte()
            sent_to(capture, upstream)
            capture.status = upstream.status
            content_type = upstream.headers.get("Content-Type", "")
            if upstream.status == 200 and "text/event-stream" in content_type:
                return await _relay_stream(request, upstream, added, capture, watch)
            return await _relay_whole(request, upstream, added, capture, watch)
    finally:
        watch.cancel()


class StallWatch:
    """Cuts off an upstream that sends nothing for `timeout` seconds: before the head of
    its answer (the request fails as a timeout), and between the chunks of its body (the
    response is closed: the pending read fails, which the relays report like any broken
    upstream, naming the stall).

    aiohttp's own `sock_read` timeout re-arms a timer on every chunk, which cost 9% of
    the proxy's throughput; here a chunk only notes the time. No timer of its own
    either: under uvloop a timer is a libuv handle made and closed per request, ~5 µs of
    the proxy's core (py-spy, c16); a watch joins its loop's one `_Ticker` instead, and
    leaves it when the exchange ends (or when it fires). A stall is therefore noticed
    up to one tick late: within `timeout` x 9/8, and never more than 1 s late.
    """

    def __init__(self, upstream: Upstream | None, timeout: float):
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.upstream = upstream
        self.task: asyncio.Task | None = None  # waiting for the head
        self.timeout = timeout
        self.last = loop.time()
        self.stalled = False
        self.ticker = _TICKERS.get(loop) or _ticker_of(loop)
        self.ticker.add(self)

    async def head(self, pending: Awaitable[UpstreamResponse]) -> UpstreamResponse:
        """The answer's head, or TimeoutError after `timeout` without it; then its body
        is watched (not at all when it came whole with the head)."""
        self.task, self.upstream = asyncio.current_task(), None
        self.touch()
        try:
            upstream = await pending
        except asyncio.CancelledError:
            if self.stalled and self.task is not None and self.task.uncancel() == 0:
                raise TimeoutError from None  # our cancel, not the client's leaving
            raise
        finally:
            self.task = None
        self.upstream = upstream
        if upstream.complete:
            self.cancel()
        return upstream

    def touch(self) -> None:
        self.last = self.loop.time()

    def fire(self) -> None:
        """Silent for `timeout` (the ticker has already let go of this watch)."""
        self.stalled = True
        if self.upstream is not None:
            self.upstream.close()
        elif self.task is not None:
            self.task.cancel()

    def cancel(self) -> None:
        self.ticker.watches.discard(self)

    def describe(self, e: BaseException) -> str:
        return silence(self.timeout) if self.stalled else repr(e)


class _Ticker:
    """One loop timer for all of a loop's `StallWatch`es: every tick it fires those
    silent for their timeout. It runs only while some watch is open, and ticks at an
    eighth of the shortest timeout it has watched (at most each second), so that an
    idle proxy is never woken and a busy one pays one timer per tick, not per request."""

    def __init__(self) -> None:
        # No reference to its loop: _TICKERS holds loops weakly, as keys of their tickers.
        self.watches: set[StallWatch] = set()
        self.interval = MAX_TICK_S
        self.handle: asyncio.TimerHandle | None = None

    def add(self, watch: StallWatch) -> None:
        self.watches.add(watch)
        if watch.timeout < self.interval * TICKS_PER_TIMEOUT:
            self.interval = watch.timeout / TICKS_PER_TIMEOUT
            if self.handle is not None:  # due later than the new interval allows: sooner
                self.handle.cancel()
                self.handle = None
        if self.handle is None:
            self.handle = watch.loop.call_later(self.interval, self._tick)

    def _tick(self) -> None:
        self.handle = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        silent = [w for w in self.watches if now >= w.last + w.timeout]
        for watch in silent:
            self.watches.discard(watch)
            watch.fire()
        if self.watches:
            self.handle = loop.call_later(self.interval, self._tick)


TICKS_PER_TIMEOUT = 8
MAX_TICK_S = 1.0
_TICKERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Ticker] = (
    weakref.WeakKeyDictionary()
)


def _ticker_of(loop: asyncio.AbstractEventLoop) -> _Ticker:
    ticker = _TICKERS[loop] = _Ticker()
    return ticker


async def _relay_whole(
    request: web.Request,
    upstream: UpstreamResponse,
    added: Added,
    capture: Capture,
    watch: StallWatch,
) -> web.Response:
    try:
        raw = await upstream.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        error = f"upstream failed while sending its answer: {watch.describe(e)}"
        capture.fail(504 if watch.stalled else None, error)
        if watch.stalled:
            raise UpstreamTimeout(error) from e
        raise UpstreamError(error) from e
    capture.done()
    headers = client_headers(upstream)
    if upstream.status != 200:
        capture.error = f"upstream HTTP {upstream.status}"
        capture.error_body = raw.decode(errors="replace")[:4096]
        return web.Response(body=raw, status=upstream.status, headers=headers)
    try:
        obj = orjson.loads(raw)
    except ValueError:
        capture.error = "upstream answered 200 with a body that is not JSON"
        capture.error_body = raw.decode(errors="replace")[:4096]
        return web.Response(body=raw, status=upstream.status, headers=headers)
    capture.add(raw, obj)
    learn_fingerprint(request.app[FINGERPRINT], obj)
    if added.any:  # without what the proxy added
        raw = capture.shape.hidden(obj, raw, added)
    transport = request.transport
    if transport is None or transport.is_closing():  # aiohttp would drop the answer quietly
        capture.error = CLIENT_LEFT_EARLY
    return web.Response(body=raw, status=200, headers=headers)


async def _relay_stream(
    request: web.Request,
    upstream: UpstreamResponse,
    added: Added,
    capture: Capture,
    watch: StallWatch,
) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers=client_headers(upstream))
    relay = capture.shape.relay(added, capture.add, request.app[FINGERPRINT])
    sent = False  # whether the client got any of the body
    try:
        try:
            await response.prepare(request)
        except ConnectionResetError:
            raise _ClientLeft from None
        async for chunk in upstream.content.iter_any():
            watch.touch()
            out = relay.feed(chunk)
            if out:
                # aiohttp's ClientConnectionResetError is a ClientError too: a failed
                # write is told apart here, where it happens, from a failed upstream read.
                try:
                    await response.write(out)
                except ConnectionResetError:
                    raise _ClientLeft from None
                if not sent:  # the time to the first chunk (observe/metrics.py)
                    capture.first_chunk_at = time.perf_counter()
                sent = True
        if not (relay.parser.done or capture.acc.complete):
            # Responses and Messages streams end with their last event, not [DONE].
            raise aiohttp.ClientPayloadError(f"the stream ended without {capture.shape.stream_end}")
    except (aiohttp.ClientError, TimeoutError) as e:
        # Upstream broke mid-stream: the client already has a 200, so tell it in-band
        # the way OpenAI does, and keep what was generated as a partial record.
        capture.fail(None, f"upstream stream broke: {watch.describe(e)}")
        err = UpstreamError(capture.error, code="upstream_disconnected")
        await write_quietly(response, relay.flush() + encode_event(json_dumps(err.body())))
        await write_quietly(response, b"", eof=True)
        return response
    except (_ClientLeft, asyncio.CancelledError) as e:
        capture.fail(None, CLIENT_LEFT if sent else CLIENT_LEFT_EARLY)
        upstream.close()  # drop the connection so vLLM stops generating
        if isinstance(e, asyncio.CancelledError):
            raise
        return response
    capture.done()
    await write_quietly(response, relay.flush(), eof=True)
    return response


async def write_quietly(response: web.StreamResponse, data: bytes, eof: bool = False) -> None:
    try:
        if data:
            await response.write(data)
        if eof:
            await response.write_eof()
    except (ConnectionResetError, RuntimeError):
        pass


# -- everything else under /v1 ---------------------------------------------------------


async def passthrough(request: web.Request) -> web.StreamResponse:
    """An allowed path (paths.py) forwarded as it is; the body read first, so that
    `--max-body-bytes` holds here too (aiohttp's `read` enforces it: 413)."""
    app = request.app
    config = app[CONFIG]
    tail = request.match_info["tail"]
    check_forwarded(tail, request.method)
    url = f"{app[UPSTREAM].url()}/v1/{tail}"
    data = await request.read() if request.body_exists else None
    try:
        async with asyncio.timeout(config.read_timeout):
            upstream = await app[SESSION].request(
                request.method,
                url,
                params=request.query,
                headers=upstream_headers(request),
                data=data,
                allow_redirects=False,  # the client's to follow: ours would carry our key
            )
    except TimeoutError as e:
        raise UpstreamTimeout(silence(config.read_timeout)) from e
    except aiohttp.ClientError as e:
        raise UpstreamError(f"upstream {config.upstream} unreachable: {e}") from e
    note_passthrough(app, request.method, tail, upstream.status)
    watch = StallWatch(upstream, config.read_timeout)
    async with upstream:
        response = web.StreamResponse(status=upstream.status, headers=client_headers(upstream))
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                watch.touch()
                await response.write(chunk)
        except (aiohttp.ClientError, ConnectionResetError):
            return response  # the client sees the body end early, as it would directly
        finally:
            watch.cancel()
        await write_quietly(response, b"", eof=True)
        return response
