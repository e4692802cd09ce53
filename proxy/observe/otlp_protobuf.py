"""The OTLP protobuf wire format of the proxy's completion spans, written directly.

An ExportTraceServiceRequest is a few nested length-delimited fields; a span's bytes
are its ids, times, name and attributes. Written here instead of through
opentelemetry-proto's generated classes (~17 µs a span, filled field by field) or the
SDK's encoder (~78 µs, from its ReadableSpans), because the export thread shares the
interpreter lock with the event loop. Most of a completion's attributes (the model, the
endpoint, the status, the sampling parameters) repeat from one request to the next, so
their encoded bytes are kept (`Encoder.cache`) and a span costs ~7-12 µs.
tests/test_tracing.py reads what this writes with opentelemetry-proto.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from overnight.proxy.observe.trace_context import Span

SCOPE = "overnight"  # the instrumentation scope, as the SDK tracer of the night is named
CACHED = 4096  # encoded (key, value) attributes kept; emptied when full
HAS_IS_REMOTE, IS_REMOTE = 0x100, 0x200  # SpanFlags, as the SDK's encoder sets them

# The fields used, from opentelemetry/proto/trace/v1/trace.proto and common/v1/common.proto:
# ExportTraceServiceRequest.resource_spans=1; ResourceSpans.resource=1, scope_spans=2,
# schema_url=3; Resource.attributes=1; ScopeSpans.scope=1, spans=2; InstrumentationScope.
# name=1; Span.trace_id=1, span_id=2, trace_state=3, parent_span_id=4, name=5, kind=6,
# start_time_unix_nano=7 (fixed64), end_time_unix_nano=8 (fixed64), attributes=9,
# dropped_attributes_count=10, status=15, flags=16 (fixed32); Status.message=2, code=3;
# KeyValue.key=1, value=2; AnyValue.string_value=1, bool_value=2, int_value=3,
# double_value=4, array_value=5; ArrayValue.values=1.

_SMALL = [bytes((n,)) for n in range(128)]
_DOUBLE = struct.Struct("<d").pack
_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack
_MASK64 = (1 << 64) - 1


def _varint(n: int) -> bytes:
    if n < 128:
        return _SMALL[n]
    out = bytearray()
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), the length, the bytes."""
    return tag + _varint(len(payload)) + payload


def _any_value(value: Any, limit: int | None) -> bytes:
    kind = type(value)
    if kind is str:
        return _field(b"\x0a", (value if limit is None else value[:limit]).encode())
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is int:
        return b"\x18" + _varint(value & _MASK64)
    if kind is float:
        return b"\x21" + _DOUBLE(value)
    if kind is list or kind is tuple:
        values = b"".join([_field(b"\x0a", _any_value(v, limit)) for v in value])
        return _field(b"\x2a", values)  # an ArrayValue: its values, field 1 each
    return _field(b"\x0a", str(value).encode())  # the SDK drops other types; we keep text


def _key_value(key: str, value: Any, limit: int | None) -> bytes:
    return _field(b"\x0a", key.encode()) + _field(b"\x12", _any_value(value, limit))


class Encoder:
    """ExportTraceServiceRequest bytes from queued spans (used by the one thread only)."""

    def __init__(self, resource: Mapping[str, Any], max_attributes: int | None, limit: int | None):
        self.max_attributes = max_attributes
        self.limit = limit
        self.cache: dict[tuple, bytes] = {}
        attributes = [_field(b"\x0a", _key_value(k, v, None)) for k, v in resource.items()]
        self.resource = _field(b"\x0a", b"".join(attributes))  # ResourceSpans.resource
        self.scope = _field(b"\x0a", _field(b"\x0a", SCOPE.encode()))  # ScopeSpans.scope

    def request(self, spans: list) -> bytes:
        encoded = b"".join([_field(b"\x12", self.span(*item)) for item in spans])
        resource_spans = self.resource + _field(b"\x12", self.scope + encoded)
        return _field(b"\x0a", resource_spans)

    def span(self, span: Span, end_ns: int, error: str | None) -> bytes:
        attributes, dropped = self._attributes(span.attributes)
        parts = [b"\x0a\x10", span.trace_id.to_bytes(16, "big"),
                 b"\x12\x08", span.span_id.to_bytes(8, "big")]  # fmt: skip
        if span.tracestate:
            parts.append(_field(b"\x1a", span.tracestate.encode()))
        if span.parent_id:
            parts += [b"\x22\x08", span.parent_id.to_bytes(8, "big")]
        parts += [_field(b"\x2a", span.name.encode()), b"\x30\x03"]  # name, kind CLIENT
        parts += [b"\x39", _FIXED64(span.start_ns), b"\x41", _FIXED64(end_ns), *attributes]
        if dropped:
            parts += [b"\x50", _varint(dropped)]
        if error is not None:
            status = (_field(b"\x12", error.encode()) if error else b"") + b"\x18\x02"
            parts.append(_field(b"\x7a", status))
        flags = HAS_IS_REMOTE | (IS_REMOTE if span.parent_id else 0)  # a parent is the client's
        parts += [b"\x85\x01", _FIXED32(flags)]
        return b"".join(parts)

    def _attributes(self, attributes: Mapping[str, Any]) -> tuple[list[bytes], int]:
        """Each attribute as a Span.attributes field, its encoding kept when its value is
        a scalar: the same model, endpoint, status on every completion cost one lookup."""
        items: Any = attributes.items()
        dropped = 0
        if self.max_attributes is not None and len(attributes) > self.max_attributes:
            items = [(k, v) for k, v in items if v is not None]
            dropped = max(len(items) - self.max_attributes, 0)  # the SDK keeps the newest
            items = items[dropped:]
        cache, limit, out = self.cache, self.limit, []
        for key, value in items:
            kind = type(value)
            if kind is str:
                memo: tuple = (key, value)
            elif kind is list or kind is tuple:  # finish reasons repeat, record ids do not
                if not all(type(v) is str for v in value):  # [1] and [True] would be one memo
                    out.append(_field(b"\x4a", _key_value(key, value, limit)))
                    continue
                memo = (key, list, *value)
            elif value is None:  # the SDK drops it (with a warning)
                continue
            else:
                memo = (key, kind, value)  # True == 1 == 1.0: the type keeps them apart
            try:
                encoded = cache.get(memo)
            except TypeError:  # a list of lists (not one of ours): encoded, not kept
                out.append(_field(b"\x4a", _key_value(key, value, limit)))
                continue
            if encoded is None:
                encoded = _field(b"\x4a", _key_value(key, value, limit))
                if len(cache) >= CACHED:
                    cache.clear()
                cache[memo] = encoded
            out.append(encoded)
        return out, dropped
