"""A call read from another tool's log, and the `completions` rows it becomes.

Every format reads its lines as `Call`s: the request in the chat shape (model, messages,
tools, response format, sampling parameters, as the service was asked), the answer as
one or more chat.completion objects or chunks (assembled with the proxy's own
accumulator, proxy/capture/chat.py), the call's own times, usage, its error, and where
the source groups calls (a Langfuse trace or session, a LiteLLM `trace_id`).

A row of an imported call is marked so, in its `notes`:

    {"imported": {"format": ..., "id": the source's id, "file": ..., "line": ...},
     "upstream": "imported:<format>",
     "completion_token_ids": "imported: no token ids (off-policy)"}

`upstream` is what a hosted model's rows carry (proxy/capture/records.py): the trainer
reads it and never trains GRPO on such a turn as if the policy had sampled it
(trainer/grpo/logged_turns.py). Token ids and logprobs are null: none exist for such a
call, and none are invented.

Ids are stable: a row's `record_id` is a hash of the format, the source's id for the
call (else a hash of its line) and the choice, so importing the same file again finds
every row already stored (run.py) and adds nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from overnight.proxy.capture.chat import CHAT, Accumulator
from overnight.proxy.capture.records import conversation_turns
from overnight.storage import SCHEMA_VERSION
from overnight.storage.read.sent_by import CLIENT

PREFIX = "imp-"  # every imported row's record_id starts so (run.py reads them back by it)
NO_IDS = "imported: no token ids (off-policy)"


class BadLine(ValueError):
    """A line (or document) that is not a call of its format: counted, named, skipped."""


@dataclass
class Call:
    """One model call as another tool logged it."""

    source_id: str  # the source's id for the call, or a hash of its line
    request: dict | None  # chat-shaped: model, messages, tools, response_format, ...
    answers: list[dict] = field(default_factory=list)  # chat.completion objects or chunks
    started_us: int | None = None
    ended_us: int | None = None
    error: str | None = None
    http_status: int | None = None
    stream: bool | None = None
    # The source's session or conversation: the row's group. With `rollout`, the row
    # counts as attributed (`attribution` "import"), as a client naming its rollout does.
    group: str | None = None
    rollout: str | None = None  # the source's trace: the rollout (its group without a session)
    usage: dict | None = None  # when the answer does not carry it
    latency_ms: float | None = None
    ttft_ms: float | None = None
    notes: dict = field(default_factory=dict)  # what else the row says (what was lost)


def content_id(data: bytes) -> str:
    """A line's own id when the source gives none: the hash of its bytes, stripped."""
    return "sha256:" + hashlib.sha256(data.strip()).hexdigest()[:32]


def _hashed(*parts: object) -> str:
    text = "\x00".join(str(p) for p in parts)
    return PREFIX + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:28]


def rows_of(
    call: Call, fmt: str, where: dict, now: int, as_policy: str | None = None
) -> list[dict]:
    """The call's rows: one per choice of its answer (one with none: a failed call).
    `as_policy`: the alias they count as asked for (a policy's night reads them: storage/
    read/policy_scope.py); the request keeps the model it named."""
    acc = Accumulator(CHAT)
    for answer in call.answers:
        if isinstance(answer, dict):
            acc.add(answer)
    indices = sorted(acc.choices) or [0]
    usage = acc.usage or call.usage or {}
    request_id = _hashed(fmt, call.source_id)
    base_rollout = call.rollout or request_id
    error = call.error
    if error is None and acc.error is not None:
        error = f"upstream error: {acc.error}"
    started = call.started_us if call.started_us is not None else now
    request = call.request
    turns = conversation_turns(request) if isinstance(request, dict) else 0
    rows = []
    for index in indices:
        state = acc.choices.get(index)
        response = _clean(acc.response(index)) if state is not None else None
        n = len(indices)
        imported = {"format": fmt, "id": call.source_id, **where}
        notes: dict[str, Any] = {
            "imported": imported, "upstream": f"imported:{fmt}", "completion_token_ids": NO_IDS,
            **call.notes,
        }  # fmt: skip
        if call.started_us is None:
            notes["started_at"] = "the source gives no time: the import's own"
        rows.append(
            {
                "record_id": _hashed(fmt, call.source_id, index),
                "request_id": request_id,
                "schema_version": SCHEMA_VERSION,
                "started_at": started,
                "ended_at": call.ended_us if call.ended_us is not None else started,
                "group_id": call.group or base_rollout,
                "rollout_id": base_rollout if n == 1 else f"{base_rollout}.{index}",
                "attribution": "none" if call.group is None and call.rollout is None else "import",
                "turn_index": turns,
                "choice_index": index,
                "endpoint": CHAT,
                "model_requested": as_policy or (
                    request.get("model") if isinstance(request, dict) else None
                ),
                "model_served": acc.meta.get("model"),
                "adapter_version": None,
                "request": request if not rows else None,
                "request_shared": True if n > 1 else None,
                "response": response,
                "prompt_token_ids": None,
                "completion_token_ids": None,
                "completion_logprobs": None,
                "finish_reason": state.finish_reason if state else None,
                "http_status": call.http_status if call.http_status is not None else (
                    200 if error is None else None
                ),
                "error": error,
                "partial": state is not None and state.finish_reason is None and error is None
                and bool(call.stream),
                "latency_ms": call.latency_ms,
                "ttft_ms": call.ttft_ms,
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens") if n == 1 else None,
                "stream": call.stream,
                "logged": True,
                "proxy_id": f"import:{fmt}",
                "sent_by": CLIENT,
                "notes": notes,
            }
        )  # fmt: skip
    return rows


def _clean(response: dict) -> dict:
    """The answer as stored: no usage of None, no logprobs (the service's, never ours)."""
    out = {k: v for k, v in response.items() if v is not None}
    for choice in out.get("choices", ()):
        choice.pop("logprobs", None)
        if choice.get("stop_reason") is None:
            choice.pop("stop_reason", None)
    return out


def seconds_us(value: Any) -> int | None:
    """Seconds since the epoch (an int or a float) as microseconds; None if not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(round(value * 1_000_000))


def iso_us(value: Any) -> int | None:
    """An ISO 8601 time ("2025-01-02T03:04:05.123Z") as microseconds since the epoch."""
    import datetime as dt

    if not isinstance(value, str) or not value:
        return seconds_us(value)
    text = value.strip().replace("Z", "+00:00")
    if "." in text:  # Python before 3.11 reads at most 6 digits of fraction; cut to 6
        head, _, tail = text.partition(".")
        digits = "".join(c for c in tail if c.isdigit())
        zone = tail[len(digits) :]
        text = f"{head}.{digits[:6]}{zone}"
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp() * 1_000_000)


def whole_answer(
    message: dict,
    *,
    model: str | None = None,
    finish: str | None = None,
    usage: dict | None = None,
    created: int | None = None,
) -> dict:
    """An assistant message as a chat.completion object with one choice."""
    answer: dict[str, Any] = {
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    }
    if created is not None:
        answer["created"] = created
    if usage:
        answer["usage"] = usage
    return answer
