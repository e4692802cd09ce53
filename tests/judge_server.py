"""An in-process OpenAI-compatible judge that answers from a script.

Each request takes the next step of the script: a callable that gets the request
body and returns (status, body, headers). Tests reach it through real litellm over
HTTP, as a self-hosted judge would be reached.
"""

from __future__ import annotations

import json
import re
import time

from aiohttp import web

SCRIPT = web.AppKey("script", list)
SEEN = web.AppKey("seen", list)


def trajectory_count(body: dict) -> int:
    content = body["messages"][1]["content"]
    if isinstance(content, list):  # a judge that sees: the text first, the pictures after it
        content = content[0]["text"]
    return int(re.search(r"Score all (\d+) trajectories", content).group(1))


def answer(text: str, status: int = 200, headers: dict | None = None):
    def step(body: dict):
        reply = {
            "id": "judge-1",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": text},
                }
            ],
            "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
        }
        return status, reply, headers or {}

    return step


def good(score_of=lambda i: i / 10):
    """Valid scores: trajectory i gets score_of(i)."""

    def step(body: dict):
        n = trajectory_count(body)
        scores = [
            {"trajectory_id": str(i), "explanation": f"reason {i}", "score": score_of(i)}
            for i in range(1, n + 1)
        ]
        return answer(json.dumps({"scores": scores}))(body)

    return step


def error(status: int, headers: dict | None = None):
    def step(body: dict):
        return (
            status,
            {"error": {"message": f"scripted {status}", "type": "x", "code": status}},
            headers or {},
        )

    return step


def context_overflow():
    """The 400 an OpenAI-compatible server (vLLM, OpenAI) answers a prompt too long for it."""

    def step(body: dict):
        message = (
            "This model's maximum context length is 8192 tokens. However, you requested "
            "9000 tokens (8800 in the messages, 200 in the completion)."
        )
        return 400, {"error": {"message": message, "type": "BadRequestError", "code": 400}}, {}

    return step


async def completions(request: web.Request) -> web.Response:
    body = await request.json()
    request.app[SEEN].append(body)
    script = request.app[SCRIPT]
    step = script.pop(0) if len(script) > 1 else script[0]  # the last step repeats
    status, reply, headers = step(body)
    return web.json_response(reply, status=status, headers=headers)


def create_judge_server(script: list) -> web.Application:
    app = web.Application()
    app[SCRIPT] = script
    app[SEEN] = []
    app.router.add_post("/v1/chat/completions", completions)
    return app
