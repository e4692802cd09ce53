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

from aiohttp import web

from .fake_admin import (
    health,
    is_sleeping,
    load_lora,
    models,
    refuse_while_asleep,
    sleep,
    unload_lora,
    wake_up,
)
from .fake_apis import messages, responses
from .fake_completions import completions
from .fake_shapes import FINGERPRINT
from .fake_shared import RECEIVED, SETTINGS, STORED

# The endpoints live in fake_completions.py, fake_apis.py and fake_admin.py; tests
# import the app, its keys and the fingerprint from here.
__all__ = ["FINGERPRINT", "RECEIVED", "SETTINGS", "STORED", "create_fake_upstream", "main"]


def create_fake_upstream(
    delay: float = 0.0, tokens: int = 4, jitter: float = 0.0, scripted: bool = False
) -> web.Application:
    """`scripted`: chat completions answer as the scripted agent (tools, schemas)."""
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[refuse_while_asleep])
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
        "asleep": False,  # POST /sleep (vLLM's dev-mode route): generation refused
        "sleeps": [],  # what the sleep routes were asked, in order ("sleep?level=1", ...)
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
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)
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
