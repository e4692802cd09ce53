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
last 10,000 responses this process answered; an id it does not hold is looked up in the
store (the record of that response holds its whole conversation), in an executor, and
where it is nowhere the turn is recorded from its own items with `history_missing`
naming the unknown id (the client's request is never failed for it: vLLM decides).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from overnight.storage import open_db

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


@dataclass
class Chain:
    messages: list[dict]  # what a continuation carries over (`carried_over`)
    missing: str | None = None  # a response id further back whose history is unknown


class ResponseChains:
    """Response id -> what a request continuing it carries over.

    Bounded (least recently used out first); an id not held is looked up in the store
    under `data_dir` (`find`), and a chain found nowhere is recorded from where it is
    known, the record saying so (`history_missing`)."""

    def __init__(self, capacity: int = 10_000, data_dir: Path | None = None):
        self.capacity = capacity
        self.data_dir = data_dir
        self.chains: OrderedDict[str, Chain] = OrderedDict()

    def get(self, response_id: str) -> Chain | None:
        found = self.chains.get(response_id)
        if found is not None:
            self.chains.move_to_end(response_id)
        return found

    def remember(self, response_id: str, conversation: list[dict], missing: str | None = None):
        """`conversation`: the request's messages, then, last, its reply."""
        self._keep(response_id, Chain(carried_over(conversation), missing))

    def _keep(self, response_id: str, chain: Chain) -> None:
        self.chains[response_id] = chain
        self.chains.move_to_end(response_id)
        if len(self.chains) > self.capacity:
            self.chains.popitem(last=False)

    async def find(self, response_id: str) -> Chain | None:
        """The chain in memory, else rebuilt from the stored record of that response
        (read in an executor: the store may be large); None where it is nowhere."""
        found = self.get(response_id)
        if found is not None or self.data_dir is None:
            return found
        loop = asyncio.get_running_loop()
        try:
            found = await loop.run_in_executor(None, stored_chain, self.data_dir, response_id)
        except Exception:  # an unreadable store must not fail the request: noted as missing
            log.exception("could not look up response %s in the store", response_id)
            return None
        if found is not None:
            self._keep(response_id, found)
        return found


def stored_chain(data_dir: Path, response_id: str) -> Chain | None:
    """The chain of `response_id` from its record in the store, or None."""
    con = open_db(data_dir)
    try:
        # `contains` is a cheap scan that finds the id's text; the JSON is checked below.
        rows = con.execute(
            "SELECT request, response FROM completions WHERE endpoint = ? "
            "AND contains(response, ?) ORDER BY started_at DESC",
            [RESPONSES, json.dumps(response_id)],
        ).fetchall()
    finally:
        con.close()
    for request_text, response_text in rows:
        response = json.loads(response_text)
        if response.get("id") != response_id or not request_text:
            continue
        request = json.loads(request_text)
        reply = ((response.get("choices") or [{}])[0]).get("message") or {}
        return Chain(carried_over([*request["messages"], reply]), request.get("history_missing"))
    return None


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
