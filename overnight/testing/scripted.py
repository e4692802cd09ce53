"""A scripted agent model behind vLLM 0.32's three chat APIs, for the compatibility suite.

The fake upstream (fake_upstream.py) answers every chat request with the same filler;
agent frameworks need more to run a whole agent: a tool call when tools are offered and
no tool result came back yet, then a final answer; JSON that fits a `response_format`
(or Responses `text.format`) json_schema; a named or required `tool_choice` honoured.
This module decides that answer (`plan`) and renders it the way vLLM 0.32 does:

- chat completions (whole and streamed; `return_token_ids`, `logprobs`/`top_logprobs`,
  `include_usage`, `continuous_usage_stats`; with token ids or logprobs on, a chunk for
  every token, held-back tool-call markup included, with `"delta": {}`, as vLLM sends);
- the Responses API (`/v1/responses`, whole and streamed as vLLM's simple, non-harmony
  path emits events; output logprobs with `include: ["message.output_text.logprobs"]`;
  function calls; `previous_response_id` against the responses it answered);
- the Anthropic Messages API (`/v1/messages`, whole and streamed, `tool_use` blocks).

Everything is deterministic: ids derive from the conversation (never from the request's
extras such as `metadata` or `return_token_ids`), and `created` is fixed, so a framework
run directly and through the proxy can be compared byte for byte. Shapes were taken from
vLLM 0.32's serving code and its pydantic models (see tests/compat/test_scripted.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

CREATED = 1_767_225_600  # fixed: the bytes of two runs must match
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "}</tool_call>"


# ---------------------------------------------------------------------------- the plan
@dataclass
class Conversation:
    """What any of the three APIs asks, reduced to what the script decides on."""

    text: str  # the conversation as text: its hash names every id, it sizes the prompt
    tools: list[tuple[str, dict]]  # (name, JSON schema of the arguments), as offered
    choice: str  # auto | required | none | the name of a forced function
    called: list[str]  # names of tools already called in the conversation
    results: int  # tool results the conversation carries
    schema: dict | None = None  # a json_schema the answer must fit

    @property
    def key(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:24]

    def prompt_ids(self) -> list[int]:
        data = self.text.encode()
        return [1 + b % 97 for b in data[: max(8, len(data) // 4)]]


@dataclass
class Call:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class Plan:
    text: str | None = None
    calls: list[Call] = field(default_factory=list)
    forced: bool = False  # a named tool_choice: vLLM reports finish_reason "stop"


def plan(conv: Conversation) -> Plan:
    """Call a tool while the conversation has no tool result (or a tool is required),
    else answer: JSON fitting the schema when one was given, a sentence otherwise."""
    names = [name for name, _ in conv.tools]
    pick = None
    if conv.choice not in ("auto", "required", "none") and conv.choice in names:
        pick = conv.choice
    elif conv.tools and (conv.choice == "required" or (conv.choice == "auto" and not conv.results)):
        fresh = [n for n in names if n not in conv.called]
        pick = fresh[0] if fresh else names[-1]
    if pick is not None:
        schema = dict(conv.tools)[pick]
        arguments = json.dumps(instance(schema, schema))
        call = Call(f"call_{conv.key[:16]}", pick, arguments)
        return Plan(calls=[call], forced=pick == conv.choice)
    if conv.schema is not None:
        return Plan(text=json.dumps(instance(conv.schema, conv.schema)))
    return Plan(text=f"Done after {conv.results} tool result{'s' * (conv.results != 1)}.")


def instance(schema: Any, root: dict, name: str = "value") -> Any:
    """A small value that fits `schema` ($ref, anyOf, enums, nested objects, arrays)."""
    if not isinstance(schema, dict):
        return name
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]
        return instance(target, root, name)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    if "default" in schema:
        return schema["default"]
    for key in ("anyOf", "oneOf", "allOf"):
        options = [s for s in schema.get(key, []) if s.get("type") != "null"]
        if options:
            return instance(options[0], root, name)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = schema.get("properties", {})
        return {k: instance(v, root, k) for k, v in props.items()}
    if kind == "array":
        count = max(1, int(schema.get("minItems", 1)))
        return [instance(schema.get("items", {}), root, name) for _ in range(count)]
    simple = {"integer": 3, "number": 2.5, "boolean": True, "null": None}
    return simple.get(kind, f"{name} 1")


# ------------------------------------------------------------------------ tokens
@dataclass
class Token:
    id: int
    text: str  # what the model generated
    logprob: float
    delta: dict | None  # the chat delta this token releases; None: held back by the parser


def _token(text: str, delta: dict | None) -> Token:
    h = zlib.crc32(text.encode())
    return Token(1000 + h % 30000, text, -round(0.05 * (1 + h % 7), 4), delta)


def pieces(text: str) -> list[str]:
    """Word-sized pieces with their leading space, as a BPE tokenizer would cut them."""
    return re.findall(r"\s*[^\s\"{}:,\[\]]+|\s*[\"{}:,\[\]]", text) or [text]


def tokens(p: Plan) -> list[Token]:
    """The generated tokens and what each releases (vLLM's hermes parser for calls)."""
    if not p.calls:
        return [_token(t, {"content": t}) for t in pieces(p.text or "")]
    out = []
    for i, call in enumerate(p.calls):
        out.append(_token(TOOL_CALL_OPEN, None))
        head = {"id": call.id, "type": "function", "index": i, "function": {"name": call.name}}
        out.append(_token(f'{{"name": "{call.name}", "arguments": ', {"tool_calls": [head]}))
        for t in pieces(call.arguments):
            out.append(_token(t, {"tool_calls": [{"index": i, "function": {"arguments": t}}]}))
        out.append(_token(TOOL_CALL_CLOSE, None))
    return out


def chat_logprobs(toks: list[Token], top: int) -> dict:
    return {
        "content": [
            {
                "token": t.text,
                "logprob": t.logprob,
                "bytes": list(t.text.encode()),
                "top_logprobs": [
                    {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
                ][:top],
            }
            for t in toks
        ]
    }


def usage(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


# ------------------------------------------------------------- chat completions
def chat_conversation(body: dict) -> Conversation:
    messages = body.get("messages") or []
    tools = [
        (t["function"]["name"], t["function"].get("parameters") or {})
        for t in body.get("tools") or []
        if t.get("type") == "function"
    ]
    choice = body.get("tool_choice") or ("auto" if tools else "none")
    if isinstance(choice, dict):
        choice = choice.get("function", {}).get("name", "auto")
    called = [
        c["function"]["name"]
        for m in messages
        if m.get("role") == "assistant"
        for c in m.get("tool_calls") or []
    ]
    fmt = body.get("response_format") or {}
    schema = (
        (fmt.get("json_schema") or {}).get("schema") if fmt.get("type") == "json_schema" else None
    )
    text = json.dumps([body.get("model"), messages, [n for n, _ in tools]], sort_keys=True)
    return Conversation(
        text=text,
        tools=tools,
        choice=choice,
        called=called,
        results=sum(m.get("role") == "tool" for m in messages),
        schema=schema,
    )


def _finish(p: Plan) -> str:
    return "tool_calls" if p.calls and not p.forced else "stop"


def chat_whole(body: dict, text: str | None = None) -> dict:
    """The whole answer; `text`: this reply instead of the script's (a teacher's)."""
    conv = chat_conversation(body)
    p = plan(conv) if text is None else Plan(text=text)
    toks = tokens(p)
    ids = bool(body.get("return_token_ids"))
    message: dict = {
        "role": "assistant",
        "content": p.text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if p.calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in p.calls
        ]
    message["reasoning"] = None
    prompt = conv.prompt_ids()
    choice = {
        "index": 0,
        "message": message,
        "logprobs": chat_logprobs(toks, int(body.get("top_logprobs") or 0))
        if body.get("logprobs")
        else None,
        "finish_reason": _finish(p),
        "stop_reason": None,
        "token_ids": [t.id for t in toks] if ids else None,
        "routed_experts": None,
    }
    return {
        "id": f"chatcmpl-{conv.key}",
        "object": "chat.completion",
        "created": CREATED,
        "model": body.get("model"),
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(len(prompt), len(toks)),
        "prompt_logprobs": None,
        "prompt_token_ids": prompt if ids else None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_chunks(body: dict, text: str | None = None) -> list[dict]:
    """The stream's events (without `[DONE]`), as vLLM's chat serving emits them;
    `text` as in chat_whole."""
    conv = chat_conversation(body)
    p = plan(conv) if text is None else Plan(text=text)
    toks = tokens(p)
    prompt = conv.prompt_ids()
    ids = bool(body.get("return_token_ids"))
    options = body.get("stream_options") or {}
    include_usage = bool(options.get("include_usage"))
    continuous = include_usage and bool(options.get("continuous_usage_stats"))
    top = int(body.get("top_logprobs") or 0)
    head = {
        "id": f"chatcmpl-{conv.key}",
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": body.get("model"),
    }
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
    first["finish_reason"] = None
    events = [{**head, "choices": [first], "prompt_token_ids": prompt if ids else None}]
    events[0]["prompt_text"] = None
    if continuous:
        events[0]["usage"] = _continuous(len(prompt), 0)
    for n, t in enumerate(toks, 1):
        last = n == len(toks)
        # A held-back token is sent only when the client asked for its id or logprob.
        if t.delta is None and not last and not (ids or body.get("logprobs")):
            continue
        choice = {
            "index": 0,
            "delta": t.delta or {},
            "logprobs": chat_logprobs([t], top) if body.get("logprobs") else None,
            "finish_reason": _finish(p) if last else None,
        }
        if last:
            choice["stop_reason"] = None
        choice["token_ids"] = [t.id] if ids else None
        event = {**head, "choices": [choice]}
        if continuous:
            event["usage"] = _continuous(len(prompt), n)
        events.append(event)
    if include_usage:
        # vLLM dumps this one with exclude_none: no null details.
        final = {**head, "choices": [], "usage": usage(len(prompt), len(toks))}
        final["usage"] = {k: v for k, v in final["usage"].items() if v is not None}
        events.append(final)
    return events


def _continuous(prompt: int, completion: int) -> dict:
    # Set explicitly on a chunk dumped with exclude_unset: the details stay unset.
    total = prompt + completion
    return {
        "prompt_tokens": prompt,
        "total_tokens": total,
        "completion_tokens": completion,
        "completion_tokens_details": None,
    }
