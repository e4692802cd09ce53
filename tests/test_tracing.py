"""OpenTelemetry traces, read back as a collector gets them: a loopback OTLP/HTTP receiver
decodes the real protobuf (opentelemetry-proto) and the tests check the proxy's
completion spans (attributes, the client's parent, the traceparent vLLM got, contents
only with the flag), the Langfuse shortcut, a night's one trace, and that a collector
that is down fails neither a request nor a night."""

from __future__ import annotations

import asyncio
import base64
import json
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


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(pairs) -> dict:
    return {kv.key: _value(kv.value) for kv in pairs}


SPANS = web.AppKey("spans", list)
POSTS = web.AppKey("posts", list)


async def _traces(request: web.Request) -> web.Response:
    message = ExportTraceServiceRequest.FromString(await request.read())
    request.app[POSTS].append({"path": request.path, "headers": dict(request.headers)})
    for batch in message.resource_spans:
        resource = _attributes(batch.resource.attributes)
        for scope in batch.scope_spans:
            for s in scope.spans:
                request.app[SPANS].append(
                    Span(s.name, s.kind, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                         _attributes(s.attributes), resource, s.status.code,
                         [e.name for e in s.events])
                )  # fmt: skip
    body = ExportTraceServiceResponse().SerializeToString()
    return web.Response(body=body, content_type="application/x-protobuf")


@pytest.fixture
async def receiver(aiohttp_server):
    """An OTLP/HTTP collector on loopback: `receiver.app[SPANS]` lists what it decoded."""
    app = web.Application()
    app[SPANS], app[POSTS] = [], []
    app.router.add_post("/v1/traces", _traces)
    app.router.add_post("/api/public/otel/v1/traces", _traces)  # Langfuse's path
    return await aiohttp_server(app)


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
    # The exporter posts synchronously from the SDK's thread to the receiver on this loop.
    provider = proxy.app[TRACING].tracing.provider
    await asyncio.get_running_loop().run_in_executor(None, provider.force_flush)


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

    from overnight.cli import main

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
