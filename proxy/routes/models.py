"""GET /v1/models: vLLM's model list, with every policy's alias on it.

Agents ask for a policy by its alias, which vLLM has never heard of: without it on the
list a client that checks its model name first (many SDK wrappers and UIs do) would
refuse to use it. Each alias gets the card of the base model it sits on (`id` the
alias, `parent` the base model, the base model's `max_model_len`), owned by overnight;
the versioned adapters vLLM lists stay as they are. Anything but a 200 with a list
passes through unchanged, as the pass-through would give it.

A key limited to policies (routes/keys.py) sees only the models it may ask for (its
policies' aliases, the models it lists), without `root`: vLLM's cards name the adapters'
and the base model's paths on the serving machine, and the other policies' adapters.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from aiohttp import web

from overnight.proxy.capture.uncaptured import note_passthrough
from overnight.proxy.state import CONFIG, POLICIES, SESSION, UPSTREAM

from .keys import KEY
from .relay import UpstreamError, UpstreamTimeout, silence, upstream_headers


async def models(request: web.Request) -> web.Response:
    app = request.app
    config = app[CONFIG]
    try:
        async with asyncio.timeout(config.read_timeout):
            async with app[SESSION].get(
                f"{app[UPSTREAM].url()}/v1/models",
                headers=upstream_headers(request),
                allow_redirects=False,  # as the pass-through (relay.py): never with our key
            ) as upstream:
                body, status = await upstream.read(), upstream.status
                content_type = upstream.headers.get("Content-Type", "application/json")
    except TimeoutError as e:
        raise UpstreamTimeout(silence(config.read_timeout)) from e
    except aiohttp.ClientError as e:
        raise UpstreamError(f"upstream {config.upstream} unreachable: {e}") from e
    note_passthrough(app, "GET", "models", status)
    listing = _parse(body) if status == 200 else None
    if listing is None:
        return web.Response(body=body, status=status, headers={"Content-Type": content_type})
    cards = listing["data"]
    known = {card.get("id") for card in cards if isinstance(card, dict)}
    policies = app[POLICIES]
    base = policies.get(None).base_model
    parent = next((c for c in cards if isinstance(c, dict) and c.get("id") == base), None)
    for alias in policies.names:
        if alias not in known:
            cards.append(_alias_card(alias, base, parent))
    key = request.get(KEY)
    if key is not None and key.allowed is not None:
        cards[:] = [
            _without_root(c) for c in cards if isinstance(c, dict) and key.may_use(c.get("id"))
        ]
    return web.Response(body=orjson.dumps(listing), content_type="application/json")


def _parse(body: bytes) -> dict | None:
    try:
        listing = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
        return None
    return listing


def _alias_card(alias: str, base: str | None, parent: dict | None) -> dict:
    card = {"id": alias, "object": "model", "owned_by": "overnight", "parent": base}
    for key in ("created", "root", "max_model_len"):
        if parent is not None and key in parent:
            card[key] = parent[key]
    return card


def _without_root(card: dict) -> dict:
    return {k: v for k, v in card.items() if k != "root"}
