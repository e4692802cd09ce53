"""A completion in vLLM 0.32's shapes, from its tokens: whole, or streamed chunk by chunk.

Chat and text completions, with vLLM's keys and nulls, `token_ids` and
`prompt_token_ids` when `return_token_ids` asks for them, logprobs in each API's shape,
a tool call as vLLM's hermes parser streams it, and the usage chunk. The stream also
misbehaves as `X-Fake` asks: it drops the connection, stalls, slows, or ends without
[DONE].
"""

from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import web

from .fake_shared import dumps

FINGERPRINT = "vllm-fake"


def _logprobs(chat: bool, tokens) -> dict:
    if chat:
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for _, t, lp in tokens
            ]
        }
    return {
        "text_offset": list(range(len(tokens))),
        "token_logprobs": [lp for *_, lp in tokens],
        "tokens": [t for _, t, _ in tokens],
        "top_logprobs": [{t: lp} for _, t, lp in tokens],
    }


def _usage(prompt: list[int], completion: int) -> dict:
    return {
        "prompt_tokens": len(prompt),
        "total_tokens": len(prompt) + completion,
        "completion_tokens": completion,
    }


def whole_response(
    body: dict, chat: bool, prompt: list[int], choices: list, tool_call: bool
) -> dict:
    ids = bool(body.get("return_token_ids"))
    want_logprobs = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
    out = []
    for i, tokens in enumerate(choices):
        text = "".join(t for _, t, _ in tokens)
        choice: dict = {"index": i}
        if chat:
            message = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            }
            if tool_call:
                message["content"] = None
                message["tool_calls"] = [
                    {
                        "id": f"chatcmpl-tool-{i}",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"query": "cats"}'},
                    }
                ]
            choice["message"] = message
        else:
            choice["text"] = text
        choice["logprobs"] = _logprobs(chat, tokens) if want_logprobs else None
        choice["finish_reason"] = "tool_calls" if tool_call else "length"
        choice["stop_reason"] = None
        choice["token_ids"] = [t for t, _, _ in tokens] if ids else None
        if not chat:
            choice["prompt_logprobs"] = None
            choice["prompt_token_ids"] = prompt if ids else None
        out.append(choice)
    response = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": out,
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": _usage(prompt, sum(len(c) for c in choices)),
    }
    if chat:
        response["prompt_logprobs"] = None
        response["prompt_token_ids"] = prompt if ids else None
    return response


async def stream_response(request, body, chat, prompt, choices, behaviour) -> web.StreamResponse:
    """vLLM's chunk sequence, in the order vLLM writes it (the proxy's tests rely on the
    order), then sent as `behaviour` says (a reset, a stall, slow chunks, no [DONE])."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    events = _stream_events(body, chat, prompt, choices, behaviour)
    if await _send_events(request, response, events, behaviour):
        if behaviour != "no-done":
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    return response


def _stream_events(body, chat, prompt, choices, behaviour) -> list[dict]:
    """The stream's chunks: each chat choice's role, then the tokens round-robin over
    the choices, then the usage where asked."""
    ids = bool(body.get("return_token_ids"))
    usage = (body.get("stream_options") or {}).get("include_usage")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
    head = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.get("model"),
    }
    events = []
    if chat:
        for i in range(len(choices)):
            delta = {"role": "assistant", "content": ""}
            first = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
            events.append({**head, "choices": [first], "prompt_token_ids": prompt if ids else None,
                           "prompt_text": None})  # fmt: skip
    longest = max(len(c) for c in choices)
    for step in range(longest):
        for i, tokens in enumerate(choices):
            if step >= len(tokens):
                continue
            last = step == len(tokens) - 1
            choice = _token_choice(body, chat, prompt, i, tokens, step, behaviour)
            event = {**head, "choices": [choice]}
            if last and not usage:
                event["system_fingerprint"] = FINGERPRINT
            events.append(event)
    if usage:
        events.append({**head, "choices": [], "usage": _usage(prompt, sum(map(len, choices))),
                       "system_fingerprint": FINGERPRINT})  # fmt: skip
    return events


def _token_choice(body, chat, prompt, i: int, tokens, step: int, behaviour: str) -> dict:
    """Choice `i`'s chunk for its token at `step` (a tool call's arguments, content or text)."""
    ids = bool(body.get("return_token_ids"))
    want_logprobs = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
    token_id, text, _ = tokens[step]
    last = step == len(tokens) - 1
    choice: dict = {"index": i}
    if chat and behaviour == "tool-call":
        call = {"index": 0, "function": {"arguments": text}}
        if step == 0:
            call = {"id": f"chatcmpl-tool-{i}", "type": "function", "index": 0,
                    "function": {"name": "lookup"}}  # fmt: skip
        choice["delta"] = {"tool_calls": [call]}
    elif chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = _logprobs(chat, [tokens[step]]) if want_logprobs else None
    choice["finish_reason"] = (
        ("tool_calls" if behaviour == "tool-call" else "length") if last else None
    )
    if last or not chat:
        choice["stop_reason"] = None
    if not chat:
        choice["prompt_token_ids"] = prompt if ids and step == 0 else None
    choice["token_ids"] = [token_id] if ids else None
    return choice


async def _send_events(request, response, events: list[dict], behaviour: str) -> bool:
    """Write the events as `behaviour` says; False when the connection was dropped."""
    reset_after = int(behaviour.split("-")[2]) if behaviour.startswith("reset-after-") else None
    stall_after = int(behaviour.split("-")[2]) if behaviour.startswith("stall-after-") else None
    gap = float(behaviour.split("-")[2]) if behaviour.startswith("slow-chunks-") else 0.0
    for sent, event in enumerate(events):
        if reset_after is not None and sent >= reset_after:
            request.transport.close()  # the connection drops mid-stream
            return False
        if stall_after is not None and sent >= stall_after:
            await asyncio.sleep(3600)  # the connection stays open, silent
        if gap:
            await asyncio.sleep(gap)
        await response.write(b"data: " + dumps(event) + b"\n\n")
    return True
