"""How a chat or text completion's record is assembled from vLLM's answer.

One pure accumulator, no I/O: the same code handles a streamed response (one chunk at
a time) and a whole one (a single "chunk" whose choices carry `message` instead of
`delta`), so both paths record exactly the same fields. What the proxy asks vLLM for,
and hides again, is additions.py's.

vLLM facts this relies on (vllm 0.32, measured): `return_token_ids: true` puts
`prompt_token_ids` at the top of a chat response (per choice for text completions)
and `token_ids` on each choice; without it those keys are present and null. The
first chunk of a stream carries the prompt ids, each later chunk its own token ids.
With `stream_options.include_usage` the last chunk has `choices: []` and `usage`.
A text completion with `echo` gives logprobs for the prompt first (as many as its ids:
`prompt_token_ids`, which a stream's first chunk carries anyway, or the whole answer's
`prompt_logprobs`), then for the completion; asked `return_tokens_as_token_ids`, each
token is written "token_id:N".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHAT = "chat.completions"
TEXT = "completions"


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
    prompt_left: int | None = None  # echo: logprobs still the prompt's (None: not seen yet)


class Accumulator:
    """Assembles the choices of one response from its chunks (or from itself)."""

    complete = False  # chat streams end with `[DONE]` (the relay's parser sees it)

    def __init__(self, endpoint: str, echo: bool = False, as_ids: bool = False):
        self.endpoint = endpoint
        self.echo = echo  # a text completion echoing its prompt
        self.as_ids = as_ids  # its ids are in the logprobs' tokens ("token_id:N")
        self.note: str | None = None  # why the record has no token ids, if it has none
        self.choices: dict[int, ChoiceState] = {}
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict | None = None
        self.meta: dict[str, Any] = {}
        self.error: dict | None = None

    def sent_plain(self, note: str) -> None:
        """The request went to vLLM as the client sent it: nothing of ours to read."""
        self.as_ids, self.note = False, note

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
        index = choice.get("index", 0)
        state = self.choices.get(index)
        if state is None:  # (not setdefault: a ChoiceState made for every chunk costs)
            state = self.choices[index] = ChoiceState()
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
        if self.echo:
            self._echoed(state, choice)
        else:
            state.logprobs.extend(_sampled_logprobs(choice.get("logprobs")))
        if choice.get("finish_reason"):
            state.finish_reason = choice["finish_reason"]
            state.stop_reason = choice.get("stop_reason")

    def _echoed(self, state: ChoiceState, choice: dict) -> None:
        """An echo's logprobs (and, `as_ids`, its ids): the prompt's first, skipped."""
        logprobs = choice.get("logprobs") or {}
        values = logprobs.get("token_logprobs") or []
        if state.prompt_left is None:  # the choice's first chunk: it starts with the prompt
            prompt = choice.get("prompt_token_ids")
            if not isinstance(prompt, list):
                prompt = choice.get("prompt_logprobs")
            state.prompt_left = len(prompt) if isinstance(prompt, list) else 0
        skip = min(state.prompt_left, len(values))
        state.prompt_left -= skip
        state.logprobs.extend(lp for lp in values[skip:] if lp is not None)
        if self.as_ids:
            try:
                ids = [int(t.removeprefix("token_id:")) for t in logprobs.get("tokens") or ()]
            except (AttributeError, ValueError):  # not the form asked for: no ids at all
                self.sent_plain("no token ids: vLLM's logprob tokens were not token_id:N")
                for each in self.choices.values():
                    each.token_ids, each.prompt_token_ids = [], None
                return
            if state.prompt_token_ids is None:  # a whole answer names them only here
                state.prompt_token_ids = ids[:skip]
            state.token_ids.extend(ids[skip:])

    def prompt_ids(self, index: int) -> list[int] | None:
        state = self.choices.get(index)
        if state is not None and state.prompt_token_ids is not None:
            return state.prompt_token_ids
        return self.prompt_token_ids

    def response(self, index: int) -> dict:
        """Choice `index` as one non-streamed response, without ids and logprobs."""
        state = self.choices.get(index) or ChoiceState()
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
