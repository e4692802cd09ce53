"""OpenAI's shapes: `openai-jsonl` and `openai-batch` (docs/import.md).

openai-jsonl, one of these a line:

- a request and its answer, as a logging middleware writes them:
  `{"request": {chat.completions body}, "response": {chat.completion}}`, the response
  also as the list of `chat.completion.chunk`s a stream sent; optional `id`, `error`
  (an OpenAI error object or text), `status_code`, `started_at` / `ended_at` (ISO or
  seconds; else the answer's `created`), `latency_ms`;
- a fine-tuning line, `{"messages": [...], "tools": [...], "parallel_tool_calls": ...}`:
  each assistant message is a call, its request the messages before it (one
  conversation, one rollout; the source has no time: the import's own).

openai-batch: the Batch API's output lines, `{"id": "batch_req_...", "custom_id": ...,
"response": {"status_code": 200, "request_id": ..., "body": {chat.completion}},
"error": null}`, joined by `custom_id` with its input lines (`{"custom_id": ...,
"method": "POST", "url": "/v1/chat/completions", "body": {...}}`) given in the same
source (a directory with both files, or the two concatenated). The inputs are read
first and held compressed until their output comes; an output whose input was not
given keeps a null request (its note says so).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import orjson

from .calls import BadLine, Call, content_id, iso_us, seconds_us, whole_answer
from .lines import Read, error_text, parse, per_line
from .sources import Item, items

_REQUEST_KEYS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")


def read_jsonl(source: Path) -> Iterator[Read]:
    return per_line(source, _jsonl_line)


def _jsonl_line(obj: object, item: Item) -> list[Call]:
    if not isinstance(obj, dict):
        raise BadLine("not a JSON object")
    if "request" in obj:
        return [_pair(obj, item)]
    if isinstance(obj.get("messages"), list):
        return _fine_tuning(obj, item)
    raise BadLine(
        'neither a request/response pair ({"request": ..., "response": ...}) nor a '
        'fine-tuning line ({"messages": [...]})'
    )


def _pair(obj: dict, item: Item) -> Call:
    request = obj["request"]
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        raise BadLine("`request` is not a chat completions body (no `messages` list)")
    response = obj.get("response")
    answers = response if isinstance(response, list) else [response] if response else []
    if not all(isinstance(a, dict) for a in answers):
        raise BadLine("`response` is neither a chat.completion nor a list of chunks")
    first = answers[0] if answers else {}
    started = _time(obj.get("started_at")) or _time(obj.get("timestamp"))
    if started is None:
        started = seconds_us(first.get("created"))
    latency = obj.get("latency_ms")
    ended = _time(obj.get("ended_at"))
    if ended is None and started is not None and isinstance(latency, int | float):
        ended = started + int(latency * 1000)
    error = error_text(obj.get("error"))
    status = obj.get("status_code")
    return Call(
        source_id=str(obj.get("id") or first.get("id") or content_id(item.data)),
        request=request,
        answers=answers,
        started_us=started,
        ended_us=ended,
        error=error,
        http_status=status if isinstance(status, int) else None,
        stream=bool(request.get("stream")) or len(answers) > 1
        or first.get("object") == "chat.completion.chunk",
        latency_ms=float(latency) if isinstance(latency, int | float) else None,
    )  # fmt: skip


def _time(value: object) -> int | None:
    return iso_us(value) if isinstance(value, str) else seconds_us(value)


def _fine_tuning(obj: dict, item: Item) -> list[Call]:
    messages = obj["messages"]
    if not all(isinstance(m, dict) for m in messages):
        raise BadLine("`messages` holds something that is not a message object")
    conversation = content_id(item.data)
    shared = {k: obj[k] for k in _REQUEST_KEYS if k in obj}
    calls = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant" or i == 0:
            continue
        reply = {k: v for k, v in message.items() if k != "weight"}
        finish = "tool_calls" if reply.get("tool_calls") else "stop"
        calls.append(
            Call(
                source_id=f"{conversation}#{i}",
                request={"messages": messages[:i], **shared},
                answers=[whole_answer(reply, finish=finish)],
                rollout=conversation,
                notes={"imported_as": "a fine-tuning example's assistant message"}
                if "weight" not in message
                else {"weight": message["weight"]},
            )
        )
    if not calls:
        raise BadLine("a fine-tuning line without an assistant message after the first")
    return calls


# -- the Batch API -------------------------------------------------------------------------


def read_batch(source: Path) -> Iterator[Read]:
    inputs: dict[str, bytes] = {}  # custom_id -> its body's JSON, compressed
    for item in items(source):
        try:
            obj = parse(item)
        except BadLine:
            continue  # named on the second pass
        if isinstance(obj, dict) and "method" in obj and isinstance(obj.get("body"), dict):
            inputs[str(obj.get("custom_id"))] = zlib.compress(orjson.dumps(obj["body"]))
    for item in items(source):
        try:
            obj = parse(item)
            if isinstance(obj, dict) and "method" in obj and "body" in obj:
                yield item, []  # an input line: read with its output
                continue
            yield item, [_batch_output(obj, item, inputs)]
        except BadLine as e:
            yield item, e
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            yield item, BadLine(f"not a Batch API output line ({type(e).__name__}: {e})")


def _batch_output(obj: object, item: Item, inputs: dict[str, bytes]) -> Call:
    if (
        not isinstance(obj, dict)
        or "custom_id" not in obj
        or not ("response" in obj or "error" in obj)
    ):
        raise BadLine("not a Batch API output line (custom_id, response, error)")
    custom_id = str(obj["custom_id"])
    body = inputs.get(custom_id)
    request = orjson.loads(zlib.decompress(body)) if body is not None else None
    response = obj.get("response") or {}
    status = response.get("status_code") if isinstance(response, dict) else None
    answer = response.get("body") if isinstance(response, dict) else None
    error = error_text(obj.get("error"))
    if isinstance(answer, dict) and "error" in answer and "choices" not in answer:
        error, answer = error or error_text(answer), None
    if error is None and isinstance(status, int) and status != 200:
        error = f"status {status}"
    notes = {"custom_id": custom_id}
    if request is None:
        notes["request"] = "the batch's input line for this custom_id was not given"
    return Call(
        source_id=str(obj.get("id") or custom_id),
        request=request,
        answers=[answer] if isinstance(answer, dict) else [],
        started_us=seconds_us(answer.get("created")) if isinstance(answer, dict) else None,
        error=error,
        http_status=status if isinstance(status, int) else None,
        stream=False,
        notes=notes,
    )
