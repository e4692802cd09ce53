"""The completion spans' way out: a bounded queue, one thread, OTLP/HTTP protobuf.

The loop hands over an ended span (`submit`: one append); a thread of ours encodes a
batch and posts it, every `OTEL_BSP_SCHEDULE_DELAY` ms (5000) or as soon as
`OTEL_BSP_MAX_EXPORT_BATCH_SIZE` (512) wait. Past `OTEL_BSP_MAX_QUEUE_SIZE` (2048) spans
are dropped and counted, never waited for: a collector that is slow or down costs spans
and a logged warning, not a request.

Why not the SDK's BatchSpanProcessor and OTLP exporter: the thread shares the
interpreter lock with the event loop, so every µs it spends is taken from requests, and
the SDK's encoder measured ~78 µs a span; otlp_protobuf.py writes the same bytes in
~7-12 µs. One connection to the collector is kept open between exports (a new one each
time, with its name lookup, was the thread's next largest cost).

The wire is the OTLP/HTTP exporter's, from the same variables it reads (the endpoint's
`/v1/traces` rule, headers, timeout, compression, certificates: `from_environment`; an
`http(s)_proxy` in the environment is used as `requests` would), and so is its retry
rule: 429, 502, 503, 504 and connection errors are retried with exponential backoff
(1 s, 2 s, ... with 20% jitter, or the collector's Retry-After) while the timeout allows.
The resource is the SDK's `Resource.create()`, so `OTEL_SERVICE_NAME` and
`OTEL_RESOURCE_ATTRIBUTES` apply; the SDK's `SpanLimits` cap attribute count and
length (`OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`).
"""

from __future__ import annotations

import base64
import collections
import gzip
import http.client
import logging
import random
import ssl
import threading
import time
import urllib.request
import zlib
from collections.abc import Mapping
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import unquote, urlsplit

from overnight.proxy.observe.otlp_protobuf import Encoder
from overnight.proxy.observe.trace_context import Span
from overnight.telemetry import SHUTDOWN_SECONDS, endpoint_of, langfuse_only, resource

log = logging.getLogger("overnight.proxy")

BATCH, QUEUE = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "OTEL_BSP_MAX_QUEUE_SIZE"
RETRY_STATUS = frozenset({429, 502, 503, 504})
MAX_ATTEMPTS = 6  # the exporter's


