"""`overnight serve`: vLLM (optionally, as a child) and the proxy in front of it.

Shutdown order matters for "loses no record": on SIGINT/SIGTERM aiohttp stops
accepting, finishes the requests in flight, and runs the app's cleanup, which
commits the log and compacts it to Parquet; only then is vLLM stopped.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field

from .config import ProxyConfig, VLLMConfig
from .errors import ConfigError

log = logging.getLogger("overnight")


@dataclass(frozen=True)
class ServeConfig:
    """Where the proxy listens, and how much it says: `overnight serve`'s own options."""

    host: str = field(default="127.0.0.1", metadata={"help": "Address the proxy listens on."})
    port: int = field(default=8000, metadata={"help": "Port the proxy listens on."})
    log_level: str = field(
        default="INFO",
        metadata={
            "help": "Logging of the proxy (and of vLLM's start).",
            "choices": ("DEBUG", "INFO", "WARNING", "ERROR"),
        },
    )


def serve_forever(proxy: ProxyConfig, vllm: VLLMConfig | None, host: str, port: int) -> None:
    """Serve `proxy` on host:port until interrupted.

    With `vllm`, start it first and stop it last; `proxy.upstream` is then its URL, so
    give `vllm` its port beforehand (`launcher.free_port`).
    """
    from aiohttp import web

    from overnight.proxy import create_app
    from overnight.proxy.address import advertise, proxy_url
    from overnight.proxy.launcher import VLLMProcess

    if vllm is not None and (vllm.port == 0 or proxy.upstream != vllm.url):
        raise ConfigError(f"with vLLM at {vllm.url}, the proxy's upstream must be its URL")
    process = None
    # SIGTERM during vLLM's start must still stop the child: make it an exception.
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        if vllm is not None:
            process = VLLMProcess(vllm)
            log.info("starting vLLM on %s (log: %s)", process.url, vllm.log_path)
            process.start()
            process.wait_healthy(progress=log.info)
        signal.signal(signal.SIGTERM, previous)
        log.info(
            "proxy on http://%s:%d/v1 -> %s, data in %s", host, port, proxy.upstream, proxy.data_dir
        )
        app = create_app(proxy)
        # DATA/proxy.json: where `overnight train` and `rollback` find this proxy.
        advertise(app, proxy.data_dir, proxy_url(host, port), proxy.admin_token is not None)
        # run_app turns SIGINT and SIGTERM into a graceful exit that runs the cleanup.
        web.run_app(
            app,
            host=host,
            port=port,
            access_log=None,
            print=None,
            shutdown_timeout=30.0,
            loop=_fast_loop(),
        )
    except KeyboardInterrupt:
        log.info("interrupted")
    finally:
        if process is not None:
            log.info("stopping vLLM")
            process.stop()
        log.info("stopped")


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _fast_loop():
    """uvloop where installed: about a third less CPU per proxied request."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop()
