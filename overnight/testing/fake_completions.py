"""The fake vLLM's /v1/completions and /v1/chat/completions.

Deterministic tokens (a token-id `prompt` is its own `prompt_token_ids`), answered after
the app's `delay`, or misbehaving as the `X-Fake` header (or SETTINGS'
`behaviour_by_path`) asks. A RULER request gets valid scores; with `scripted`, chat
answers as the scripted agent of scripted.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import uuid

from aiohttp import web

from . import scripted
from .fake_shapes import stream_response, whole_response
from .fake_shared import SETTINGS, dumps, record, send_stream

# Every choice of an answer is built in memory: a fuzzed `n` or `max_tokens` in the
# billions (tests/test_fuzz_proxy.py) once took the test process to 21 GB and the OOM
# killer. vLLM refuses a max_tokens beyond its context; the fake refuses past this.
MAX_TOKENS_BUILT = 1_000_000
# vLLM's own bound on `n` (sampling_params._verify_num_sequences, VLLM_MAX_N_SEQUENCES).
MAX_N_SEQUENCES = 16384


def _prompt_ids(body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt  # a token-id prompt, as vLLM takes it: the ids are the prompt
    text = json.dumps(body.get("messages") or prompt)
    return [1 + (ord(c) % 97) for c in text[:64]]


def _tokens(n: int, choice: int, tool_call: bool) -> list[tuple[int, str, float]]:
    if tool_call:  # streamed as vLLM's hermes parser does: the name, then argument pieces
        pieces = ["<tool_call>", '{"query": ', '"cats"}']
        return [(900 + i, p, -0.05 * (i + 1)) for i, p in enumerate(pieces)]
    return [
        (100 + 7 * choice + i, f" w{choice}{i}", -0.01 * (i + 1) - 0.1 * choice) for i in range(n)
    ]


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    entry = record(request, body)
    settings = request.app[SETTINGS]
    behaviour = request.headers.get("X-Fake") or settings["behaviour_by_path"].get(request.path, "")
    if behaviour == "stall":
        await asyncio.sleep(3600)
    if behaviour.startswith("status-"):
        status = int(behaviour.split("-")[1])
        return web.json_response(
            {"error": {"message": f"fake {status}", "type": "fake", "code": status}}, status=status
        )
    if behaviour == "garbage":
        return web.Response(text="<html>not json</html>", content_type="application/json")
    if settings["delay"]:
        jitter = settings["jitter"]
        await asyncio.sleep(settings["delay"] * (1 + jitter * (2 * random.random() - 1)))
    chat = request.path.endswith("chat/completions")
    if chat and settings.get("scripted") and not _is_ruler(body):
        return await _scripted_chat(request, body)
    if chat and _is_ruler(body):
        return web.Response(body=dumps(_ruler_answer(body)), content_type="application/json")
    n = int(body.get("n") or 1)
    max_tokens = int(body.get("max_tokens") or settings["tokens"])
    if n > MAX_N_SEQUENCES:  # as vLLM does, before it builds anything
        message = f"n must be at most {MAX_N_SEQUENCES}, got {n}."
        error = {"message": message, "type": "BadRequestError", "code": 400}
        return web.json_response({"error": error}, status=400)
    if n * max_tokens > MAX_TOKENS_BUILT:  # as vLLM refuses a max_tokens past its context
        message = f"n x max_tokens is {n * max_tokens}: the fake builds at most {MAX_TOKENS_BUILT}"
        error = {"message": message, "type": "BadRequestError", "code": 400}
        return web.json_response({"error": error}, status=400)
    tool_call = behaviour == "tool-call"
    prompt = _prompt_ids(body)
    choices = [_tokens(max_tokens, i, tool_call) for i in range(n)]
    if body.get("stream"):
        try:
            return await stream_response(request, body, chat, prompt, choices, behaviour)
        except (ConnectionResetError, asyncio.CancelledError):
            # A stream whose client left is stopped (vLLM: at its next write; here, at
            # the write or when the server cancels the handler); tests read the entry.
            entry["client_left"] = True
            raise
    return web.Response(
        body=dumps(whole_response(body, chat, prompt, choices, tool_call)),
        content_type="application/json",
    )


def _is_ruler(body: dict) -> bool:
    schema = (body.get("response_format") or {}).get("json_schema") or {}
    return schema.get("name") == "ruler_scores"


def _ruler_answer(body: dict) -> dict:
    """A judge's valid answer to a RULER prompt: trajectory i of n scores i/n."""
    n = int(re.search(r"Score all (\d+) trajectories", body["messages"][-1]["content"]).group(1))
    scores = [
        {"trajectory_id": str(i), "explanation": f"fake reason {i}", "score": i / n}
        for i in range(1, n + 1)
    ]
    message = {"role": "assistant", "content": json.dumps({"scores": scores})}
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": len(body["messages"][-1]["content"]) // 4,
            "completion_tokens": 20 * n,
            "total_tokens": len(body["messages"][-1]["content"]) // 4 + 20 * n,
        },
    }


async def _scripted_chat(request: web.Request, body: dict) -> web.StreamResponse:
    if not body.get("stream"):
        return web.Response(body=dumps(scripted.chat_whole(body)), content_type="application/json")
    events = [b"data: " + dumps(e) + b"\n\n" for e in scripted.chat_chunks(body)]
    return await send_stream(request, [*events, b"data: [DONE]\n\n"])
