"""The hot hop to vLLM: a small HTTP/1.1 client on asyncio protocols and httptools.

Completions are the proxy's traffic, and aiohttp's client costs more per request than
everything overnight itself does (bench/forwarder_floor.py: 0.10-0.15 ms of added
latency at concurrency 1 against this client). What this path needs is narrow: POST a
body to one host, read a response whole or as it streams, keep connections alive. So
it is written here, with httptools (the parser uvicorn uses) doing the HTTP; every
other path (`/v1/models`, admin calls to vLLM) keeps aiohttp's full client.

It speaks the same interface as the part of `aiohttp.ClientResponse` the relays use
(`status`, `headers`, `read()`, `content.iter_any()`, `close()`, `async with`) and
raises aiohttp's exception types, so the error handling around it is one code path.

Connections: a pool of idle keep-alive connections, closed after `keepalive_timeout`
idle (below vLLM's 5 s, so we never send on a connection it is closing; one timer
for the pool closes them even when no request comes); a response
read to its end returns its connection to the pool, anything else closes it. A request
on a pooled connection that the upstream closed before answering is repeated once on
a new connection (nothing of it was processed).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from urllib.parse import urlsplit

import aiohttp
import httptools
from multidict import CIMultiDict


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.head: asyncio.Future | None = None
        self.closed = False
        self.idle_since = 0.0
        self._headers: list[tuple[str, str]] = []

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(aiohttp.ClientPayloadError(f"malformed response from upstream: {e}"))
            self.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.head is not None and not self.head.done():
            self.head.set_exception(aiohttp.ServerDisconnectedError())
        elif self.response is not None and not self.response.complete:
            self._fail(aiohttp.ClientPayloadError("upstream closed the connection mid-response"))

    # -- httptools callbacks --------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        response = UpstreamResponse(self, self.parser.get_status_code(), CIMultiDict(self._headers))
        self._headers = []
        self.response = response
        if self.head is not None and not self.head.done():
            self.head.set_result(response)

    def on_body(self, chunk: bytes) -> None:
        if self.response is not None:
            self.response.feed(chunk)

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None:
            response.complete = True
            response.reusable = self.parser.should_keep_alive()
            response.feed_eof()

    # -----------------------------------------------------------------------------------

    def _fail(self, error: Exception) -> None:
        if self.response is not None and not self.response.complete:
            self.response.feed_error(error)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def send(self, data: bytes) -> asyncio.Future:
        self.parser = httptools.HttpResponseParser(self)
        self.response = None
        self.head = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.head


class _Body:
    """`response.content`: the body as it arrives."""

    def __init__(self, response: UpstreamResponse):
        self.response = response

    async def iter_any(self):
        while True:
            chunk = await self.response.next_chunk()
            if chunk is None:
                return
            yield chunk


class UpstreamResponse:
    def __init__(self, connection: _Connection, status: int, headers: CIMultiDict):
        self.connection = connection
        self.status = status
        self.headers = headers
        self.complete = False  # the whole body arrived
        self.reusable = False
        self.finished = False  # the body was read to its end (or its error) by the caller
        self.content = _Body(self)
        self.pool: UpstreamPool | None = None
        # The replica it counts as outstanding on until released (balancer.py).
        self.replica = None
        # What arrived and was not read yet; one waiter at most (the relay).
        self._chunks: list[bytes] = []
        self._eof = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future | None = None

    # -- the connection's side ------------------------------------------------------------

    def feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def feed_error(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the reader's side ----------------------------------------------------------------

    async def next_chunk(self) -> bytes | None:
        """Everything that arrived since the last call (at least one byte), or None at
        the end of the body; raises what broke the response, after the data before it."""
        while True:
            if self._chunks:
                chunks, self._chunks = self._chunks, []
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if self._error is not None:
                self.finished = True
                raise self._error
            if self._eof:
                self.finished = True
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Drop the connection (the upstream stops generating); a pending read fails."""
        if not self._eof:
            self.feed_error(aiohttp.ClientPayloadError("response closed"))
        self.connection.close()

    def release(self) -> None:
        replica, self.replica = self.replica, None
        if replica is not None:
            replica.outstanding -= 1
        if self.finished and self.complete and self.reusable and self.pool is not None:
            self.pool.give_back(self.connection)
        else:
            self.connection.close()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()


