"""A scripted hosted API, as strict as the real ones: OpenAI's chat completions and
Responses, Anthropic's Messages, each refusing what it does not know.

The proxy in front of a hosted upstream must add nothing (overnight/config/upstream_kind.py);
this upstream holds it to that the way the real APIs would: a request field it does not
know is a 400 naming the field (OpenAI: "Unrecognized request argument supplied: X";
Anthropic: "X: Extra inputs are not permitted"), and a request without its own key is
a 401 (OpenAI: `Authorization: Bearer KEY`; Anthropic: `x-api-key: KEY`, and an
`anthropic-version` header). Answers are the scripted agent's (scripted.py,
scripted_apis.py: tool calls, schemas, deterministic ids) in the hosted shapes: vLLM's
own keys (token ids, `stop_reason`, transfer params) left out. Given an `answer`
function, chat completions answer with its text instead: a teacher good at some task,
for tests that distil its logged traffic into the local model. Every request it takes
is kept in RECEIVED with its raw bytes, for tests that compare what arrived with what
the client sent; an answer's bytes are kept in ANSWERS, for tests that compare what the
client got with what the upstream sent.

    python -m overnight.testing.hosted_upstream --port 8002 --key sk-hosted
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from aiohttp import web

from . import scripted, scripted_apis
from .fake_shared import RECEIVED, STORED, dumps, send_stream

KEY = web.AppKey("key", str)
ANSWERS = web.AppKey("answers", list)  # each answer's bytes, whole or the stream's
# A chat request's body -> the reply's text (None: the script's).
TEACHER = web.AppKey("teacher", Callable[[dict], str] | None)
SNAPSHOT = "-2026-01-01"  # a chat answer's model: the one asked for, dated

# What each API takes (their references, 2026); anything else is refused.
# fmt: off
CHAT_FIELDS = frozenset((
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
    "n", "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop",
    "store", "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs",
    "top_p", "user", "verbosity", "web_search_options",
))
RESPONSES_FIELDS = frozenset((
    "background", "conversation", "include", "input", "instructions", "max_output_tokens",
    "max_tool_calls", "metadata", "model", "parallel_tool_calls", "previous_response_id",
    "prompt", "prompt_cache_key", "reasoning", "safety_identifier", "service_tier", "store",
    "stream", "stream_options", "temperature", "text", "tool_choice", "tools", "top_logprobs",
    "top_p", "truncation", "user",
))
MESSAGES_FIELDS = frozenset((
    "model", "messages", "max_tokens", "metadata", "service_tier", "stop_sequences", "stream",
    "system", "temperature", "thinking", "tool_choice", "tools", "top_k", "top_p", "container",
    "mcp_servers",
))
# vLLM's keys in the scripted shapes, which a hosted API never sends.
VLLM_ONLY = frozenset((
    "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
    "ec_transfer_params", "metrics", "token_ids", "stop_reason", "routed_experts",
    "input_messages", "output_messages",
))
# fmt: on


def _json(obj, status: int = 200) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


def _openai_error(message: str, status: int, code: str | None = None) -> web.Response:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return _json({"error": error}, status)


def _anthropic_error(message: str, status: int, kind: str) -> web.Response:
    return _json({"type": "error", "error": {"type": kind, "message": message}}, status)


def masked(key: str) -> str:
    """A key as OpenAI's 401 names it: its ends only."""
    return f"{key[:3]}***{key[-4:]}" if len(key) > 8 else "***"


def _hosted_shape(obj):
    """`obj` without vLLM's own keys, at any depth (a chunk's choices, a message)."""
    if isinstance(obj, dict):
        return {k: _hosted_shape(v) for k, v in obj.items() if k not in VLLM_ONLY}
    if isinstance(obj, list):
        return [_hosted_shape(v) for v in obj]
    return obj


