"""What the fake vLLM's endpoints share: its app's keys, and how it writes an answer.

Every request an endpoint takes is kept in RECEIVED (`record`), where tests read what
reached the upstream; SETTINGS holds what the app was made with and what tests change
while it runs. JSON goes out compact, as vLLM writes it.
"""

from __future__ import annotations

import json

from aiohttp import web

RECEIVED = web.AppKey("received", list)
SETTINGS = web.AppKey("settings", dict)
# Responses answered, by id: the items a `previous_response_id` continues from.
STORED = web.AppKey("stored", dict)


def record(request: web.Request, body) -> dict:
    """The request kept in RECEIVED; its entry, for notes made later (`client_left`)."""
    entry = {"path": request.path, "body": body, "headers": dict(request.headers)}
    request.app[RECEIVED].append(entry)
    return entry


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


async def send_stream(request: web.Request, events: list[bytes]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    for event in events:
        await response.write(event)
    await response.write_eof()
    return response
