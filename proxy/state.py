"""The proxy's shared state: every typed `web.AppKey` the handlers read, in one place.

`create_app` (app.py) sets them; handlers read `request.app[KEY]`. The web view's keys
are not here: view/ may not import the proxy, so they live in `overnight.view.web`
and the proxy sets them when it mounts the view.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from aiohttp import web

from overnight.config import ProxyConfig
from overnight.storage import LogWriter

from .alias.policies import Policies
from .alias.registry import AdapterRegistry
from .capture.captures import TurnCounter
from .capture.events import SeenFingerprint
from .forward.balancer import Balancer
from .vllm_sleep import Maintenance


@dataclass(slots=True)
class ProxyStats:
    """Counters of this process, as `/admin/stats` reports them (beside the writer's)."""

    requests: int = 0  # completions answered, whatever their outcome


CONFIG = web.AppKey("config", ProxyConfig)
# aiohttp's client, for everything but completions: /v1 pass-through and adapter calls.
SESSION = web.AppKey("session", aiohttp.ClientSession)
# The proxy's own client for completions: the vLLM replicas and a pool for each
# (balancer.py, upstream.py).
UPSTREAM = web.AppKey("upstream", Balancer)
WRITER = web.AppKey("writer", LogWriter)
# Every policy's registry (the alias's adapters), routing by the model asked for.
POLICIES = web.AppKey("policies", Policies)
# The default policy's registry (`--alias`): the one of a proxy that serves one policy.
ADAPTERS = web.AppKey("adapters", AdapterRegistry)
STATS = web.AppKey("stats", ProxyStats)
TURNS = web.AppKey("turns", TurnCounter)
FINGERPRINT = web.AppKey("fingerprint", SeenFingerprint)
# vLLM asleep for a colocated night, and the requests held meanwhile (vllm_sleep.py).
MAINTENANCE = web.AppKey("maintenance", Maintenance)
