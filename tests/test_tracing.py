"""OpenTelemetry traces, read back as a collector gets them: a loopback OTLP/HTTP receiver
decodes the real protobuf (opentelemetry-proto) and the tests check the proxy's
completion spans (attributes, the client's parent, the traceparent vLLM got, contents
only with the flag), the Langfuse shortcut, a night's one trace, and that a collector
that is down fails neither a request nor a night."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import pytest
from aiohttp import web

from overnight import telemetry
from overnight.errors import ConfigError
from overnight.proxy.observe.tracing import TRACING

from .helpers import rows, wait_for_rows

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SPAN_KIND_CLIENT = 3
STATUS_ERROR = 2


@dataclass
class Span:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent: str
    attributes: dict
    resource: dict
    status: int
    events: list[str]
    tracestate: str


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(pairs) -> dict:
    return {kv.key: _value(kv.value) for kv in pairs}


SPANS = web.AppKey("spans", list)
POSTS = web.AppKey("posts", list)
FAILS = web.AppKey("fails", list)  # statuses to answer first, one per post


async def _traces(request: web.Request) -> web.Response:
    peer = request.transport.get_extra_info("peername") if request.transport else None
    request.app[POSTS].append({"path": request.path, "headers": request.headers.copy(),
                               "peer": peer})  # fmt: skip
    if request.app[FAILS]:
        return web.Response(status=request.app[FAILS].pop(0))
    message = ExportTraceServiceRequest.FromString(await request.read())  # gzip: undone
    for batch in message.resource_spans:
        resource = _attributes(batch.resource.attributes)
        for scope in batch.scope_spans:
            for s in scope.spans:
                request.app[SPANS].append(
                    Span(s.name, s.kind, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                         _attributes(s.attributes), resource, s.status.code,
                         [e.name for e in s.events], s.trace_state)
                )  # fmt: skip
    body = ExportTraceServiceResponse().SerializeToString()
    return web.Response(body=body, content_type="application/x-protobuf")


def _receiver_app() -> web.Application:
    app = web.Application()
    app[SPANS], app[POSTS], app[FAILS] = [], [], []
    app.router.add_post("/v1/traces", _traces)
    app.router.add_post("/api/public/otel/v1/traces", _traces)  # Langfuse's path
    return app


@pytest.fixture
async def receiver(aiohttp_server):
    """An OTLP/HTTP collector on loopback: `receiver.app[SPANS]` lists what it decoded."""
    return await aiohttp_server(_receiver_app())


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No tracing variable of the machine's leaks in; exports happen promptly."""
    for name in list(os.environ):
        if name.startswith(("OTEL_", "LANGFUSE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # ms


def dead_endpoint() -> str:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def flushed(proxy) -> None:
    # The exporter posts synchronously from its thread to the receiver on this loop.
    exporter = proxy.app[TRACING].exporter
    assert await asyncio.get_running_loop().run_in_executor(None, exporter.flush, 30.0)


CHAT = {
    "model": "policy",
    "messages": [{"role": "user", "content": "Write to ann@example.com please"}],
    "temperature": 0.7,
    "top_p": 0.9,
    "max_tokens": 5,
    "seed": 3,
}
TRACED = {
    "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
    "X-Rollout-Group": "group-1",
    "X-Rollout-Id": "rollout-1",
}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_completion_is_a_client_span_under_the_clients_trace(
    make_proxy, receiver, received, monkeypatch, tmp_path, stream
):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", str(receiver.make_url("")))
    monkeypatch.setenv("OTEL_SERVICE_NAME", "proxy-under-test")
    proxy = await make_proxy()
    r = await proxy.post("/v1/chat/completions", json={**CHAT, "stream": stream}, headers=TRACED)
    assert r.status == 200
    await r.read()
    (record,) = await wait_for_rows(tmp_path / "data", 1)
    await flushed(proxy)
    (span,) = receiver.app[SPANS]
    assert span.name == "chat policy" and span.kind == SPAN_KIND_CLIENT
    assert span.trace_id == CLIENT_TRACE and span.parent == CLIENT_SPAN  # the client's trace
    assert span.resource["service.name"] == "proxy-under-test"
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "vllm"
    assert a["gen_ai.request.model"] == "policy"
    assert a["gen_ai.response.model"] == record["model_served"]
    assert a["gen_ai.response.id"] == json.loads(record["response"])["id"]
    assert a["gen_ai.response.finish_reasons"] == [record["finish_reason"]]
    assert a["gen_ai.usage.input_tokens"] == record["prompt_tokens"] > 0
    assert a["gen_ai.usage.output_tokens"] == record["completion_tokens"] > 0
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (0.7, 0.9)
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.seed"]) == (5, 3)
    assert a["gen_ai.request.stream"] is stream
    assert a["gen_ai.conversation.id"] == "rollout-1" and a["session.id"] == "group-1"
    assert a["langfuse.trace.metadata.rollout_id"] == "rollout-1"
    assert a["server.address"] == "127.0.0.1" and a["http.response.status_code"] == 200
    assert a["overnight.record_ids"] == [record["record_id"]] and "error.type" not in a
    # Without --trace-contents no message reaches the trace.
    assert not any("messages" in k or "prompt" in k or "completion" in k for k in a), a
    assert "ann@example.com" not in repr(span)
    # vLLM got the proxy's span as its parent, once, in place of the client's.
    headers = received[-1]["headers"]
    assert headers["traceparent"] == f"00-{CLIENT_TRACE}-{span.span_id}-01"
    assert sum(k.lower() == "traceparent" for k in headers) == 1


async def test_contents_only_with_the_flag_and_after_the_redaction_hook(
    make_proxy, receiver, monkeypatch, tmp_path
):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", str(receiver.make_url("/v1/traces")))
    hook = "examples/redact_emails.py:redact"
    proxy = await make_proxy(trace_contents=True, redact=hook)
    r = await proxy.post("/v1/chat/completions", json=CHAT)  # no traceparent: a trace of its own
    assert r.status == 200
    reply = (await r.json())["choices"][0]["message"]["content"]
    await wait_for_rows(tmp_path / "data", 1)
    await flushed(proxy)
    (span,) = receiver.app[SPANS]
    assert span.parent == "" and span.trace_id != CLIENT_TRACE
    (message,) = json.loads(span.attributes["gen_ai.input.messages"])
    assert message["role"] == "user" and message["parts"][0]["type"] == "text"
    text = message["parts"][0]["content"]
    assert "Write to" in text and "ann@example.com" not in text, text  # what the store keeps
    (out,) = json.loads(span.attributes["gen_ai.output.messages"])
    assert out["role"] == "assistant" and out["finish_reason"] == "length"
    assert out["parts"] == [{"type": "text", "content": reply}]


async def test_a_failed_request_is_an_error_span(make_proxy, receiver, monkeypatch, tmp_path):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", str(receiver.make_url("")))
    proxy = await make_proxy()
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Fake": "status-500"})
    assert r.status == 500
    await wait_for_rows(tmp_path / "data", 1)  # the span ends when the record is built
    await flushed(proxy)
    (span,) = receiver.app[SPANS]
    assert span.attributes["error.type"] == "500" and span.status == STATUS_ERROR


async def test_tracing_off_makes_no_span_and_forwards_the_clients_traceparent(make_proxy, received):
    proxy = await make_proxy()
    assert TRACING not in proxy.app
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers=TRACED)
    assert r.status == 200
    assert received[-1]["headers"]["traceparent"] == TRACED["traceparent"]  # untouched


def test_off_the_proxy_imports_no_opentelemetry(tmp_path):
    script = (
        "import sys\n"
        "from overnight.config import ProxyConfig\n"
        "from overnight.proxy import create_app\n"
        f"create_app(ProxyConfig(upstream='http://127.0.0.1:9', data_dir={str(tmp_path)!r}))\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LANGFUSE_"))}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


