"""One conversation shape for every API: Responses and Messages requests as chat requests.

The judge, the trainer, `overnight show` and /ui read a record's conversation from the
chat completions shape: `request["messages"]` and `request["tools"]`, the reply in
`response["choices"][0]["message"]`. A Responses or Messages request is recorded in that
shape too, with the body the client sent under `"raw"` (the response likewise, in
apis.py), so no reader needs to know which API an agent used.

The conversion follows what vLLM 0.32 itself does with these APIs (its Messages server
translates to chat completions; its Responses server builds chat messages from the input
items, after the messages of the `previous_response_id` chain), so the recorded
conversation is the one the model was prompted with, up to the chat template.

`previous_response_id`: the record must hold the whole conversation, not just the new
items. vLLM 0.32 answers one only when it runs with VLLM_ENABLE_RESPONSES_API_STORE=1
(else 404), and then prompts with: this request's instructions, the earlier request's
messages without their system message, the earlier reply's output text as assistant
messages (its function calls and reasoning are NOT carried over), then the new input
(vllm/entrypoints/openai/responses/utils.py, construct_input_messages). `ResponseChains`
keeps, per response id, what such a continuation carries over (`carried_over`), for the
responses this process answered, as many as fit in `CHAIN_BYTES` (counted as text, a
message shared by several chains once); an id it does not hold is looked up in the store
(the record of that response holds its whole conversation) through the store's index of
Responses ids (storage/read/response_index.py), on a thread of its own, one lookup at a time,
for `LOOKUP_WAIT` seconds at most, an id found nowhere remembered as such for a while.
Where it is nowhere, the turn is recorded from its own items with `history_missing`
naming the unknown id (the client's request is never failed for it: vLLM decides, and
answers an id it does not know with its own 404). Any client may send any id: none of
this may cost more than the index does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from overnight.storage.read.response_index import ResponseIndex

RESPONSES = "responses"
MESSAGES = "messages"
log = logging.getLogger("overnight.proxy")

# Sampling fields read by the trainer (trainer/grpo/sampling.py), in the chat names.
_SAME_NAME = ("temperature", "top_p", "top_k", "min_p", "seed", "parallel_tool_calls")
_TEXT_PARTS = ("text", "input_text", "output_text")


def carried_over(conversation: list[dict]) -> list[dict]:
    """What vLLM carries into a request naming this response as `previous_response_id`:
    `conversation` (the request's messages, then, last, the reply) without system
    messages, and of the reply only its text, as an assistant message."""
    *messages, reply = conversation or [{}]
    kept = [m for m in messages if m.get("role") != "system"]
    if reply.get("content"):
        kept.append({"role": "assistant", "content": reply["content"]})
    return kept


# What the chains in memory may hold, counted as text (`_size`): a conversation's chains
# share their messages, so a message is counted once however many chains hold it.
CHAIN_BYTES = 64 * 1024 * 1024
CHAIN_COUNT = 100_000  # and at most this many chains, whatever their size
LOOKUP_WAIT = 1.0  # how long a request waits for its chain from the store, at most
LOOKUPS_PENDING = 16  # lookups waiting their turn, at most; more are answered "missing"
ABSENT_SECONDS = 60.0  # an id found nowhere is not looked up again for this long
ABSENT_KEPT = 10_000


@dataclass
class Chain:
    messages: list[dict]  # what a continuation carries over (`carried_over`)
    missing: str | None = None  # a response id further back whose history is unknown
    model: str | None = None  # the model it asked for: a scoped key continues its own only


class ResponseChains:
    """Response id -> what a request continuing it carries over.

    Bounded in bytes and in count (least recently used out first); an id not held is
    looked up in the store under `data_dir` (`find`), and a chain found nowhere is
    recorded from where it is known, the record saying so (`history_missing`)."""

    def __init__(
        self, capacity: int = CHAIN_COUNT, data_dir: Path | None = None,
        max_bytes: int = CHAIN_BYTES,
    ):  # fmt: skip
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.data_dir = data_dir
        self.chains: OrderedDict[str, Chain] = OrderedDict()
        self.bytes = 0  # of the messages held (each once)
        self._held: dict[int, list] = {}  # id(message) -> [message, size, chains holding it]
        self._lookups: dict[str, asyncio.Future] = {}
        self._absent: OrderedDict[str, float] = OrderedDict()  # id -> when found nowhere
        self._pool: ThreadPoolExecutor | None = None
        self._index: ResponseIndex | None = None

    def get(self, response_id: str) -> Chain | None:
        found = self.chains.get(response_id)
        if found is not None:
            self.chains.move_to_end(response_id)
        return found

    def remember(
        self,
        response_id: str,
        conversation: list[dict],
        missing: str | None = None,
        model: str | None = None,
    ):
        """`conversation`: the request's messages, then, last, its reply; `model`: what
        the request asked for (its policy's alias)."""
        self._keep(response_id, Chain(carried_over(conversation), missing, model))

    def _keep(self, response_id: str, chain: Chain) -> None:
        old = self.chains.pop(response_id, None)
        if old is not None:
            self._release(old)
        for message in chain.messages:
            held = self._held.get(id(message))
            if held is None:
                held = self._held[id(message)] = [message, _size(message), 0]
                self.bytes += held[1]
            held[2] += 1
        self.chains[response_id] = chain
        self._absent.pop(response_id, None)
        while self.chains and (len(self.chains) > self.capacity or self.bytes > self.max_bytes):
            self._release(self.chains.popitem(last=False)[1])

    def _release(self, chain: Chain) -> None:
        for message in chain.messages:
            held = self._held.get(id(message))
            if held is None:
                continue
            held[2] -= 1
            if held[2] == 0:
                del self._held[id(message)]
                self.bytes -= held[1]

    async def find(self, response_id: str) -> Chain | None:
        """The chain in memory, else rebuilt from the stored record of that response
        (off the event loop, bounded: the module's doc); None where it is nowhere, or
        when the store did not answer in time (the lookup goes on, for the next turn)."""
        found = self.get(response_id)
        if found is not None or self.data_dir is None:
            return found
        seen = self._absent.get(response_id)
        if seen is not None and time.monotonic() - seen < ABSENT_SECONDS:
            return None
        lookup = self._lookups.get(response_id)
        if lookup is None:
            if len(self._lookups) >= LOOKUPS_PENDING:
                log.warning("%d store lookups of response ids pending: %s recorded as missing",
                            len(self._lookups), response_id)  # fmt: skip
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="overnight-chains")
                self._index = ResponseIndex(self.data_dir)  # used on that thread alone
            loop = asyncio.get_running_loop()
            lookup = loop.run_in_executor(self._pool, stored_chain, self._index, response_id)
            self._lookups[response_id] = lookup
            lookup.add_done_callback(lambda done: self._looked_up(response_id, done))
        try:
            return await asyncio.wait_for(asyncio.shield(lookup), LOOKUP_WAIT)
        except TimeoutError:
            log.warning("response %s not found in the store within %.1f s: recorded as "
                        "missing", response_id, LOOKUP_WAIT)  # fmt: skip
        except Exception:  # an unreadable store must not fail the request: noted as missing
            log.exception("could not look up response %s in the store", response_id)
        return None

    def _looked_up(self, response_id: str, done: asyncio.Future) -> None:
        self._lookups.pop(response_id, None)
        found = None if done.cancelled() or done.exception() else done.result()
        if found is not None:
            self._keep(response_id, found)
            return
        self._absent[response_id] = time.monotonic()
        while len(self._absent) > ABSENT_KEPT:
            self._absent.popitem(last=False)


def _size(value: Any) -> int:
    """What a message holds, counted as text (an estimate: no serialisation)."""
    if isinstance(value, str):
        return len(value) + 50
    if isinstance(value, dict):
        return 64 + sum(len(k) + _size(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return 56 + sum(_size(v) for v in value)
    return 24


def stored_chain(index: ResponseIndex, response_id: str) -> Chain | None:
    """The chain of `response_id` from its record in the store (`index`'s), or None."""
    found = index.find(response_id)
    if found is None or not found[0] or not found[1]:
        return None
    request, response = json.loads(found[0]), json.loads(found[1])
    if response.get("id") != response_id:
        return None
    reply = ((response.get("choices") or [{}])[0]).get("message") or {}
    messages = carried_over([*request["messages"], reply])
    return Chain(messages, request.get("history_missing"), request.get("model"))


CHAINS = web.AppKey("response_chains", ResponseChains)


def _common(body: dict, out: dict) -> dict:
    for key in _SAME_NAME:
        if body.get(key) is not None:
            out[key] = body[key]
    return out


def _text_or_parts(content: Any) -> Any:
    """Content parts as chat content: plain text when every part is text."""
    if not isinstance(content, list):
        return content
    parts = [p for p in content if isinstance(p, dict)]
    if all(p.get("type") in _TEXT_PARTS for p in parts):
        return "".join(p.get("text") or "" for p in parts)
    out = []
    for p in parts:
        kind = p.get("type")
        if kind in _TEXT_PARTS:
            out.append({"type": "text", "text": p.get("text") or ""})
        elif kind == "input_image":
            out.append({"type": "image_url", "image_url": {"url": p.get("image_url")}})
        elif kind == "image" and isinstance(p.get("source"), dict):
            src = p["source"]
            url = src.get("url") or f"data:{src.get('media_type')};base64,{src.get('data')}"
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            out.append(p)
    return out


def tool_call(call_id: Any, name: Any, arguments: Any) -> dict:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _add_call(messages: list[dict], call: dict) -> None:
    """Consecutive calls belong to one assistant turn (as chat completions carry them)."""
    last = messages[-1] if messages else None
    if last is not None and last.get("role") == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


# -- the Responses API -------------------------------------------------------------------
def responses_messages(items: Any) -> list[dict]:
    """Responses input items (a string, or messages, function calls and their outputs)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for item in items or ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(
                {"role": item.get("role", "user"), "content": _text_or_parts(item.get("content"))}
            )
        elif kind == "function_call":
            call = tool_call(item.get("call_id"), item.get("name"), item.get("arguments"))
            _add_call(messages, call)
        elif kind == "function_call_output":
            output = _text_or_parts(item.get("output"))
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
            )
        elif kind == "reasoning":
            text = "".join(
                part.get("text") or ""
                for part in (item.get("content") or item.get("summary") or ())
                if isinstance(part, dict)
            )
            messages.append({"role": "assistant", "content": None, "reasoning": text})
        else:  # a built-in tool's item: kept as it came, in its own message
            messages.append({"role": "assistant", "content": None, "item": item})
    return messages


def responses_request(body: dict, chains: ResponseChains) -> dict:
    """A Responses request as a chat request, its chain resolved from memory only."""
    previous = body.get("previous_response_id")
    return _responses_request(body, chains.get(previous) if previous else None)


async def resolve_responses_request(body: dict, chains: ResponseChains) -> dict:
    """A Responses request as a chat request, its chain from memory or the store."""
    previous = body.get("previous_response_id")
    return _responses_request(body, await chains.find(previous) if previous else None)


def _responses_request(body: dict, chain: Chain | None) -> dict:
    out: dict[str, Any] = {"model": body.get("model")}
    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    previous = body.get("previous_response_id")
    if previous and chain is None:
        out["history_missing"] = previous  # answered before this process, and not stored
    elif chain is not None:
        messages.extend(chain.messages)
        if chain.missing:
            out["history_missing"] = chain.missing  # known from there, not before
    messages.extend(responses_messages(body.get("input")))
    out["messages"] = messages
    tools = [_responses_tool(t) for t in body.get("tools") or () if isinstance(t, dict)]
    if tools:
        out["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    _common(body, out)
    out["raw"] = body
    return out


def _responses_tool(tool: dict) -> dict:
    if tool.get("type") != "function":
        return tool
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


# -- the Anthropic Messages API ----------------------------------------------------------
def anthropic_messages(system: Any, messages: Any) -> list[dict]:
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": _text_or_parts(system)})
    for message in messages or ():
        if not isinstance(message, dict):
            continue
        role, content = message.get("role", "user"), message.get("content")
        if not isinstance(content, list):
            out.append({"role": role, "content": content})
            continue
        parts: list[dict] = []
        calls: list[dict] = []
        reasoning = ""
        for block in content:
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "tool_use":
                calls.append(tool_call(block.get("id"), block.get("name"), block.get("input")))
            elif kind == "tool_result":  # a tool's answer: a chat message of its own
                result = _text_or_parts(block.get("content"))
                out.append(
                    {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result}
                )
            elif kind == "thinking":
                reasoning += block.get("thinking") or ""
            else:
                parts.append(block)
        if parts or calls or reasoning or not content:
            turn: dict[str, Any] = {
                "role": role,
                "content": _text_or_parts(parts) if parts else None,
            }
            if calls:
                turn["tool_calls"] = calls
            if reasoning:
                turn["reasoning"] = reasoning
            out.append(turn)
    return out


def messages_request(body: dict) -> dict:
    out: dict[str, Any] = {
        "model": body.get("model"),
        "messages": anthropic_messages(body.get("system"), body.get("messages")),
    }
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                "description": t.get("description"),
                "parameters": t.get("input_schema"),
            },
        }
        if "input_schema" in t
        else t
        for t in body.get("tools") or ()
        if isinstance(t, dict)
    ]
    if tools:
        out["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        names = {"auto": "auto", "any": "required", "none": "none"}
        out["tool_choice"] = names.get(kind) or {
            "type": "function",
            "function": {"name": choice.get("name")},
        }
    if body.get("max_tokens") is not None:
        out["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    _common(body, out)
    out["raw"] = body
    return out
