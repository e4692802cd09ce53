"""Prometheus metrics of the proxy, served at `/metrics` (prometheus_client's own text).

What vLLM cannot see and does not export already (`vllm:*`): completions by the model asked
for, the adapter served, the endpoint and status; failures by type; the duration a client
sees, its time to the first chunk, the proxy's own part; tokens by adapter; the recording
pipeline; uncaptured generating requests; shadow siblings; the alias's adapter; the last
nights. `overnight_` names (no colons: those are for recording rules); `model_name` is the
base model's name, as on vLLM's metrics, so a query joins the two on it.

Three kinds of update, by cost: a finished completion is observed once, after its answer
was written (`observe`: plain counts in a tally of its kind, nothing on the forwarding
path; a tally is added to prometheus_client's series at the next scrape, or at once under
`--workers N`, whose files must hold a killed worker's every count); the counts
the proxy keeps already (writer, shadow sampler, uncaptured paths) are copied by `sync` at
each scrape (and every SYNC_SECONDS in each worker under `--workers N`); what every worker
sees alike (the alias, the training runs in the data directory) is collected at scrape time
by the worker answering (`Shared`, shared.py).

Labels are bounded: a model name counts as itself only when the proxy knows it (the alias,
the base model, a promoted adapter), else as "other"; no rollout, group or request id is a
label. Each app has its own registry (tests make many apps in one process). Under
`--workers N` the supervisor (overnight/cli/serve.py) sets PROMETHEUS_MULTIPROC_DIR to a
directory it wiped and marks dead workers there; any worker's scrape reads all the files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.multiprocess import MultiProcessCollector

from overnight.errors import OvernightError
from overnight.proxy.alias.policies import Policies
from overnight.proxy.capture.captures import Capture
from overnight.proxy.capture.recorder import RECORDER, Recording
from overnight.proxy.capture.redact import REDACTOR
from overnight.proxy.capture.uncaptured import UNCAPTURED
from overnight.proxy.shadow.sampler import SHADOW
from overnight.proxy.state import WRITER
from overnight.storage import now_us
from overnight.storage.read.sent_by import CLIENT

from .shared import Shared
from .tally import Tally

log = logging.getLogger("overnight.proxy")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# How stale another worker's copied counts may be in a scrape under --workers N.
SYNC_SECONDS = 5.0

# OpenTelemetry GenAI semantic conventions' buckets: gen_ai.client.operation.duration
# and gen_ai.server.time_to_first_token (seconds).
DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
FIRST_CHUNK_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
# The proxy's own time is a fraction of a millisecond when all is well (BENCHMARKS.md):
# the GenAI buckets start at 10 ms and would put every request in the first one.
OWN_TIME_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip

OTHER = "other"  # a model name the proxy does not know, as a label

# Counters copied from the counts the proxy keeps (`sync`): key, name, help.
COPIED = (
    ("appended", "records_appended", "Rows queued for the log (acknowledged)."),
    ("committed", "records_committed", "Rows on disk (fsynced)."),
    ("lost", "records_lost", "Rows that will never be on disk."),
    ("write_errors", "records_write_errors", "Log batches that failed (each lost its rows)."),
    ("compacted", "records_compacted", "Rows moved from the log into Parquet."),
    ("compact_errors", "records_compact_errors", "Compactions that failed (tried again)."),
    ("redaction", "redaction_failures", "Records the --redact hook failed on."),
    ("shadow_requests", "shadow_requests", "Turns whose shadow siblings were asked of vLLM."),
    ("shadow_cancelled", "shadow_cancelled", "Shadow attempts cancelled for served traffic."),
    ("shadow_failed", "shadow_failed", "Shadow requests that failed."),
    ("shadow_dropped", "shadow_dropped", "Turns dropped because the shadow queue was full."),
    ("shadow_siblings", "shadow_siblings", "Shadow sibling rows stored."),
)
# Gauges of each worker's state (`sync`): key, name, help, how workers' values combine.
GAUGES = (
    ("queued", "records_queued", "Rows waiting to be written to the log.", "livesum"),
    (
        "degraded",
        "recording_degraded",
        "1 while recording is degraded (batches cannot be written, or damaged files are set "
        "aside): the signal that recording stopped.",
        "livemax",
    ),
    ("quarantined", "records_files_quarantined", "Damaged Parquet files set aside.", "livemax"),
    ("shadow_queued", "shadow_queued", "Turns waiting for shadow sampling.", "livesum"),
)


# How the relay's messages (relay.py, agent_api.py) begin, as error types; then statuses.
ERROR_PREFIXES = (
    ("client disconnected", "client_disconnected"),
    ("maintenance:", "maintenance"),
    ("internal error", "internal_error"),
    ("upstream HTTP", "upstream_status"),  # vLLM's error status, passed through
    ("upstream stream broke", "upstream_disconnected"),
)
STATUS_ERRORS = {502: "upstream_unavailable", 504: "upstream_timeout"}


def error_type(capture: Capture) -> str | None:
    """A finished completion's failure as one of a few words; None when it succeeded."""
    error, status = capture.error, capture.status
    if error is None and status < 400:
        return None
    for prefix, kind in ERROR_PREFIXES:
        if error is not None and error.startswith(prefix):
            return kind
    if status in STATUS_ERRORS:
        return STATUS_ERRORS[status]
    return "upstream_status" if status >= 400 else "upstream_malformed"  # 200, unreadable