async def test_a_collector_that_is_down_fails_no_request(make_proxy, monkeypatch, tmp_path):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", dead_endpoint())
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.5")  # seconds
    proxy = await make_proxy()
    for stream in (False, True):
        r = await proxy.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert r.status == 200 and (await r.read())
    await wait_for_rows(tmp_path / "data", 2)
    await flushed(proxy)  # the export fails (connection refused): logged, nothing raised
    r = await proxy.post("/v1/chat/completions", json=CHAT)
    assert r.status == 200
    await proxy.close()  # the stop waits for the exporter at most its deadline
    assert len(rows(tmp_path / "data", "SELECT * FROM completions")) == 3


# -- the environment --------------------------------------------------------------------


def test_the_langfuse_shortcut_targets_its_otlp_endpoint_with_basic_auth():
    env = {"LANGFUSE_PUBLIC_KEY": "pk-lf-1", "LANGFUSE_SECRET_KEY": "sk-lf-2"}
    url, headers = telemetry.langfuse_target({**env, "LANGFUSE_HOST": "https://lf.example/"})
    assert url == "https://lf.example/api/public/otel/v1/traces"
    assert headers == {"Authorization": "Basic " + base64.b64encode(b"pk-lf-1:sk-lf-2").decode()}
    newer = telemetry.langfuse_target({**env, "LANGFUSE_BASE_URL": "http://127.0.0.1:3000"})
    assert newer[0] == "http://127.0.0.1:3000/api/public/otel/v1/traces"
    # Half a configuration is off (Langfuse's own SDK reads the same names), not an error.
    assert telemetry.langfuse_target(env) is None
    assert not telemetry.configured(env) and not telemetry.configured({})


