"""`overnight serve`: vLLM (optionally, as a child) and the proxy in front of it.

Shutdown order matters for "loses no record": on SIGINT/SIGTERM aiohttp stops
accepting, finishes the requests in flight, and runs the app's cleanup, which
commits the log and compacts it to Parquet; only then is vLLM stopped.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from aiohttp import web

from .config import ProxyConfig

log = logging.getLogger("overnight")


def serve_forever(
    *,
    model: str | None,
    upstream: str | None,
    host: str,
    port: int,
    data_dir: Path,
    alias: str,
    api_keys: tuple[str, ...],
    admin_token: str | None,
    upstream_api_key: str | None,
    served_model_name: str | None,
    max_lora_rank: int,
    max_loras: int,
    tool_call_parser: str | None,
    vllm_args: tuple[str, ...],
    tuning: dict | None = None,
) -> None:
    """`tuning`: the other ProxyConfig fields (timeouts, body limit, log commit)."""
    from overnight.proxy import create_app
    from overnight.proxy.launcher import VLLMConfig, VLLMProcess

    vllm = None
    # SIGTERM during vLLM's start must still stop the child: make it an exception.
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        if model:
            vllm = VLLMProcess(
                VLLMConfig(
                    model=model,
                    served_model_name=served_model_name,
                    max_lora_rank=max_lora_rank,
                    max_loras=max_loras,
                    tool_call_parser=tool_call_parser,
                    extra_args=vllm_args,
                    log_path=Path(data_dir) / "logs" / "vllm.log",
                )
            )
            log.info("starting vLLM on %s (log: %s)", vllm.url, vllm.config.log_path)
            vllm.start()
            vllm.wait_healthy(progress=log.info)
            upstream = vllm.url
        config = ProxyConfig(
            upstream=upstream,
            data_dir=data_dir,
            alias=alias,
            api_keys=api_keys,
            admin_token=admin_token,
            upstream_api_key=upstream_api_key,
            **(tuning or {}),
        )
        signal.signal(signal.SIGTERM, previous)
        log.info("proxy on http://%s:%d/v1 -> %s, data in %s", host, port, upstream, data_dir)
        # run_app turns SIGINT and SIGTERM into a graceful exit that runs the cleanup.
        web.run_app(
            create_app(config),
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
        if vllm is not None:
            log.info("stopping vLLM")
            vllm.stop()
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
