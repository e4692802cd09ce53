"""`overnight serve`: vLLM (optionally, as a child) and the proxy in front of it.

Shutdown order matters for "loses no record": on SIGINT/SIGTERM aiohttp stops
accepting, finishes the requests in flight, and runs the app's cleanup, which
commits the log and compacts it to Parquet; only then is vLLM stopped.

With `--workers N` the proxy runs as N processes on one port (SO_REUSEPORT: the kernel
spreads connections over them). Each has its own log writer (its own files under
DATA/wal, so they never contend) and follows DATA/adapters.json, so a promotion made
through any of them reaches all. This process only starts them, restarts one that
dies, and on SIGINT/SIGTERM sends each one SIGTERM, once, and waits for its cleanup.
Their Prometheus metrics meet in PROMETHEUS_MULTIPROC_DIR (proxy/observe/metrics.py):
a directory wiped before they start, where a dead worker is marked dead.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from overnight.config import ProxyConfig, VLLMConfig
from overnight.errors import ConfigError

log = logging.getLogger("overnight")

# A worker finishing its requests and compacting its log may take a while; then SIGKILL
# (its log is recovered at the next start: nothing committed is lost).
WORKER_STOP_S = 90.0
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode


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
    # One event loop uses one core; a second process pays off once a core is saturated
    # (bench/replicas.py).
    workers: int = field(
        default=1,
        metadata={
            "help": "Proxy processes sharing the port (SO_REUSEPORT); each writes its own log "
            "and all follow one promotion state."
        },
    )

    # One box that serves and learns (cli/learner.py): `overnight learn` beside the proxy.
    learn: str | None = field(
        default=None,
        metadata={
            "help": "Also run `overnight learn` with these options (one quoted string, e.g. "
            "--learn '--every-groups 32 --preset smollm2-cpu') on --data, promoting through "
            "this proxy; stopped before the proxy stops."
        },
    )

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError("workers must be at least 1")


def serve_forever(
    proxy: ProxyConfig,
    vllm: VLLMConfig | None,
    host: str,
    port: int,
    workers: int = 1,
    learn: str | None = None,
) -> None:
    """Serve `proxy` on host:port until interrupted, in `workers` processes.

    With `vllm`, start it first and stop it last; `proxy.upstream` is then its URL, so
    give `vllm` its port beforehand (`launcher.free_port`). With `learn` (`overnight
    learn`'s options), a learner beside the proxy (cli/learner.py), stopped first.
    """
    from overnight.proxy.address import proxy_url, remove_address, write_address
    from overnight.proxy.launch.launcher import VLLMProcess
    from overnight.proxy.routes.key_buckets import make_file as make_buckets
    from overnight.telemetry import check_environment as check_tracing

    from .learner import Learner

    if vllm is not None and (vllm.port == 0 or proxy.upstream != vllm.url):
        raise ConfigError(f"with vLLM at {vllm.url}, the proxy's upstream must be its URL")
    check_tracing()  # OTEL_* that cannot work stop here, before vLLM or any worker starts
    # Bad --learn options stop here too; the learner starts once the proxy answers.
    learner = (
        Learner(learn, proxy.data_dir, proxy_url(host, port), proxy.admin_token) if learn else None
    )
    if vllm is not None and proxy.shadow_samples:
        vllm = with_priority_scheduling(vllm)
    if vllm is not None:  # what `overnight train --colocate auto` asks /admin/adapters
        proxy = replace(proxy, launched_vllm=True, vllm_sleeps=vllm.sleep_mode)
    proxy, replicas = with_replicas(proxy, vllm) if vllm is not None else (proxy, [])
    processes = [VLLMProcess(config, env) for config, env in replicas]
    # SIGTERM during vLLM's start must still stop the children: make it an exception.
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        for process in processes:  # all start at once; each is waited for in turn
            log.info("starting vLLM on %s (log: %s)", process.url, process.config.log_path)
            process.start()
        for process in processes:
            process.wait_healthy(progress=log.info)
        signal.signal(signal.SIGTERM, previous)
        log.info(
            "proxy on http://%s:%d/v1 -> %s, data in %s%s",
            host,
            port,
            ", ".join(proxy.upstreams),
            proxy.data_dir,
            f", {workers} workers" if workers > 1 else "",
        )
        metrics_dir = _metrics_dir() if proxy.metrics and (workers > 1 or _given_dir()) else None
        if learner:
            learner.start()
        on_stop = learner.stop if learner else None
        if workers == 1:
            _run(proxy, host, port, advertise_address=True, on_stop=on_stop)
        else:
            # DATA/proxy.json names this process: the one `overnight train` finds alive.
            write_address(proxy.data_dir, proxy_url(host, port), proxy.admin_token is not None)
            buckets = make_buckets(proxy)  # the keys' rates, held across the workers
            try:
                # Each worker holds requests for a maintenance window on its own: refused.
                _supervise(replace(proxy, workers=workers), host, port, workers, metrics_dir,
                           on_stop)  # fmt: skip
            finally:
                remove_address(proxy.data_dir)
                if buckets is not None:
                    buckets.unlink(missing_ok=True)
                if metrics_dir is not None and not _given_dir():
                    shutil.rmtree(metrics_dir, ignore_errors=True)
    except KeyboardInterrupt:
        log.info("interrupted")
    finally:
        if learner:  # already stopped with the proxy, unless vLLM's start was interrupted
            learner.stop()
        for process in processes:
            log.info("stopping vLLM on %s", process.url)
            process.stop()
        log.info("stopped")


def with_priority_scheduling(vllm: VLLMConfig) -> VLLMConfig:
    """Shadow siblings ask for a low `priority`; vLLM accepts and ignores the field unless
    started with the priority policy (which, with every served request at priority 0,
    orders them first come first served as the default does). An explicit
    `--vllm-arg=--scheduling-policy=...` wins."""
    if any(arg.startswith("--scheduling-policy") for arg in vllm.extra_args):
        return vllm
    return replace(vllm, extra_args=(*vllm.extra_args, "--scheduling-policy=priority"))


def with_replicas(
    proxy: ProxyConfig, vllm: VLLMConfig
) -> tuple[ProxyConfig, list[tuple[VLLMConfig, dict[str, str]]]]:
    """vLLM's replicas (launcher.replica_configs) and the proxy in front of all of them.

    Replica i listens on vLLM's port + i; when one of those is taken, all move to the
    first free run of ports (the proxy then balances over the moved URLs)."""
    from overnight.proxy.launch.launcher import free_ports, port_free, replica_configs

    if vllm.replicas > 1:
        ports = range(vllm.port, vllm.port + vllm.replicas)
        if not all(port_free(vllm.host, p) for p in ports):
            vllm = replace(vllm, port=free_ports(vllm.host, vllm.replicas))
    replicas = replica_configs(vllm)
    urls = tuple(config.url for config, _ in replicas)
    return replace(proxy, upstream=urls[0], upstreams=urls), replicas


def _run(proxy: ProxyConfig, host: str, port: int, advertise_address: bool, on_stop=None) -> None:
    """One proxy process: the app on the port until SIGINT/SIGTERM, then its cleanup;
    `on_stop` (blocking: in a thread) as its shutdown begins, before its log is compacted."""
    import asyncio

    from aiohttp import web

    from overnight.proxy import create_app
    from overnight.proxy.address import advertise, proxy_url

    app = create_app(proxy)
    if advertise_address:  # DATA/proxy.json: where `overnight train` and `rollback` find us
        advertise(app, proxy.data_dir, proxy_url(host, port), proxy.admin_token is not None)
    loop = _fast_loop() or asyncio.new_event_loop()
    if on_stop is not None:
        # `on_stop` while the proxy still serves (aiohttp's own handlers close the listening
        # socket before its on_shutdown): then the graceful exit, as run_app's would be.
        def stop_then_exit() -> None:
            async def stop() -> None:
                await asyncio.to_thread(on_stop)
                loop.call_soon(_raise_graceful_exit)  # out of the loop: the cleanup follows

            loop.create_task(stop())

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop_then_exit)
    # run_app turns SIGINT and SIGTERM into a graceful exit that runs the cleanup.
    web.run_app(
        app,
        host=host,
        port=port,
        access_log=None,
        print=None,
        shutdown_timeout=30.0,
        reuse_port=not advertise_address,
        loop=loop,
        handle_signals=on_stop is None,
    )


def _worker(proxy: ProxyConfig, host: str, port: int, log_level: int) -> None:
    # Its own process group: a terminal's Ctrl-C reaches the supervisor alone, which
    # then stops each worker once (a second signal during cleanup would cut it short).
    os.setpgrp()
    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s %(name)s[{os.getpid()}]: %(message)s",
    )
    _run(proxy, host, port, advertise_address=False)


def _given_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def _metrics_dir() -> Path:
    """Where the workers' metrics meet: the operator's PROMETHEUS_MULTIPROC_DIR, its
    metric files of an earlier run removed (they would count again), or a new temporary
    directory, named in the environment the workers inherit."""
    given = _given_dir()
    if given is None:
        path = Path(tempfile.mkdtemp(prefix="overnight-metrics-"))
        os.environ[MULTIPROC_ENV] = str(path)
        return path
    path = Path(given)
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*.db"):
        old.unlink(missing_ok=True)
    return path


def _mark_dead(metrics_dir: Path | None, pid: int | None) -> None:
    """A dead worker's gauges leave the sums (its counters stay: they were counted)."""
    if metrics_dir is None or pid is None:
        return
    from prometheus_client.multiprocess import mark_process_dead

    mark_process_dead(pid, str(metrics_dir))


def _supervise(
    proxy: ProxyConfig,
    host: str,
    port: int,
    n: int,
    metrics_dir: Path | None = None,
    on_stop=None,
) -> None:
    """Start n workers, restart any that dies, stop them all on SIGINT/SIGTERM (after
    `on_stop`, while they still serve)."""
    context = multiprocessing.get_context("spawn")  # no copy of this process's loop or locks
    level = logging.getLogger().getEffectiveLevel()

    def start(i: int) -> multiprocessing.Process:
        worker = context.Process(
            target=_worker, args=(proxy, host, port, level), name=f"proxy-{i}", daemon=False
        )
        worker.start()
        return worker

    stopping = []
    handler = lambda signum, _frame: stopping.append(signum)  # noqa: E731
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    workers = [start(i) for i in range(n)]
    try:
        while not stopping:
            time.sleep(0.2)
            for i, worker in enumerate(workers):
                if not worker.is_alive() and not stopping:
                    log.error("worker %s exited (code %s): restarting it", i, worker.exitcode)
                    _mark_dead(metrics_dir, worker.pid)
                    time.sleep(1.0)  # a worker that cannot start must not spin
                    workers[i] = start(i)
    finally:
        if on_stop is not None:
            on_stop()
        for worker in workers:
            if worker.is_alive():
                os.kill(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + WORKER_STOP_S
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                log.error("worker %s did not stop in time: killed", worker.pid)
                worker.kill()
                worker.join()
            _mark_dead(metrics_dir, worker.pid)
        for s, h in previous.items():
            signal.signal(s, h)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _raise_graceful_exit() -> None:
    from aiohttp import web

    raise web.GracefulExit  # a SystemExit: a loop callback's ends run_app, as its own do


def _fast_loop():
    """uvloop where installed: about a third less CPU per proxied request."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop()