async def test_langfuse_receives_spans_at_its_path_with_its_header(receiver):
    env = {
        "LANGFUSE_PUBLIC_KEY": "pk-lf-1",
        "LANGFUSE_SECRET_KEY": "sk-lf-2",
        "LANGFUSE_HOST": str(receiver.make_url("")),
    }
    tracing = telemetry.from_environment("overnight-test", env)
    assert tracing is not None
    tracing.tracer.start_span("one").end()
    await asyncio.get_running_loop().run_in_executor(None, tracing.shutdown)
    (post,) = receiver.app[POSTS]
    assert post["path"] == "/api/public/otel/v1/traces"
    assert (
        post["headers"]["Authorization"] == "Basic " + base64.b64encode(b"pk-lf-1:sk-lf-2").decode()
    )
    (span,) = receiver.app[SPANS]
    assert span.name == "one" and span.resource["service.name"] == "overnight-test"


def test_off_switches_and_a_protocol_we_do_not_speak():
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert telemetry.configured(endpoint)
    assert not telemetry.configured({**endpoint, "OTEL_SDK_DISABLED": "true"})
    assert not telemetry.configured({**endpoint, "OTEL_TRACES_EXPORTER": "none"})
    with pytest.raises(ConfigError, match="http/protobuf"):
        telemetry.from_environment("x", {**endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})


def test_without_the_sdk_a_configured_tracing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ConfigError, match=r"overnight\[otel\]"):
        telemetry.from_environment("x", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})


# -- sampling and the client's trace context (as the SDK decides them) ----------------