class Exporter:
    """The queue, its thread, and the collector it posts to."""

    def __init__(
        self,
        endpoint: str,
        headers: Mapping[str, str],
        resource: Mapping[str, Any],
        timeout: float = 10.0,
        compression: str = "none",
        tls: ssl.SSLContext | None = None,
        delay_ms: float = 5000,
        batch: int = 512,
        queue_size: int = 2048,
        max_attributes: int | None = 128,
        max_length: int | None = None,
    ):
        self.endpoint = endpoint
        self.headers = {"Content-Type": "application/x-protobuf", **headers}
        if compression != "none":
            self.headers["Content-Encoding"] = compression
        self.compression = compression
        self.timeout = timeout
        try:
            self.target: Target | None = Target(endpoint, tls)
        except ValueError as e:  # said once here; the proxy serves on, untraced
            log.warning("tracing: no span can be exported: %s", e)
            self.target = None
        else:
            if self.target.tunnel is None:  # a plain-HTTP proxy reads them from the request
                self.headers.update(self.target.proxy_headers)
        self._connection: http.client.HTTPConnection | None = None
        self.delay = delay_ms / 1000
        self.batch = max(1, batch)
        self.queue_size = max(1, queue_size)
        self.encoder = Encoder(resource, max_attributes, max_length)
        self.queue: collections.deque = collections.deque()
        self.dropped = 0  # spans past the queue's bound (counted on the loop)
        self._reported = 0
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._flushes: list[threading.Event] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="overnight-otlp", daemon=True)
        self._thread.start()

    # -- the loop's side ---------------------------------------------------------------

    def submit(self, span: Span, end_ns: int, error: str | None) -> None:
        """Queue an ended span for export; dropped (counted) when the queue is full."""
        queue = self.queue
        if len(queue) >= self.queue_size:
            self.dropped += 1
            return
        queue.append((span, end_ns, error))
        if len(queue) >= self.batch and not self._wake.is_set():
            self._wake.set()

    # -- any thread ----------------------------------------------------------------------

    def flush(self, timeout: float = 30.0) -> bool:
        """Export what is queued now; whether that finished within `timeout` seconds."""
        if not self._thread.is_alive():  # stopped: nothing will export it
            return not self.queue
        done = threading.Event()
        with self._lock:
            self._flushes.append(done)
        self._wake.set()
        return done.wait(timeout)

    def shutdown(self, deadline: float = SHUTDOWN_SECONDS) -> None:
        """Export the last spans, waiting at most `deadline` seconds, then drop them."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(deadline)
        if self._thread.is_alive():
            log.warning("tracing: spans not exported within %g s were dropped", deadline)

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self.delay)
            self._wake.clear()
            with self._lock:
                flushes, self._flushes = self._flushes, []
            waiting = len(self.queue)  # what came before this wake; later spans, the next
            while waiting > 0:
                take = min(waiting, self.batch)
                waiting -= take
                self._export([self.queue.popleft() for _ in range(take)])
            if self.dropped != self._reported:
                log.warning("tracing: %d spans dropped, the queue was full (OTEL_BSP_MAX_QUEUE_"
                            "SIZE=%d)", self.dropped - self._reported, self.queue_size)  # fmt: skip
                self._reported = self.dropped
            for done in flushes:
                done.set()
            if self._stopping.is_set():
                if self._connection is not None:
                    self._connection.close()
                return

    def _export(self, spans: list) -> None:
        try:
            self.send(self.encoder.request(spans))  # one that does not arrive: logged there
        except Exception:  # a value or an answer not foreseen: this batch is lost, not the thread
            log.exception("tracing: could not export %d spans", len(spans))

    def send(self, body: bytes) -> bool:
        """POST one request, retried as the OTLP exporter retries; whether it arrived."""
        if self.target is None:
            return False
        if self.compression == "gzip":
            body = gzip.compress(body)
        elif self.compression == "deflate":
            body = zlib.compress(body)
        deadline = time.monotonic() + self.timeout
        for attempt in range(MAX_ATTEMPTS):
            backoff = 2**attempt * random.uniform(0.8, 1.2)
            status, reason, retry_after = self._post(body, max(deadline - time.monotonic(), 0.0))
            if status is not None and 200 <= status < 400:
                return True
            retryable = status in RETRY_STATUS if status is not None else reason is not None
            if retry_after is not None:
                backoff = retry_after
            last = attempt + 1 == MAX_ATTEMPTS or backoff > deadline - time.monotonic()
            if not retryable or last or self._stopping.is_set():
                log.warning("tracing: export to %s failed (%s)", self.endpoint, reason or status)
                return False
            log.info("tracing: export failed (%s), retrying in %.2f s", reason or status, backoff)
            if self._stopping.wait(backoff):
                return False
        return False

    def _post(self, body: bytes, timeout: float) -> tuple[int | None, str | None, float | None]:
        """(status, why it failed, Retry-After seconds); status None: no answer at all.
        A kept connection that fails is tried once more on a new one at once (it may
        have gone stale between exports), as the exporter does."""
        target = self.target
        assert target is not None  # send() posts nothing without one
        for fresh in (self._connection is None, True):
            connection = self._connection or target.connect()
            self._connection = connection
            connection.timeout = max(timeout, 0.001)
            if connection.sock is not None:
                connection.sock.settimeout(connection.timeout)
            try:
                connection.request("POST", target.path, body, self.headers)
                answer = connection.getresponse()
                answer.read()
            except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out
                connection.close()
                self._connection = None
                if fresh:
                    return None, f"{type(e).__name__}: {e}", None
                continue
            if answer.will_close:
                connection.close()
                self._connection = None
            if answer.status >= 400:
                return (
                    answer.status,
                    f"HTTP {answer.status}",
                    _retry_after(answer.getheader("Retry-After")),
                )
            return answer.status, None, None
        return None, "no connection", None


class Target:
    """Where the exporter connects: the collector, or the environment's proxy to it."""

    def __init__(self, endpoint: str, tls: ssl.SSLContext | None):
        url = urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{endpoint!r} is not an http(s) URL")
        self.https = url.scheme == "https"
        self.tls = (
            tls if tls is not None else (ssl.create_default_context() if self.https else None)
        )
        self.host, self.port = url.hostname, url.port or (443 if self.https else 80)
        self.path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self.tunnel: tuple[str, int] | None = None
        self.proxy_headers: dict[str, str] = {}
        proxy = urllib.request.getproxies().get(url.scheme)
        if proxy and not urllib.request.proxy_bypass(url.hostname):
            via = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            if via.username:
                token = base64.b64encode(
                    f"{unquote(via.username)}:{unquote(via.password or '')}".encode()
                )
                self.proxy_headers["Proxy-Authorization"] = f"Basic {token.decode()}"
            if self.https:  # CONNECT through the proxy, TLS with the collector
                self.tunnel = (self.host, self.port)
            else:  # plain HTTP: the proxy is asked for the whole URL
                self.path = endpoint
            self.host, self.port = via.hostname or "", via.port or 80

    def connect(self) -> http.client.HTTPConnection:
        if self.https:
            connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                self.host, self.port, context=self.tls
            )
        else:
            connection = http.client.HTTPConnection(self.host, self.port)
        if self.tunnel is not None:
            connection.set_tunnel(*self.tunnel, headers=self.proxy_headers)
        return connection


