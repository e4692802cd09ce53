"""`overnight import --format litellm|otel|langfuse` (docs/import.md): files shaped as
each tool writes them (LiteLLM's StandardLoggingPayload, OTLP/JSON spans with the GenAI
semantic conventions, Langfuse's ObservationV2 pages and traces), each with tool calls,
an image, a multi-turn session, an error and a malformed line."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from overnight.imports.run import import_source
from overnight.storage import open_db

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 2).decode()
T0 = 1_733_000_000.25  # 2024-11-30 UTC
TOOL_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def _rows(data: Path) -> list[dict]:
    con = open_db(data)
    try:
        cur = con.execute("SELECT * FROM completions ORDER BY started_at, record_id")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    finally:
        con.close()


def _by_id(data: Path) -> dict[str, dict]:
    return {json.loads(r["notes"])["imported"]["id"]: r for r in _rows(data)}


def _import_twice(tmp_path: Path, source: Path, fmt: str):
    data = tmp_path / "data"
    first = import_source(data, source, fmt, say=lambda _: None)
    second = import_source(data, source, fmt, say=lambda _: None)
    assert second.written == 0 and second.already == first.written
    return data, first


# -- LiteLLM ---------------------------------------------------------------------------------


def _payload(i: str, messages, response, **extra) -> dict:
    """litellm.types.utils.StandardLoggingPayload, as a callback gets it (the keys a line
    carries; model_map_information and hidden_params abbreviated)."""
    return {
        "id": i, "trace_id": f"trace-{i}", "session_id": None, "litellm_call_id": i,
        "call_type": "acompletion", "stream": False, "response_cost": 0.00012,
        "cost_breakdown": None, "status": "success",
        "status_fields": {"llm_api_status": "success", "guardrail_status": "not_run"},
        "custom_llm_provider": "openai", "total_tokens": 30, "prompt_tokens": 20,
        "completion_tokens": 10, "startTime": T0, "endTime": T0 + 1.5,
        "completionStartTime": T0 + 0.4, "response_time": 1.5,
        "model_map_information": {"model_map_key": "gpt-4o-mini", "model_map_value": None},
        "model": "gpt-4o-mini", "model_id": "abc", "model_group": "small",
        "api_base": "https://api.openai.com/v1", "metadata": {"user_api_key_hash": "x"},
        "cache_hit": None, "cache_key": None, "saved_cache_cost": 0.0, "request_tags": [],
        "end_user": None, "requester_ip_address": None, "user_agent": None,
        "messages": messages, "response": response, "error_str": None,
        "error_information": {"error_code": "", "error_class": "", "llm_provider": ""},
        "model_parameters": {"temperature": 0.2}, "hidden_params": {"model_id": "abc"},
        "guardrail_information": None, "standard_built_in_tools_params": None, **extra,
    }  # fmt: skip


def _model_response(content, finish="stop", tool_calls=None) -> dict:
    message = {"content": content, "role": "assistant", "tool_calls": tool_calls,
               "function_call": None}  # fmt: skip
    return {"id": "chatcmpl-x", "created": int(T0), "model": "gpt-4o-mini-2024-07-18",
            "object": "chat.completion", "system_fingerprint": None,
            "choices": [{"finish_reason": finish, "index": 0, "message": message}],
            "usage": {"completion_tokens": 10, "prompt_tokens": 20, "total_tokens": 30}}  # fmt: skip


def test_litellm_standard_logging_payloads(tmp_path: Path) -> None:
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    image = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
              {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}]  # fmt: skip
    lines = [
        _payload(
            "a1",
            ask,
            _model_response(None, "tool_calls", [TOOL_CALL]),
            model_parameters={"tools": TOOLS, "temperature": 0.2},
            session_id="sess-1",
        ),  # fmt: skip
        _payload(
            "a2",
            [
                *ask,
                {"role": "assistant", "tool_calls": [TOOL_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            ],
            _model_response("18C and sunny."),
            session_id="sess-1",
            stream=True,
        ),  # fmt: skip
        _payload("a3", image, _model_response("A cat.")),
        _payload(
            "a4",
            ask,
            None,
            status="failure",
            error_str="litellm.RateLimitError: OpenAIException - Rate limit reached",
            error_information={
                "error_code": "429",
                "error_class": "RateLimitError",
                "llm_provider": "openai",
            },
        ),  # fmt: skip
        {"id": "x", "call_type": "aembedding", "messages": []},
    ]
    source = tmp_path / "litellm.jsonl"
    source.write_text("\n".join(json.dumps(x) for x in lines) + "\n{truncated\n")
    data, summary = _import_twice(tmp_path, source, "litellm")
    assert (summary.calls, summary.written, summary.bad.total()) == (4, 4, 2)
    assert summary.bad_named[0].startswith("litellm.jsonl:5: call_type 'aembedding'")
    rows = _by_id(data)
    tool = rows["a1"]
    assert json.loads(tool["request"])["tools"] == TOOLS and tool["finish_reason"] == "tool_calls"
    assert json.loads(tool["request"])["model"] == "small"  # the model group asked for
    assert tool["model_served"] == "gpt-4o-mini-2024-07-18"
    assert (tool["group_id"], tool["rollout_id"]) == ("sess-1", "trace-a1")
    assert rows["a2"]["group_id"] == "sess-1" and rows["a2"]["turn_index"] == 1
    assert rows["a2"]["stream"] is True and rows["a2"]["ttft_ms"] == 400
    assert (tool["prompt_tokens"], tool["completion_tokens"], tool["latency_ms"]) == (20, 10, 1500)
    assert tool["completion_token_ids"] is None and tool["date"].isoformat() == "2024-11-30"
    url = json.loads(rows["a3"]["request"])["messages"][0]["content"][1]["image_url"]["url"]
    assert url.startswith("overnight-image:image/png;sha256:")
    failed = rows["a4"]
    assert failed["http_status"] == 429 and failed["error"].startswith("RateLimitError: ")
    assert json.loads(failed["notes"])["response_cost"] == 0.00012


# -- OpenTelemetry -------------------------------------------------------------------------


def _attr(key: str, value) -> dict:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    if isinstance(value, float):
        return {"key": key, "value": {"doubleValue": value}}
    if isinstance(value, list):
        return {
            "key": key,
            "value": {"arrayValue": {"values": [{"stringValue": v} for v in value]}},
        }
    return {"key": key, "value": {"stringValue": value}}


def _span(span_id: str, start_s: float, attrs: dict, events=(), status=None) -> dict:
    return {
        "traceId": "5b8efff798038103d269b633813fc60c", "spanId": span_id,
        "parentSpanId": "eee19b7ec3c1b173", "name": "chat gpt-4o", "kind": 3,
        "startTimeUnixNano": str(int(start_s * 1e9)),
        "endTimeUnixNano": str(int((start_s + 2) * 1e9)),
        "attributes": [_attr(k, v) for k, v in attrs.items()],
        "events": list(events), "status": status or {},
    }  # fmt: skip


def _export(spans: list[dict]) -> dict:
    """An ExportTraceServiceRequest in OTLP/JSON, as the Collector's file exporter writes."""
    return {"resourceSpans": [{"resource": {"attributes": [_attr("service.name", "agent")]},
            "scopeSpans": [{"scope": {"name": "opentelemetry.instrumentation.openai_v2"},
                            "spans": spans}]}]}  # fmt: skip


