"""A CLIENT span per completion, after OpenTelemetry's GenAI semantic conventions.

Off unless the environment names a collector (overnight/telemetry.py): then `install`
puts a `ProxyTracing` under `TRACING` and the handlers find it there; off, the key is
absent and no span object is ever made.

A span starts when the completion is accepted (its start time is the record's), as a
child of the client's `traceparent` when it sent one (W3C trace context), and its own
`traceparent` replaces the client's on the request to vLLM, so vLLM's spans (its
`--otlp-traces-endpoint`) nest under the proxy's. It ends when the record is built,
with the end time of the answer, and carries what the record says: the adapter that
served it, the response id, finish reasons, token counts, the status. The rollout is
`gen_ai.conversation.id`, the group `session.id`: Langfuse shows a session per group.

Message contents go on the span only with `--trace-contents`, and are read from the
records after the `--redact` hook ran, so what a trace shows is what the store keeps.
An exporter that fails (a collector that is down) fails nothing: ended spans are
queued and a thread exports them (otlp.py), and a span that cannot be made is logged
and skipped. No SDK span object is made on the loop: the ids, the parent and the
sampling decision are trace_context.py's, the attributes a plain dict (the SDK's span
lifecycle cost ~34 µs a request there; this one a few).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson
from aiohttp import web

from overnight.config import ProxyConfig
from overnight.config.upstream_kind import HOSTED_KINDS
from overnight.proxy.capture.attribution import Attribution
from overnight.proxy.capture.captures import Capture
from overnight.proxy.observe.trace_context import Sampler, Span, parent, sampler_from
from overnight.telemetry import check_environment, wall_ns

if TYPE_CHECKING:
    from overnight.proxy.observe.otlp import Exporter

log = logging.getLogger("overnight.proxy")

PROVIDER = "vllm"  # gen_ai.provider.name: the server behind the proxy (a hosted API: its kind)
# Request fields and the GenAI attribute each becomes (the sampling parameters).
SAMPLING = {
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "max_tokens": "gen_ai.request.max_tokens",
    "max_completion_tokens": "gen_ai.request.max_tokens",
    "max_output_tokens": "gen_ai.request.max_tokens",  # Responses
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "seed": "gen_ai.request.seed",
    "n": "gen_ai.request.choice.count",
}
TRACE_HEADERS = ("traceparent", "tracestate")


class ProxyTracing:
    """The sampler and the exporter, and a span's start, forwarding and end."""

    def __init__(self, exporter: Exporter, sampler: Sampler, contents: bool, provider=PROVIDER):
        self.exporter = exporter
        self.sampler = sampler
        self.contents = contents
        self.provider = provider  # vllm, or the hosted API's kind (openai, anthropic)

    def start(self, request: web.Request, capture: Capture, who: Attribution, started: int):
        """The span of `capture`, begun at `started` (µs, when the request was accepted)."""
        body = request_fields(capture.request_body)
        operation = capture.shape.operation  # the GenAI operation: chat, text_completion
        try:
            name = f"{operation} {body.get('model') or ''}".rstrip()
            span = Span(parent(request.headers), self.sampler, name, started * 1000)
            if span.sampled:  # an unsampled span only names vLLM's parent
                span.attributes = start_attributes(operation, capture, who, body, self.provider)
            capture.span = span
        except Exception:  # tracing must never fail a request
            log.exception("tracing: could not start the span of %s", capture.request_id)

    def forwarded(self, capture: Capture, headers: dict[str, str]) -> None:
        """`headers` for vLLM carry this span's trace context instead of the client's."""
        for name in [k for k in headers if k.lower() in TRACE_HEADERS]:
            del headers[name]
        span = capture.span
        headers["traceparent"] = span.traceparent()
        if span.tracestate:
            headers["tracestate"] = span.tracestate

    def end(self, capture: Capture, rows: list[dict]) -> None:
        """End the span with what the (redacted) records say, and queue it for export."""
        span, capture.span = capture.span, None
        if span is None or not span.sampled:
            return
        error = None
        try:
            span.attributes.update(end_attributes(capture, rows))
            if self.contents and rows and rows[0].get("logged"):
                span.attributes.update(contents(rows))
            if capture.error is not None or capture.status >= 400:
                error = capture.error or ""
        except Exception:  # a record of a shape not foreseen here: the span ends anyway
            log.exception("tracing: could not describe the span of %s", capture.request_id)
        done = capture.latency_ms
        end_ns = time.time_ns() if done is None else wall_ns(capture.t0 + done / 1000)
        self.exporter.submit(span, end_ns, error)


