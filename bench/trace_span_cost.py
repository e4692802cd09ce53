"""The CPU one completion span costs, on the event loop and in the export thread: the
proxy's path (proxy/observe/tracing.py, trace_context.py, otlp.py) beside the SDK's
(a span from its tracer under a BatchSpanProcessor, then its OTLP encoder), in-process,
no network. The handlers' own work (the capture, the records) is not in either.

    python bench/trace_span_cost.py [--spans 20000]

Loop: start (the client's traceparent parsed, the sampling decision, the start
attributes), the traceparent for vLLM, the end attributes and the hand-over to the
queue. Thread: a request of 512 spans encoded to bytes (what is posted; gzip off).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from overnight.proxy.observe import tracing  # noqa: E402
from overnight.proxy.observe.otlp_protobuf import Encoder  # noqa: E402
from overnight.proxy.observe.trace_context import Sampler  # noqa: E402

BATCH = 512
HEADERS = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
BODY = {"model": "policy", "messages": [], "max_tokens": 12, "temperature": 0.7}


def capture(i: int) -> SimpleNamespace:
    """What tracing.py reads of a Capture, as a plain agent's chat completion has it."""
    return SimpleNamespace(
        request_body=BODY,
        endpoint="chat",
        stream=False,
        request_id=f"req-{i:016x}",
        route=SimpleNamespace(served="policy-v3", version=3),
        status=200,
        acc=SimpleNamespace(meta={"id": f"chatcmpl-{i:024x}"}),
        ttft_ms=1.25 + i % 7,
        error=None,
        latency_ms=2.5,
        t0=time.perf_counter(),
        span=None,
    )


WHO = SimpleNamespace(source="header", rollout_id=None, group_id="bench")


def rows(i: int) -> list[dict]:
    return [{"finish_reason": "length", "prompt_tokens": 40, "completion_tokens": 12,
             "turn_index": 0, "record_id": f"rec-{i:016x}", "logged": True}]  # fmt: skip


def ours(n: int) -> tuple[float, float]:
    queued: list = []
    exporter = SimpleNamespace(submit=lambda *item: queued.append(item))
    proxy = tracing.ProxyTracing(exporter, Sampler(), contents=False)
    request = SimpleNamespace(headers=HEADERS)
    work = [(capture(i), rows(i)) for i in range(n)]
    t0 = time.process_time()
    for c, r in work:
        proxy.start(request, c, WHO, 1_700_000_000_000_000)
        proxy.forwarded(c, {"content-type": "application/json"})
        tracing.sent_to(c, SimpleNamespace(replica=SimpleNamespace(url="http://127.0.0.1:8000")))
        proxy.end(c, r)
    loop = (time.process_time() - t0) / n
    encoder = Encoder({"service.name": "overnight-proxy"}, 128, None)
    t0 = time.process_time()
    for i in range(0, n, BATCH):
        encoder.request(queued[i : i + BATCH])
    return loop, (time.process_time() - t0) / n


def sdks(n: int) -> tuple[float, float]:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ended: list = []

    class Keep(SpanExporter):  # the BSP's thread hands its batches here
        def export(self, spans):
            ended.extend(spans)
            return SpanExportResult.SUCCESS

    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(Keep(), max_queue_size=n + 1))
    tracer, propagator = provider.get_tracer("overnight"), TraceContextTextMapPropagator()
    work = [(capture(i), rows(i)) for i in range(n)]
    t0 = time.process_time()
    for c, r in work:  # what the SDK-based tracing.py did for each completion
        span = tracer.start_span(
            "chat policy",
            context=propagator.extract(HEADERS),
            kind=trace.SpanKind.CLIENT,
            start_time=1_700_000_000_000_000_000,
            attributes=tracing.start_attributes("chat", c, WHO, BODY),
        )
        propagator.inject({}, context=trace.set_span_in_context(span))
        span.set_attribute("server.address", "127.0.0.1")
        span.set_attribute("server.port", 8000)
        span.set_attributes(tracing.end_attributes(c, r))
        span.end()
    loop = (time.process_time() - t0) / n  # its thread runs too, but only wakes to hand over
    provider.force_flush()
    t0 = time.process_time()
    for i in range(0, n, BATCH):
        encode_spans(ended[i : i + BATCH]).SerializePartialToString()
    thread = (time.process_time() - t0) / n
    provider.shutdown()
    return loop, thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=20000)
    args = parser.parse_args()
    for name, measure in (("proxy's path", ours), ("SDK", sdks)):
        measure(2000)  # warm up
        loop, thread = measure(args.spans)
        print(f"{name:<14} loop {loop * 1e6:6.1f} µs/span   thread {thread * 1e6:6.1f} µs/span"
              f"   total {(loop + thread) * 1e6:6.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
