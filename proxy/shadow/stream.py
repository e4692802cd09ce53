"""Sibling requests are streamed (a cancelled one stops at vLLM's next write); this
assembles the stream back into the whole /v1/completions answer storage.siblings reads."""

from __future__ import annotations

import orjson

from overnight.proxy.forward.sse import SSEParser
from overnight.storage.read.siblings import SiblingError


async def assemble_stream(response, on_first=None) -> dict:
    """The whole /v1/completions response (the `choices` that storage.siblings reads)
    from vLLM's stream of it, read from `response.content.iter_any()` (an aiohttp
    response or the proxy's own upstream one).

    vLLM 0.32 (read in its serving code and checked against its whole answer, seeded:
    tests/test_shadow.py) sends one choice per chunk, the choices of n > 1 interleaved
    by `index`; a chunk has the choice's new text, `token_ids` and `logprobs`
    (`token_logprobs`, one per new token), its first also the `prompt_token_ids` (with
    `return_token_ids`), its last the `finish_reason`; `stream_options` add only usage,
    not needed. An `{"error": ...}` event or a stream cut before `[DONE]` raises
    SiblingError."""
    choices: dict[int, dict] = {}
    parser = SSEParser()
    async for chunk in response.content.iter_any():
        if on_first is not None:  # the first bytes: vLLM's prefill is done
            on_first()
            on_first = None
        for raw in parser.feed(chunk):
            payload = SSEParser.data_of(raw)
            if payload is None:
                continue
            if payload == b"[DONE]":
                return {"choices": [_whole_choice(choices[i]) for i in sorted(choices)]}
            event = orjson.loads(payload)
            if "error" in event:
                raise SiblingError(f"vLLM failed mid-stream: {str(event['error'])[:200]}")
            for part in event.get("choices") or ():
                _add_part(choices.setdefault(part["index"], _empty_choice(part["index"])), part)
    raise SiblingError("the stream ended before [DONE]")


def _empty_choice(index: int) -> dict:
    return {"index": index, "text": [], "token_ids": [], "token_logprobs": [], "prompt": None}


def _add_part(choice: dict, part: dict) -> None:
    choice["text"].append(part.get("text") or "")
    choice["token_ids"].extend(part.get("token_ids") or ())
    # A chunk without logprobs leaves the choice one short: sibling_rows refuses it.
    choice["token_logprobs"].extend((part.get("logprobs") or {}).get("token_logprobs") or ())
    if part.get("prompt_token_ids") is not None:
        choice["prompt"] = part["prompt_token_ids"]
    if part.get("finish_reason") is not None:
        choice["finish_reason"] = part["finish_reason"]


def _whole_choice(choice: dict) -> dict:
    if choice["prompt"] is None:  # else sibling_rows could not check the context
        raise SiblingError("vLLM streamed a choice without its prompt_token_ids")
    return {
        "index": choice["index"],
        "text": "".join(choice["text"]),
        "token_ids": choice["token_ids"],
        "logprobs": {"token_logprobs": choice["token_logprobs"]},
        "finish_reason": choice.get("finish_reason"),
        "prompt_token_ids": choice["prompt"],
    }
