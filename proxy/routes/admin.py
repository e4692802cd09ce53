"""The admin API under /admin/: the adapters behind the alias, and the proxy's counters.

Access (the admin token, else loopback only) is checked by the app's middleware
(auth.py) before any of these run. The /admin/adapters routes act on one policy: the
query parameter `policy` names it (absent: the default policy, `--alias`), the one
place it is read, so that the middleware can check a policy's own admin token by it.

Such a token (auth.POLICY_TOKEN on the request) promotes its policy's own adapters only
(alias/ownership.py) and sees what its night reads (`NIGHT_VIEW`): not the replicas'
URLs, where vLLM loaded the base model from, the requests in flight or the machine; nor
do its errors name them. The reasons it gives are bounded (`TOKEN_REASON_CHARS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from aiohttp import web

from overnight.errors import OvernightError
from overnight.proxy.alias.ownership import own_adapter
from overnight.proxy.capture.recorder import RECORDER, Recording
from overnight.proxy.capture.redact import REDACTOR
from overnight.proxy.capture.uncaptured import UNCAPTURED
from overnight.proxy.forward.jsonio import read_json_object
from overnight.proxy.shadow.sampler import SHADOW
from overnight.proxy.state import CONFIG, MAINTENANCE, POLICIES, STATS, WRITER

from .auth import POLICY_TOKEN
from .hosted import refuse_if_hosted
from .keys import KEYS

POLICY_PARAM = "policy"  # ?policy=NAME on /admin/adapters...
# What a per-policy admin token's /admin/adapters shows: what its night reads (the scope
# of its groups, the base model's name, the adapters, stack, canary and history for the
# watch, the canary and staleness). A night that needs more (the base model's path,
# vLLM's URL for --resample, the colocated sleep) is the operator's, or given it as
# options (--base-model, --resample-upstream).
NIGHT_VIEW = (
    "alias", "base_model", "current", "stack", "canary", "handover", "adapters", "events",
    "state_version", "policies", "default", "others_trained",
)  # fmt: skip
# The longest "reason" a per-policy admin token's promotion or rollback keeps: its event is
# in the state every proxy reads at each poll (200 events kept; a body may be 32 MB).
TOKEN_REASON_CHARS = 2000


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
    state = {**request.app[POLICIES].describe(policy_of(request)), "colocation": colocation}
    return web.json_response(_seen(request, state))


def _seen(request: web.Request, state: dict) -> dict:
    """`state` as the caller may see it: whole for the operator, its night's part for a
    per-policy admin token."""
    if request.get(POLICY_TOKEN) is None:
        return state
    return {k: state[k] for k in NIGHT_VIEW if k in state}


async def promote(request: web.Request) -> web.Response:
    """{"path": ...}: serve it under the alias; with "canary": 0.1, only to that share of
    the alias's rollouts (promoting the canary's path later serves it to all); "reason"
    is kept with the event."""
    body = await read_json_object(request)
    _expect(body, {"path": "string", "canary": "number", "reason": "string"}, ("path",))
    policies = request.app[POLICIES]
    registry = policies.get(policy_of(request))
    path, reason = body["path"], _reason(request, body)
    if request.get(POLICY_TOKEN) is not None:  # its policy's own adapters only
        path = await asyncio.to_thread(own_adapter, path, registry.alias, policies.default,
                                       registry.data_dir, list(registry.history))  # fmt: skip
    canary = body.get("canary")
    with _replicas_unnamed(request, registry):
        _awake(request)
        adapter = await registry.promote(path, None if canary is None else float(canary), reason)
    described = _seen(request, policies.describe(registry.alias))
    return web.json_response({"promoted": adapter.name, **described})


async def rollback(request: web.Request) -> web.Response:
    """Serve the previous adapter again; {"canary": true} drops only the canary. An
    optional "reason" (the watch's numbers, `overnight rollback --reason`) is kept."""
    body = await read_json_object(request) if await request.read() else {}
    _expect(body, {"reason": "string", "canary": "boolean"})
    policies = request.app[POLICIES]
    registry = policies.get(policy_of(request))
    reason = _reason(request, body)
    with _replicas_unnamed(request, registry):
        _awake(request)
        await registry.rollback(reason, canary=body.get("canary", False))
    return web.json_response(_seen(request, policies.describe(registry.alias)))


def _reason(request: web.Request, body: dict) -> str:
    reason = body.get("reason", "")
    if request.get(POLICY_TOKEN) is not None and len(reason) > TOKEN_REASON_CHARS:
        raise OvernightError(
            f'"reason" has {len(reason)} characters; a policy\'s admin token gives at most '
            f"{TOKEN_REASON_CHARS}", status=400, code="invalid_request",
        )  # fmt: skip
    return reason


@contextlib.contextmanager
def _replicas_unnamed(request: web.Request, registry):
    """A per-policy admin token's errors say "replica 2", not where the replicas are nor
    where vLLM loaded the base model from (NIGHT_VIEW leaves both out): a load that failed
    names each replica's URL and echoes vLLM's answer (replicas/loading.py)."""
    try:
        yield
    except OvernightError as e:
        if request.get(POLICY_TOKEN) is not None:
            message = str(e)
            for i, replica in enumerate(registry.balancer.replicas, 1):
                message = message.replace(replica.url, f"replica {i}")
            if registry.base_model_path:
                message = message.replace(registry.base_model_path, "the base model")
            e.args = (message,)
        raise


def _awake(request: web.Request) -> None:
    """Adapters change only while vLLM is awake: a night promotes once it ended its window;
    and never against a hosted upstream."""
    refuse_if_hosted(request.app, "promote or roll back")
    window = request.app[MAINTENANCE].window
    if window is not None:
        raise OvernightError(
            f"vLLM is asleep for {window.holder}'s maintenance window; promote after it ends",
            status=409,
            code="maintenance",
        )


async def prune(request: web.Request) -> web.Response:
    """{"keep": N, "dry_run": true}: the adapters no longer needed (alias/retention.py),
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
    app = request.app
    writer, recorder = app[WRITER], app.get(RECORDER)
    recording = Recording(writer, recorder, app[REDACTOR])  # the recorder's rows counted in
    health = recording.health()
    return web.json_response(
        {
            "requests": request.app[STATS].requests,
            "rows_appended": recording.appended,
            "rows_committed": health.rows_written,
            # status and reason; rows written, lost, fitted; failed batches; rows
            # compacted, lines quarantined, failed compactions (storage.WriterHealth)
            **health.as_dict(),
            "redaction_failures": recording.redaction_failures,
            # the completion records' own process (capture/recorder.py), when there is one
            "recorder": recorder.snapshot() if recorder is not None else None,
            # path -> POSTs whose model output was forwarded but not recorded
            "uncaptured": request.app[UNCAPTURED].snapshot(),
            "shadow": request.app[SHADOW].snapshot(),  # shadow sampling's counts
            "keys": request.app[KEYS].snapshot(),  # scoped keys: admitted, refused (keys.py)
            "writer_id": writer.writer_id,
        }
    )