SAMPLER_SETTINGS = [
    {},
    {"OTEL_TRACES_SAMPLER": "always_on"},
    {"OTEL_TRACES_SAMPLER": "always_off"},
    {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"},
    {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
    {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"},  # -> 1.0
    {"OTEL_TRACES_SAMPLER": "parentbased_always_off"},
    {"OTEL_TRACES_SAMPLER": "ParentBased_TraceIdRatio", "OTEL_TRACES_SAMPLER_ARG": "0.5"},
    {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"},
    {"OTEL_TRACES_SAMPLER": "no_such_sampler"},  # -> the default
]


@pytest.mark.parametrize("settings", SAMPLER_SETTINGS)
def test_each_sampler_decides_as_the_sdks_of_that_name(monkeypatch, settings):
    import random

    from opentelemetry.sdk.trace import sampling
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from overnight.proxy.observe.trace_context import parent, sampler_from

    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    ours, theirs = sampler_from(os.environ), sampling._get_from_env_or_default()
    generator, decided = random.Random(7), set()
    for i in range(400):
        trace_id = generator.getrandbits(128)
        flag = ("", "-00", "-01")[i % 3]  # no parent, a parent not sampled, one sampled
        headers = {"traceparent": f"00-{trace_id:032x}-{CLIENT_SPAN}{flag}"} if flag else {}
        context = TraceContextTextMapPropagator().extract(headers)
        expected = theirs.should_sample(context, trace_id, "chat policy").decision.is_sampled()
        assert ours.sampled(trace_id, parent(headers)) is expected, (settings, headers)
        decided.add(expected)
    if settings.get("OTEL_TRACES_SAMPLER_ARG") in ("0.25", "0.5"):
        assert decided == {True, False}  # the ratio was exercised both ways


INVALID_TRACEPARENTS = [
    f"00-{CLIENT_TRACE.upper()}-{CLIENT_SPAN}-01",  # uppercase hex
    f"00-{'0' * 32}-{CLIENT_SPAN}-01",  # all-zero trace id
    f"00-{CLIENT_TRACE}-{'0' * 16}-01",  # all-zero span id
    f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01",  # the forbidden version
    f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01-extra",  # version 00 has no more fields
    f"00-{CLIENT_TRACE[:-1]}-{CLIENT_SPAN}-01",  # short
    f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-0g",
    f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01" + " " * 600,  # past the length limit
    "not a traceparent",
]
VALID_TRACEPARENTS = [
    f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
    f" \t00-{CLIENT_TRACE}-{CLIENT_SPAN}-03\t",  # blanks around; flags beyond sampled
    f"01-{CLIENT_TRACE}-{CLIENT_SPAN}-00-more",  # a later version may carry more
]


@pytest.mark.parametrize("header", INVALID_TRACEPARENTS + VALID_TRACEPARENTS)
def test_the_clients_traceparent_is_read_as_the_sdk_reads_it(header):
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from overnight.proxy.observe.trace_context import parent

    headers = {"traceparent": header, "tracestate": "vendor=1,bad key=2"}
    context = TraceContextTextMapPropagator().extract(headers)
    theirs = trace.get_current_span(context).get_span_context()
    ours = parent(headers)
    assert (ours is not None) is theirs.is_valid is (header in VALID_TRACEPARENTS)
    if ours is not None:
        assert (ours.trace_id, ours.span_id) == (theirs.trace_id, theirs.span_id)
        assert ours.sampled is theirs.trace_flags.sampled
        assert ours.tracestate == (theirs.trace_state.to_header() or None)


@pytest.mark.parametrize(
    ("settings", "client_flag", "exported", "vllm_flag"),
    [
        ({}, "00", 0, "00"),  # the default follows the client: not sampled
        ({}, "01", 1, "01"),
        ({"OTEL_TRACES_SAMPLER": "always_on"}, "00", 1, "01"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, "01", 0, "00"),
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
            "01",
            1,
            "01",
        ),  # fmt: skip
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
            None,
            0,
            "00",
        ),  # fmt: skip
    ],
)
async def test_the_sampler_decides_what_is_exported_and_what_vllm_is_told(
    make_proxy, receiver, received, monkeypatch, tmp_path, settings, client_flag, exported,
    vllm_flag,
):  # fmt: skip
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", str(receiver.make_url("")))
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    proxy = await make_proxy()
    headers = (
        {} if client_flag is None else {"traceparent": TRACED["traceparent"][:-2] + client_flag}
    )
    for stream in (False, True):
        r = await proxy.post(
            "/v1/chat/completions", json={**CHAT, "stream": stream}, headers=headers
        )
        assert r.status == 200 and await r.read()
        sent = received[-1]["headers"]["traceparent"]
        assert sent.endswith(f"-{vllm_flag}") and CLIENT_SPAN not in sent
        assert client_flag is None or sent.startswith(f"00-{CLIENT_TRACE}-")
    await wait_for_rows(tmp_path / "data", 2)
    await flushed(proxy)
    assert len(receiver.app[SPANS]) == 2 * exported
    assert len(rows(tmp_path / "data", "SELECT * FROM completions")) == 2  # never sampled


async def test_an_invalid_traceparent_starts_a_new_root(
    make_proxy, receiver, received, monkeypatch
):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", str(receiver.make_url("")))
    proxy = await make_proxy()
    bad = f"00-{CLIENT_TRACE.upper()}-{CLIENT_SPAN}-01"
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"traceparent": bad})
    assert r.status == 200
    await flushed(proxy)
    (span,) = receiver.app[SPANS]
    assert span.parent == "" and span.trace_id != CLIENT_TRACE.lower()
    headers = received[-1]["headers"]
    assert headers["traceparent"] == f"00-{span.trace_id}-{span.span_id}-01"  # ours, once
    assert sum(k.lower() == "traceparent" for k in headers) == 1


