"""What agents call: completions (forwarded and recorded), rewards, finishing a rollout.

Request path for chat and text completions:
  read body (size-capped) -> parse -> attribute to a rollout -> resolve the alias ->
  ask upstream for token ids/logprobs/usage -> forward -> tee the answer to the
  client (hiding what we added) and into an Accumulator -> one record per choice.
The record is appended to the write-ahead log after the client has its answer, so
logging adds no latency. Rewards and finishes are durable before they are answered.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from .attribution import Attribution, attribute, logging_enabled
from .capture import CHAT, TEXT, add_training_fields
from .capture_state import Capture
from .jsonio import read_json_object
from .records import completion_rows, finish_row, parse_reward, reward_row
from .relay import forward, passthrough
from .state import ADAPTERS, STATS, TURNS, WRITER

ENDPOINTS = {"chat/completions": CHAT, "completions": TEXT}


async def completions(request: web.Request) -> web.StreamResponse:
    tail = request.match_info.get("tail", request.path.removeprefix("/v1/"))
    endpoint = ENDPOINTS[tail]
    started = time.time_ns() // 1000
    body = await read_json_object(request)
    who = attribute(
        request.headers, request.match_info.get("group"), request.match_info.get("rollout"), body
    )
    app = request.app
    adapters = app[ADAPTERS]
    route = adapters.route(body.get("model"))
    upstream_body = dict(body, model=route.served)
    added = add_training_fields(upstream_body, endpoint)
    capture = Capture(endpoint, bool(body.get("stream")), request_body=body, route=route)
    try:
        return await forward(request, endpoint, upstream_body, added, capture)
    finally:
        adapters.release(route)
        app[STATS].requests += 1
        # Built once the response is on its way (aiohttp writes it before this task next
        # yields), so a burst of answers is not held up by the records of the earlier ones.
        asyncio.get_running_loop().call_soon(
            _record, app, capture, who, started, logging_enabled(request.headers)
        )


def _record(
    app: web.Application, capture: Capture, who: Attribution, started: int, logged: bool
) -> None:
    writer = app[WRITER]
    rows = completion_rows(
        capture,
        who,
        started=started,
        turn_counter=app[TURNS],
        logged=logged,
        proxy_id=writer.writer_id,
    )
    for row in rows:
        writer.append("completions", row)


async def prefixed(request: web.Request) -> web.StreamResponse:
    """/rollouts/{group}/{rollout}/v1/... for clients that can only set a base URL."""
    if request.match_info["tail"] in ENDPOINTS and request.method == "POST":
        return await completions(request)
    return await passthrough(request)


async def post_reward(request: web.Request) -> web.Response:
    rollout_id = request.match_info["rollout_id"]
    reward, metrics = parse_reward(await read_json_object(request))
    writer = request.app[WRITER]
    row = reward_row(rollout_id, reward, metrics, writer.writer_id)
    await writer.wait_committed(writer.append("rewards", row))
    return web.json_response({"rollout_id": rollout_id, "reward": reward, "recorded": True})


async def post_finish(request: web.Request) -> web.Response:
    rollout_id = request.match_info["rollout_id"]
    if request.body_exists:
        await read_json_object(request)  # must be JSON if present; nothing in it is used
    writer = request.app[WRITER]
    row = finish_row(rollout_id, writer.writer_id)
    await writer.wait_committed(writer.append("finishes", row))
    return web.json_response({"rollout_id": rollout_id, "finished": True})