def test_otel_genai_spans_new_and_old_conventions(tmp_path: Path) -> None:
    common = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
              "gen_ai.request.model": "gpt-4o", "gen_ai.response.model": "gpt-4o-2024-08-06",
              "gen_ai.conversation.id": "conv-7", "gen_ai.request.temperature": 0.5}  # fmt: skip
    first = _span("a1", T0, {**common, "gen_ai.response.id": "chatcmpl-o1",
        "gen_ai.system_instructions": json.dumps([{"type": "text", "content": "Be brief."}]),
        "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [
            {"type": "text", "content": "Weather in Paris?"}]}]),
        "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [
            {"type": "tool_call", "id": "call_1", "name": "get_weather",
             "arguments": {"city": "Paris"}}], "finish_reason": "tool_call"}]),
        "gen_ai.tool.definitions": json.dumps(TOOLS),
        "gen_ai.usage.input_tokens": 30, "gen_ai.usage.output_tokens": 9})  # fmt: skip
    second = _span("a2", T0 + 3, {**common, "gen_ai.response.id": "chatcmpl-o2",
        "gen_ai.response.finish_reasons": ["stop"]}, events=[
        {"timeUnixNano": "1", "name": "gen_ai.user.message",
         "attributes": [_attr("content", "Weather in Paris?")]},
        {"timeUnixNano": "1", "name": "gen_ai.assistant.message",
         "attributes": [_attr("tool_calls", json.dumps([TOOL_CALL]))]},
        {"timeUnixNano": "1", "name": "gen_ai.tool.message",
         "attributes": [_attr("content", "18C"), _attr("id", "call_1")]},
        {"timeUnixNano": "1", "name": "gen_ai.choice",
         "attributes": [_attr("index", 0), _attr("finish_reason", "stop"),
                        _attr("message", json.dumps({"content": "18C and sunny."}))]},
    ])  # fmt: skip
    image = _span("a3", T0 + 9, {**common, "gen_ai.response.id": "chatcmpl-o3",
        "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [
            {"type": "text", "content": "What is it?"},
            {"type": "blob", "modality": "image", "mime_type": "image/png", "content": PNG}]}]),
        "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [
            {"type": "text", "content": "A cat."}], "finish_reason": "stop"}])})  # fmt: skip
    failed = _span("a4", T0 + 12, {**common, "error.type": "RateLimitError"},
                   status={"code": 2, "message": "429 Too Many Requests"})  # fmt: skip
    tool_span = _span("a5", T0, {"gen_ai.operation.name": "execute_tool"})
    source = tmp_path / "traces.jsonl"
    source.write_text(
        json.dumps(_export([first, second, tool_span]))
        + "\n" + json.dumps(_export([image, failed])) + "\n" + '{"resourceLogs": []}\n'
    )  # fmt: skip
    data, summary = _import_twice(tmp_path, source, "otel")
    assert (summary.lines, summary.calls, summary.written, summary.bad.total()) == (3, 4, 4, 1)
    rows = _by_id(data)
    one = rows["chatcmpl-o1"]
    request = json.loads(one["request"])
    assert request["messages"] == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Weather in Paris?"}]  # fmt: skip
    assert request["tools"] == TOOLS and request["temperature"] == 0.5
    reply = json.loads(one["response"])["choices"][0]["message"]
    assert reply["tool_calls"][0]["function"] == {"name": "get_weather",
                                                  "arguments": '{"city": "Paris"}'}  # fmt: skip
    assert (one["prompt_tokens"], one["completion_tokens"], one["latency_ms"]) == (30, 9, 2000)
    assert one["group_id"] == "conv-7" and one["rollout_id"] == "5b8efff798038103d269b633813fc60c"
    assert one["date"].isoformat() == "2024-11-30"
    two = rows["chatcmpl-o2"]
    assert [m["role"] for m in json.loads(two["request"])["messages"]] == [
        "user", "assistant", "tool"]  # fmt: skip
    assert json.loads(two["response"])["choices"][0]["message"]["content"] == "18C and sunny."
    assert two["turn_index"] == 1 and two["finish_reason"] == "stop"
    parts = json.loads(rows["chatcmpl-o3"]["request"])["messages"][0]["content"]
    assert parts[1]["image_url"]["url"].startswith("overnight-image:image/png;sha256:")
    bad = next(r for r in rows.values() if r["error"])
    assert bad["error"] == "429 Too Many Requests" and bad["response"] is None


