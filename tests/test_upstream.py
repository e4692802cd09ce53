"""The proxy's own client for the hop to vLLM (proxy/forward/upstream.py), against a real
aiohttp server on a real socket: keep-alive reuse, idle expiry, a stale pooled
connection, streamed bodies, errors in aiohttp's types."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from overnight.proxy.forward.upstream import UpstreamPool


@pytest.fixture
async def server(aiohttp_server):
    """Echo with the peer's port (which connection), a chunked stream, a closer."""

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        port = request.transport.get_extra_info("peername")[1]
        return web.json_response(
            {"port": port, "body": body.decode(), "auth": request.headers.get("Authorization")}
        )

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)  # no Content-Length: chunked
        for i in range(3):
            await response.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.05)
        await response.write_eof()
        return response

    async def close_after(request: web.Request) -> web.Response:
        return web.Response(text="bye", headers={"Connection": "close"})

    async def half(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = 100
        await response.prepare(request)
        await response.write(b"x" * 10)
        request.transport.close()  # dies mid-body
        return response

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_post("/stream", stream)
    app.router.add_post("/close", close_after)
    app.router.add_post("/half", half)
    return await aiohttp_server(app)


def pool_for(server, keepalive: float = 4.0) -> UpstreamPool:
    return UpstreamPool(str(server.make_url("")), connect_timeout=2, keepalive_timeout=keepalive)


async def post_json(pool, path="/echo", body=b"hi", headers=None):
    async with await pool.post(path, body, headers or {}) as r:
        return r.status, await r.read()


async def test_a_connection_is_kept_alive_and_reused(server):
    pool = pool_for(server)
    answers = [await post_json(pool, body=f"n{i}".encode()) for i in range(3)]
    ports = {json.loads(raw)["port"] for _, raw in answers}
    assert all(status == 200 for status, _ in answers) and len(ports) == 1
    assert b'"body": "n2"' in answers[2][1] and len(pool.idle) == 1
    # Headers go through as given.
    _, raw = await post_json(pool, headers={"Authorization": "Bearer up"})
    assert b'"auth": "Bearer up"' in raw
    pool.close()


async def test_idle_connections_expire_before_the_upstream_drops_them(server):
    pool = pool_for(server, keepalive=0.05)
    _, first = await post_json(pool)
    await asyncio.sleep(0.1)
    _, second = await post_json(pool)
    assert json.loads(first)["port"] != json.loads(second)["port"]
    pool.close()


async def test_a_stale_pooled_connection_is_retried_once_on_a_new_one(server):
    pool = pool_for(server)
    await post_json(pool)
    (idle,) = pool.idle
    idle.transport.close()  # as if the upstream had closed it while idle ...
    idle.closed = False  # ... and we had not noticed yet
    status, _ = await post_json(pool)
    assert status == 200
    pool.close()


async def test_a_chunked_stream_arrives_piece_by_piece(server):
    pool = pool_for(server)
    r = await pool.post("/stream", b"", {})
    assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
    pieces = [chunk async for chunk in r.content.iter_any()]
    r.release()
    assert b"".join(pieces) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n" and len(pieces) >= 2
    assert len(pool.idle) == 1  # read to its end: back in the pool
    pool.close()


async def test_connection_close_is_honoured_and_a_broken_body_raises(server):
    pool = pool_for(server)
    assert await post_json(pool, "/close") == (200, b"bye")
    assert not pool.idle
    r = await pool.post("/half", b"", {})
    with pytest.raises(aiohttp.ClientPayloadError):
        await r.read()
    r.release()
    assert not pool.idle
    pool.close()


async def test_a_closed_response_fails_the_pending_read_and_drops_the_connection(server):
    pool = pool_for(server)
    r = await pool.post("/stream", b"", {})
    reader = asyncio.ensure_future(r.read())
    await asyncio.sleep(0.02)
    r.close()  # what the stall watchdog and a client disconnect do
    with pytest.raises(aiohttp.ClientPayloadError):
        await reader
    r.release()
    assert not pool.idle
    pool.close()


async def test_an_upstream_that_is_down_raises_a_connection_error():
    pool = UpstreamPool("http://127.0.0.1:9", connect_timeout=2, keepalive_timeout=4)
    with pytest.raises(aiohttp.ClientConnectionError, match="cannot connect to 127.0.0.1:9"):
        await pool.post("/v1/chat/completions", b"{}", {})
