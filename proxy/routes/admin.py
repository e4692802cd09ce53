"""The admin API under /admin/: the adapters behind the alias, and the proxy's counters.

Access (the admin token, else loopback only) is checked by the app's middleware
(auth.py) before any of these run. The /admin/adapters routes act on one policy: the
query parameter `policy` names it (absent: the default policy, `--alias`), the one
place it is read, so that the middleware can check a policy's own admin token by it.
"""

from __future__ import annotations

import socket

from aiohttp import web

from overnight.errors import OvernightError
from overnight.proxy.capture.redact import REDACTOR
from overnight.proxy.capture.uncaptured import UNCAPTURED
from overnight.proxy.forward.jsonio import read_json_object
from overnight.proxy.shadow.sampler import SHADOW
from overnight.proxy.state import CONFIG, MAINTENANCE, POLICIES, STATS, WRITER

from .keys import KEYS

POLICY_PARAM = "policy"  # ?policy=NAME on /admin/adapters...


def policy_of(request: web.Request) -> str | None:
    """The policy an admin request is about (None: the default policy); named twice: 400."""
    named = request.query.getall(POLICY_PARAM, [])
    if len(named) > 1:
        raise OvernightError(
            f"?policy= is given {len(named)} times: name one policy", status=400,
            code="invalid_request",
        )  # fmt: skip
    return named[0] if named else None


async def adapters(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    # Where the night may colocate: vLLM launched here, with its sleep routes.
    colocation = {
        "launched_vllm": config.launched_vllm,
        "vllm_sleeps": config.vllm_sleeps,
        "host": socket.gethostname(),
    }
    # The policy's state (the default's without ?policy=), and every policy's name.
    state = request.app[POLICIES].describe(policy_of(request))
    return web.json_response({**state, "colocation": colocation})


async def promote(request: web.Request) -> web.Response:
    """{"path": ...}: serve it under the alias; with "canary": 0.1, only to that share of
    the alias's rollouts (promoting the canary's path later serves it to all); "reason"
    is kept with the event."""
    body = await read_json_object(request)
    _expect(body, {"path": "string", "canary": "number", "reason": "string"}, ("path",))
    policies = request.app[POLICIES]
    registry = policies.get(policy_of(request))
    _awake(request)
    canary = body.get("canary")
    adapter = await registry.promote(
        body["path"], None if canary is None else float(canary), body.get("reason", "")
    )
    return web.json_response({"promoted": adapter.name, **policies.describe(registry.alias)})


async def rollback(request: web.Request) -> web.Response:
    """Serve the previous adapter again; {"canary": true} drops only the canary. An
    optional "reason" (the watch's numbers, `overnight rollback --reason`) is kept."""
    body = await read_json_object(request) if await request.read() else {}
    _expect(body, {"reason": "string", "canary": "boolean"})
    policies = request.app[POLICIES]
    registry = policies.get(policy_of(request))
    _awake(request)
    await registry.rollback(body.get("reason", ""), canary=body.get("canary", False))
    return web.json_response(policies.describe(registry.alias))


def _awake(request: web.Request) -> None:
    """Adapters change only while vLLM is awake: a night promotes once it ended its window."""
    window = request.app[MAINTENANCE].window
    if window is not None:
        raise OvernightError(
            f"vLLM is asleep for {window.holder}'s maintenance window; promote after it ends",
            status=409,
            code="maintenance",
        )


async def prune(request: web.Request) -> web.Response:
    """{"keep": N, "dry_run": true}: the adapters no longer needed (adapters/retention.py),
    deleted unless `dry_run`. Adapters are the data directory's: whichever policy is
    named, what every policy needs is kept (`keep` rollback targets of each)."""
    body = await read_json_object(request) if await request.read() else {}
    _expect(body, {"keep": "number", "dry_run": "boolean"})
    keep = body.get("keep", 5)
    if keep != int(keep) or keep < 0:
        raise OvernightError("keep must be a whole number >= 0", status=400)
    policies = request.app[POLICIES]
    policies.get(policy_of(request))  # an unknown one is refused, as on the other routes
    pruned = await policies.prune(int(keep), body.get("dry_run", True))
    return web.json_response(pruned.as_dict())


_KINDS = {
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
}


def _expect(body: dict, fields: dict[str, str], required: tuple[str, ...] = ()) -> None:
    """A clear 400 for unknown fields, wrong types and missing required ones."""
    bad = sorted(k for k, v in body.items() if k not in fields or not _KINDS[fields[k]](v))
    missing = [k for k in required if k not in body]
    if bad or missing:
        shape = ", ".join(f'"{k}": {kind}' for k, kind in fields.items())
        raise OvernightError(
            f"expected {{{shape}}} (required: {', '.join(required) or 'none'}); "
            f"unknown fields or wrong types: {bad}; missing: {missing}",
            status=400,
            code="invalid_request",
        )


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
            "shadow": request.app[SHADOW].snapshot(),  # shadow sampling's counts
            "keys": request.app[KEYS].snapshot(),  # scoped keys: admitted, refused (keys.py)
            "writer_id": writer.writer_id,
        }
    )
