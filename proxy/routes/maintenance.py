"""The admin side of a colocated night's maintenance window, and the hold on the rest.

    GET  /admin/maintenance                       the window, if one is open, and the last
    POST /admin/maintenance {"action": "begin", "holder": run id, "lease_seconds": 120}
                                                  drain, vLLM asleep; answers once asleep
    POST /admin/maintenance {"action": "renew", "holder": ..., "lease_seconds": ...}
    POST /admin/maintenance {"action": "end", "holder": ...}
                                                  vLLM awake, adapters loaded again

`held` wraps the pass-through: a POST (a generating path of vLLM's that the proxy does
not record, say /v1/embeddings) waits out the window as completions do. Reads pass.
"""

from __future__ import annotations

from aiohttp import web

from overnight.errors import OvernightError
from overnight.proxy.forward.jsonio import read_json_object
from overnight.proxy.state import MAINTENANCE

from .admin import _expect
from .hosted import refuse_if_hosted
from .relay import passthrough

# A lease shorter than this would expire between two renewals of a busy night.
MIN_LEASE_SECONDS = 1.0


async def state(request: web.Request) -> web.Response:
    return web.json_response(request.app[MAINTENANCE].describe())


async def change(request: web.Request) -> web.Response:
    refuse_if_hosted(request.app, "put to sleep for a night")
    body = await read_json_object(request)
    _expect(body, {"action": "string", "holder": "string", "lease_seconds": "number"},
            ("action", "holder"))  # fmt: skip
    maintenance = request.app[MAINTENANCE]
    lease = float(body.get("lease_seconds", 120.0))
    if lease < MIN_LEASE_SECONDS:
        raise OvernightError(f"lease_seconds must be at least {MIN_LEASE_SECONDS:g}", status=400)
    action, holder = body["action"], body["holder"]
    if action == "begin":
        return web.json_response(await maintenance.begin(holder, lease))
    if action == "renew":
        return web.json_response(maintenance.renew(holder, lease))
    if action == "end":
        return web.json_response(await maintenance.end(holder))
    raise OvernightError(f"action must be begin, renew or end, got {action!r}", status=400)


async def held(request: web.Request) -> web.StreamResponse:
    """The pass-through, a POST held while vLLM sleeps."""
    if request.method != "POST":
        return await passthrough(request)
    async with request.app[MAINTENANCE].serving():
        return await passthrough(request)
