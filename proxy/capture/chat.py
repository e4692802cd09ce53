"""What the proxy asks vLLM for, what it hides again, and how it assembles records.

Pure functions and one pure accumulator, no I/O: the same code handles a streamed
response (one chunk at a time) and a whole one (a single "chunk" whose choices carry
`message` instead of `delta`), so both paths record exactly the same fields.

vLLM facts this relies on (vllm 0.32, measured): `return_token_ids: true` puts
`prompt_token_ids` at the top of a chat response (per choice for text completions)
and `token_ids` on each choice; without it those keys are present and null. The
first chunk of a stream carries the prompt ids, each later chunk its own token ids.
With `stream_options.include_usage` the last chunk has `choices: []` and `usage`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHAT = "chat.completions"
TEXT = "completions"


@dataclass(frozen=True)
class Additions:
    """What the proxy added to the client's request, so it can be hidden again."""

    token_ids: bool = False
    logprobs: bool = False
    usage: bool = False
    # A chat stream for which vLLM sends a chunk per token only because we asked for ids
    # and logprobs: chunks left with `"delta": {}` are ours to drop (vllm 0.32, measured:
    # a `tool_choice: "required"` stream had 18 chunks plain, 41 with the additions).
    empty_chunks: bool = False

    @property
    def any(self) -> bool:
        return self.token_ids or self.logprobs or self.usage


def add_training_fields(body: dict, endpoint: str) -> Additions:
    """Ask upstream for token ids, logprobs and usage; mutates `body`."""
    token_ids = not body.get("return_token_ids")
    if token_ids:
        body["return_token_ids"] = True
    if endpoint == CHAT:
        logprobs = not body.get("logprobs")
        if logprobs:
            body["logprobs"] = True
    else:  # text completions take a count of top logprobs; 0 means the sampled one
        logprobs = body.get("logprobs") is None
        if logprobs:
            body["logprobs"] = 0
    usage = False
    stream = bool(body.get("stream"))
    if stream:
        options = body.get("stream_options") or {}
        if not options.get("include_usage"):
            usage = True
            body["stream_options"] = {**options, "include_usage": True}
    empty = stream and endpoint == CHAT and token_ids and logprobs
    return Additions(token_ids=token_ids, logprobs=logprobs, usage=usage, empty_chunks=empty)


def hide_additions(obj: dict, added: Additions) -> dict | None:
    """The response or chunk as the client would have got it without our additions.

    Returns None for a chunk that only exists because we asked for usage. Keys are
    nulled rather than deleted: that is what vLLM itself sends when not asked; `usage`
    is deleted, since vLLM leaves it unset on chunks when not asked (the client's
    `continuous_usage_stats` without `include_usage` gives no usage at all).
    """
    choices = obj.get("choices")
    if added.usage and "usage" in obj:
        if choices == []:
            return None
        del obj["usage"]
    if added.token_ids and obj.get("prompt_token_ids") is not None:
        obj["prompt_token_ids"] = None
    for choice in choices or ():
        if added.token_ids:
            if choice.get("token_ids") is not None:
                choice["token_ids"] = None
            if choice.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = None
        if added.logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None
    return obj


def only_added(visible: dict) -> bool:
    """Whether a chunk, our additions hidden, carries nothing: every choice's delta empty
    and unfinished (vLLM would not have sent it had we not asked for ids and logprobs;
    a continuous usage count on it is dropped with it, as vLLM would not have sent it)."""
    choices = visible.get("choices")
    if not choices:
        return False
    for choice in choices:
        if choice.get("delta") or choice.get("finish_reason") is not None:
            return False
    return True


@dataclass
class ChoiceState:
    role: str | None = None
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None


class Accumulator:
    """Assembles the choices of one response from its chunks (or from itself)."""

    complete = False  # chat streams end with `[DONE]` (the relay's parser sees it)

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.choices: dict[int, ChoiceState] = {}
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict | None = None
        self.meta: dict[str, Any] = {}
        self.error: dict | None = None

    def add(self, obj: dict) -> None:
        if "error" in obj and "choices" not in obj:
            self.error = obj["error"]
            return
        for key in ("id", "object", "created", "model", "system_fingerprint"):
            if key in obj and key not in self.meta:
                self.meta[key] = obj[key]
        if obj.get("prompt_token_ids") is not None:
            self.prompt_token_ids = obj["prompt_token_ids"]
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or ():
            self._add_choice(choice)

    def _add_choice(self, choice: dict) -> None:
        state = self.choices.setdefault(choice.get("index", 0), ChoiceState())
        part = choice.get("delta") or choice.get("message") or {}
        if part.get("role"):
            state.role = part["role"]
        if part.get("content"):
            state.content.append(part["content"])
        if part.get("reasoning") or part.get("reasoning_content"):
            state.reasoning.append(part.get("reasoning") or part.get("reasoning_content"))
        if choice.get("text"):
            state.content.append(choice["text"])
        for position, call in enumerate(part.get("tool_calls") or ()):
            _merge_tool_call(state.tool_calls, call.get("index", position), call)
        if choice.get("token_ids"):
            state.token_ids.extend(choice["token_ids"])
        if choice.get("prompt_token_ids") is not None:
            state.prompt_token_ids = choice["prompt_token_ids"]
        state.logprobs.extend(_sampled_logprobs(choice.get("logprobs")))
        if choice.get("finish_reason"):
            state.finish_reason = choice["finish_reason"]
            state.stop_reason = choice.get("stop_reason")

    def prompt_ids(self, index: int) -> list[int] | None:
        state = self.choices.get(index)
        if state is not None and state.prompt_token_ids is not None:
            return state.prompt_token_ids
        return self.prompt_token_ids

    def response(self, index: int) -> dict:
        """Choice `index` as one non-streamed response, without ids and logprobs."""
        state = self.choices.get(index, ChoiceState())
        if self.endpoint == CHAT:
            message: dict[str, Any] = {
                "role": state.role or "assistant",
                "content": "".join(state.content) if state.content else None,
            }
            if state.reasoning:
                message["reasoning"] = "".join(state.reasoning)
            if state.tool_calls:
                message["tool_calls"] = [
                    _finish_tool_call(c) for _, c in sorted(state.tool_calls.items())
                ]
            choice = {"index": index, "message": message}
            kind = "chat.completion"
        else:
            choice = {"index": index, "text": "".join(state.content)}
            kind = "text_completion"
        choice["finish_reason"] = state.finish_reason
        if state.stop_reason is not None:
            choice["stop_reason"] = state.stop_reason
        return {**self.meta, "object": kind, "choices": [choice], "usage": self.usage}


def _merge_tool_call(calls: dict[int, dict], index: int, delta: dict) -> None:
    call = calls.setdefault(index, {"id": None, "type": "function", "name": None, "arguments": []})
    if delta.get("id"):
        call["id"] = delta["id"]
    if delta.get("type"):
        call["type"] = delta["type"]
    fn = delta.get("function") or {}
    if fn.get("name"):
        call["name"] = fn["name"]
    if fn.get("arguments"):
        call["arguments"].append(fn["arguments"])


def _finish_tool_call(call: dict) -> dict:
    return {
        "id": call["id"],
        "type": call["type"],
        "function": {"name": call["name"], "arguments": "".join(call["arguments"])},
    }


def _sampled_logprobs(logprobs: dict | None) -> list[float]:
    if not logprobs:
        return []
    if "content" in logprobs:  # chat: one entry per sampled token
        return [entry["logprob"] for entry in logprobs["content"] or ()]
    return [lp for lp in logprobs.get("token_logprobs") or () if lp is not None]
