"""The fake vLLM's /v1/responses and /v1/messages (Responses, Anthropic Messages), scripted.

Both answer as the scripted agent of scripted_apis.py, whole or as an event stream.
"""

from __future__ import annotations

from aiohttp import web

from . import scripted_apis
from .fake_shared import STORED, dumps, record, send_stream


def _not_found(message: str) -> web.Response:
    error = {"message": message, "type": "NotFoundError", "param": None, "code": 404}
    return web.json_response({"error": error}, status=404, dumps=lambda o: dumps(o).decode())


async def responses(request: web.Request) -> web.StreamResponse:
    """The Responses API, scripted (scripted_apis.py); `previous_response_id` continues
    a response this upstream answered."""
    body = await request.json()
    record(request, body)
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
        return web.Response(body=dumps(final), content_type="application/json")
    lines = [f"event: {e['type']}\ndata: ".encode() + dumps(e) + b"\n\n" for e in events]
    return await send_stream(request, lines)


async def messages(request: web.Request) -> web.StreamResponse:
    """The Anthropic Messages API, scripted (scripted_apis.py)."""
    body = await request.json()
    record(request, body)
    if not body.get("stream"):
        whole = scripted_apis.message_whole(body)
        return web.Response(body=dumps(whole), content_type="application/json")
    events = scripted_apis.message_events(body)
    lines = [f"event: {name}\ndata: ".encode() + dumps(data) + b"\n\n" for name, data in events]
    return await send_stream(request, lines)