async def test_the_clients_tracestate_goes_on_the_span_and_to_vllm(
    make_proxy, receiver, received, monkeypatch
):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", str(receiver.make_url("")))
    proxy = await make_proxy()
    headers = {**TRACED, "tracestate": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"}
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status == 200
    await flushed(proxy)
    assert received[-1]["headers"]["tracestate"] == headers["tracestate"]
    assert receiver.app[SPANS][0].tracestate == headers["tracestate"]


# -- the exporter ---------------------------------------------------------------------


async def test_past_the_queue_bound_spans_are_dropped_and_counted_requests_unaffected(
    make_proxy, receiver, monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", str(receiver.make_url("")))
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "2")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # nothing leaves before the flush
    proxy = await make_proxy()
    for _ in range(5):
        r = await proxy.post("/v1/chat/completions", json=CHAT)
        assert r.status == 200
    await wait_for_rows(tmp_path / "data", 5)
    exporter = proxy.app[TRACING].exporter
    assert exporter.dropped == 3 and not receiver.app[POSTS]
    await flushed(proxy)
    assert len(receiver.app[SPANS]) == 2
    assert "3 spans dropped, the queue was full" in caplog.text


async def test_a_collector_that_answers_503_once_gets_the_batch_on_the_retry(
    make_proxy, receiver, monkeypatch
):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", str(receiver.make_url("")))
    receiver.app[FAILS].append(503)
    proxy = await make_proxy()
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers=TRACED)
    assert r.status == 200
    await flushed(proxy)  # the retry waits its backoff (about a second)
    assert len(receiver.app[POSTS]) == 2 and not receiver.app[FAILS]
    (span,) = receiver.app[SPANS]
    assert span.parent == CLIENT_SPAN


async def test_a_collector_that_answers_400_is_not_retried(make_proxy, receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", str(receiver.make_url("")))
    receiver.app[FAILS].append(400)
    proxy = await make_proxy()
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200
    await flushed(proxy)
    assert len(receiver.app[POSTS]) == 1 and not receiver.app[SPANS]
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200
    await flushed(proxy)
    assert len(receiver.app[SPANS]) == 1  # the next batch goes as usual
    first, second = receiver.app[POSTS]
    assert first["peer"] == second["peer"]  # on the connection kept from the first export


async def test_a_kept_connection_the_collector_closed_is_replaced_at_once(
    make_proxy, aiohttp_server, monkeypatch, caplog
):
    caplog.set_level(logging.INFO, logger="overnight.proxy")
    receiver = await aiohttp_server(_receiver_app(), keepalive_timeout=0.05)  # closes idle ones
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", str(receiver.make_url("")))
    proxy = await make_proxy()
    for _ in range(2):
        assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200
        await flushed(proxy)
        await asyncio.sleep(0.3)  # past the collector's keep-alive: the kept one is stale
    first, second = receiver.app[POSTS]
    assert len(receiver.app[SPANS]) == 2 and first["peer"] != second["peer"]
    assert "export failed" not in caplog.text  # no retry after a backoff, no failure


async def test_gzip_and_the_standard_headers_and_resource_variables(
    make_proxy, receiver, monkeypatch
):
    endpoint = str(receiver.make_url("/v1/traces"))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # the traces one wins
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=k%201,x-team=a")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,region=eu")
    proxy = await make_proxy()
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200
    await flushed(proxy)
    (post,) = receiver.app[POSTS]
    assert post["headers"]["Content-Encoding"] == "gzip"
    assert post["headers"]["Content-Type"] == "application/x-protobuf"
    assert (post["headers"]["x-api-key"], post["headers"]["x-team"]) == ("k 1", "a")
    (span,) = receiver.app[SPANS]  # the receiver decompressed and decoded it
    assert span.name == "chat policy" and span.resource["region"] == "eu"
    assert span.resource["service.name"] == "overnight-proxy"
    assert span.resource["telemetry.sdk.name"] == "opentelemetry"  # Resource.create()'s


