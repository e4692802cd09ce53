"""Real agent frameworks, run directly and through the proxy, against the scripted upstream.

One stack per session, served from a thread of its own (so that sync frameworks and
async ones both run from plain test functions): the scripted upstream (the fake vLLM
with `scripted=True`), the proxy in front of it, and two taps, recording forwarders
that the frameworks talk to. The direct tap forwards to the upstream, the proxied tap
to the proxy; each keeps the bytes of every answer, exactly as the framework got them.

A framework's test runs its agent once through each tap (`run_both`) and compares the
two recordings, then reads the rows the proxy logged (`rows`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from filelock import FileLock

from overnight.config import ProxyConfig
from overnight.proxy import create_app
from overnight.storage import open_db
from overnight.testing.fake_upstream import RECEIVED, create_fake_upstream

from ..helpers import wait_until

NODE_SDK = "6.49.0"  # the Node `openai` SDK, installed with npm into .cache/compat-node
NODE_DIR = Path(__file__).resolve().parent.parent.parent / ".cache" / "compat-node"
MODEL = "scripted"  # any name but the alias: the proxy passes it through unchanged
# Request headers a tap must not copy: aiohttp sets its own.
_HOP = {"host", "content-length", "transfer-encoding", "connection"}


@dataclass
class Exchange:
    method: str
    path: str  # without a /rollouts/{group}/{rollout} prefix
    status: int
    body: bytes  # the whole answer as the client received it (an SSE stream included)


@dataclass
class Tap:
    target: str
    url: str = ""
    seen: list[Exchange] = field(default_factory=list)
    # Exchanges still being relayed: a client may have its last byte (and return) before
    # the tap has seen the upstream's end and noted the exchange.
    in_flight: int = 0


def _strip_prefix(path: str) -> str:
    if path.startswith("/rollouts/"):
        return "/" + path.split("/", 4)[4]
    return path


def _tap_app(tap: Tap) -> web.Application:
    async def forward(request: web.Request) -> web.StreamResponse:
        tap.in_flight += 1
        try:
            return await relay(request)
        finally:
            tap.in_flight -= 1

    async def relay(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = await request.read()
        async with session.request(
            request.method, tap.target + request.path_qs, headers=headers, data=body
        ) as upstream:
            response = web.StreamResponse(status=upstream.status)
            for name in ("Content-Type", "Content-Encoding"):
                if name in upstream.headers:
                    response.headers[name] = upstream.headers[name]
            await response.prepare(request)
            received = bytearray()
            async for chunk in upstream.content.iter_any():
                received += chunk
                await response.write(chunk)
            path = _strip_prefix(request.path)
            tap.seen.append(Exchange(request.method, path, upstream.status, bytes(received)))
            await response.write_eof()
        return response

    async def session_ctx(app: web.Application):
        app["session"] = aiohttp.ClientSession(auto_decompress=False)
        yield
        await app["session"].close()

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


class Stack:
    """The scripted upstream (or a real vLLM at `upstream`), the proxy and two taps,
    served from a background loop."""

    def __init__(self, data_dir: Path, upstream: str | None = None) -> None:
        self.data_dir = data_dir
        self.loop = asyncio.new_event_loop()
        self.runners: list[web.AppRunner] = []
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.upstream_app = create_fake_upstream(scripted=True) if upstream is None else None
        self.upstream = upstream or self._serve(self.upstream_app)
        config = ProxyConfig(upstream=self.upstream, data_dir=data_dir, commit_interval=0.0)
        self.proxy = self._serve(create_app(config))
        self.direct_tap = Tap(self.upstream)
        self.direct_tap.url = self._serve(_tap_app(self.direct_tap))
        self.proxy_tap = Tap(self.proxy)
        self.proxy_tap.url = self._serve(_tap_app(self.proxy_tap))

    def _serve(self, app: web.Application) -> str:
        async def start() -> str:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.runners.append(runner)
            return f"http://127.0.0.1:{runner.addresses[0][1]}"

        return asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)

    @property
    def received(self) -> list[dict]:
        """What the scripted upstream was sent (path, body, headers), both runs."""
        assert self.upstream_app is not None, "a real upstream records nothing"
        return self.upstream_app[RECEIVED]

    def close(self) -> None:
        async def stop() -> None:
            for runner in reversed(self.runners):
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def run_both(self, agent: Callable[[str, bool], object]) -> Runs:
        """`agent(origin, proxied)`: the agent against `origin` (scheme://host:port), once
        directly and once through the proxy; what each run received and returned."""
        self.direct_tap.seen.clear()
        self.proxy_tap.seen.clear()
        direct = agent(self.direct_tap.url, False)
        proxied = agent(self.proxy_tap.url, True)
        for tap in (self.direct_tap, self.proxy_tap):
            wait_until(lambda tap=tap: tap.in_flight == 0, 10, "the tap to note every exchange")
        return Runs(list(self.direct_tap.seen), list(self.proxy_tap.seen), direct, proxied)

    def rows(self, rollout_id: str, expect: int = 1, timeout: float = 5.0) -> list[dict]:
        """The completions rows of a rollout, once at least `expect` are readable."""
        deadline = time.monotonic() + timeout
        while True:
            con = open_db(self.data_dir)
            cur = con.execute(
                "SELECT * FROM completions WHERE rollout_id = ? ORDER BY turn_index", [rollout_id]
            )
            names = [d[0] for d in cur.description]
            found = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
            con.close()
            if len(found) >= expect or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


@dataclass
class Runs:
    direct: list[Exchange]
    proxied: list[Exchange]
    direct_result: object
    proxied_result: object


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    s = Stack(tmp_path_factory.mktemp("compat") / "data")
    yield s
    s.close()


@pytest.fixture(scope="session")
def vllm_stack(vllm_server, tmp_path_factory) -> Stack:
    """The same stack in front of the session's real vLLM (tests marked `vllm` too)."""
    s = Stack(tmp_path_factory.mktemp("compat-vllm") / "data", upstream=vllm_server.url)
    yield s
    s.close()


@pytest.fixture(scope="session")
def node_sdk() -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed: the Node SDK is not tested")
    package = NODE_DIR / "node_modules" / "openai" / "package.json"
    NODE_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(NODE_DIR / ".install.lock"):  # one npm install for all the test workers
        if not package.exists() or json.loads(package.read_text())["version"] != NODE_SDK:
            done = subprocess.run(
                ["npm", "install", "--no-audit", "--no-fund", "--silent", f"openai@{NODE_SDK}"],
                cwd=NODE_DIR,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode != 0:
                pytest.skip(f"npm install openai@{NODE_SDK} failed: {done.stderr[-500:]}")
        script = NODE_DIR / "node_agent.mjs"  # beside node_modules: `import "openai"` resolves
        source = Path(__file__).resolve().parent / "node_agent.mjs"
        if not script.exists() or script.read_bytes() != source.read_bytes():
            shutil.copy(source, script)  # never under a node the other worker runs
    return script


def need(module: str) -> None:
    """Skip, with the install line, when a framework of the `compat` extra is missing."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[compat]')")


def assert_same_bytes(runs: Runs, normalise: Callable[[bytes], bytes] | None = None) -> None:
    """Each answer the client got through the proxy is the direct run's, byte for byte
    (after `normalise`, for what differs between any two calls: ids, timestamps)."""
    assert [(e.method, e.path, e.status) for e in runs.proxied] == [
        (e.method, e.path, e.status) for e in runs.direct
    ]
    if normalise is not None:
        runs = Runs(
            [replace(e, body=normalise(e.body)) for e in runs.direct],
            [replace(e, body=normalise(e.body)) for e in runs.proxied],
            runs.direct_result,
            runs.proxied_result,
        )
    for direct, proxied in zip(runs.direct, runs.proxied, strict=True):
        if proxied.body != direct.body and direct.body.startswith((b"data:", b"event:")):
            # A stream: say which events differ, and how many each side got.
            events = direct.body.split(b"\n\n"), proxied.body.split(b"\n\n")
            assert events[1] == events[0], (
                f"{direct.path}: {len(events[0])} events directly, {len(events[1])} through the proxy"
            )
        assert proxied.body == direct.body, f"{direct.path}: the client got other bytes"
