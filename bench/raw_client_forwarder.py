"""The bare forwarder with aiohttp's client replaced by the proxy's own (proxy/forward/upstream.py).

aiohttp still serves the agent's side; the hop to the upstream goes through the
keep-alive pool of asyncio protocols with httptools that overnight uses for
completions. Nothing else: no parsing, no logging. bench/forwarder_floor.py runs it
beside bench/bare_forwarder.py to show what the client side of aiohttp costs (it was
first written as a stand-alone prototype, to size the client before building it).

    python bench/raw_client_forwarder.py --port 8003 --upstream http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from overnight.proxy.forward.upstream import UpstreamPool  # noqa: E402

POOL = web.AppKey("pool", UpstreamPool)
HEADERS = {"Content-Type": "application/json"}


async def forward(request: web.Request) -> web.Response:
    async with await request.app[POOL].post(request.path, await request.read(), HEADERS) as r:
        body = await r.read()
    return web.Response(body=body, status=r.status, content_type="application/json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    app = web.Application()
    app[POOL] = UpstreamPool(args.upstream, connect_timeout=10, keepalive_timeout=4)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/health", lambda r: web.Response())
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = None
    web.run_app(app, port=args.port, access_log=None, print=None, loop=loop)


if __name__ == "__main__":
    main()