@dataclass(frozen=True, slots=True)
class _Children:
    requests: Any
    duration: Any
    first_chunk: Any
    own_time: Any
    prompt_tokens: Any
    generation_tokens: Any


class Metrics:
    """The proxy's collectors on their own registry, and the `/metrics` handler."""

    def __init__(self, app: web.Application, adapters: Policies, data_dir) -> None:
        self.app = app
        self.adapters = adapters
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        disable_created_metrics()  # a `_created` per series doubles a scrape; nothing uses it
        self.registry = CollectorRegistry(auto_describe=True)
        self._define()
        self._copied: dict[tuple, float] = {}  # (counter, labels) -> value copied so far
        self._known_key: tuple | None = None
        self._known: frozenset[str] = frozenset()
        self._children: dict[tuple, _Children] = {}  # bounded: every label is
        self._tallies: dict[tuple, Tally] = {}  # kept per kind, zeroed when added; same keys
        self.shared = Shared(adapters, data_dir)
        if self.multiprocess:  # every worker's files, read at each scrape
            exposed = CollectorRegistry()
            MultiProcessCollector(exposed)
        else:
            exposed = self.registry
        exposed.register(self.shared)
        self._generate = make_aiohttp_handler(exposed)

    def _define(self) -> None:
        r = self.registry
        # sent_by: `client`, or what of overnight's own sent it (storage/read/sent_by.py):
        # the agents' traffic is {sent_by="client"}.
        by_request = ["model_name", "endpoint", "requested_model", "adapter", "status", "sent_by"]
        self.requests = Counter(
            "overnight_requests",
            "Completions answered, by model asked for, adapter served, endpoint, status and "
            "sender (client: an agent; else overnight's own: eval, judge, ...).",
            by_request,
            registry=r,
        )
        self.failures = Counter(
            "overnight_request_failures",
            "Completions that failed, by error type (client_disconnected, upstream_status, "
            "upstream_unavailable, upstream_timeout, upstream_disconnected, maintenance, "
            "internal_error, or the proxy's own refusal code such as invalid_json).",
            ["model_name", "endpoint", "error_type"],
            registry=r,
        )
        timing = ["model_name", "endpoint", "stream"]
        self.duration = Histogram(
            "overnight_request_duration_seconds",
            "A completion's duration as its client sees it: from its request's arrival to "
            "its answer's last byte written.",
            timing,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.first_chunk = Histogram(
            "overnight_time_to_first_chunk_seconds",
            "Streamed completions: from the request's arrival to the first chunk written.",
            timing,
            buckets=FIRST_CHUNK_BUCKETS,
            registry=r,
        )
        self.own_time = Histogram(
            "overnight_proxy_time_seconds",
            "The proxy's own part of a successful completion's duration: the duration less "
            "the time from the request sent upstream to the upstream's last byte.",
            timing,
            buckets=OWN_TIME_BUCKETS,
            registry=r,
        )
        tokens = ["model_name", "adapter"]
        self.prompt_tokens = Counter(
            "overnight_prompt_tokens", "Prompt tokens by adapter (usage).", tokens, registry=r
        )
        self.generation_tokens = Counter(
            "overnight_generation_tokens",
            "Generated tokens by adapter (usage).",
            tokens,
            registry=r,
        )
        # Copied from the counts the proxy keeps (sync).
        self.copied = {
            key: Counter(f"overnight_{name}", help, registry=r) for key, name, help in COPIED
        }
        self.uncaptured = Counter(
            "overnight_uncaptured_requests",
            "Generating requests forwarded whose output the proxy does not record, by path.",
            ["path"],
            registry=r,
        )
        # Each worker's state, summed or the worst over the live workers.
        self.gauges = {
            key: Gauge(f"overnight_{name}", help, registry=r, multiprocess_mode=mode)
            for key, name, help, mode in GAUGES
        }

    # -- the request side ---------------------------------------------------------------

    def _known_names(self) -> frozenset[str]:
        """Every alias, base model and adapter of every policy: the model names that are
        labels as themselves (any other name is "other")."""
        registries = self.adapters.registries  # one per policy: each alias is known
        key = tuple((r.version, r.base_model, len(r.history)) for r in registries)
        if key != self._known_key:
            names = {a.name for r in registries for a in r.history}
            names |= {n for r in registries for n in (r.alias, r.base_model or "")}
            self._known, self._known_key = frozenset(names - {""}), key
        return self._known

    def model_name(self) -> str:
        return self.adapters.get(None).base_model or ""

    def observe(self, capture: Capture, started_us: int) -> None:
        """One finished completion, after its answer was written (agent_api._record)."""
        try:
            self._observe(capture, started_us)
        except Exception:  # metrics never fail a request; say it once in the log
            log.exception("metrics: could not observe request %s", capture.request_id)

    def _observe(self, capture: Capture, started_us: int) -> None:
        # Clocks: the request's arrival in wall-clock microseconds (the record's start);
        # the rest relative to capture.t0 on the performance counter.
        duration = max(0.0, (now_us() - started_us) / 1e6)
        before_t0 = max(0.0, duration - (time.perf_counter() - capture.t0))  # body read
        requested = capture.request_body.get("model") if capture.request_body else None
        known = self._known_names()
        key = (
            capture.endpoint,
            requested if requested in known else OTHER,
            served if (served := capture.route.served) in known else OTHER,
            capture.status or 499,  # no status: the client left before any
            capture.stream,
            self.model_name(),
            capture.sent_by,
        )
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = Tally(
                DURATION_BUCKETS, FIRST_CHUNK_BUCKETS, OWN_TIME_BUCKETS
            )
        tally.requests += 1
        tally.duration.observe(duration)
        failure = error_type(capture)
        if failure is not None:
            self.failures.labels(key[5], capture.endpoint, failure).inc()  # its model_name
        elif capture.sent_at is not None and capture.latency_ms is not None:
            upstream = capture.t0 + capture.latency_ms / 1000 - capture.sent_at
            tally.own_time.observe(max(0.0, duration - upstream))
        if capture.stream and capture.first_chunk_at is not None:
            tally.first_chunk.observe(before_t0 + capture.first_chunk_at - capture.t0)
        usage = capture.acc.usage
        if usage:
            prompt, generated = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and prompt > 0:
                tally.prompt += prompt
            if isinstance(generated, int) and generated > 0:
                tally.generated += generated
        if self.multiprocess:  # into the worker's files now: a killed worker's counts stay
            tally.add_to(self._series(key))

    def _add_tallies(self) -> None:
        """The completions observed since the last sync, into their series."""
        for key, tally in self._tallies.items():
            tally.add_to(self._series(key))

    def _series(self, key: tuple) -> _Children:
        """The labelled series of one kind of request, looked up once: `labels()` costs a
        lock and a dict per call, and a completion touches five series."""
        children = self._children.get(key)
        return children if children is not None else self._make_children(key)

    def _make_children(self, key: tuple) -> _Children:
        endpoint, requested, adapter, status, stream, model_name, sent_by = key
        timing = (model_name, endpoint, "true" if stream else "false")
        children = _Children(
            self.requests.labels(model_name, endpoint, requested, adapter, str(status), sent_by),
            self.duration.labels(*timing),
            self.first_chunk.labels(*timing),
            self.own_time.labels(*timing),
            self.prompt_tokens.labels(model_name, adapter),
            self.generation_tokens.labels(model_name, adapter),
        )
        self._children[key] = children
        return children

    def refused(self, endpoint: str, error: OvernightError, sent_by: str = CLIENT) -> None:
        """A completion the proxy refused before forwarding it (a body it cannot read)."""
        model_name = self.model_name()
        status = str(error.status)
        self.requests.labels(model_name, endpoint, OTHER, OTHER, status, sent_by).inc()
        self.failures.labels(model_name, endpoint, error.code).inc()

    # -- counts the proxy keeps, copied ---------------------------------------------------

    def sync(self) -> None:
        """The completions observed since the last sync into their series; copy the
        writer's, the shadow sampler's and the uncaptured paths' counts."""
        self._add_tallies()
        app = self.app
        writer = app.get(WRITER)
        recording = Recording(writer, app.get(RECORDER), app[REDACTOR]) if writer else None
        if recording is not None:  # with the recorder process's rows (capture/recorder.py)
            health = recording.health()
            appended = recording.appended
            self._copy("appended", appended)
            self._copy("committed", health.rows_written)
            self._copy("lost", health.rows_lost)
            self._copy("write_errors", health.write_errors)
            self._copy("compacted", health.rows_compacted)
            self._copy("compact_errors", health.compact_errors)
            waiting = appended - health.rows_written - health.rows_lost
            self.gauges["queued"].set(max(0, waiting))
            self.gauges["degraded"].set(0 if health.status == "ok" else 1)
            self.gauges["quarantined"].set(health.files_quarantined)
            self._copy("redaction", recording.redaction_failures)
        shadow = app[SHADOW]
        stats = shadow.stats
        self._copy("shadow_requests", stats.requests)
        self._copy("shadow_cancelled", stats.preempted)
        self._copy("shadow_failed", stats.failed)
        self._copy("shadow_dropped", stats.dropped)
        self._copy("shadow_siblings", stats.siblings)
        self.gauges["shadow_queued"].set(shadow.queue.qsize())
        for path, n in app[UNCAPTURED].snapshot().items():
            self._copy_labelled(self.uncaptured, (f"/v1/{path}",), n)

    def _copy(self, name: str, value: int) -> None:
        self._copy_labelled(self.copied[name], (), value)

    def _copy_labelled(self, counter: Counter, labels: tuple[str, ...], value: float) -> None:
        key = (counter, labels)
        delta = value - self._copied.get(key, 0)
        if delta > 0:
            (counter.labels(*labels) if labels else counter).inc(delta)
            self._copied[key] = value

    # -- the handler and the worker's loop ------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.sync()
        self.shared.summary = await asyncio.to_thread(self.shared.runs.read)  # cached
        return await self._generate(request)

    async def lifecycle(self, _app: web.Application) -> AsyncIterator[None]:
        """Under --workers N, each worker copies its counts every SYNC_SECONDS: a scrape
        is answered by one worker, from every worker's files."""
        task = asyncio.create_task(self._sync_loop()) if self.multiprocess else None
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.sync()  # the last counts, before the writer closes

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(SYNC_SECONDS)
            try:
                self.sync()
            except Exception:
                log.exception("metrics: could not copy the proxy's counts")


METRICS = web.AppKey("metrics", Metrics)