def test_otel_a_whole_pretty_printed_document(tmp_path: Path) -> None:
    span = _span("b1", T0, {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m",
        "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "Hi",
        "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "Hello",
        "gen_ai.completion.0.finish_reason": "stop"})  # fmt: skip
    source = tmp_path / "trace.json"
    source.write_text(json.dumps(_export([span]), indent=2))
    data, summary = _import_twice(tmp_path, source, "otel")
    (row,) = _rows(data)
    assert json.loads(row["request"])["messages"] == [{"role": "user", "content": "Hi"}]
    assert json.loads(row["response"])["choices"][0]["message"]["content"] == "Hello"


# -- Langfuse --------------------------------------------------------------------------------


def _observation(i: str, trace: str, start: str, kind="GENERATION", **extra) -> dict:
    """langfuse.api.ObservationV2 as the public API returns it (camelCase aliases)."""
    return {
        "id": i, "traceId": trace, "startTime": start, "endTime": start.replace(".000Z", ".900Z"),
        "projectId": "proj", "parentObservationId": None, "type": kind,
        "isRootObservation": False, "name": "OpenAI-generation", "level": "DEFAULT",
        "statusMessage": None, "version": None, "environment": "default",
        "userId": "u1", "sessionId": "sess-9", "completionStartTime": start.replace(".000Z", ".500Z"),
        "createdAt": start, "updatedAt": start, "input": None, "output": None,
        "metadata": {}, "model": "gpt-4o-mini", "internalModelId": "m1",
        "modelParameters": {"temperature": "0.7", "max_tokens": "256"},
        "usageDetails": {"input": 25, "output": 7, "total": 32},
        "costDetails": {"total": 0.0001}, "totalCost": 0.0001, "promptId": None,
        "latency": 2.0, "timeToFirstToken": 0.5, "traceName": "weather", "tags": [], **extra,
    }  # fmt: skip