async def _read(request: web.Request, fields: frozenset[str], anthropic: bool):
    """The body, or the error the API would answer (auth first, as they check it)."""
    raw = await request.read()
    request.app[RECEIVED].append(
        {"path": request.path, "raw": raw, "headers": dict(request.headers), "body": None}
    )
    key = request.app[KEY]
    if anthropic:
        if request.headers.get("x-api-key") != key:
            return None, _anthropic_error("invalid x-api-key", 401, "authentication_error")
        if "anthropic-version" not in request.headers:
            return None, _anthropic_error(
                "anthropic-version: header is required", 400, "invalid_request_error"
            )
    else:
        given = request.headers.get("Authorization", "")
        if given != f"Bearer {key}":
            token = given.removeprefix("Bearer ")
            message = (
                f"Incorrect API key provided: {masked(token)}."
                if token
                else "You didn't provide an API key."
            )
            return None, _openai_error(message, 401, "invalid_api_key")
    body = await request.json()
    request.app[RECEIVED][-1]["body"] = body
    unknown = sorted(set(body) - fields)
    if unknown:
        if anthropic:
            message = f"{unknown[0]}: Extra inputs are not permitted"
            return None, _anthropic_error(message, 400, "invalid_request_error")
        return None, _openai_error(f"Unrecognized request argument supplied: {unknown[0]}", 400)
    return body, None


async def _answer(request: web.Request, body: dict, whole: dict, events: list[bytes]):
    if not body.get("stream"):
        data = dumps(whole)
        request.app[ANSWERS].append(data)
        return web.Response(body=data, content_type="application/json")
    request.app[ANSWERS].append(b"".join(events))
    return await send_stream(request, events)


async def chat(request: web.Request) -> web.StreamResponse:
    body, refused = await _read(request, CHAT_FIELDS, anthropic=False)
    if refused is not None:
        return refused
    # A hosted API names the snapshot that answered (`gpt-4o` is `gpt-4o-2024-08-06`).
    answered = {"model": f"{body.get('model')}{SNAPSHOT}"}
    teacher = request.app[TEACHER]
    text = teacher(body) if teacher else None
    whole = {**_hosted_shape(scripted.chat_whole(body, text)), **answered}
    for choice in whole["choices"]:  # vLLM's reasoning text, which OpenAI's chat has not
        choice["message"].pop("reasoning", None)
    chunks = [{**_hosted_shape(c), **answered} for c in scripted.chat_chunks(body, text)]
    events = [b"data: " + dumps(c) + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]
    return await _answer(request, body, whole, events)


async def responses(request: web.Request) -> web.StreamResponse:
    body, refused = await _read(request, RESPONSES_FIELDS, anthropic=False)
    if refused is not None:
        return refused
    stored = request.app[STORED]
    previous = body.get("previous_response_id")
    if previous and previous not in stored:
        return _openai_error(f"Previous response with id '{previous}' not found.", 400)
    history = stored.get(previous, []) if previous else []
    conv = scripted_apis.responses_conversation(body, history)
    events = [_hosted_shape(e) for e in scripted_apis.responses_events(body, conv)]
    final = events[-1]["response"]
    new_input = body.get("input")
    if isinstance(new_input, str):
        new_input = [{"role": "user", "content": new_input}]
    stored[final["id"]] = [*history, *(new_input or []), *final["output"]]
    lines = [f"event: {e['type']}\ndata: ".encode() + dumps(e) + b"\n\n" for e in events]
    return await _answer(request, body, final, lines)


async def messages(request: web.Request) -> web.StreamResponse:
    body, refused = await _read(request, MESSAGES_FIELDS, anthropic=True)
    if refused is not None:
        return refused
    whole = scripted_apis.message_whole(body)
    events = scripted_apis.message_events(body)
    lines = [f"event: {name}\ndata: ".encode() + dumps(data) + b"\n\n" for name, data in events]
    return await _answer(request, body, whole, lines)


async def models(request: web.Request) -> web.Response:
    if request.headers.get("Authorization") != f"Bearer {request.app[KEY]}":
        return _openai_error("You didn't provide an API key.", 401, "invalid_api_key")
    card = {"id": "hosted-large", "object": "model", "created": 0, "owned_by": "hosted"}
    return _json({"object": "list", "data": [card]})


def create_hosted_upstream(
    key: str = "sk-hosted-upstream", answer: Callable[[dict], str] | None = None
) -> web.Application:
    """The hosted API, answering requests that carry `key` in its own header; `answer`:
    each chat reply's text, from the request's body (else the scripted agent's)."""
    app = web.Application()
    app[KEY] = key
    app[TEACHER] = answer
    app[RECEIVED] = []
    app[ANSWERS] = []
    app[STORED] = {}
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    app.router.add_get("/v1/models", models)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument("--key", default="sk-hosted-upstream")
    args = parser.parse_args()
    web.run_app(create_hosted_upstream(args.key), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
