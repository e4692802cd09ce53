"""The proxy: an aiohttp app that forwards to vLLM and records every completion.

`create_app(config)` assembles the parts, each in its own module:
  auth.py        who may call what; the middleware that also shapes every error
  agent_api.py   completions (forwarded and recorded), rewards, finishing a rollout
  relay.py       forwarding: the whole and streamed relays, the stall watch, pass-through
  admin.py       /admin/: adapters behind the alias, counters
  state.py       the typed app keys those handlers read
and mounts the web view (overnight.view.web) at /ui as a sub-application. Only the
CLI runs the app (`web.run_app`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from overnight.config import ProxyConfig
from overnight.storage import LogWriter, WriterConfig, attach
from overnight.view import web as view

from .alias.policies import Policies
from .capture.captures import TurnCounter
from .capture.conversation import CHAINS, ResponseChains
from .capture.image_urls import IMAGE_FETCHER, ImageFetcher
from .capture.recorder import RECORDER, RecorderProcess, Recording
from .capture.recorder_main import record_frame
from .capture.redact import REDACTOR, Redactor
from .capture.uncaptured import UNCAPTURED, Uncaptured
from .forward.balancer import Balancer
from .observe import tracing
from .observe.metrics import METRICS, Metrics
from .observe.tracing import TRACING
from .routes import admin, handover, maintenance
from .routes.agent_api import completions, post_finish, post_reward, prefixed
from .routes.auth import make_guard
from .routes.hosted import HOSTED
from .routes.hosted import install as install_hosted
from .routes.keys import KeyRing
from .routes.keys import install as install_keys
from .routes.models import models
from .shadow.sampler import SHADOW, ShadowSampler
from .state import (
    ADAPTERS,
    CONFIG,
    FINGERPRINT,
    MAINTENANCE,
    POLICIES,
    SESSION,
    STATS,
    TURNS,
    UPSTREAM,
    WRITER,
    ProxyStats,
    SeenFingerprint,
)
from .vllm_sleep import Maintenance

log = logging.getLogger("overnight.proxy")


def create_app(config: ProxyConfig) -> web.Application:
    # --data a URL (s3://...): the app works in its local directory; segments go there.
    config = dataclasses.replace(config, data_dir=attach(config.data_dir, config.local_dir))
    config.data_dir.mkdir(parents=True, exist_ok=True)
    keys = KeyRing(config)  # the client keys, plain and scoped (routes/keys.py)
    app = web.Application(
        client_max_size=config.max_body_bytes,  # every path, the pass-through too (relay.py)
        middlewares=[make_guard(config, keys)],
        # aiohttp arms this timer when a connection opens and closes the connection if no
        # whole request head has arrived by then (and after each response, if no next
        # one): the header-read timeout it has no option for. Header sizes keep aiohttp's
        # limits (8190-byte lines, 128 fields).
        handler_args={"keepalive_timeout": config.header_timeout},
    )
    app[CONFIG] = config
    install_keys(app, config, keys)
    # A hosted API (routes/hosted.py): no adapters, no watch of the replicas, no probes.
    hosted = install_hosted(app, config)
    beside = handover.install(app, config)  # a hosted model beside vLLM: the handover's
    app[STATS] = ProxyStats()
    app[UNCAPTURED] = Uncaptured()
    app[CHAINS] = ResponseChains(data_dir=config.data_dir)  # chains before a restart
    app[TURNS] = TurnCounter()
    app[FINGERPRINT] = SeenFingerprint()
    app[REDACTOR] = Redactor(config.redact)
    app[UPSTREAM] = balancer = Balancer(
        config.upstreams,
        config.connect_timeout,
        config.keepalive_timeout,
        passive_checks=config.upstream_check_interval > 0,
    )
    # One registry per policy (--alias, the default, and each --policy): policies.py.
    app[POLICIES] = policies = Policies(
        config.policy_names,
        config.data_dir,
        balancer=balancer,
        session_headers=_upstream_auth(config),
        drain_timeout=config.drain_timeout,
        base_model=config.base_model,
        check_interval=0 if hosted else config.upstream_check_interval,
        follow_interval=0 if hosted else config.state_poll_interval,
        hosted=app[HOSTED].label if hosted else None,
        hosted_model=config.upstream_model,
        beside=beside,
    )
    app[ADAPTERS] = policies.get(None)
    app[MAINTENANCE] = Maintenance(
        balancer,
        _upstream_auth(config),
        hold=config.maintenance_hold,
        drain=config.maintenance_drain,
        after_wake=policies.check_upstream,  # what vLLM lost asleep, loaded again
        workers=config.workers,
    )
    app[SHADOW] = ShadowSampler(config, balancer, app[REDACTOR])
    if config.fetch_images_from:  # the listed hosts' image URLs (capture/image_urls.py)
        app[IMAGE_FETCHER] = fetcher = ImageFetcher(config.fetch_images_from, config.max_body_bytes)
        app.on_cleanup.append(lambda _: fetcher.close())
    tracing.install(app, config)  # OpenTelemetry, when OTEL_*/LANGFUSE_* ask for it
    _install_recorder(app, config)
    app.cleanup_ctx.append(_lifecycle)
    if config.metrics:  # Prometheus at /metrics (observe/metrics.py)
        app[METRICS] = metrics = Metrics(app, policies, config.data_dir)
        app.cleanup_ctx.append(metrics.lifecycle)  # after _lifecycle: the writer is there
        app.router.add_get("/metrics", metrics.handle)

    _add_routes(app.router)
    _mount_web_view(app, config, policies)
    return app


def _add_routes(r: web.UrlDispatcher) -> None:
    """What clients call: completions, rewards, finishes, the admin API, the pass-through."""
    r.add_get("/health", health)
    r.add_post("/v1/chat/completions", completions)
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/responses", completions)
    r.add_post("/v1/messages", completions)
    r.add_post("/v1/rollouts/{rollout_id}/reward", post_reward)
    r.add_post("/v1/rollouts/{rollout_id}/finish", post_finish)
    r.add_get("/admin/adapters", admin.adapters)
    r.add_post("/admin/adapters/promote", admin.promote)
    r.add_post("/admin/adapters/rollback", admin.rollback)
    r.add_post("/admin/adapters/prune", admin.prune)
    r.add_post("/admin/handover", handover.set_share)
    r.add_get("/admin/stats", admin.stats)
    r.add_get("/admin/maintenance", maintenance.state)
    r.add_post("/admin/maintenance", maintenance.change)
    r.add_get("/v1/models", models)  # vLLM's list, with every policy's alias on it
    r.add_route("*", "/rollouts/{group}/{rollout}/v1/{tail:.*}", prefixed)
    r.add_route("*", "/v1/{tail:.*}", maintenance.held)


def _mount_web_view(app: web.Application, config: ProxyConfig, policies: Policies) -> None:
    """The web view at /ui. It reads what it needs through request.config_dict, under its
    own keys: it never imports this module (view/ sits below the proxy)."""
    app[view.DATA_DIR] = config.data_dir
    app[view.ADAPTER_STATE] = policies.describe
    app[view.UNCAPTURED] = app[UNCAPTURED].snapshot
    app.add_subapp("/ui", view.create_web_view())


def _install_recorder(app: web.Application, config: ProxyConfig) -> None:
    """Completion records in a recorder process (capture/recorder.py), unless they are
    needed here: shadow siblings are asked for from them, and a span ends with them."""
    if config.recorder != "process":
        return
    if app[SHADOW].enabled or TRACING in app:
        using = "shadow sampling" if app[SHADOW].enabled else "tracing"
        log.info("records are built in the serving process: %s needs them here", using)
        return

    def here(frame: tuple) -> None:  # a frame the pipe cannot take: recorded inline
        record_frame(frame, app[WRITER], app[REDACTOR])

    app[RECORDER] = RecorderProcess.for_config(config, app[TURNS], here)


async def health(request: web.Request) -> web.Response:
    """200 while the proxy serves. "degraded", with the reason, while recording fails:
    completions are still served (an agent must not fail because logging does), so a
    load balancer should keep sending traffic; the writer recovers by itself."""
    app = request.app
    writer = Recording(app[WRITER], app.get(RECORDER), app[REDACTOR]).health()
    if writer.status == "ok":
        return web.json_response({"status": "ok"})
    return web.json_response(
        {"status": writer.status, "reason": writer.reason, "since": writer.since}
    )


def _upstream_auth(config: ProxyConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.upstream_api_key}"} if config.upstream_api_key else {}


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """The upstream clients and the log writer: made at start, closed at the end."""
    config = app[CONFIG]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=config.keepalive_timeout)
    # No total cap (long generations are fine) and no sock_read: relay.StallWatch does that.
    timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout)
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,  # bytes pass to the client as the upstream encoded them
        cookie_jar=aiohttp.DummyCookieJar(),  # never carry one client's cookies to another
    )
    app[SESSION] = session
    writer = LogWriter(
        WriterConfig(
            config.data_dir,
            commit_interval=config.commit_interval,
            roll_seconds=config.roll_seconds,
        )
    )
    writer.start()
    app[WRITER] = writer
    policies = app[POLICIES]
    policies.session = session
    app[MAINTENANCE].session = session
    if HOSTED not in app:  # vLLM's: its sleep state, the promoted adapter loaded again
        await app[MAINTENANCE].recover()  # a vLLM left asleep by a night that died with us
        await policies.restore()
    app[SHADOW].start(writer)
    recorder = app.get(RECORDER)
    if recorder is not None:
        await recorder.start()
    yield
    if recorder is not None:  # its last records written, its log sealed
        await recorder.close()
    await app[SHADOW].close()
    await app[MAINTENANCE].close()
    await policies.close()
    app[UPSTREAM].close()
    await session.close()
    # Blocking: commit the queue, seal and compact. Nothing is lost on a clean stop.
    await asyncio.get_running_loop().run_in_executor(None, writer.close)
