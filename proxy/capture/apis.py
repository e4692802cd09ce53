"""Accumulators for the Responses and the Messages APIs, in the chat record's shape.

They read what vLLM sends on `/v1/responses` and `/v1/messages` (a whole body, or the
events of a stream, each a "chunk" as in chat.py) and give records.py the same
interface as `capture.Accumulator`: `choices` (one `ChoiceState`), `usage` in chat
names, `error`, `prompt_ids()`, and `response()`, a chat completion whose `raw` key
holds the API's own response (whole, or assembled from the stream's events).

vLLM 0.32 gives no token ids on either API unless asked; Messages cannot be asked. On
Responses, a request with `enable_response_messages: true` and
`include: ["message.output_text.logprobs"]` gets, for a non-harmony model, the prompt's
and the reply's token ids (`input_messages` / `output_messages`) and one logprob per
reply token (measured: bench/retokenize_mismatch.py); such a record is token-exact.
The ids are recorded also where a stream left out a logprob (it gives none to a token
without text of its own): the record's notes say so. A tool call has no logprobs at all
and is recorded without ids; the trainer rebuilds such tokens from the conversation
(docs/wire.md).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .chat import ChoiceState
from .conversation import MESSAGES, RESPONSES, tool_call

_STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
}


class _ApiAccumulator:
    endpoint = ""
    prompt_token_ids = None

    def __init__(self) -> None:
        self.usage: dict | None = None
        self.meta: dict[str, Any] = {}
        self.error: Any = None
        self.complete = False  # the stream's last event came (it has no `[DONE]`)
        self.note: str | None = None  # why the record has no token ids, if it has none

    def sent_plain(self, note: str) -> None:
        """The request went to vLLM as the client sent it: nothing of ours to read."""
        self.note = note

    @property
    def choices(self) -> dict[int, ChoiceState]:
        state = self._state()
        return {} if state is None else {0: state}

    def prompt_ids(self, index: int) -> list[int] | None:
        return None

    def _state(self) -> ChoiceState | None:
        raise NotImplementedError

    def raw(self) -> dict | None:
        raise NotImplementedError

    def response(self, index: int) -> dict:
        state = self._state() or ChoiceState()
        message: dict[str, Any] = {"role": "assistant"}
        message["content"] = "".join(state.content) if state.content else None
        if state.reasoning:
            message["reasoning"] = "".join(state.reasoning)
        if state.tool_calls:
            message["tool_calls"] = [c for _, c in sorted(state.tool_calls.items())]
        choice = {"index": 0, "message": message, "finish_reason": state.finish_reason}
        return {
            **self.meta,
            "object": "chat.completion",
            "choices": [choice],
            "usage": self.usage,
            "raw": self.raw(),
        }


class ResponsesAccumulator(_ApiAccumulator):
    """`/v1/responses`: the response object (whole, or the stream's `response.completed`),
    else, for a stream cut short, the output items as far as they came."""

    endpoint = RESPONSES

    def __init__(self, added: ResponsesAdditions | None = None) -> None:
        super().__init__()
        self.added = added  # what the proxy asked for: not in the recorded `raw`
        self.final: dict | None = None
        self.items: dict[int, dict] = {}  # output index -> item (added, then done)
        self.deltas: dict[int, list[str]] = {}  # text or arguments before the item is done
        self.logprobs: list[float] = []
        self.prompt_token_ids: list[int] | None = None
        self.token_ids: list[int] = []

    def prompt_ids(self, index: int) -> list[int] | None:
        state = self._state() if self.token_ids else None  # exact only with the reply's ids
        return self.prompt_token_ids if state is not None and state.token_ids else None

    def add(self, obj: dict) -> None:
        kind = obj.get("type")
        if kind is None:
            if obj.get("object") == "response":
                self._finish(obj)
            elif "error" in obj:
                self.error = obj["error"]
            return
        index = obj.get("output_index", 0)
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            self._finish(obj.get("response") or {})
            self.complete = True
        elif kind in ("response.created", "response.in_progress"):
            self._meta(obj.get("response") or {})
        elif kind == "response.output_item.added" or kind == "response.output_item.done":
            self.items[index] = obj.get("item") or {}
            if kind.endswith("done"):  # the item is whole: its deltas are in it
                self.deltas.pop(index, None)
        elif kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            self.deltas.setdefault(index, []).append(obj.get("delta") or "")
            self.logprobs.extend(e.get("logprob") for e in obj.get("logprobs") or ())
        elif kind == "error":
            self.error = {k: v for k, v in obj.items() if k not in ("type", "sequence_number")}

    def _meta(self, response: dict) -> None:
        for key in ("id", "created_at", "model"):
            if key in response and key not in self.meta:
                self.meta["created" if key == "created_at" else key] = response[key]

    def _finish(self, response: dict) -> None:
        self.final = response
        self._meta(response)
        usage = response.get("usage")
        if usage:
            prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
            self.usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": usage.get("total_tokens"),
            }
        if response.get("error"):
            self.error = response["error"]
        self._token_ids(response.get("input_messages"), response.get("output_messages"))

    def _token_ids(self, inputs: Any, outputs: Any) -> None:
        """vLLM's own ids (`enable_response_messages`): a single-turn answer of a
        non-harmony model has one prompt entry and one reply entry of raw tokens."""
        if not (isinstance(inputs, list) and isinstance(outputs, list)):
            return
        if len(inputs) != 1 or len(outputs) != 1:
            return  # harmony messages, or a multi-turn (built-in tool) answer
        if not all(
            isinstance(m, dict) and m.get("type") == "raw_message_tokens" for m in inputs + outputs
        ):
            return
        self.prompt_token_ids = list(inputs[0].get("tokens") or ())
        self.token_ids = list(outputs[0].get("tokens") or ())

    def raw(self) -> dict | None:
        """The response as the client got it (the ids and logprobs are in the record)."""
        if self.final is None or self.added is None:
            return self.final
        return hide_responses_additions(self.final, self.added) or self.final

    def _state(self) -> ChoiceState | None:
        items = self.final.get("output") if self.final is not None else None
        if items is None:
            items = [self._partial(i) for i in sorted(self.items)]
        if not items and self.final is None:
            return None
        state = ChoiceState(role="assistant")
        logprobs: list[float] = []
        for item in items:
            kind = item.get("type")
            if kind == "message":
                for part in item.get("content") or ():
                    state.content.append(part.get("text") or part.get("refusal") or "")
                    logprobs += [e.get("logprob") for e in part.get("logprobs") or ()]
            elif kind == "function_call":
                call = tool_call(item.get("call_id"), item.get("name"), item.get("arguments"))
                state.tool_calls[len(state.tool_calls)] = call
            elif kind == "reasoning":
                for part in item.get("content") or item.get("summary") or ():
                    state.reasoning.append(part.get("text") or "")
        state.logprobs = logprobs or self.logprobs
        if state.logprobs:
            # vLLM's own ids, also where a logprob is missing (a stream gives none to a
            # token without text of its own: part of a character, a stop token; the
            # record's notes say so, records.py); a tool call has no logprobs at all.
            state.token_ids = list(self.token_ids)
        state.finish_reason = self._finish_reason(state)
        return state

    def _partial(self, index: int) -> dict:
        item = dict(self.items[index])
        pieces = self.deltas.get(index)
        if pieces and item.get("type") == "function_call":
            item["arguments"] = "".join(pieces)
        elif pieces:
            item["content"] = [{"type": "output_text", "text": "".join(pieces)}]
        return item

    def _finish_reason(self, state: ChoiceState) -> str | None:
        status = (self.final or {}).get("status")
        if status == "completed":
            return "tool_calls" if state.tool_calls else "stop"
        if status == "incomplete":
            reason = ((self.final or {}).get("incomplete_details") or {}).get("reason")
            return "length" if reason == "max_output_tokens" else reason or "length"
        return None  # failed, or a stream cut short: the record is partial


class MessagesAccumulator(_ApiAccumulator):
    """`/v1/messages`: the message (whole), or one assembled from the stream's events."""

    endpoint = MESSAGES

    def __init__(self) -> None:
        super().__init__()
        self.message: dict | None = None
        self.blocks: dict[int, dict] = {}
        self.json_parts: dict[int, list[str]] = {}

    def add(self, obj: dict) -> None:
        kind = obj.get("type")
        if kind == "message":  # the whole answer
            self.message = obj
            self.blocks = dict(enumerate(obj.get("content") or ()))
            self._usage(obj.get("usage"))
            self.complete = True
        elif kind == "message_start":
            self.message = dict(obj.get("message") or {})
            self._usage(self.message.get("usage"))
        elif kind == "content_block_start":
            self.blocks[obj.get("index", 0)] = dict(obj.get("content_block") or {})
        elif kind == "content_block_delta":
            self._delta(obj.get("index", 0), obj.get("delta") or {})
        elif kind == "message_delta" and self.message is not None:
            self.message.update(obj.get("delta") or {})
            self._usage(obj.get("usage"))
        elif kind == "message_stop":
            self.complete = True
        elif kind == "error" or (kind is None and "error" in obj):
            self.error = obj.get("error")
        if self.message is not None and "id" not in self.meta:
            self.meta.update(id=self.message.get("id"), model=self.message.get("model"))

    def _delta(self, index: int, delta: dict) -> None:
        block = self.blocks.setdefault(index, {"type": "text", "text": ""})
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = (block.get("text") or "") + (delta.get("text") or "")
        elif kind == "input_json_delta":
            self.json_parts.setdefault(index, []).append(delta.get("partial_json") or "")
        elif kind == "thinking_delta":
            block["thinking"] = (block.get("thinking") or "") + (delta.get("thinking") or "")

    def _usage(self, usage: dict | None) -> None:
        if not usage:
            return
        merged = {**(self.usage or {})}
        if usage.get("input_tokens"):
            merged["prompt_tokens"] = usage["input_tokens"]
        if usage.get("output_tokens") is not None:
            merged["completion_tokens"] = usage["output_tokens"]
        self.usage = merged

    def _content(self) -> list[dict]:
        out = []
        for index, block in sorted(self.blocks.items()):
            parts = self.json_parts.get(index)
            if parts is not None and block.get("type") == "tool_use":
                try:
                    block = {**block, "input": json.loads("".join(parts) or "{}")}
                except ValueError:  # cut short mid-arguments: keep the text that came
                    block = {**block, "input": "".join(parts)}
            out.append(block)
        return out

    def raw(self) -> dict | None:
        if self.message is None:
            return None
        return {**self.message, "content": self._content()}

    def _state(self) -> ChoiceState | None:
        if self.message is None:
            return None
        state = ChoiceState(role="assistant")
        for block in self._content():
            kind = block.get("type")
            if kind == "text":
                state.content.append(block.get("text") or "")
            elif kind == "tool_use":
                call = tool_call(block.get("id"), block.get("name"), block.get("input"))
                state.tool_calls[len(state.tool_calls)] = call
            elif kind == "thinking":
                state.reasoning.append(block.get("thinking") or "")
        stop = self.message.get("stop_reason")
        state.finish_reason = _STOP_REASONS.get(stop, stop) if self.complete or stop else None
        return state


# -- token ids on the Responses API, asked for by the proxy ---------------------------------
LOGPROBS_INCLUDE = "message.output_text.logprobs"


@dataclass(frozen=True)
class ResponsesAdditions:
    """What the proxy added to a Responses request for token ids, to hide again."""

    messages: bool = False  # `enable_response_messages`: the prompt's and reply's ids
    logprobs: bool = False  # `include` output-text logprobs: one per reply token
    # The request as the client sent it, sent instead if vLLM refuses the additions.
    plain: dict | None = field(default=None, compare=False, repr=False)

    @property
    def any(self) -> bool:
        return self.messages or self.logprobs


# Per app, the served models whose vLLM refused the additions (gpt-oss: "logprobs are not
# supported with gpt-oss models", 400): asked as the client asks from then on.
_REFUSED: weakref.WeakKeyDictionary[web.Application, set[str]] = weakref.WeakKeyDictionary()


def refused_additions(app: web.Application) -> set[str]:
    return _REFUSED.setdefault(app, set())


def add_responses_fields(body: dict) -> ResponsesAdditions:
    """Ask vLLM for the prompt's and the reply's token ids and the reply's logprobs
    (vLLM 0.32, models without the harmony format); mutates `body`."""
    plain = dict(body)
    messages = not body.get("enable_response_messages")
    if messages:
        body["enable_response_messages"] = True
    include = body.get("include")
    # Not a list: vLLM refuses it, and ours in its place would make it accept it.
    logprobs = include is None or (isinstance(include, list) and LOGPROBS_INCLUDE not in include)
    include = include or []
    if logprobs:
        body["include"] = [*include, LOGPROBS_INCLUDE]
    return ResponsesAdditions(messages=messages, logprobs=logprobs, plain=plain)


def hide_responses_additions(obj: dict, added: ResponsesAdditions) -> dict | None:
    """A response or stream event as vLLM sends it when not asked, or None when the
    additions left it as it is (then its exact bytes go to the client). The token
    messages and `top_logprobs` are null, output-text logprobs null in parts and `[]`
    in deltas (measured against vLLM 0.32's answers without the additions:
    test_real_vllm.py). `obj` is not changed: the record keeps what it holds."""
    if obj.get("object") == "response":
        return _hide_in_response(obj, added)
    response = obj.get("response")
    if isinstance(response, dict) and response.get("object") == "response":
        hidden = _hide_in_response(response, added)
        return None if hidden is None else {**obj, "response": hidden}
    if not added.logprobs:
        return None
    kind = obj.get("type")
    if kind == "response.output_text.delta" and obj.get("logprobs"):
        return {**obj, "logprobs": []}
    if isinstance(obj.get("item"), dict):
        item = _hide_in_item(obj["item"])
        return None if item is None else {**obj, "item": item}
    if kind != "response.content_part.added":  # a part just added has `[]` either way
        part = _hide_in_part(obj.get("part"))
        return None if part is None else {**obj, "part": part}
    return None


def _hide_in_response(response: dict, added: ResponsesAdditions) -> dict | None:
    changes: dict[str, Any] = {}
    if added.messages:
        for key in ("input_messages", "output_messages"):
            if response.get(key) is not None:
                changes[key] = None
    if added.logprobs:
        if response.get("top_logprobs") is not None:
            changes["top_logprobs"] = None  # echoed from the sampling parameters: unset
        output = response.get("output")
        if isinstance(output, list):
            items = [_hide_in_item(item) for item in output]
            if any(item is not None for item in items):
                changes["output"] = [new or old for new, old in zip(items, output, strict=True)]
    return {**response, **changes} if changes else None


def _hide_in_item(item: Any) -> dict | None:
    content = item.get("content") if isinstance(item, dict) else None
    if not isinstance(content, list):
        return None
    parts = [_hide_in_part(part) for part in content]
    if all(part is None for part in parts):
        return None
    return {**item, "content": [new or old for new, old in zip(parts, content, strict=True)]}


def _hide_in_part(part: Any) -> dict | None:
    """A finished output-text part has null logprobs when they were not asked for."""
    if not isinstance(part, dict) or part.get("type") != "output_text":
        return None
    return None if part.get("logprobs") is None else {**part, "logprobs": None}
