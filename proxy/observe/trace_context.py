"""A completion span's identity: the client's W3C trace context, the sampling decision,
new ids, and the `traceparent` vLLM gets. What the OpenTelemetry SDK's propagator,
samplers and id generator decide, made without their objects.

Why not the SDK's own: on the event loop its span lifecycle (a Context, a NonRecording
parent, a sampler call, BoundedAttributes, the span processor's locks) measured ~34 µs a
completion, a tenth of the proxy's whole CPU per request at c16 (bench/proxy_overhead.py
`--only observe`). The rules are small and fixed by specifications, so they are
restated here, and tests/test_tracing.py checks each decision against the SDK's:

- `traceparent` (W3C trace context): version 00 is exactly `00-{32 hex}-{16 hex}-{2 hex}`,
  lowercase; a later version may carry more after a dash; ff, an all-zero trace or span
  id, or anything else is no parent (then the span is a root, as with the SDK).
- `tracestate` is kept only with a valid parent, validated by the API's TraceState (the
  SDK's parser), and forwarded to vLLM with the proxy's `traceparent`.
- Samplers from `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` as the SDK reads them:
  always_on, always_off, traceidratio, and the parent-based three (the default,
  parentbased_always_on, follows the client's sampled flag; without a parent its root
  sampler decides). traceidratio samples a trace when its low 64 bits are below
  round(ratio * 2**64); a ratio that is not a number in [0, 1] is 1.0, with a warning.
- Ids from `random.getrandbits` (the SDK's RandomIdGenerator), never zero.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

log = logging.getLogger("overnight.proxy")

TRACEPARENT = re.compile(
    r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$"
)
MAX_HEADER = 512  # the SDK's limit on either header; longer: ignored, as it does
LOW_64 = (1 << 64) - 1
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)


class Parent(NamedTuple):
    """The client's span, from its `traceparent` (and `tracestate`)."""

    trace_id: int
    span_id: int
    sampled: bool
    tracestate: str | None


def parent(headers: Mapping[str, str]) -> Parent | None:
    """The client's span, or None when it sent none or one that is not valid."""
    header = headers.get("traceparent")
    if not header or len(header) > MAX_HEADER:
        return None
    match = TRACEPARENT.search(header)
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if trace_id == "0" * 32 or span_id == "0" * 16 or version == "ff":
        return None
    if version == "00" and rest:
        return None
    state = headers.get("tracestate")
    if state is not None:
        state = _tracestate(state)
    return Parent(int(trace_id, 16), int(span_id, 16), bool(int(flags, 16) & 1), state)


def _tracestate(header: str) -> str | None:
    if len(header) > MAX_HEADER:
        return None
    from opentelemetry.trace.span import TraceState  # the API's parser (rare: imported late)

    return TraceState.from_header([header]).to_header() or None


class Sampler:
    """Whether a new span is sampled, as the SDK's sampler of that name decides."""

    def __init__(self, name: str = "parentbased_always_on", ratio: float = 1.0):
        if name not in SAMPLERS:
            raise ValueError(f"unknown sampler {name!r}")
        self.name = name
        self.parent_based = name.startswith("parentbased_")
        self.root = name.removeprefix("parentbased_")
        self.bound = round(ratio * (LOW_64 + 1))

    def sampled(self, trace_id: int, parent: Parent | None) -> bool:
        if self.parent_based and parent is not None:
            return parent.sampled  # the client's span is remote: its flag decides
        if self.root == "always_on":
            return True
        if self.root == "always_off":
            return False
        return trace_id & LOW_64 < self.bound


def sampler_from(environ: Mapping[str, str]) -> Sampler:
    """The sampler `OTEL_TRACES_SAMPLER` names (the SDK's rules and warnings)."""
    name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").lower()
    if name not in SAMPLERS:
        log.warning("tracing: unknown OTEL_TRACES_SAMPLER %r, using parentbased_always_on", name)
        name = "parentbased_always_on"
    ratio = 1.0
    if name.endswith("traceidratio"):
        try:
            ratio = float(environ.get("OTEL_TRACES_SAMPLER_ARG", ""))
            if not 0.0 <= ratio <= 1.0:
                raise ValueError(ratio)
        except ValueError:
            log.warning("tracing: OTEL_TRACES_SAMPLER_ARG is not a ratio in [0, 1]; using 1.0")
            ratio = 1.0
    return Sampler(name, ratio)


class Span:
    """A completion span on the loop: its ids, and (sampled only) what the thread encodes."""

    __slots__ = ("trace_id", "span_id", "parent_id", "sampled", "tracestate", "name", "start_ns",
                 "attributes")  # fmt: skip

    def __init__(self, parent: Parent | None, sampler: Sampler, name: str, start_ns: int):
        trace_id = parent.trace_id if parent is not None else _new_id(128)
        self.trace_id = trace_id
        self.span_id = _new_id(64)
        self.parent_id = parent.span_id if parent is not None else 0
        self.tracestate = parent.tracestate if parent is not None else None
        self.sampled = sampler.sampled(trace_id, parent)
        self.name = name
        self.start_ns = start_ns
        self.attributes: dict[str, Any] = {}

    def traceparent(self) -> str:
        """This span as vLLM's parent (the flag says whether it was sampled)."""
        flags = "01" if self.sampled else "00"
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{flags}"


def _new_id(bits: int) -> int:
    while True:
        value = random.getrandbits(bits)
        if value:
            return value