TRACING = web.AppKey("tracing", ProxyTracing)


def install(app: web.Application, config: ProxyConfig) -> None:
    """Tracing for this app when the environment asks for it; stopped with the app."""
    if not check_environment(os.environ):
        return
    from overnight.proxy.observe import otlp

    exporter = otlp.from_environment("overnight-proxy", os.environ)
    hosted = config.upstream_kind in HOSTED_KINDS  # else vLLM, `auto` left open included
    provider = config.upstream_kind if hosted else PROVIDER
    app[TRACING] = ProxyTracing(exporter, sampler_from(os.environ), config.trace_contents, provider)
    log.info("tracing: OTLP/HTTP spans to %s", exporter.endpoint)

    async def stop(app: web.Application) -> None:
        import asyncio

        # Up to its deadline, off the loop: the last spans are exported, or dropped.
        await asyncio.get_running_loop().run_in_executor(None, exporter.shutdown)

    app.on_cleanup.append(stop)


def sent_to(capture: Capture, upstream: Any) -> None:
    """The replica that answered, as `server.address` and `server.port`."""
    span = capture.span
    if span is None or not span.sampled:
        return
    replica = getattr(upstream, "replica", None)
    if replica is None:
        return
    host, port = _address(replica.url)
    span.attributes["server.address"] = host
    if port is not None:
        span.attributes["server.port"] = port


@functools.lru_cache(maxsize=64)  # a few replicas, parsed once each, not per request
def _address(url: str) -> tuple[str, int | None]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port


def request_fields(body: Any) -> dict:
    return body if isinstance(body, dict) else {}


def start_attributes(
    operation: str, capture: Capture, who: Attribution, body: dict, provider: str = PROVIDER
) -> dict:
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": provider,
        "gen_ai.request.stream": capture.stream,
        "overnight.request_id": capture.request_id,
        "overnight.endpoint": capture.endpoint,
        "overnight.attribution": who.source,
        # `client`, or what of overnight's own sent it: the agents' spans are the
        # `client` ones (storage/read/sent_by.py); Langfuse filters on its metadata.
        "overnight.sent_by": capture.sent_by,
        "langfuse.trace.metadata.sent_by": capture.sent_by,
    }
    if isinstance(body.get("model"), str):
        attributes["gen_ai.request.model"] = body["model"]
    for field, name in SAMPLING.items():
        if field in body and type(body[field]) in (int, float):  # JSON's numbers, not bools
            attributes[name] = body[field]
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if isinstance(stops, list) and stops and all(isinstance(s, str) for s in stops):
        attributes["gen_ai.request.stop_sequences"] = stops
    if who.rollout_id is not None:  # a rollout is a conversation; its group a session
        attributes["gen_ai.conversation.id"] = who.rollout_id
        attributes["langfuse.trace.metadata.rollout_id"] = who.rollout_id
    group = who.group_id or who.rollout_id
    if group is not None:
        attributes["session.id"] = group
        attributes["langfuse.trace.metadata.group_id"] = group
    return attributes


