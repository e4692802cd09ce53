"""A loopback OTLP/HTTP collector for the tracing measurements: it decodes each batch as
a collector would (opentelemetry-proto) and counts the spans; nothing is kept.

    python bench/otlp_sink.py --port 4318     # POST /v1/traces; GET /health: the count

bench/proxy_overhead.py `--only observe` starts one for its "tracing on" proxy and
checks afterwards that every traced request reached it as a span.
"""

from __future__ import annotations

import argparse

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

SPANS = web.AppKey("spans", list)  # one counter: [spans decoded]
ANSWER = ExportTraceServiceResponse().SerializeToString()


async def traces(request: web.Request) -> web.Response:
    message = ExportTraceServiceRequest.FromString(await request.read())  # gzip: undone
    request.app[SPANS][0] += sum(
        len(scope.spans) for batch in message.resource_spans for scope in batch.scope_spans
    )
    return web.Response(body=ANSWER, content_type="application/x-protobuf")


async def health(request: web.Request) -> web.Response:
    return web.Response(text=str(request.app[SPANS][0]))


def create_app() -> web.Application:
    app = web.Application(client_max_size=64 << 20)  # the exporter's request size limit
    app[SPANS] = [0]
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/health", health)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args()
    web.run_app(create_app(), host="127.0.0.1", port=args.port, print=None)
