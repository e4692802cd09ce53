"""The proxy: an aiohttp app that forwards to vLLM and records every completion.

Request path for chat and text completions:
  read body (size-capped) -> parse -> attribute to a rollout -> resolve the alias ->
  ask upstream for token ids/logprobs/usage -> forward -> tee the answer to the
  client (hiding what we added) and into an Accumulator -> one record per choice.
Everything else under /v1 passes through untouched. The record is appended to the
write-ahead log after the client has its answer, so logging adds no latency.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time

import aiohttp
import orjson
from aiohttp import web
from overnight.storage import LogWriter, WriterConfig

from overnight.config import ProxyConfig
from overnight.errors import OvernightError

from overnight.view import web as ui
from .adapters import AdapterRegistry, Route
from .attribution import attribute, logging_enabled
from .capture import CHAT, TEXT, Accumulator, Additions, add_training_fields, hide_additions
from .records import completion_rows, finish_row, new_id, parse_reward, reward_row
from .sse import SSEParser, encode_event
from .upstream import UpstreamPool, UpstreamResponse

log = logging.getLogger("overnight.proxy")

CONFIG = web.AppKey("config", ProxyConfig)
SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", UpstreamPool)
WRITER = web.AppKey("writer", LogWriter)
ADAPTERS = web.AppKey("adapters", AdapterRegistry)
STATS = web.AppKey("stats", dict)

# Headers that describe one hop, not the message; never forwarded either way.
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
ENDPOINTS = {"chat/completions": CHAT, "completions": TEXT}


class UpstreamError(OvernightError):
    status = 502
    code = "upstream_unavailable"


def json_dumps(obj) -> bytes:
    # vLLM's own encoding: compact, UTF-8 as is. orjson is ~5x faster than json here.
    try:
        return orjson.dumps(obj)
    except TypeError:  # integers over 64 bits and the like
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def error_response(exc: OvernightError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


# -- middleware: errors and authentication --------------------------------------------


@web.middleware
async def guard(request: web.Request, handler):
    """Authenticate, and turn every error the proxy makes into OpenAI-shaped JSON.

    One middleware rather than two: each layer costs a coroutine per request.
    """
    try:
        _authenticate(request)
        return await handler(request)
    except OvernightError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}
        message = e.text
        if e.status == 413:
            limit = request.app[CONFIG].max_body_bytes
            message = f"request body is larger than the limit of {limit} bytes"
        return error_response(
            OvernightError(message, status=e.status, code=code.get(e.status, "http_error"))
        )


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else None


def _authenticate(request: web.Request) -> None:
    config = request.app[CONFIG]
    path = request.path
    if path.startswith(("/admin/", "/ui")):
        # The web view is the admin API's, read-only: a browser brings the token once as
        # ?token=, then as a cookie.
        token = ui.token_from(request) if path.startswith("/ui") else _bearer(request)
        if config.admin_token is not None:
            if token != config.admin_token:
                raise OvernightError(
                    "missing or wrong admin token", status=401, code="invalid_admin_token"
                )
        elif not _is_loopback(request.remote):
            raise OvernightError(
                "the admin API and web view answer loopback clients only unless an admin token is set",
                status=403,
                code="admin_forbidden",
            )
    elif config.api_keys and path != "/health" and _bearer(request) not in config.api_keys:
        raise OvernightError("missing or incorrect API key", status=401, code="invalid_api_key")


def _is_loopback(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


# -- completions: forward and capture -------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    tail = request.match_info.get("tail", request.path.removeprefix("/v1/"))
    endpoint = ENDPOINTS[tail]
    started = time.time_ns() // 1000
    body = await _read_json_object(request)
    who = attribute(
        request.headers, request.match_info.get("group"), request.match_info.get("rollout"), body
    )
    app = request.app
    route = app[ADAPTERS].route(body.get("model"))
    upstream_body = dict(body, model=route.served)
    added = add_training_fields(upstream_body, endpoint)
    capture = Capture(endpoint, bool(body.get("stream")), request_body=body, route=route)
    try:
        return await _forward(request, endpoint, upstream_body, added, capture)
    finally:
        app[ADAPTERS].release(route)
        app[STATS]["requests"] += 1
        # Built once the response is on its way (aiohttp writes it before this task next
        # yields), so a burst of answers is not held up by the records of the earlier ones.
        asyncio.get_running_loop().call_soon(
            _record, app, capture, who, started, logging_enabled(request.headers)
        )


def _record(app: web.Application, capture, who, started: int, logged: bool) -> None:
    rows = completion_rows(
        capture,
        who,
        started=started,
        turn_counter=app[STATS]["turns"],
        logged=logged,
        proxy_id=app[WRITER].writer_id,
    )
    for row in rows:
        app[WRITER].append("completions", row)


class Capture:
    """What one request produced, filled in as the response goes by."""

    def __init__(self, endpoint: str, stream: bool, request_body: dict, route: Route):
        self.request_id = new_id()
        self.endpoint = endpoint
        self.stream = stream
        self.request_body = request_body
        self.route = route
        self.acc = Accumulator(endpoint)
        self.status = 0
        self.error: str | None = None
        self.error_body: str | None = None
        self.t0 = time.perf_counter()
        self.ttft_ms: float | None = None
        self.latency_ms: float | None = None

    def first_byte(self) -> None:
        if self.ttft_ms is None:
            self.ttft_ms = (time.perf_counter() - self.t0) * 1000

    def done(self) -> None:
        self.latency_ms = (time.perf_counter() - self.t0) * 1000


async def _read_json_object(request: web.Request) -> dict:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise OvernightError(
            f"request body is not valid JSON: {e}", status=400, code="invalid_json"
        ) from e
    if not isinstance(body, dict):
        raise OvernightError("request body must be a JSON object", status=400, code="invalid_json")
    return body


def _upstream_headers(request: web.Request) -> dict[str, str]:
    config = request.app[CONFIG]
    headers = {
        k: v
        for k, v in request.headers.items()
        if k.lower() not in HOP_BY_HOP and not k.lower().startswith("x-rollout-")
    }
    if config.upstream_api_key:
        headers["Authorization"] = f"Bearer {config.upstream_api_key}"
    return headers


def _client_headers(upstream: aiohttp.ClientResponse | UpstreamResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}


async def _forward(request, endpoint, upstream_body, added: Additions, capture: Capture):
    app = request.app
    config = app[CONFIG]
    path = f"/v1/{'chat/completions' if endpoint == CHAT else 'completions'}"
    headers = {
        k: v for k, v in _upstream_headers(request).items() if k.lower() != "accept-encoding"
    }
    headers["Content-Type"] = "application/json"  # we read the answer: ask for it uncompressed
    try:
        async with asyncio.timeout(config.read_timeout):  # until the response headers
            upstream = await app[UPSTREAM].post(path, json_dumps(upstream_body), headers)
    except (aiohttp.ClientError, TimeoutError) as e:
        capture.status, capture.error = 502, f"upstream unreachable: {e!r}"
        capture.done()
        if isinstance(e, TimeoutError):
            capture.status = 504
            raise UpstreamError(
                f"upstream sent nothing for {config.read_timeout:g} s",
                status=504,
                code="upstream_timeout",
            ) from e
        raise UpstreamError(f"upstream {config.upstream} unreachable: {e}") from e
    watch = StallWatch(upstream, config.read_timeout)
    try:
        async with upstream:
            capture.first_byte()
            capture.status = upstream.status
            content_type = upstream.headers.get("Content-Type", "")
            if upstream.status == 200 and "text/event-stream" in content_type:
                return await _relay_stream(request, upstream, added, capture, watch)
            return await _relay_whole(upstream, added, capture, watch)
    finally:
        watch.cancel()


class StallWatch:
    """Closes an upstream response that sends nothing for `timeout` seconds.

    aiohttp's own `sock_read` timeout re-arms a timer on every chunk, which cost 9% of
    the proxy's throughput; here a chunk only notes the time, and the one timer is
    re-armed when it fires early. Closing the response makes the pending read fail,
    which the relays report like any broken upstream, naming the stall.
    """

    def __init__(self, upstream: aiohttp.ClientResponse | UpstreamResponse, timeout: float):
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
        return f"upstream sent nothing for {self.timeout:g} s" if self.stalled else repr(e)


async def _relay_whole(
    upstream: UpstreamResponse, added: Additions, capture: Capture, watch: StallWatch
):
    try:
        raw = await upstream.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        capture.error = f"upstream failed while sending its answer: {watch.describe(e)}"
        capture.done()
        if watch.stalled:
            capture.status = 504
            raise UpstreamError(capture.error, status=504, code="upstream_timeout") from e
        raise UpstreamError(capture.error) from e
    capture.done()
    headers = _client_headers(upstream)
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
        raw = json_dumps(hide_additions(obj, added))
    return web.Response(body=raw, status=200, headers=headers)


async def _relay_stream(
    request, upstream: UpstreamResponse, added: Additions, capture: Capture, watch: StallWatch
):
    response = web.StreamResponse(status=200, headers=_client_headers(upstream))
    await response.prepare(request)
    relay = EventRelay(added, capture, request.app[STATS]["upstream"])
    try:
        async for chunk in upstream.content.iter_any():
            watch.touch()
            out = relay.feed(chunk)
            if out:
                await response.write(out)
        if not relay.parser.done:
            raise aiohttp.ClientPayloadError("the stream ended without [DONE]")
    except (aiohttp.ClientError, TimeoutError) as e:
        # Upstream broke mid-stream: the client already has a 200, so tell it in-band
        # the way OpenAI does, and keep what was generated as a partial record.
        capture.error = f"upstream stream broke: {watch.describe(e)}"
        err = UpstreamError(
            f"upstream stream broke: {watch.describe(e)}", code="upstream_disconnected"
        )
        await _write_quietly(response, relay.flush() + encode_event(json_dumps(err.body())))
    except (ConnectionResetError, asyncio.CancelledError) as e:
        capture.error = "client disconnected mid-stream"
        capture.done()
        upstream.close()  # drop the connection so vLLM stops generating
        if isinstance(e, asyncio.CancelledError):
            raise
        return response
    capture.done()
    await _write_quietly(response, relay.flush(), eof=True)
    return response


class EventRelay:
    """Turns upstream SSE bytes into what the client gets, feeding the capture.

    Events we need not change go out as the exact upstream bytes. When we asked for
    usage, vLLM moves `system_fingerprint` from each choice's finishing chunk to the
    usage chunk we drop. The fingerprint is constant per server, so once seen it is
    put back at once; until then finishing chunks wait for the usage chunk.
    """

    def __init__(self, added: Additions, capture: Capture, memo: dict):
        self.added = added
        self.capture = capture
        self.memo = memo  # app-wide: {"system_fingerprint": ...} once seen
        self.parser = SSEParser()
        self.held: list[dict] = []

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(self._event(e) for e in self.parser.feed(chunk))

    def flush(self) -> bytes:
        held, self.held = self.held, []
        fingerprint = self.memo.get("system_fingerprint")
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
        if "system_fingerprint" in obj:
            self.memo["system_fingerprint"] = obj["system_fingerprint"]
        visible = hide_additions(obj, self.added)
        if visible is None:  # the usage chunk only we asked for
            return self.flush()
        if self.added.usage and any(c.get("finish_reason") for c in visible.get("choices") or ()):
            if "system_fingerprint" not in self.memo:
                self.held.append(visible)
                return b""
            visible.setdefault("system_fingerprint", self.memo["system_fingerprint"])
        return encode_event(json_dumps(visible))


async def _write_quietly(response: web.StreamResponse, data: bytes, eof: bool = False) -> None:
    try:
        if data:
            await response.write(data)
        if eof:
            await response.write_eof()
    except (ConnectionResetError, RuntimeError):
        pass


# -- everything else under /v1: pass through ------------------------------------------


async def passthrough(request: web.Request) -> web.StreamResponse:
    app = request.app
    config = app[CONFIG]
    url = f"{config.upstream}/v1/{request.match_info['tail']}"
    try:
        async with asyncio.timeout(config.read_timeout):
            upstream = await app[SESSION].request(
                request.method,
                url,
                params=request.query,
                headers=_upstream_headers(request),
                data=request.content if request.body_exists else None,
            )
    except TimeoutError as e:
        raise UpstreamError(
            f"upstream sent nothing for {config.read_timeout:g} s",
            status=504,
            code="upstream_timeout",
        ) from e
    except aiohttp.ClientError as e:
        raise UpstreamError(f"upstream {config.upstream} unreachable: {e}") from e
    watch = StallWatch(upstream, config.read_timeout)
    async with upstream:
        response = web.StreamResponse(status=upstream.status, headers=_client_headers(upstream))
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                watch.touch()
                await response.write(chunk)
        except (aiohttp.ClientError, ConnectionResetError):
            return response  # the client sees the body end early, as it would directly
        finally:
            watch.cancel()
        await _write_quietly(response, b"", eof=True)
        return response


async def prefixed(request: web.Request) -> web.StreamResponse:
    """/rollouts/{group}/{rollout}/v1/... for clients that can only set a base URL."""
    if request.match_info["tail"] in ENDPOINTS and request.method == "POST":
        return await completions(request)
    return await passthrough(request)


# -- rewards, finishing, health, admin -------------------------------------------------


async def post_reward(request: web.Request) -> web.Response:
    rollout_id = request.match_info["rollout_id"]
    reward, metrics = parse_reward(await _read_json_object(request))
    row = reward_row(rollout_id, reward, metrics, request.app[WRITER].writer_id)
    await request.app[WRITER].wait_committed(request.app[WRITER].append("rewards", row))
    return web.json_response({"rollout_id": rollout_id, "reward": reward, "recorded": True})


async def post_finish(request: web.Request) -> web.Response:
    rollout_id = request.match_info["rollout_id"]
    if request.body_exists:
        await _read_json_object(request)  # must be JSON if present; nothing in it is used
    row = finish_row(rollout_id, request.app[WRITER].writer_id)
    await request.app[WRITER].wait_committed(request.app[WRITER].append("finishes", row))
    return web.json_response({"rollout_id": rollout_id, "finished": True})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def admin_adapters(request: web.Request) -> web.Response:
    return web.json_response(request.app[ADAPTERS].describe())


async def admin_promote(request: web.Request) -> web.Response:
    body = await _read_json_object(request)
    unknown = set(body) - {"path"}
    if unknown or not isinstance(body.get("path"), str):
        raise OvernightError(
            f'expected {{"path": "..."}}; unknown fields: {sorted(unknown)}',
            status=400,
            code="invalid_request",
        )
    adapter = await request.app[ADAPTERS].promote(body["path"])
    return web.json_response({"promoted": adapter.name, **request.app[ADAPTERS].describe()})


async def admin_rollback(request: web.Request) -> web.Response:
    await request.app[ADAPTERS].rollback()
    return web.json_response(request.app[ADAPTERS].describe())


async def admin_stats(request: web.Request) -> web.Response:
    writer = request.app[WRITER]
    stats = request.app[STATS]
    return web.json_response(
        {
            "requests": stats["requests"],
            "rows_appended": writer.appended,
            "rows_committed": writer.rows_committed,
            "rows_compacted": writer.rows_compacted,
            "write_errors": writer.errors,
            "writer_id": writer.writer_id,
        }
    )


# -- the app --------------------------------------------------------------------------


async def _lifecycle(app: web.Application):
    config = app[CONFIG]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=config.keepalive_timeout)
    # No total cap (long generations are fine) and no sock_read: StallWatch does that.
    timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout)
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,  # bytes pass to the client as the upstream encoded them
        cookie_jar=aiohttp.DummyCookieJar(),  # never carry one client's cookies to another
    )
    app[SESSION] = session
    app[UPSTREAM] = UpstreamPool(config.upstream, config.connect_timeout, config.keepalive_timeout)
    writer = LogWriter(
        WriterConfig(
            config.data_dir,
            commit_interval=config.commit_interval,
            roll_seconds=config.roll_seconds,
        )
    )
    writer.start()
    app[WRITER] = writer
    registry = app[ADAPTERS]
    registry.session = session
    await registry.restore()
    yield
    await registry.close()
    app[UPSTREAM].close()
    await session.close()
    # Blocking: commit the queue, seal and compact. Nothing is lost on a clean stop.
    await asyncio.get_running_loop().run_in_executor(None, writer.close)


def create_app(config: ProxyConfig) -> web.Application:
    config.data_dir.mkdir(parents=True, exist_ok=True)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[guard])
    app[CONFIG] = config
    app[STATS] = {"requests": 0, "turns": _TurnCounter(), "upstream": {}}
    upstream_headers = (
        {"Authorization": f"Bearer {config.upstream_api_key}"} if config.upstream_api_key else {}
    )
    app[ADAPTERS] = AdapterRegistry(
        alias=config.alias,
        state_path=config.data_dir / "adapters.json",
        upstream=config.upstream,
        session_headers=upstream_headers,
        drain_timeout=config.drain_timeout,
        base_model=config.base_model,
    )
    app.cleanup_ctx.append(_lifecycle)
    r = app.router
    r.add_get("/health", health)
    r.add_post("/v1/chat/completions", completions)
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/rollouts/{rollout_id}/reward", post_reward)
    r.add_post("/v1/rollouts/{rollout_id}/finish", post_finish)
    r.add_get("/admin/adapters", admin_adapters)
    r.add_post("/admin/adapters/promote", admin_promote)
    r.add_post("/admin/adapters/rollback", admin_rollback)
    r.add_get("/admin/stats", admin_stats)
    ui.add_routes(r)
    r.add_route("*", "/rollouts/{group}/{rollout}/v1/{tail:.*}", prefixed)
    r.add_route("*", "/v1/{tail:.*}", passthrough)
    return app


class _TurnCounter:
    """Turn index per rollout, in the order this process saw them; bounded memory."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self.counts: dict[str, int] = {}

    def next(self, rollout_id: str) -> int:
        n = self.counts.pop(rollout_id, -1) + 1
        self.counts[rollout_id] = n  # re-inserted: most recent last
        if len(self.counts) > self.capacity:
            del self.counts[next(iter(self.counts))]
        return n