def end_attributes(capture: Capture, rows: list[dict]) -> dict:
    attributes: dict[str, Any] = {
        # The record's: a hosted API's names the model that answered (records.py).
        "gen_ai.response.model": rows[0]["model_served"] if rows else capture.route.served,
        "http.response.status_code": capture.status,
    }
    if capture.route.version is not None:
        attributes["overnight.adapter_version"] = capture.route.version
    response_id = capture.acc.meta.get("id")
    if isinstance(response_id, str):
        attributes["gen_ai.response.id"] = response_id
    reasons = [r["finish_reason"] for r in rows if r.get("finish_reason")]
    if reasons:
        attributes["gen_ai.response.finish_reasons"] = reasons
    if rows and rows[0].get("prompt_tokens") is not None:
        attributes["gen_ai.usage.input_tokens"] = rows[0]["prompt_tokens"]
    outputs = [r["completion_tokens"] for r in rows if r.get("completion_tokens") is not None]
    if outputs:
        attributes["gen_ai.usage.output_tokens"] = sum(outputs)
    if rows:
        attributes["overnight.turn_index"] = rows[0]["turn_index"]
        attributes["overnight.record_ids"] = [r["record_id"] for r in rows]
    if capture.ttft_ms is not None:
        attributes["overnight.ttft_ms"] = capture.ttft_ms
    kind = error_type(capture, rows)
    if kind is not None:
        attributes["error.type"] = kind
    return attributes


def error_type(capture: Capture, rows: list[dict]) -> str | None:
    """Low-cardinality, as the conventions ask: the HTTP status of a failed request, or
    what broke a stream that had begun (its status was already 200)."""
    if capture.status >= 400:
        return str(capture.status)
    error = capture.error or next((r["error"] for r in rows if r.get("error")), None)
    if error is None:
        return None
    for prefix, kind in (
        ("client disconnected", "client_disconnected"),
        ("upstream stream broke", "upstream_disconnected"),
        ("upstream error in stream", "upstream_error"),
        ("redaction failed", None),  # the request itself went well
    ):
        if prefix in error:
            return kind
    return "_OTHER"


# -- contents (--trace-contents) -------------------------------------------------------


def contents(rows: list[dict]) -> dict[str, str]:
    """`gen_ai.input.messages` and `gen_ai.output.messages` as the conventions shape
    them (JSON text: role, parts), from the stored (redacted) request and responses."""
    out: dict[str, str] = {}
    request = rows[0].get("request")
    if isinstance(request, dict):
        if isinstance(request.get("messages"), list):
            messages = [_message(m) for m in request["messages"] if isinstance(m, dict)]
        else:
            messages = [{"role": "user", "parts": _parts(request.get("prompt"))}]
        out["gen_ai.input.messages"] = orjson.dumps(messages).decode()
    replies = [_reply(r["response"]) for r in rows if isinstance(r.get("response"), dict)]
    replies = [r for r in replies if r is not None]
    if replies:
        out["gen_ai.output.messages"] = orjson.dumps(replies).decode()
    return out


def _reply(response: dict) -> dict | None:
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        return None
    choice = choices[0]
    message = choice.get("message") or {"role": "assistant", "content": choice.get("text")}
    return {**_message(message), "finish_reason": choice.get("finish_reason")}


def _message(message: Mapping) -> dict:
    role = message.get("role") or "user"
    if role == "tool":
        part = {"type": "tool_call_response", "id": message.get("tool_call_id")}
        return {"role": role, "parts": [{**part, "response": message.get("content")}]}
    parts = _parts(message.get("content"))
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        parts.insert(0, {"type": "reasoning", "content": reasoning})
    for call in message.get("tool_calls") or []:
        if isinstance(call, dict):
            function = call.get("function") or {}
            parts.append(
                {
                    "type": "tool_call",
                    "id": call.get("id"),
                    "name": function.get("name"),
                    "arguments": function.get("arguments"),
                }
            )
    return {"role": role, "parts": parts}


def _parts(content: Any) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    if isinstance(content, list):  # content parts: text kept, the others named only
        return [
            {"type": "text", "content": p.get("text")}
            if p.get("type") in ("text", "input_text", "output_text")
            else {"type": str(p.get("type"))}
            for p in content
            if isinstance(p, dict)
        ]
    return []
