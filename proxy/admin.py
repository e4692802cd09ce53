"""The admin API under /admin/: the adapters behind the alias, and the proxy's counters.

Access (the admin token, else loopback only) is checked by the app's middleware
(auth.py) before any of these run.
"""

from __future__ import annotations

from aiohttp import web

from overnight.errors import OvernightError

from .jsonio import read_json_object
from .redact import REDACTOR
from .state import ADAPTERS, STATS, WRITER
from .uncaptured import UNCAPTURED


async def adapters(request: web.Request) -> web.Response:
    return web.json_response(request.app[ADAPTERS].describe())


async def promote(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    unknown = set(body) - {"path"}
    if unknown or not isinstance(body.get("path"), str):
        raise OvernightError(
            f'expected {{"path": "..."}}; unknown fields: {sorted(unknown)}',
            status=400,
            code="invalid_request",
        )
    registry = request.app[ADAPTERS]
    adapter = await registry.promote(body["path"])
    return web.json_response({"promoted": adapter.name, **registry.describe()})


async def rollback(request: web.Request) -> web.Response:
    registry = request.app[ADAPTERS]
    await registry.rollback()
    return web.json_response(registry.describe())


async def stats(request: web.Request) -> web.Response:
    writer = request.app[WRITER]
    return web.json_response(
        {
            "requests": request.app[STATS].requests,
            "rows_appended": writer.appended,
            "rows_committed": writer.rows_committed,
            # status and reason; rows written, lost, fitted; failed batches; rows
            # compacted, lines quarantined, failed compactions (storage.WriterHealth)
            **writer.health().as_dict(),
            "redaction_failures": request.app[REDACTOR].failures,
            # path -> POSTs whose model output was forwarded but not recorded
            "uncaptured": request.app[UNCAPTURED].snapshot(),
            "writer_id": writer.writer_id,
        }
    )
