"""The bare forwarder with aiohttp's client replaced by a raw asyncio protocol.

aiohttp still serves the agent's side; the hop to the upstream is a keep-alive
connection pool of `asyncio.Protocol`s with httptools parsing the response. No error
handling, no streaming, no timeouts: a measurement of what the client side of
aiohttp costs (bench/forwarder_floor.py runs it beside bench/bare_forwarder.py), to
size a custom upstream client for the proxy before writing one.

    python bench/raw_client_forwarder.py --port 8003 --upstream http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
from urllib.parse import urlsplit

import httptools
from aiohttp import web

POOL = web.AppKey("pool", object)


class Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future | None = None
        self.body: list[bytes] = []
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(ConnectionError("upstream closed the connection"))

    # httptools callbacks
    def on_body(self, chunk: bytes) -> None:
        self.body.append(chunk)

    def on_message_complete(self) -> None:
        answer, self.answer = self.answer, None
        body, self.body = b"".join(self.body), []
        answer.set_result((self.parser.get_status_code(), body))

    async def post(self, head: bytes, data: bytes) -> tuple[int, bytes]:
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(head + b"Content-Length: %d\r\n\r\n" % len(data) + data)
        return await self.answer


class Pool:
    def __init__(self, upstream: str) -> None:
        url = urlsplit(upstream)
        self.host, self.port = url.hostname, url.port
        self.idle: list[Connection] = []

    async def post(self, path: str, data: bytes) -> tuple[int, bytes]:
        connection = None
        while self.idle and connection is None:
            candidate = self.idle.pop()
            connection = None if candidate.closed else candidate
        if connection is None:
            loop = asyncio.get_running_loop()
            _, connection = await loop.create_connection(Connection, self.host, self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            "Content-Type: application/json\r\n"
        ).encode()
        answer = await connection.post(head, data)
        self.idle.append(connection)
        return answer


async def forward(request: web.Request) -> web.Response:
    status, body = await request.app[POOL].post(request.path, await request.read())
    return web.Response(body=body, status=status, content_type="application/json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    app = web.Application()
    app[POOL] = Pool(args.upstream)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/health", lambda r: web.Response())
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = None
    web.run_app(app, port=args.port, access_log=None, print=None, loop=loop)


if __name__ == "__main__":
    main()