def from_environment(service: str, environ: Mapping[str, str]) -> Exporter:
    """The exporter the variables describe, read as the OTLP/HTTP exporter and the SDK's
    batch processor read them (each `OTEL_EXPORTER_OTLP_TRACES_*` before its general
    `OTEL_EXPORTER_OTLP_*`); Langfuse's shortcut when no standard endpoint is set."""
    from opentelemetry.sdk.trace import SpanLimits
    from opentelemetry.util.re import parse_env_headers

    def setting(name: str) -> str | None:
        return environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or environ.get(
            f"OTEL_EXPORTER_OTLP_{name}"
        )

    credentials = [n for n in environ if n.startswith("OTEL_PYTHON_EXPORTER_OTLP_HTTP_")
                   and n.endswith("CREDENTIAL_PROVIDER") and "_LOGS_" not in n]  # fmt: skip
    if credentials:  # a requests.Session plug-in; the night's SDK exporter uses it
        log.warning("tracing: the proxy's spans ignore %s", ", ".join(credentials))
    langfuse = langfuse_only(environ)
    endpoint, given = langfuse if langfuse else (endpoint_of(environ), {})
    headers = {"user-agent": "overnight-proxy (OTLP/HTTP)"}
    headers.update(parse_env_headers(setting("HEADERS") or "", liberal=True))
    headers.update({k.lower(): v for k, v in given.items()})
    compression = (setting("COMPRESSION") or "none").strip().lower()
    if compression not in ("none", "gzip", "deflate"):
        log.warning("tracing: unsupported compression %r, sending uncompressed", compression)
        compression = "none"
    try:
        limits = SpanLimits()  # OTEL_[SPAN_]ATTRIBUTE_COUNT_LIMIT, _VALUE_LENGTH_LIMIT
        count, length = limits.max_span_attributes, limits.max_span_attribute_length
    except ValueError as e:
        log.warning("tracing: %s; using the default limits", e)
        count, length = 128, None
    return Exporter(
        endpoint,
        headers,
        dict(resource(service).attributes),
        timeout=_number(setting("TIMEOUT"), 10.0, "OTEL_EXPORTER_OTLP_TIMEOUT"),
        compression=compression,
        tls=_tls(endpoint, setting),
        delay_ms=_number(environ.get("OTEL_BSP_SCHEDULE_DELAY"), 5000, "OTEL_BSP_SCHEDULE_DELAY"),
        batch=int(_number(environ.get(BATCH), 512, BATCH)),
        queue_size=int(_number(environ.get(QUEUE), 2048, QUEUE)),
        max_attributes=count,
        max_length=length,
    )


def _number(raw: str | None, default: float, name: str) -> float:
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        log.warning("tracing: %s=%r is not a positive number; using %g", name, raw, default)
        return default
    return value


def _tls(endpoint: str, setting) -> ssl.SSLContext | None:
    """The certificates the exporter would use (a CA bundle, a client certificate)."""
    if not endpoint.startswith("https:"):
        return None
    try:
        context = ssl.create_default_context(cafile=setting("CERTIFICATE"))
        certificate, key = setting("CLIENT_CERTIFICATE"), setting("CLIENT_KEY")
        if certificate:
            context.load_cert_chain(certificate, key)
    except (OSError, ssl.SSLError) as e:  # each export will fail verification: said here
        log.warning("tracing: the OTEL_EXPORTER_OTLP_*CERTIFICATE files did not load: %s", e)
        return None
    return context


def _retry_after(value: str | None) -> float | None:
    """The Retry-After header (RFC 9110: seconds, or an HTTP date), as the exporter reads it."""
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None
