"""LiteLLM's logs: one `StandardLoggingPayload` a line (litellm/types/utils.py), as a
custom callback or the proxy's logging integrations write it (docs/import.md).

    id -> the source id; trace_id -> the rollout (and its group); session_id -> the group
    messages, model_parameters (tools, temperature, response_format, ...) -> the request
    response (a ModelResponse dumped: a chat.completion) -> the answer
    startTime, endTime, completionStartTime (seconds) -> started_at, ended_at, ttft_ms
    status "failure", error_str, error_information -> error, http_status
    prompt_tokens, completion_tokens, stream -> the same columns
    model_group, api_base, response_cost, cache_hit, end_user, request_tags -> notes
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from .calls import BadLine, Call, seconds_us, whole_answer
from .lines import Read, per_line

_NOTED = ("model_group", "custom_llm_provider", "response_cost", "cache_hit", "end_user",
          "request_tags", "call_type")  # fmt: skip


def read_litellm(source: Path) -> Iterator[Read]:
    return per_line(source, _payload)


def _payload(obj: object, _item) -> list[Call]:
    if not isinstance(obj, dict) or "id" not in obj or "messages" not in obj:
        raise BadLine("not a StandardLoggingPayload (no id, messages)")
    if obj.get("call_type") not in (None, "completion", "acompletion", "text_completion",
                                    "atext_completion"):  # fmt: skip
        raise BadLine(f"call_type {obj.get('call_type')!r} is not a chat or text completion")
    messages = obj["messages"]
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if isinstance(messages, dict):
        messages = [messages]
    if not isinstance(messages, list):
        raise BadLine("`messages` is not a list of messages")
    parameters = obj.get("model_parameters") or {}
    request = {
        "model": obj.get("model_group") or obj.get("model"),
        "messages": messages,
        **{k: v for k, v in parameters.items() if v is not None},
    }
    if obj.get("stream") is not None:
        request["stream"] = obj["stream"]
    response = obj.get("response")
    failed = obj.get("status") == "failure"
    answers: list[dict] = []
    if isinstance(response, dict) and response.get("choices"):
        answers = [response]
    elif isinstance(response, str) and response and not failed:
        answers = [whole_answer({"role": "assistant", "content": response}, model=obj.get("model"))]
    info = obj.get("error_information") or {}
    error = None
    if failed:
        error = obj.get("error_str") or info.get("error_message") or "failed"
        if info.get("error_class"):
            error = f"{info['error_class']}: {error}"
    code = str(info.get("error_code") or "")
    started, ended = seconds_us(obj.get("startTime")), seconds_us(obj.get("endTime"))
    first = seconds_us(obj.get("completionStartTime"))
    trace = obj.get("trace_id")
    return [
        Call(
            source_id=str(obj["id"]),
            request=request,
            answers=answers,
            started_us=started,
            ended_us=ended,
            error=error,
            http_status=int(code) if code.isdigit() else (None if failed else 200),
            stream=obj.get("stream"),
            group=obj.get("session_id"),
            rollout=trace,
            usage={"prompt_tokens": obj.get("prompt_tokens"),
                   "completion_tokens": obj.get("completion_tokens")},
            latency_ms=(ended - started) / 1000 if started and ended else None,
            ttft_ms=(first - started) / 1000 if started and first and failed is False else None,
            notes={k: obj[k] for k in _NOTED if obj.get(k) not in (None, [], "")},
        )
    ]  # fmt: skip