def test_langfuse_observation_pages_and_traces(tmp_path: Path) -> None:
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    page = {
        "data": [
            _observation(
                "g1",
                "t1",
                "2024-11-30T10:00:00.000Z",
                input={"messages": ask, "tools": TOOLS},
                output={"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
            ),  # fmt: skip
            _observation("s1", "t1", "2024-11-30T10:00:00.000Z", kind="SPAN"),
            _observation(
                "g2",
                "t1",
                "2024-11-30T10:00:03.000Z",
                input=json.dumps(
                    [
                        *ask,
                        {"role": "assistant", "tool_calls": [TOOL_CALL]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
                    ]
                ),
                output="18C and sunny.",
            ),  # fmt: skip
            _observation(
                "g3",
                "t2",
                "2024-11-30T10:05:00.000Z",
                input=ask,
                output=None,
                level="ERROR",
                statusMessage="Error: 429 Rate limit reached",
            ),  # fmt: skip
        ],
        "meta": {"cursor": None},
    }
    trace = {  # GET /api/public/traces/{id}: the older API, its observations nested
        "id": "t3", "timestamp": "2024-11-30T11:00:00.000Z", "name": "weather",
        "sessionId": "sess-10", "input": None, "output": None,
        "observations": [
            _observation("g4", "t3", "2024-11-30T11:00:00.000Z", sessionId=None,
                         input=[{"role": "user", "content": [
                             {"type": "text", "text": "And this?"},
                             {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}],
                         output={"role": "assistant", "content": "A cat."}),
        ],
    }  # fmt: skip
    folder = tmp_path / "langfuse"
    folder.mkdir()
    (folder / "observations.json").write_text(json.dumps(page, indent=2))
    (folder / "traces.jsonl").write_text(json.dumps(trace) + "\n" + '{"name": "x"}\n')
    data, summary = _import_twice(tmp_path, folder, "langfuse")
    assert (summary.calls, summary.written, summary.bad.total()) == (4, 4, 1)
    assert summary.bad_named == [
        "traces.jsonl:2: neither an observation (id, type) nor a trace (observations)"]  # fmt: skip
    rows = _by_id(data)
    one = rows["g1"]
    request = json.loads(one["request"])
    assert request["tools"] == TOOLS and request["temperature"] == 0.7
    assert request["max_tokens"] == 256 and request["model"] == "gpt-4o-mini"
    assert one["finish_reason"] == "tool_calls" and (one["group_id"], one["rollout_id"]) == (
        "sess-9", "t1")  # fmt: skip
    assert (one["prompt_tokens"], one["completion_tokens"], one["ttft_ms"]) == (25, 7, 500)
    assert one["started_at"].isoformat() == "2024-11-30T10:00:00+00:00"
    two = rows["g2"]
    assert two["turn_index"] == 1 and json.loads(two["response"])["choices"][0]["message"] == {
        "role": "assistant", "content": "18C and sunny."}  # fmt: skip
    assert rows["g3"]["error"] == "Error: 429 Rate limit reached"
    four = rows["g4"]
    assert four["group_id"] == "sess-10" and four["rollout_id"] == "t3"
    url = json.loads(four["request"])["messages"][0]["content"][1]["image_url"]["url"]
    assert url.startswith("overnight-image:image/png;sha256:")