async def test_the_proxys_spans_take_the_langfuse_shortcut_too(receiver):
    from overnight.proxy.observe import otlp
    from overnight.proxy.observe.trace_context import Sampler, Span

    env = {
        "LANGFUSE_PUBLIC_KEY": "pk-lf-1",
        "LANGFUSE_SECRET_KEY": "sk-lf-2",
        "LANGFUSE_BASE_URL": str(receiver.make_url("")),
    }
    exporter = otlp.from_environment("overnight-proxy", env)
    span = Span(None, Sampler(), "chat policy", 1_000)
    span.attributes = {"session.id": "group-1"}
    exporter.submit(span, 2_000, None)
    await asyncio.get_running_loop().run_in_executor(None, exporter.shutdown, 10.0)
    (post,) = receiver.app[POSTS]
    assert post["path"] == "/api/public/otel/v1/traces"
    assert (
        post["headers"]["Authorization"] == "Basic " + base64.b64encode(b"pk-lf-1:sk-lf-2").decode()
    )
    (got,) = receiver.app[SPANS]
    assert got.attributes == {"session.id": "group-1"} and got.span_id == f"{span.span_id:016x}"


def test_the_encoder_writes_what_opentelemetry_proto_reads():
    """Every value kind, a parent and its trace state, an error status, the limits."""
    from overnight.proxy.observe.otlp_protobuf import Encoder
    from overnight.proxy.observe.trace_context import Parent, Sampler, Span

    encoder = Encoder({"service.name": "s", "n": 2}, max_attributes=10, limit=4)
    client = Parent(int(CLIENT_TRACE, 16), int(CLIENT_SPAN, 16), True, "a=1")
    span = Span(client, Sampler(), "chat émoji", 1_700_000_000_000_000_000)
    span.attributes = {"first": "dropped by the count limit", "text": "éabcdef", "yes": True,
                       "no": False, "int": -3, "big": 2**40, "float": 0.25, "list": ["abcdef", "x"],
                       "empty": [], "ints": [1, 2], "bools": [True], "none": None}  # fmt: skip
    for _ in range(2):  # the second time from the encoder's kept bytes
        message = ExportTraceServiceRequest.FromString(
            encoder.request([(span, span.start_ns + 5, "boom")])
        )
        (resource_spans,) = message.resource_spans
        assert _attributes(resource_spans.resource.attributes) == {"service.name": "s", "n": 2}
        (scope,) = resource_spans.scope_spans
        assert scope.scope.name == "overnight"
        (s,) = scope.spans
        assert (s.trace_id.hex(), s.parent_span_id.hex()) == (CLIENT_TRACE, CLIENT_SPAN)
        assert s.span_id == span.span_id.to_bytes(8, "big") and s.trace_state == "a=1"
        assert (s.name, s.kind) == ("chat émoji", SPAN_KIND_CLIENT)
        assert s.end_time_unix_nano - s.start_time_unix_nano == 5
        assert _attributes(s.attributes) == {
            **{"text": "éabc", "yes": True, "no": False, "int": -3, "big": 2**40, "float": 0.25},
            **{"list": ["abcd", "x"], "empty": [], "ints": [1, 2], "bools": [True]},
        }
        assert s.dropped_attributes_count == 1
        assert (s.status.code, s.status.message) == (STATUS_ERROR, "boom")
        assert s.flags == 0x300  # SpanFlags: the parent is remote (as the SDK writes it)