class UpstreamPool:
    """Keep-alive connections to one upstream (scheme, host and port of `base_url`)."""

    def __init__(self, base_url: str, connect_timeout: float, keepalive_timeout: float):
        url = urlsplit(base_url)
        self.https = url.scheme == "https"
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if self.https else 80)
        self.prefix = url.path.rstrip("/")
        default_port = self.port == (443 if self.https else 80)
        self.host_header = self.host if default_port else f"{self.host}:{self.port}"
        self.connect_timeout = connect_timeout
        self.keepalive_timeout = keepalive_timeout
        self.idle: deque[_Connection] = deque()  # oldest left, most recently used right
        self._sweep: asyncio.TimerHandle | None = None
        self._ssl = ssl.create_default_context() if self.https else None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        """POST and wait for the response's status and headers."""
        head = [f"POST {self.prefix}{path} HTTP/1.1", f"Host: {self.host_header}"]
        head += [
            f"{k}: {v}" for k, v in headers.items() if k.lower() not in ("host", "content-length")
        ]
        head.append(f"Content-Length: {len(body)}")
        # aiohttp decodes a client's header bytes as UTF-8 with surrogateescape: this
        # encoding gives the upstream exactly the bytes the client sent, whatever they were.
        data = ("\r\n".join(head) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body
        connection, reused = await self._acquire()
        try:
            response = await self._exchange(connection, data)
        except aiohttp.ServerDisconnectedError:
            if not reused:
                raise
            # Closed by the upstream while idle: nothing of the request was processed.
            response = await self._exchange(await self._connect(), data)
        response.pool = self
        return response

    @staticmethod
    async def _exchange(connection: _Connection, data: bytes) -> UpstreamResponse:
        """Send and wait for the head; a connection that failed is closed."""
        try:
            return await connection.send(data)
        except BaseException:
            connection.close()
            raise

    async def _acquire(self) -> tuple[_Connection, bool]:
        now = asyncio.get_running_loop().time()
        while self.idle:
            connection = self.idle.pop()  # the most recently used: least likely stale
            if connection.closed or now - connection.idle_since > self.keepalive_timeout:
                connection.close()
                continue
            return connection, True
        return await self._connect(), False

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    _Connection,
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self.host if self.https else None,
                )
        except TimeoutError as e:
            raise aiohttp.ClientConnectionError(
                f"cannot connect to {self.host}:{self.port} within {self.connect_timeout:g} s"
            ) from e
        except OSError as e:
            raise aiohttp.ClientOSError(
                e.errno, f"cannot connect to {self.host}:{self.port}: {e.strerror or e}"
            ) from e
        return connection

    def give_back(self, connection: _Connection) -> None:
        if connection.closed:
            return
        loop = asyncio.get_running_loop()
        connection.idle_since = loop.time()
        self.idle.append(connection)
        if self._sweep is None:
            self._sweep = loop.call_at(connection.idle_since + self.keepalive_timeout, self._expire)

    def _expire(self) -> None:
        """Close what was idle for `keepalive_timeout`: one timer for the whole pool,
        re-armed for the oldest connection left (the left end of `idle`)."""
        self._sweep = None
        now = asyncio.get_running_loop().time()
        while self.idle and (
            self.idle[0].closed or now - self.idle[0].idle_since >= self.keepalive_timeout
        ):
            self.idle.popleft().close()
        if self.idle:
            due = self.idle[0].idle_since + self.keepalive_timeout
            self._sweep = asyncio.get_running_loop().call_at(due, self._expire)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        while self.idle:
            self.idle.pop().close()
