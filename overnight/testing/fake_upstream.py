"""A fake of vLLM's OpenAI server, for fast proxy tests and overhead benchmarks.

It answers in vLLM 0.32's shapes (the same keys, nulls where vLLM sends nulls,
`prompt_token_ids`/`token_ids` with `return_token_ids`, logprobs, usage chunks) with
deterministic tokens, instantly or after `delay`. It is not a model: tests that
claim to exercise vLLM use the real one. Asked to judge (a RULER request, with the
`ruler_scores` response format) it answers with valid scores, for judge benchmarks. A request can ask it to misbehave with the
`X-Fake` header: `status-500`, `status-429`, `garbage` (200 with a body that is not
JSON), `reset-after-N` (stream N chunks then drop the connection), `stall` (never
answer), `stall-after-N` (stream N chunks, then go silent), `slow-chunks-S` (S seconds between chunks), `no-done` (end the stream without [DONE]), `tool-call`; or
`SETTINGS["behaviour_by_path"]` gives one to every request on a path. A token-id
`prompt` (a list of ints) is its own `prompt_token_ids`, as in vLLM. A stream whose
client left stops (at its next write, as vLLM's, or when aiohttp cancels the handler)
and its received entry gets `client_left: True`.

`/v1/responses` and `/v1/messages` (the Responses and Anthropic Messages APIs) answer
as the scripted agent of scripted.py does; with `scripted=True` (`--scripted`) chat
completions do too: tool calls while the conversation has no tool result, JSON that
fits a `response_format` schema, deterministic ids, for running real agent frameworks.

    python -m overnight.testing.fake_upstream --port 8001 --delay 0.02 --tokens 48
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
import uuid

from aiohttp import web

from . import scripted, scripted_apis

FINGERPRINT = "vllm-fake"
# Every choice of an answer is built in memory: a fuzzed `n` or `max_tokens` in the
# billions (tests/test_fuzz_proxy.py) once took the test process to 21 GB and the OOM
# killer. vLLM refuses a max_tokens beyond its context; the fake refuses past this.
MAX_TOKENS_BUILT = 1_000_000
RECEIVED = web.AppKey("received", list)
SETTINGS = web.AppKey("settings", dict)
# Responses answered, by id: the items a `previous_response_id` continues from.
STORED = web.AppKey("stored", dict)


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


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


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    entry = {"path": request.path, "body": body, "headers": dict(request.headers)}
    request.app[RECEIVED].append(entry)
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
        return web.Response(body=_dumps(_ruler_answer(body)), content_type="application/json")
    n = int(body.get("n") or 1)
    max_tokens = int(body.get("max_tokens") or settings["tokens"])
    if n * max_tokens > MAX_TOKENS_BUILT:  # as vLLM refuses a max_tokens past its context
        message = f"n x max_tokens is {n * max_tokens}: the fake builds at most {MAX_TOKENS_BUILT}"
        error = {"message": message, "type": "BadRequestError", "code": 400}
        return web.json_response({"error": error}, status=400)
    tool_call = behaviour == "tool-call"
    prompt = _prompt_ids(body)
    choices = [_tokens(max_tokens, i, tool_call) for i in range(n)]
    if body.get("stream"):
        try:
            return await _stream(request, body, chat, prompt, choices, behaviour)
        except (ConnectionResetError, asyncio.CancelledError):
            # A stream whose client left is stopped (vLLM: at its next write; here, at
            # the write or when the server cancels the handler); tests read the entry.
            entry["client_left"] = True
            raise
    return web.Response(
        body=_dumps(_whole(body, chat, prompt, choices, tool_call)), content_type="application/json"
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


def _whole(body: dict, chat: bool, prompt: list[int], choices: list, tool_call: bool) -> dict:
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


async def _stream(request, body, chat, prompt, choices, behaviour) -> web.StreamResponse:
    # One piece on purpose: it writes vLLM's chunk sequence in the order vLLM does, and
    # the order is what the proxy's tests rely on.
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    ids = bool(body.get("return_token_ids"))
    want_logprobs = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
    usage = (body.get("stream_options") or {}).get("include_usage")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
    head = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.get("model"),
    }
    reset_after = int(behaviour.split("-")[2]) if behaviour.startswith("reset-after-") else None
    stall_after = int(behaviour.split("-")[2]) if behaviour.startswith("stall-after-") else None
    gap = float(behaviour.split("-")[2]) if behaviour.startswith("slow-chunks-") else 0.0
    events = []
    if chat:
        for i in range(len(choices)):
            events.append(
                {
                    **head,
                    "choices": [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    "prompt_token_ids": prompt if ids else None,
                    "prompt_text": None,
                }
            )
    longest = max(len(c) for c in choices)
    for step in range(longest):
        for i, tokens in enumerate(choices):
            if step >= len(tokens):
                continue
            token_id, text, lp = tokens[step]
            last = step == len(tokens) - 1
            choice = {"index": i}
            if chat and behaviour == "tool-call":
                call = {"index": 0, "function": {"arguments": text}}
                if step == 0:
                    call = {
                        "id": f"chatcmpl-tool-{i}",
                        "type": "function",
                        "index": 0,
                        "function": {"name": "lookup"},
                    }
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
            event = {**head, "choices": [choice]}
            if last and not usage:
                event["system_fingerprint"] = FINGERPRINT
            events.append(event)
    if usage:
        events.append(
            {
                **head,
                "choices": [],
                "usage": _usage(prompt, sum(len(c) for c in choices)),
                "system_fingerprint": FINGERPRINT,
            }
        )
    for sent, event in enumerate(events):
        if reset_after is not None and sent >= reset_after:
            request.transport.close()  # the connection drops mid-stream
            return response
        if stall_after is not None and sent >= stall_after:
            await asyncio.sleep(3600)  # the connection stays open, silent
        if gap:
            await asyncio.sleep(gap)
        await response.write(b"data: " + _dumps(event) + b"\n\n")
    if behaviour != "no-done":
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _scripted_chat(request: web.Request, body: dict) -> web.StreamResponse:
    if not body.get("stream"):
        return web.Response(body=_dumps(scripted.chat_whole(body)), content_type="application/json")
    events = [b"data: " + _dumps(e) + b"\n\n" for e in scripted.chat_chunks(body)]
    return await _send_stream(request, [*events, b"data: [DONE]\n\n"])


async def _send_stream(request: web.Request, events: list[bytes]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    for event in events:
        await response.write(event)
    await response.write_eof()
    return response


def _not_found(message: str) -> web.Response:
    error = {"message": message, "type": "NotFoundError", "param": None, "code": 404}
    return web.json_response({"error": error}, status=404, dumps=lambda o: _dumps(o).decode())


async def responses(request: web.Request) -> web.StreamResponse:
    """The Responses API, scripted (scripted_apis.py); `previous_response_id` continues
    a response this upstream answered."""
    body = await request.json()
    request.app[RECEIVED].append(
        {"path": request.path, "body": body, "headers": dict(request.headers)}
    )
    stored = request.app[STORED]
    history: list[dict] = []
    if body.get("previous_response_id"):
        if body["previous_response_id"] not in stored:
            return _not_found(f"Response with id '{body['previous_response_id']}' not found.")
        history = stored[body["previous_response_id"]]
    conv = scripted_apis.responses_conversation(body, history)
    events = scripted_apis.responses_events(body, conv)
    final = events[-1]["response"]
    new_input = body.get("input")
    if isinstance(new_input, str):
        new_input = [{"role": "user", "content": new_input}]
    stored[final["id"]] = [*history, *(new_input or []), *final["output"]]
    if not body.get("stream"):
        return web.Response(body=_dumps(final), content_type="application/json")
    lines = [f"event: {e['type']}\ndata: ".encode() + _dumps(e) + b"\n\n" for e in events]
    return await _send_stream(request, lines)


async def messages(request: web.Request) -> web.StreamResponse:
    """The Anthropic Messages API, scripted (scripted_apis.py)."""
    body = await request.json()
    request.app[RECEIVED].append(
        {"path": request.path, "body": body, "headers": dict(request.headers)}
    )
    if not body.get("stream"):
        whole = scripted_apis.message_whole(body)
        return web.Response(body=_dumps(whole), content_type="application/json")
    events = scripted_apis.message_events(body)
    lines = [f"event: {name}\ndata: ".encode() + _dumps(data) + b"\n\n" for name, data in events]
    return await _send_stream(request, lines)


async def models(request: web.Request) -> web.Response:
    data = [
        {
            "id": "fake-base",
            "object": "model",
            "owned_by": "vllm",
            "root": "fake-base",
            "parent": None,
            # vLLM gives it on the base model's card only; None: a card without it
            "max_model_len": request.app[SETTINGS]["max_model_len"],
        }
    ]
    for name, path in request.app[SETTINGS]["loras"].items():
        data.append(
            {"id": name, "object": "model", "owned_by": "vllm", "root": path, "parent": "fake-base"}
        )
    return web.json_response({"object": "list", "data": data})


async def load_lora(request: web.Request) -> web.Response:
    body = await request.json()
    request.app[RECEIVED].append(
        {"path": request.path, "body": body, "headers": dict(request.headers)}
    )
    loras = request.app[SETTINGS]["loras"]
    if body["lora_name"] in loras:
        return web.json_response({"error": {"message": "already loaded", "code": 400}}, status=400)
    loras[body["lora_name"]] = body["lora_path"]
    return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")


async def unload_lora(request: web.Request) -> web.Response:
    body = await request.json()
    request.app[RECEIVED].append(
        {"path": request.path, "body": body, "headers": dict(request.headers)}
    )
    if request.app[SETTINGS]["loras"].pop(body["lora_name"], None) is None:
        return web.json_response({"error": {"message": "not found", "code": 404}}, status=404)
    return web.Response(text="Success")


async def health(request: web.Request) -> web.Response:
    return web.Response()


def create_fake_upstream(
    delay: float = 0.0, tokens: int = 4, jitter: float = 0.0, scripted: bool = False
) -> web.Application:
    """`scripted`: chat completions answer as the scripted agent (tools, schemas)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[RECEIVED] = []
    app[SETTINGS] = {
        "delay": delay,
        "jitter": jitter,
        "tokens": tokens,
        "loras": {},
        "max_model_len": 4096,
        "scripted": scripted,
        # path -> an X-Fake behaviour for requests without the header (requests the
        # proxy makes itself, such as shadow samples, carry no client header)
        "behaviour_by_path": {},
    }
    app[STORED] = {}
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/load_lora_adapter", load_lora)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before each answer")
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="delay varies uniformly by this fraction (0.5: 10-30 ms for 20 ms)",
    )
    parser.add_argument("--tokens", type=int, default=4, help="tokens per choice unless max_tokens")
    parser.add_argument(
        "--scripted",
        action="store_true",
        help="chat completions answer as a scripted agent: tool calls, JSON fitting a schema",
    )
    args = parser.parse_args()
    app = create_fake_upstream(args.delay, args.tokens, args.jitter, scripted=args.scripted)
    # The benchmark reads the RECEIVED list never; keep memory flat under load.
    app[RECEIVED] = _Discard()
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)


class _Discard(list):
    def append(self, _item) -> None:
        pass


if __name__ == "__main__":
    main()
