"""OpenTelemetry GenAI spans as OTLP/JSON (docs/import.md): one ExportTraceServiceRequest
a line, as the Collector's file exporter writes them (or a file holding one, whole).

A span is a call when it carries the GenAI semantic conventions: `gen_ai.operation.name`
chat or text_completion (or any gen_ai.* messages); other spans are passed over.

    gen_ai.input.messages, gen_ai.system_instructions (JSON: role and parts) -> messages
      (older: gen_ai.system/user/assistant/tool.message events; gen_ai.prompt.N.* attributes)
    gen_ai.output.messages (older: gen_ai.choice events; gen_ai.completion.N.*) -> the answer
    gen_ai.tool.definitions, gen_ai.request.* (temperature, max_tokens, top_p, ...) -> request
    gen_ai.response.id -> the source id (else the span id); model, finish_reasons, usage
    traceId -> the rollout (and its group); gen_ai.conversation.id or session.id -> the group
    startTimeUnixNano, endTimeUnixNano -> started_at, ended_at; status code 2 -> error
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .calls import BadLine, Call
from .lines import Read, per_line

OPERATIONS = ("chat", "text_completion", "generate_content")
_REQUEST = {
    "gen_ai.request.temperature": "temperature", "gen_ai.request.max_tokens": "max_tokens",
    "gen_ai.request.top_p": "top_p", "gen_ai.request.top_k": "top_k",
    "gen_ai.request.seed": "seed", "gen_ai.request.stop_sequences": "stop",
    "gen_ai.request.frequency_penalty": "frequency_penalty",
    "gen_ai.request.presence_penalty": "presence_penalty",
    "gen_ai.request.choice.count": "n",
}  # fmt: skip


def read_otel(source: Path) -> Iterator[Read]:
    return per_line(source, _request, whole=True)


def _request(obj: object, _item) -> list[Call]:
    if not isinstance(obj, dict) or not isinstance(obj.get("resourceSpans"), list):
        raise BadLine("not an OTLP/JSON traces request (no resourceSpans)")
    calls = []
    for resource in obj["resourceSpans"]:
        for scope in resource.get("scopeSpans") or ():
            for span in scope.get("spans") or ():
                call = _span(span)
                if call is not None:
                    calls.append(call)
    return calls


def value(v: dict) -> Any:
    """An OTLP/JSON AnyValue as Python."""
    if not isinstance(v, dict):
        return v
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in v:
            return v[key]
    if "intValue" in v:
        return int(v["intValue"])  # a string in OTLP/JSON (64-bit)
    if "arrayValue" in v:
        return [value(x) for x in v["arrayValue"].get("values") or ()]
    if "kvlistValue" in v:
        return attributes(v["kvlistValue"].get("values"))
    return None


def attributes(pairs: object) -> dict[str, Any]:
    return {p["key"]: value(p.get("value")) for p in pairs or () if isinstance(p, dict)}


def _json(text: Any) -> Any:
    if isinstance(text, str):
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


def _span(span: dict) -> Call | None:
    attrs = attributes(span.get("attributes"))
    operation = attrs.get("gen_ai.operation.name")
    has_messages = any(k.startswith(("gen_ai.input", "gen_ai.prompt")) for k in attrs) or any(
        str(e.get("name", "")).startswith("gen_ai.") for e in span.get("events") or ()
    )
    if operation not in OPERATIONS and not (operation is None and has_messages):
        return None
    events = span.get("events") or ()
    messages, reply, finish = _conversation(attrs, events)
    request: dict[str, Any] = {"model": attrs.get("gen_ai.request.model"), "messages": messages}
    tools = _json(attrs.get("gen_ai.tool.definitions"))
    if isinstance(tools, list):
        request["tools"] = tools
    for key, name in _REQUEST.items():
        if attrs.get(key) is not None:
            request[name] = attrs[key]
    finishes = attrs.get("gen_ai.response.finish_reasons")
    if finish is None and isinstance(finishes, list) and finishes:
        finish = finishes[0]
    usage = {
        "prompt_tokens": attrs.get("gen_ai.usage.input_tokens", attrs.get("gen_ai.usage.prompt_tokens")),
        "completion_tokens": attrs.get("gen_ai.usage.output_tokens", attrs.get("gen_ai.usage.completion_tokens")),
    }  # fmt: skip
    answers = []
    if reply is not None:
        answers = [{"object": "chat.completion", "model": attrs.get("gen_ai.response.model"),
                    "choices": [{"index": 0, "message": reply, "finish_reason": finish}]}]  # fmt: skip
    status = span.get("status") or {}
    failed = status.get("code") in (2, "STATUS_CODE_ERROR")
    error = None
    if failed:
        error = status.get("message") or attrs.get("error.type") or "the span's status is error"
    trace = span.get("traceId")
    group = attrs.get("gen_ai.conversation.id") or attrs.get("session.id")
    started, ended = _nanos(span.get("startTimeUnixNano")), _nanos(span.get("endTimeUnixNano"))
    return Call(
        source_id=str(attrs.get("gen_ai.response.id") or f"span:{trace}:{span.get('spanId')}"),
        request=request,
        answers=answers,
        started_us=started,
        ended_us=ended,
        error=error,
        http_status=None if failed else 200,
        group=group,
        rollout=trace,
        usage=usage,
        latency_ms=(ended - started) / 1000 if started and ended else None,
        notes={"span": {"name": span.get("name"), "span_id": span.get("spanId"),
                        "provider": attrs.get("gen_ai.provider.name") or attrs.get("gen_ai.system")}},
    )  # fmt: skip


def _nanos(text: Any) -> int | None:
    try:
        return int(text) // 1000
    except (TypeError, ValueError):
        return None


def _conversation(attrs: dict, events) -> tuple[list[dict], dict | None, str | None]:
    """The request's messages, the reply and its finish reason, from whichever of the
    conventions' three generations the span uses."""
    inputs = _json(attrs.get("gen_ai.input.messages"))
    if isinstance(inputs, list):
        messages = []
        system = _json(attrs.get("gen_ai.system_instructions"))
        if isinstance(system, list) and system:
            messages.append({"role": "system", "content": _text(system)})
        messages += [_message(m) for m in inputs if isinstance(m, dict)]
        outputs = _json(attrs.get("gen_ai.output.messages"))
        if isinstance(outputs, list) and outputs and isinstance(outputs[0], dict):
            return messages, _message(outputs[0]), outputs[0].get("finish_reason")
        return messages, None, None
    if any(k.startswith("gen_ai.prompt.") for k in attrs):
        return _indexed(attrs, "gen_ai.prompt"), *_first(
            _indexed(attrs, "gen_ai.completion"), attrs
        )
    return _from_events(events)


