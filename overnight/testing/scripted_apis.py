"""The scripted agent behind vLLM 0.32's Responses API and Anthropic Messages API.

Same plan and tokens as the chat completions in scripted.py; rendered the way vLLM
0.32 renders them: `/v1/responses` through its simple (non-harmony) path, whose
streamed events come from `SimpleStreamingEventProcessor`, and `/v1/messages`, which
vLLM serves by translating to chat completions and back (`AnthropicServingMessages`).
vLLM gives no token ids on either API; Responses gives output-text logprobs when
`include` has `message.output_text.logprobs`, Messages none at all.
"""

from __future__ import annotations

import json

from .scripted import CREATED, Conversation, Plan, Token, plan, tokens

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_MODEL_LEN = 4096  # the context the scripted model claims


# ------------------------------------------------------------------- Responses API
def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content or [] if isinstance(part, dict))


def responses_conversation(body: dict, history: list[dict]) -> Conversation:
    """`history`: the items of the `previous_response_id` chain (input and output)."""
    items = body.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else list(items or [])
    items = history + items
    tools = [
        (t["name"], t.get("parameters") or {})
        for t in body.get("tools") or []
        if t.get("type") == "function"
    ]
    choice = body.get("tool_choice") or ("auto" if tools else "none")
    if isinstance(choice, dict):
        choice = choice.get("name", "auto")
    fmt = (body.get("text") or {}).get("format") or {}
    conv_text = json.dumps(
        [body.get("model"), body.get("instructions"), items, [n for n, _ in tools]],
        sort_keys=True,
    )
    return Conversation(
        text=conv_text,
        tools=tools,
        choice=choice,
        called=[i["name"] for i in items if i.get("type") == "function_call"],
        results=sum(i.get("type") == "function_call_output" for i in items),
        schema=fmt.get("schema") if fmt.get("type") == "json_schema" else None,
    )


def _logprob(t: Token, top: int) -> dict:
    entry = {"token": t.text, "bytes": list(t.text.encode()), "logprob": t.logprob}
    entry["top_logprobs"] = [dict(entry)][:top]
    return entry


def _message_item(key: str, text: str, logprobs: list | None, status: str) -> dict:
    content = [{"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}]
    return {
        "id": f"msg_{key}",
        "content": content if text else [],
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def _call_item(item_id: str, call, arguments: str, status: str) -> dict:
    return {
        "arguments": arguments,
        "call_id": call.id,
        "name": call.name,
        "type": "function_call",
        "id": item_id,
        "caller": None,
        "namespace": None,
        "status": status,
    }


def response_object(body: dict, conv: Conversation, output: list, n_out: int | None) -> dict:
    """ResponsesResponse.from_request(...) as vLLM dumps it (`n_out` None: in progress).

    Long because vLLM's object is: one literal, field by field, in its order."""
    prompt = len(conv.prompt_ids())
    usage = None
    if n_out is not None:
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {
                "cached_tokens": 0,
                "cache_write_tokens": 0,
                "input_tokens_per_turn": [prompt],
                "cached_tokens_per_turn": [0],
            },
            "output_tokens": n_out,
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [n_out],
                "tool_output_tokens_per_turn": [0],
            },
            "total_tokens": prompt + n_out,
        }
    tools = [
        {
            "name": t["name"],
            "parameters": t.get("parameters"),
            "strict": t.get("strict"),
            "type": "function",
            "allowed_callers": None,
            "defer_loading": None,
            "description": t.get("description"),
            "output_schema": None,
        }
        for t in body.get("tools") or []
        if t.get("type") == "function"
    ]
    include_logprobs = LOGPROBS_INCLUDE in (body.get("include") or [])
    return {
        "id": f"resp_{conv.key}",
        "created_at": CREATED,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": body.get("model"),
        "object": "response",
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 1.0),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": tools,
        "top_p": body.get("top_p", 1.0),
        "background": bool(body.get("background")),
        # vLLM fills in what the context leaves when the request sets no limit.
        "max_output_tokens": body.get("max_output_tokens") or MAX_MODEL_LEN - prompt,
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": body.get("previous_response_id"),
        "prompt": None,
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier") or "auto",
        "status": "in_progress" if n_out is None else "completed",
        "text": body.get("text"),
        "top_logprobs": body.get("top_logprobs", 0) if include_logprobs else None,
        "truncation": body.get("truncation") or "disabled",
        "usage": usage,
        "user": body.get("user"),
        "presence_penalty": body.get("presence_penalty", 0.0),
        "frequency_penalty": body.get("frequency_penalty", 0.0),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def responses_events(body: dict, conv: Conversation) -> list[dict]:
    """The stream's events in order; the last one, `response.completed`, holds the whole
    response (the non-streaming answer is that response). One piece: the event order is
    the contract, and it reads best as one sequence."""
    p: Plan = plan(conv)
    toks = tokens(p)
    want = LOGPROBS_INCLUDE in (body.get("include") or [])
    top = int(body.get("top_logprobs") or 0)
    start = response_object(body, conv, [], None)
    events: list[dict] = [
        {"response": start, "type": "response.created"},
        {"response": start, "type": "response.in_progress"},
    ]
    output: list[dict] = []
    if p.calls:
        for index, call in enumerate(p.calls):
            item_id = f"fc_{conv.key}{index}"
            added = _call_item(item_id, call, "", "in_progress")
            events.append(
                {"item": added, "output_index": index, "type": "response.output_item.added"}
            )
            deltas = [t.delta["tool_calls"][0] for t in toks if t.delta]
            args = [d["function"].get("arguments") for d in deltas if d["index"] == index]
            for piece in [a for a in args if a]:
                events.append(
                    {
                        "delta": piece,
                        "item_id": item_id,
                        "output_index": index,
                        "type": "response.function_call_arguments.delta",
                    }
                )
            done = {"arguments": call.arguments, "item_id": item_id, "name": call.name}
            done |= {"output_index": index, "type": "response.function_call_arguments.done"}
            events.append(done)
            item = _call_item(item_id, call, call.arguments, "completed")
            output.append(item)
            events.append(
                {"item": item, "output_index": index, "type": "response.output_item.done"}
            )
    else:
        key, text = conv.key, p.text or ""
        at = {"content_index": 0, "item_id": f"msg_{key}"}
        added = _message_item(key, "", None, "in_progress")
        events.append({"item": added, "output_index": 0, "type": "response.output_item.added"})
        part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        events.append(
            {**at, "output_index": 0, "part": part, "type": "response.content_part.added"}
        )
        for t in toks:
            lps = [{"token": t.text, "logprob": t.logprob, "top_logprobs": []}] if want else []
            if want and top:
                lps[0]["top_logprobs"] = [{"token": t.text, "logprob": t.logprob}]
            delta = {**at, "delta": t.text, "item_id": at["item_id"], "logprobs": lps}
            events.append(delta | {"output_index": 0, "type": "response.output_text.delta"})
        events.append(
            {**at, "logprobs": [], "output_index": 0, "text": text}
            | {"type": "response.output_text.done"}
        )
        logprobs = [_logprob(t, top) for t in toks] if want else None
        item = _message_item(key, text, logprobs, "completed")
        part = item["content"][0] if text else {**part, "logprobs": logprobs}
        events.append({**at, "output_index": 0, "part": part, "type": "response.content_part.done"})
        output.append(item)
        events.append({"item": item, "output_index": 0, "type": "response.output_item.done"})
    final = response_object(body, conv, output, len(toks))
    events.append({"response": final, "type": "response.completed"})
    for number, event in enumerate(events):
        # vLLM's field order: `sequence_number` sorts just before `type`, after the rest.
        kind = event.pop("type")
        event["sequence_number"] = number
        event["type"] = kind
    return events


# ------------------------------------------------------------- Anthropic Messages API
def messages_conversation(body: dict) -> Conversation:
    messages = body.get("messages") or []
    tools = [(t["name"], t.get("input_schema") or {}) for t in body.get("tools") or []]
    choice = body.get("tool_choice") or {"type": "auto"}
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(
        choice.get("type"), choice.get("name", "auto")
    )
    blocks = [
        b
        for m in messages
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, dict)
    ]
    conv_text = json.dumps(
        [body.get("model"), body.get("system"), messages, [n for n, _ in tools]], sort_keys=True
    )
    return Conversation(
        text=conv_text,
        tools=tools if choice != "none" else [],
        choice=choice,
        called=[b["name"] for b in blocks if b.get("type") == "tool_use"],
        results=sum(b.get("type") == "tool_result" for b in blocks),
    )


