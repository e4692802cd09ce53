"""Forwarding: send a request upstream and relay the answer to the client as it comes.

Completions go through the proxy's own client (upstream.py) and are teed into the
request's Capture: a whole answer is read, recorded and passed on (re-encoded only
when the proxy added fields to hide); a stream is relayed event by event, the events
the proxy need not change as the exact upstream bytes. Everything else under /v1
passes through aiohttp's client untouched. A `StallWatch` cuts off an upstream that
goes silent; every failure becomes an OpenAI-shaped error, or, once a stream has
started, an error event in the stream.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import orjson
from aiohttp import web

from overnight.errors import OvernightError
from overnight.proxy.capture.apis import (
    ResponsesAdditions,
    hide_responses_additions,
    refused_additions,
)
from overnight.proxy.capture.chat import CHAT, TEXT, Additions, hide_additions, only_added
from overnight.proxy.capture.conversation import MESSAGES, RESPONSES
from overnight.proxy.capture.state import Capture
from overnight.proxy.capture.uncaptured import note_passthrough
from overnight.proxy.forward.jsonio import json_dumps
from overnight.proxy.forward.paths import check_forwarded
from overnight.proxy.forward.sse import SSEParser, encode_event, with_data
from overnight.proxy.forward.upstream import UpstreamResponse
from overnight.proxy.state import CONFIG, FINGERPRINT, SESSION, UPSTREAM, SeenFingerprint

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
UPSTREAM_PATHS = {
    CHAT: "/v1/chat/completions",
    TEXT: "/v1/completions",
    RESPONSES: "/v1/responses",
    MESSAGES: "/v1/messages",
}

UPSTREAM_CHAT = (CHAT, TEXT)

Upstream = aiohttp.ClientResponse | UpstreamResponse
Added = Additions | ResponsesAdditions  # what the proxy asked for, to hide again


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


def silence(timeout: float) -> str:
    return f"upstream sent nothing for {timeout:g} s"


def upstream_headers(request: web.Request) -> dict[str, str]:
    """The client's headers as upstream gets them: ours and the hop's removed, our key in."""
    config = request.app[CONFIG]
    headers = {
        k: v
        for k, v in request.headers.items()
        if k.lower() not in HOP_BY_HOP and not k.lower().startswith("x-rollout-")
    }
    if config.upstream_api_key:
        headers["Authorization"] = f"Bearer {config.upstream_api_key}"
    return headers


def client_headers(upstream: Upstream) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}


# -- completions -----------------------------------------------------------------------


async def forward(
    request: web.Request,
    endpoint: str,
    body: dict,
    added: Added,
    capture: Capture,
    affinity: str | None = None,
) -> web.StreamResponse:
    """POST `body` upstream and relay the answer, whole or streamed, into `capture`.
    Requests with the same `affinity` (a rollout's id) go to the same replica."""
    app = request.app
    config = app[CONFIG]
    headers = upstream_headers(request)
    headers["Content-Type"] = "application/json"
    sent = body
    while True:  # twice at most, for a Responses request whose additions vLLM refused
        try:
            async with asyncio.timeout(config.read_timeout):  # until the response headers
                upstream = await app[UPSTREAM].post(
                    UPSTREAM_PATHS[endpoint], json_dumps(sent), headers, affinity
                )
        except (aiohttp.ClientError, TimeoutError) as e:
            # The record says what the client was told.
            if isinstance(e, TimeoutError):
                error: UpstreamError = UpstreamTimeout(silence(config.read_timeout))
            else:
                error = UpstreamError(f"upstream {config.upstream} unreachable: {e}")
            capture.status, capture.error = error.status, str(error)
            capture.done()
            raise error from e
        if upstream.status != 400 or not isinstance(added, ResponsesAdditions):
            break
        if added.plain is None:  # the client's own request, refused: relayed as it is
            break
        # vLLM refused what the proxy added (a gpt-oss model takes no logprobs): the
        # client's own request is sent instead, and its answer relayed as it comes.
        async with upstream:
            await upstream.read()
        sent, added = added.plain, ResponsesAdditions()
    if sent is not body and upstream.status != 400:  # the additions were the trouble
        refused_additions(app).add(str(body.get("model")))
    watch = StallWatch(upstream, config.read_timeout)
    try:
        async with upstream:
            capture.first_byte()
            capture.status = upstream.status
            content_type = upstream.headers.get("Content-Type", "")
            if upstream.status == 200 and "text/event-stream" in content_type:
                return await _relay_stream(request, upstream, added, capture, watch)
            return await _relay_whole(request, upstream, added, capture, watch)
    finally:
        watch.cancel()


class StallWatch:
    """Closes an upstream response that sends nothing for `timeout` seconds.

    aiohttp's own `sock_read` timeout re-arms a timer on every chunk, which cost 9% of
    the proxy's throughput; here a chunk only notes the time, and the one timer is
    re-armed when it fires early. Closing the response makes the pending read fail,
    which the relays report like any broken upstream, naming the stall.
    """

    def __init__(self, upstream: Upstream, timeout: float):
        self.loop = asyncio.get_running_loop()
        self.upstream = upstream
        self.timeout = timeout
        self.last = self.loop.time()
        self.stalled = False
        self.handle = self.loop.call_at(self.last + timeout, self._check)

    def touch(self) -> None:
        self.last = self.loop.time()

    def _check(self) -> None:
        due = self.last + self.timeout
        if self.loop.time() >= due:
            self.stalled = True
            self.upstream.close()
        else:
            self.handle = self.loop.call_at(due, self._check)

    def cancel(self) -> None:
        self.handle.cancel()

    def describe(self, e: BaseException) -> str:
        return silence(self.timeout) if self.stalled else repr(e)


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
        capture.error = f"upstream failed while sending its answer: {watch.describe(e)}"
        capture.done()
        if watch.stalled:
            capture.status = 504
            raise UpstreamTimeout(capture.error) from e
        raise UpstreamError(capture.error) from e
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
    capture.acc.add(obj)
    if added.any:
        raw = _hidden(obj, raw, added)
    transport = request.transport
    if transport is None or transport.is_closing():  # aiohttp would drop the answer quietly
        capture.error = CLIENT_LEFT_EARLY
    return web.Response(body=raw, status=200, headers=headers)


def _hidden(obj: dict, raw: bytes, added: Added) -> bytes:
    """A whole answer as the client gets it: without what the proxy added."""
    if not isinstance(added, ResponsesAdditions):
        return json_dumps(hide_additions(obj, added))
    hidden = hide_responses_additions(obj, added)
    if hidden is None:
        return raw
    # vLLM writes a whole Responses answer with Python's json (starlette's JSONResponse),
    # whose floats (1e-05) orjson would write otherwise (1e-5).
    return json.dumps(hidden, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def _relay_stream(
    request: web.Request,
    upstream: UpstreamResponse,
    added: Added,
    capture: Capture,
    watch: StallWatch,
) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers=client_headers(upstream))
    relay: EventRelay
    if isinstance(added, ResponsesAdditions):
        relay = ResponsesEventRelay(added, capture, request.app[FINGERPRINT])
    else:
        relay = EventRelay(added, capture, request.app[FINGERPRINT])
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
                sent = True
        if not (relay.parser.done or capture.acc.complete):
            # Responses and Messages streams end with their last event, not [DONE].
            end = "[DONE]" if capture.endpoint in UPSTREAM_CHAT else "its last event"
            raise aiohttp.ClientPayloadError(f"the stream ended without {end}")
    except (aiohttp.ClientError, TimeoutError) as e:
        # Upstream broke mid-stream: the client already has a 200, so tell it in-band
        # the way OpenAI does, and keep what was generated as a partial record.
        capture.error = f"upstream stream broke: {watch.describe(e)}"
        err = UpstreamError(capture.error, code="upstream_disconnected")
        await write_quietly(response, relay.flush() + encode_event(json_dumps(err.body())))
    except (_ClientLeft, asyncio.CancelledError) as e:
        capture.error = CLIENT_LEFT if sent else CLIENT_LEFT_EARLY
        capture.done()
        upstream.close()  # drop the connection so vLLM stops generating
        if isinstance(e, asyncio.CancelledError):
            raise
        return response
    capture.done()
    await write_quietly(response, relay.flush(), eof=True)
    return response


class EventRelay:
    """Turns upstream SSE bytes into what the client gets, feeding the capture.

    Events we need not change go out as the exact upstream bytes. When we asked for
    usage, vLLM moves `system_fingerprint` from each choice's finishing chunk to the
    usage chunk we drop. The fingerprint is constant per server, so once seen it is
    put back at once; until then finishing chunks wait for the usage chunk.
    """

    def __init__(self, added: Additions, capture: Capture, fingerprint: SeenFingerprint):
        self.added = added
        self.capture = capture
        self.fingerprint = fingerprint  # app-wide
        self.parser = SSEParser()
        self.held: list[dict] = []

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(self._event(e) for e in self.parser.feed(chunk))

    def flush(self) -> bytes:
        held, self.held = self.held, []
        fingerprint = self.fingerprint.value
        for obj in held:
            if fingerprint is not None:
                obj.setdefault("system_fingerprint", fingerprint)
        return b"".join(encode_event(json_dumps(obj)) for obj in held)

    def _event(self, event: bytes) -> bytes:
        data = SSEParser.data_of(event)
        obj = None
        if data is not None and data != b"[DONE]":
            try:
                obj = orjson.loads(data)
            except ValueError:
                obj = None
        if not isinstance(obj, dict):
            return self.flush() + event
        self.capture.acc.add(obj)
        if not self.added.any:
            return event
        fingerprint = self.fingerprint
        if "system_fingerprint" in obj:
            fingerprint.seen = True
            fingerprint.value = obj["system_fingerprint"]
        visible = hide_additions(obj, self.added)
        if visible is None:  # the usage chunk only we asked for
            return self.flush()
        if self.added.empty_chunks and only_added(visible):  # the record has taken it
            return b""
        if self.added.usage and any(c.get("finish_reason") for c in visible.get("choices") or ()):
            if not fingerprint.seen:
                self.held.append(visible)
                return b""
            visible.setdefault("system_fingerprint", fingerprint.value)
        return encode_event(json_dumps(visible))


class ResponsesEventRelay(EventRelay):
    """A Responses stream: an event the proxy's additions changed is re-encoded with its
    `event:` line kept; every other event goes out as the exact upstream bytes."""

    def __init__(self, added: ResponsesAdditions, capture: Capture, fingerprint: SeenFingerprint):
        super().__init__(Additions(), capture, fingerprint)
        self.responses_added = added

    def _event(self, event: bytes) -> bytes:
        data = SSEParser.data_of(event)
        try:
            obj = orjson.loads(data) if data is not None else None
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            return event
        self.capture.acc.add(obj)
        added = self.responses_added
        hidden = hide_responses_additions(obj, added) if added.any else None
        return event if hidden is None else with_data(event, json_dumps(hidden))


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