def _first(replies: list[dict], attrs: dict) -> tuple[dict | None, str | None]:
    if not replies:
        return None, None
    finish = attrs.get("gen_ai.completion.0.finish_reason")
    return replies[0], finish


def _indexed(attrs: dict, prefix: str) -> list[dict]:
    """OpenLLMetry's flat attributes: gen_ai.prompt.0.role, gen_ai.prompt.0.content, ..."""
    out = []
    i = 0
    while f"{prefix}.{i}.role" in attrs or f"{prefix}.{i}.content" in attrs:
        out.append({"role": attrs.get(f"{prefix}.{i}.role") or "assistant",
                    "content": attrs.get(f"{prefix}.{i}.content")})  # fmt: skip
        i += 1
    return out


def _from_events(events) -> tuple[list[dict], dict | None, str | None]:
    messages: list[dict] = []
    reply, finish = None, None
    for event in events:
        name = str(event.get("name", ""))
        body = attributes(event.get("attributes"))
        if name == "gen_ai.choice":
            message = _json(body.get("message")) or {}
            reply = {
                "role": "assistant",
                **(message if isinstance(message, dict) else {"content": message}),
            }
            finish = body.get("finish_reason")
        elif name.startswith("gen_ai.") and name.endswith(".message"):
            role = name[len("gen_ai.") : -len(".message")]
            message = {"role": body.get("role") or role, "content": _json(body.get("content"))}
            if body.get("tool_calls") is not None:
                message["tool_calls"] = _json(body["tool_calls"])
            if body.get("id") is not None and role == "tool":
                message["tool_call_id"] = body["id"]
            messages.append(message)
    return messages, reply, finish


def _text(parts: list) -> str:
    return "".join(
        str(p.get("content", "")) for p in parts if isinstance(p, dict) and p.get("type") == "text"
    )


def _message(m: dict) -> dict:
    """A GenAI message (role and parts) in the chat shape."""
    if "parts" not in m:
        return m
    role = m.get("role") or "user"
    out: dict[str, Any] = {"role": role}
    content: list[dict] = []
    calls = []
    for part in m.get("parts") or ():
        kind = part.get("type")
        if kind == "text":
            content.append({"type": "text", "text": part.get("content", "")})
        elif kind == "tool_call":
            arguments = part.get("arguments")
            calls.append({"id": part.get("id"), "type": "function", "function": {
                "name": part.get("name"),
                "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})  # fmt: skip
        elif kind == "tool_call_response":
            out = {"role": "tool", "tool_call_id": part.get("id")}
            response = part.get("response")
            content.append(
                {
                    "type": "text",
                    "text": response if isinstance(response, str) else json.dumps(response),
                }
            )
        elif kind in ("blob", "uri") and part.get("modality") == "image":
            url = part.get("uri") or f"data:{part.get('mime_type')};base64,{part.get('content')}"
            content.append({"type": "image_url", "image_url": {"url": url}})
    if len(content) == 1 and content[0]["type"] == "text" or not content:
        out["content"] = content[0]["text"] if content else None
    else:
        out["content"] = content
    if calls:
        out["tool_calls"] = calls
    return out
