"""Langfuse's observations (docs/import.md): its public API's (`GET /api/public/v2/observations`
pages, `ObservationV2`; the older `/observations`, and `GET /traces/{id}` with its
observations nested) or an export of them, one a line or one page a file.

Only GENERATION observations are calls; spans and events are passed over.

    id -> the source id; traceId -> the rollout (and its group); sessionId -> the group
    input: a list of messages, or {"messages": [...], "tools": [...]}, or text -> request
    output: an assistant message, a chat.completion, or text -> the answer
    model, modelParameters -> the request's model and sampling parameters
    startTime, endTime, completionStartTime (ISO) -> started_at, ended_at, ttft_ms
    usageDetails {input, output} (older usage {input, output} or {promptTokens, ...})
    level ERROR with statusMessage -> error
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .calls import BadLine, Call, iso_us, whole_answer
from .lines import Read, per_line


def read_langfuse(source: Path) -> Iterator[Read]:
    return per_line(source, _document, whole=True)


def _document(obj: object, _item) -> list[Call]:
    if isinstance(obj, list):
        found = obj
    elif isinstance(obj, dict) and isinstance(obj.get("data"), list):
        found = obj["data"]  # an API page
    elif isinstance(obj, dict):
        found = [obj]
    else:
        raise BadLine("neither an observation, a trace, nor a page of them")
    calls = []
    for one in found:
        if not isinstance(one, dict):
            raise BadLine("a page holds something that is not an object")
        if isinstance(one.get("observations"), list) and "type" not in one:  # a trace
            session = one.get("sessionId")
            for o in one["observations"]:
                if isinstance(o, dict):
                    trace = {"sessionId": session, "traceId": one.get("id")}
                    calls += _observation({**o, **{k: o.get(k) or v for k, v in trace.items()}})
        elif "type" in one and "id" in one:
            calls += _observation(one)
        else:
            raise BadLine("neither an observation (id, type) nor a trace (observations)")
    return calls


def _json(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _observation(o: dict) -> list[Call]:
    if o.get("type") != "GENERATION":
        return []
    given = _json(o.get("input"))
    request: dict[str, Any] = {"model": o.get("model")}
    if isinstance(given, dict) and isinstance(given.get("messages"), list):
        request.update(given)
    elif isinstance(given, list):
        request["messages"] = given
    elif given is not None:
        request["messages"] = [{"role": "user", "content": given if isinstance(given, str)
                                else json.dumps(given)}]  # fmt: skip
    else:
        request["messages"] = []
    parameters = o.get("modelParameters")
    if isinstance(parameters, dict):
        request.update({k: _number(v) for k, v in parameters.items() if v is not None})
    output = _json(o.get("output"))
    usage = _usage(o.get("usageDetails") or o.get("usage") or {})
    answers: list[dict] = []
    if isinstance(output, dict) and "choices" in output:
        answers = [output]
    elif isinstance(output, dict) and ("content" in output or "tool_calls" in output):
        message = {"role": output.get("role") or "assistant", **output}
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        answers = [whole_answer(message, model=o.get("model"), finish=finish)]
    elif isinstance(output, str):
        answers = [whole_answer({"role": "assistant", "content": output}, model=o.get("model"),
                                finish="stop")]  # fmt: skip
    error = None
    if o.get("level") == "ERROR":
        error = o.get("statusMessage") or "the observation's level is ERROR"
    started, ended = iso_us(o.get("startTime")), iso_us(o.get("endTime"))
    first = iso_us(o.get("completionStartTime"))
    trace = o.get("traceId")
    return [
        Call(
            source_id=str(o["id"]),
            request=request,
            answers=answers,
            started_us=started,
            ended_us=ended,
            error=error,
            http_status=None if error else 200,
            group=o.get("sessionId"),
            rollout=trace,
            usage=usage,
            latency_ms=(ended - started) / 1000 if started and ended else None,
            ttft_ms=(first - started) / 1000 if started and first else None,
            notes={k: o[k] for k in ("name", "promptName", "totalCost") if o.get(k) is not None},
        )
    ]


def _number(v: Any) -> Any:
    """Langfuse keeps model parameters as strings ("0.7", "256"): numbers again."""
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                return v
    return v


def _usage(u: dict) -> dict:
    if not isinstance(u, dict):
        return {}
    return {
        "prompt_tokens": u.get("input", u.get("promptTokens")),
        "completion_tokens": u.get("output", u.get("completionTokens")),
    }
