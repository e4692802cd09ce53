"""The least an aiohttp proxy can do: forward the body, return the answer's bytes.

No parsing, no logging, no rewriting: the floor that overnight's own work sits on,
measured beside it in bench/proxy_overhead.py.

    python bench/bare_forwarder.py --port 8002 --upstream http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)


async def forward(request: web.Request) -> web.Response:
    body = await request.read()
    url = request.app["upstream"] + request.path
    async with request.app[SESSION].post(
        url, data=body, headers={"Content-Type": "application/json"}
    ) as r:
        return web.Response(body=await r.read(), status=r.status, content_type="application/json")


async def session_ctx(app: web.Application):
    app[SESSION] = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
    )
    yield
    await app[SESSION].close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    app = web.Application()
    app["upstream"] = args.upstream
    app.cleanup_ctx.append(session_ctx)
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
