"""The handover (issue 28, part 3): a hosted model beside the local vLLM, and the share
of each policy's rollouts the local model serves.

With `--hosted-upstream` (overnight/config/handover.py) a policy's alias is served two
ways. A rollout in the handover's share (a hash of its id, sticky in every proxy and
every turn: alias/promotions.py `served_locally`) goes to vLLM as before, with the
proxy's additions and vLLM's key; any other goes to the hosted API as the client sent it
(hosted.py: nothing added, `--upstream-model` for the alias) with `--hosted-api-key`
only. Each record says which served it: `model_served`, and `notes.upstream` on the
hosted one's. The share is each policy's promotion state (`handover`: share, since),
shared by every proxy like the canary's; `POST /admin/handover?policy=` sets it
(`overnight watch` moves it on live rewards: trainer/live/handover.py), and
/admin/adapters and /ui show it. Before a handover starts the hosted model serves all.
"""

from __future__ import annotations

import types
from collections.abc import AsyncIterator

from aiohttp import web

from overnight.config import ProxyConfig
from overnight.config.upstream_kind import CONFIGURED
from overnight.errors import OvernightError
from overnight.proxy.alias.promotions import Route
from overnight.proxy.forward.balancer import Balancer
from overnight.proxy.forward.jsonio import read_json_object
from overnight.proxy.state import POLICIES

from .admin import _expect, _seen, policy_of
from .hosted import HOSTED, HostedUpstream, UpstreamAuth


class HostedBeside:
    """The hop to the hosted API beside vLLM: its own connection pool and its own key
    (never vLLM's, never the client's). `post` is the balancer's, for relay.forward."""

    def __init__(self, config: ProxyConfig):
        url, kind = config.hosted_upstream, config.hosted_kind
        # The hosted upstream's settings as hosted.py reads a hosted proxy's: one URL, its
        # kind, the configured key.
        alone = types.SimpleNamespace(
            upstream=url,
            upstream_kind=kind,
            upstream_api_key=config.hosted_api_key,
            upstream_auth=CONFIGURED,
        )
        self.url = url  # named in its errors (relay.py)
        self.auth = UpstreamAuth(alone)
        self.upstream = HostedUpstream(alone)  # how its records name it
        self.balancer = Balancer([url], config.connect_timeout, config.keepalive_timeout,
                                 passive_checks=False)  # fmt: skip
        self.post = self.balancer.post

    async def lifecycle(self, _app: web.Application) -> AsyncIterator[None]:
        yield
        self.balancer.close()


BESIDE = web.AppKey("hosted_beside", HostedBeside)  # absent without --hosted-upstream


def install(app: web.Application, config: ProxyConfig) -> str | None:
    """The hosted hop beside vLLM, when configured; how its records name it."""
    if config.hosted_upstream is None:
        return None
    app[BESIDE] = beside = HostedBeside(config)
    app.cleanup_ctx.append(beside.lifecycle)
    return beside.upstream.label


def hop_of(app: web.Application, route: Route) -> HostedBeside | None:
    """Where `route` goes when it is not the app's upstream: the hosted one beside vLLM."""
    return app[BESIDE] if route.hosted else None


def hosted_of(app: web.Application, route: Route) -> HostedUpstream | None:
    """The hosted upstream that serves `route`, if one does: the app's own (a hosted
    proxy), or the one beside vLLM (a handover's hosted side); None: vLLM serves it."""
    return app[BESIDE].upstream if route.hosted else app.get(HOSTED)


async def set_share(request: web.Request) -> web.Response:
    """{"share": 0.25, "reason": ...}: that share of the policy's rollouts is served
    locally, the rest by the hosted model; 0 stops the handover, 1 completes it."""
    if BESIDE not in request.app:
        raise OvernightError(
            "no hosted model beside vLLM here (overnight serve --hosted-upstream URL): "
            "there is nothing to hand over from",
            status=409,
            code="no_hosted_upstream",
        )
    body = await read_json_object(request)
    _expect(body, {"share": "number", "reason": "string"}, ("share",))
    policies = request.app[POLICIES]
    registry = policies.get(policy_of(request))
    await registry.set_handover(float(body["share"]), body.get("reason", ""))
    return web.json_response(_seen(request, policies.describe(registry.alias)))