# -- the night ---------------------------------------------------------------------------


def test_a_night_with_its_collector_down_still_runs_and_still_fails_as_it_would(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", dead_endpoint())
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.5")

    @telemetry.traced("step", lambda n: {"n": n})
    def step(n: int) -> int:
        return n + 1

    with telemetry.night() as root:
        assert root.span is not None and step(1) == 2
    with pytest.raises(ZeroDivisionError), telemetry.night():
        step(1) / 0  # the night's own error, not the exporter's
    assert telemetry.phase("outside").__enter__() is telemetry.OFF  # no night: no span


async def test_a_night_is_one_trace_plan_judge_steps_gate_promotion(
    make_proxy, receiver, aiohttp_server, tiny_model_dir, lora_adapter, monkeypatch, tmp_path
):
    """`overnight train` with a judge, on the tiny model, the proxy in front of the fake
    vLLM (test_gate.py's cheapest promoting night): one root, its phases as children."""
    pytest.importorskip("peft")
    from click.testing import CliRunner

    from overnight.cli.main import main

    from .judge_server import create_judge_server, good
    from .test_gate import write_night
    from .test_judge import write_groups

    proxy = await make_proxy()  # before the variables: the night's spans only
    url, data = str(proxy.make_url("")), tmp_path / "data"
    await proxy.post("/admin/adapters/promote", json={"path": str(lora_adapter)})
    write_night(data, tasks=8, held_out=6)
    write_groups(data, {"france": ["Paris", "Lyon", "I don't know"]})  # for the judge
    judge = await aiohttp_server(create_judge_server([good()]))
    reward = tmp_path / "reward.py"
    reward.write_text("def length(rollout):\n    return len(rollout['messages'][-1]['content'])\n")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", str(receiver.make_url("")))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-judge")
    monkeypatch.setenv("OVERNIGHT_JUDGE_BACKOFF", "0.01")
    args = ["train", "--data", str(data), "--proxy", url, "--base-model", str(tiny_model_dir),
            "--learning-rate", "1e-9", "--lora-rank", "4", "--gate-prompts", "8",
            "--gate-reward", f"{reward}:length", "--judge-model", "openai/judge-model",
            "--judge-base-url", str(judge.make_url("/v1"))]  # fmt: skip
    done = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert done.exit_code == 0, done.output
    assert "promoted: the proxy now serves it" in done.output, done.output
    spans = receiver.app[SPANS]  # the night flushed them before it returned
    (root,) = [s for s in spans if s.parent == ""]
    assert root.name == "overnight night" and {s.trace_id for s in spans} == {root.trace_id}
    assert root.resource["service.name"] == "overnight-train"
    (run,) = rows(data, "SELECT run_id, promoted_as FROM training_runs")
    assert root.attributes["overnight.run_id"] == run["run_id"]
    assert root.attributes["overnight.promoted_as"] == run["promoted_as"]
    by_id = {s.span_id: s for s in spans}
    children = [s.name for s in spans if s.parent == root.span_id]
    for phase in ("score", "watch", "plan", "training", "gate", "promotion"):
        assert children.count(phase) == 1, children
    judged = [s for s in spans if s.name == "judge"]
    assert judged and all(by_id[s.parent].name == "score" for s in judged), done.output
    assert judged[0].attributes["gen_ai.request.model"] == "openai/judge-model"
    assert judged[0].attributes["gen_ai.usage.input_tokens"] == 100  # the judge server's usage
    assert judged[0].attributes["overnight.group_id"] == "france"
    steps = [s for s in spans if s.name == "step"]
    assert steps and all(by_id[s.parent].name == "training" for s in steps)
    assert "overnight.loss" in steps[0].attributes
    gate = next(s for s in spans if s.name == "gate")
    assert gate.attributes["overnight.promote"] is True
    assert not any("messages" in k for s in spans for k in s.attributes)  # no contents