def _stop_reason(p: Plan) -> str:
    return "tool_use" if p.calls else "end_turn"


def message_whole(body: dict) -> dict:
    conv = messages_conversation(body)
    p = plan(conv)
    content: list[dict] = [{"type": "text", "text": p.text}] if p.text else []
    for call in p.calls:
        block = {"type": "tool_use", "id": call.id, "name": call.name}
        content.append(block | {"input": json.loads(call.arguments)})
    return {
        "id": f"chatcmpl-{conv.key}",
        "type": "message",
        "role": "assistant",
        "content": content or [{"type": "text", "text": ""}],
        "model": body.get("model"),
        "stop_reason": _stop_reason(p),
        "usage": {"input_tokens": len(conv.prompt_ids()), "output_tokens": len(tokens(p))},
    }


def message_events(body: dict) -> list[tuple[str, dict]]:
    """(event name, data) in order, as vLLM's message_stream_converter yields them."""
    conv = messages_conversation(body)
    p = plan(conv)
    toks = tokens(p)
    start = {
        "id": f"chatcmpl-{conv.key}",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": body.get("model"),
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},  # its first chunk has no usage
    }
    events: list[tuple[str, dict]] = [
        ("message_start", {"type": "message_start", "message": start})
    ]
    if p.calls:
        for index, call in enumerate(p.calls):
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            events.append(_block_start(block, index))
            for t in toks:
                calls = (t.delta or {}).get("tool_calls") or [{}]
                piece = calls[0].get("function", {}).get("arguments")
                if piece and calls[0].get("index") == index:
                    events.append(
                        _block_delta({"type": "input_json_delta", "partial_json": piece}, index)
                    )
            events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    else:
        events.append(_block_start({"type": "text", "text": ""}, 0))
        for t in toks:
            events.append(_block_delta({"type": "text_delta", "text": t.text}, 0))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
    delta = {"stop_reason": _stop_reason(p), "stop_sequence": None}
    usage = {"input_tokens": len(conv.prompt_ids()), "output_tokens": len(toks)}
    events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def _block_start(block: dict, index: int) -> tuple[str, dict]:
    return "content_block_start", {
        "type": "content_block_start",
        "content_block": block,
        "index": index,
    }


def _block_delta(delta: dict, index: int) -> tuple[str, dict]:
    return "content_block_delta", {"type": "content_block_delta", "delta": delta, "index": index}
