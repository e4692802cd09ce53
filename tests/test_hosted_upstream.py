"""The proxy in front of a hosted API (issue 28): nothing added, the key as chosen, every
path recorded. The upstream is the scripted hosted API (overnight/testing/hosted_upstream.py),
which refuses any field it does not know with OpenAI's 400 (Anthropic's on /v1/messages)
and any request without its own key with a 401: a proxy that added anything, or sent the
wrong key, fails here as it would against the real one."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import ssl
import sys

import aiohttp
import pytest

from overnight.config import ConfigError, ProxyConfig
from overnight.proxy import create_app
from overnight.proxy.forward.upstream import UpstreamPool
from overnight.proxy.launch.launcher import detect_kind, free_port
from overnight.proxy.routes.hosted import HostedUpstream
from overnight.storage.read.reader import open_db
from overnight.testing.fake_upstream import create_fake_upstream
from overnight.testing.hosted_upstream import (
    ANSWERS,
    RECEIVED,
    SNAPSHOT,
    create_hosted_upstream,
)
from overnight.testing.processes import spawn, spawn_serve
from overnight.view.display import list_groups

from .helpers import post_status, rows, sse_events, wait_for_rows

UPSTREAM_KEY = "sk-hosted-0123456789abcdef"
PROXY_KEY = "ovn-proxy-key-fedcba9876543210"
MODEL = "hosted-large"
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ROLLOUT = {"X-Rollout-Group": "g1", "X-Rollout-Id": "r1"}


@pytest.fixture
async def hosted(aiohttp_server):
    return await aiohttp_server(create_hosted_upstream(UPSTREAM_KEY))


@pytest.fixture
def sent(hosted):
    """What reached the hosted API: path, raw bytes, headers, body."""
    return hosted.app[RECEIVED]


@pytest.fixture
def answers(hosted):
    return hosted.app[ANSWERS]


@pytest.fixture
def start(make_proxy, hosted):
    """A proxy in front of the hosted API (conftest's make_proxy): `await start(kind, ...)`."""

    async def start(kind: str = "openai", **overrides):
        settings = {"upstream_model": MODEL, "upstream_api_key": UPSTREAM_KEY, **overrides}
        return await make_proxy(str(hosted.make_url("")), upstream_kind=kind, **settings)

    return start


def label(hosted, kind: str = "openai") -> str:
    return f"{kind} 127.0.0.1:{hosted.port}"


def notes(row: dict) -> dict:
    return json.loads(row["notes"])


# -- every path, unchanged and recorded ----------------------------------------------


async def test_chat_goes_as_sent_answer_comes_as_sent_and_is_recorded(
    start, hosted, sent, answers, tmp_path
):
    proxy = await start(api_keys=(PROXY_KEY,))
    auth = {"Authorization": f"Bearer {PROXY_KEY}"}
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={**ROLLOUT, **auth})
    assert r.status == 200, await r.text()
    assert await r.read() == answers[-1]  # the hosted API's bytes, untouched
    # Nothing added: the alias became the hosted model, and that is all.
    assert sent[-1]["body"] == {**CHAT, "model": MODEL}
    headers = {k.lower(): v for k, v in sent[-1]["headers"].items()}
    assert headers["authorization"] == f"Bearer {UPSTREAM_KEY}"  # ours, not the client's
    assert not [h for h in headers if h.startswith("x-rollout-") or h == "x-overnight-key"]

    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert (row["group_id"], row["rollout_id"]) == ("g1", "r1")
    assert (row["model_requested"], row["model_served"]) == ("policy", MODEL + SNAPSHOT)
    assert row["adapter_version"] is None and row["completion_token_ids"] is None
    assert row["prompt_token_ids"] is None and row["completion_logprobs"] is None
    assert notes(row) == {
        "upstream": label(hosted),
        "completion_token_ids": "no token ids: a hosted upstream (openai) gives none",
    }
    answer = json.loads(answers[-1])
    assert (
        json.loads(row["response"])["choices"][0]["message"]["content"]
        == (answer["choices"][0]["message"]["content"])
    )
    assert row["prompt_tokens"] == answer["usage"]["prompt_tokens"]
    assert row["completion_tokens"] == answer["usage"]["completion_tokens"]
    assert json.loads(row["request"]) == CHAT


async def test_a_hosted_model_named_directly_goes_byte_for_byte(start, sent):
    proxy = await start()
    # Odd spacing and key order: only the client's own bytes look like this.
    raw = b'{ "messages" : [{"role":"user","content":"Hi"}], "model":"other-model" ,"seed":7}'
    r = await proxy.post(
        "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}
    )
    assert r.status == 200, await r.text()
    assert sent[-1]["raw"] == raw


async def test_metadata_ids_leave_the_body_and_nothing_else_changes(start, sent, tmp_path):
    proxy = await start()
    metadata = {"rollout_group": "g2", "rollout_id": "r2", "team": "search"}
    body = {**CHAT, "model": "other-model", "metadata": metadata, "store": True}
    r = await proxy.post("/v1/chat/completions", json=body)
    assert r.status == 200, await r.text()
    assert sent[-1]["body"] == {**body, "metadata": {"team": "search"}}
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert (row["group_id"], row["rollout_id"], row["attribution"]) == ("g2", "r2", "metadata")


async def test_chat_stream_with_tool_calls_passes_byte_for_byte(start, sent, answers, tmp_path):
    proxy = await start()
    body = {**CHAT, "stream": True, "tools": TOOLS}
    r = await proxy.post("/v1/chat/completions", json=body, headers=ROLLOUT)
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    assert await r.read() == answers[-1]
    assert sent[-1]["body"] == {**body, "model": MODEL}  # no stream_options, no logprobs
    events = sse_events(answers[-1].decode())
    assert events[-1] == "[DONE]" and not any("usage" in e for e in events[:-1])

    (row,) = await wait_for_rows(tmp_path / "data", 1)
    message = json.loads(row["response"])["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert row["finish_reason"] == "tool_calls" and row["stream"] is True
    assert row["model_served"] == MODEL + SNAPSHOT and row["completion_token_ids"] is None


async def test_whole_tool_call_is_recorded(start, answers, tmp_path):
    proxy = await start()
    r = await proxy.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS})
    assert await r.read() == answers[-1]
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    call = json.loads(row["response"])["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and row["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_pass_unchanged_and_are_recorded_in_the_chat_shape(
    start, hosted, sent, answers, tmp_path, stream
):
    proxy = await start()
    body = {"model": "policy", "input": "Hi there", "stream": stream}
    r = await proxy.post("/v1/responses", json=body, headers=ROLLOUT)
    assert r.status == 200, await r.text()
    assert await r.read() == answers[-1]
    # No `enable_response_messages`, no `include` of logprobs: OpenAI would refuse the first.
    assert sent[-1]["body"] == {**body, "model": MODEL}
    first = json.loads(answers[-1]) if not stream else None
    chained = {"model": "policy", "input": "And then?"}
    chained["previous_response_id"] = first["id"] if first else _response_id(answers[-1])
    r = await proxy.post("/v1/responses", json=chained, headers=ROLLOUT)
    assert r.status == 200, await r.text()

    found = await wait_for_rows(tmp_path / "data", 2)
    assert [row["endpoint"] for row in found] == ["responses", "responses"]
    request = json.loads(found[1]["request"])  # the chain's history, rebuilt for the record
    assert [m["role"] for m in request["messages"]] == ["user", "assistant", "user"]
    assert notes(found[0])["upstream"] == label(hosted)
    assert found[0]["completion_token_ids"] is None and found[0]["model_served"] == MODEL


def _response_id(stream: bytes) -> str:
    """The id a Responses stream's last event (`response.completed`) gives."""
    last = stream.decode().strip().split("\n\n")[-1]
    return json.loads(last.split("data: ", 1)[1])["response"]["id"]


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_go_natively_with_the_anthropic_key(
    start, hosted, sent, answers, tmp_path, stream
):
    proxy = await start("anthropic")
    body = {"model": "policy", "max_tokens": 16, "stream": stream, "messages": CHAT["messages"]}
    r = await proxy.post(
        "/v1/messages", json=body, headers={**ROLLOUT, "Authorization": "Bearer client-own"}
    )
    assert r.status == 200, await r.text()
    assert await r.read() == answers[-1]
    assert sent[-1]["body"] == {**body, "model": MODEL}
    headers = {k.lower(): v for k, v in sent[-1]["headers"].items()}
    assert headers["x-api-key"] == UPSTREAM_KEY and headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in headers  # the client's goes nowhere: never both

    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["endpoint"] == "messages" and notes(row)["upstream"] == label(hosted, "anthropic")
    reply = json.loads(row["response"])["choices"][0]["message"]
    whole = json.loads(answers[-1]) if not stream else None
    if whole is not None:
        assert reply["content"] == whole["content"][0]["text"]
    assert reply["content"]


async def test_the_upstreams_errors_pass_through_and_are_recorded(start, answers, sent, tmp_path):
    proxy = await start()
    # The client's own vLLM-only field: the hosted API's verdict, byte for byte.
    r = await proxy.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True})
    assert r.status == 400
    error = await r.json()
    assert error["error"]["message"] == "Unrecognized request argument supplied: return_token_ids"
    assert len(sent) == 1  # not sent again without it: the client asked for it
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["http_status"] == 400 and "return_token_ids" in row["error"] + str(row["response"])


# -- keys ------------------------------------------------------------------------------


async def test_client_auth_forwards_the_clients_key_and_reads_ours_elsewhere(start, sent):
    proxy = await start(upstream_auth="client", upstream_api_key=None, api_keys=(PROXY_KEY,))
    theirs = {"Authorization": f"Bearer {UPSTREAM_KEY}"}
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers=theirs)
    assert r.status == 401 and not sent  # the proxy's key is missing: refused here
    r = await proxy.post(
        "/v1/chat/completions", json=CHAT, headers={**theirs, "X-Overnight-Key": PROXY_KEY}
    )
    assert r.status == 200, await r.text()
    headers = {k.lower(): v for k, v in sent[-1]["headers"].items()}
    assert headers["authorization"] == f"Bearer {UPSTREAM_KEY}" and "x-overnight-key" not in headers
    # A wrong key of the client's is the upstream's to refuse, as it would directly.
    r = await proxy.post(
        "/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": "Bearer sk-wrong-key-000000", "X-Overnight-Key": PROXY_KEY},
    )
    assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
    # Rewards are the proxy's alone: its key, in its header.
    reward = {"reward": 1.0}
    r = await proxy.post("/v1/rollouts/r1/reward", json=reward, headers=theirs)
    assert r.status == 401
    r = await proxy.post(
        "/v1/rollouts/r1/reward", json=reward, headers={"X-Overnight-Key": PROXY_KEY}
    )
    assert r.status == 200, await r.text()


async def test_client_auth_anthropic_forwards_x_api_key(start, sent):
    proxy = await start("anthropic", upstream_auth="client", upstream_api_key=None)
    body = {"model": MODEL, "max_tokens": 8, "messages": CHAT["messages"]}
    headers = {"x-api-key": UPSTREAM_KEY, "anthropic-version": "2023-06-01"}
    r = await proxy.post("/v1/messages", json=body, headers=headers)
    assert r.status == 200, await r.text()
    assert {k.lower(): v for k, v in sent[-1]["headers"].items()}["x-api-key"] == UPSTREAM_KEY
    r = await proxy.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"


async def test_configured_auth_never_forwards_the_clients_keys(start, sent):
    proxy = await start()
    client = {"Authorization": "Bearer sk-client-secret", "x-api-key": "client-x-secret"}
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers=client)
    assert r.status == 200, await r.text()
    headers = {k.lower(): v for k, v in sent[-1]["headers"].items()}
    assert headers["authorization"] == f"Bearer {UPSTREAM_KEY}" and "x-api-key" not in headers


async def test_no_key_in_records_logs_or_errors(start, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    proxy = await start(api_keys=(PROXY_KEY,))
    auth = {"Authorization": f"Bearer {PROXY_KEY}"}
    for body in (CHAT, {**CHAT, "stream": True}, {**CHAT, "logprobs": 1, "tools": TOOLS}):
        await (await proxy.post("/v1/chat/completions", json=body, headers=auth)).read()
    wrong = await start(upstream_api_key="sk-wrong-key-1234567890", data_dir=tmp_path / "w")
    r = await wrong.post("/v1/chat/completions", json=CHAT)
    assert r.status == 401
    message = (await r.json())["error"]["message"]  # OpenAI's: the key's ends only
    await wait_for_rows(tmp_path / "data", 3)
    await wait_for_rows(tmp_path / "w", 1)
    await proxy.close()
    await wrong.close()  # compacted: the WAL's lines are in Parquet now, the logs too
    stored = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    for key in (UPSTREAM_KEY, PROXY_KEY, "sk-wrong-key-1234567890"):
        assert key.encode() not in stored
        assert key not in caplog.text and key not in message


# -- what a hosted upstream has not ----------------------------------------------------


async def test_no_adapters_and_no_sleep_against_a_hosted_upstream(start, sent, tmp_path):
    proxy = await start()
    r = await proxy.post("/admin/adapters/promote", json={"path": str(tmp_path)})
    assert r.status == 409 and (await r.json())["error"]["code"] == "hosted_upstream"
    r = await proxy.post("/admin/adapters/rollback", json={})
    assert r.status == 409
    r = await proxy.post("/admin/maintenance", json={"action": "begin", "holder": "night"})
    assert r.status == 409
    assert not sent  # no LoRA call, no /v1/models, no probe reached the hosted API


async def test_the_alias_without_a_hosted_model_is_a_clear_error(start, sent):
    proxy = await start(upstream_model=None)
    r = await proxy.post("/v1/chat/completions", json=CHAT)
    assert r.status == 404 and "--upstream-model" in (await r.json())["error"]["message"]
    assert not sent


async def test_ls_shows_the_model_that_answered_and_the_upstream(start, hosted, tmp_path):
    proxy = await start()
    await (await proxy.post("/v1/chat/completions", json=CHAT, headers=ROLLOUT)).read()
    await wait_for_rows(tmp_path / "data", 1)
    con = open_db(tmp_path / "data")
    try:
        shown = list_groups(con, None, 10)
    finally:
        con.close()
    assert f"served by {MODEL}{SNAPSHOT} via {label(hosted)}" in shown


# -- configuration -----------------------------------------------------------------------


def test_known_hosts_are_hosted_without_asking_and_others_wait_for_serve():
    assert ProxyConfig(upstream="https://api.openai.com/v1").upstream_kind == "openai"
    assert ProxyConfig(upstream="https://api.anthropic.com").upstream_kind == "anthropic"
    assert ProxyConfig(upstream="https://openrouter.ai/api/v1").upstream_kind == "openai"
    assert ProxyConfig(upstream="http://127.0.0.1:8001").upstream_kind == "auto"
    assert ProxyConfig(upstream="http://api.openai.com").upstream_kind == "auto"  # not https


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"upstream_auth": "client", "upstream_api_key": "k"}, "not both"),
        ({"upstreams": ("https://api.openai.com", "https://b.example")}, "one URL"),
        ({"shadow_samples": 2}, "shadow sampling"),
        ({"upstream_kind": "vllm", "upstream_auth": "client"}, "vLLM upstream"),
        ({"upstream_kind": "gemini"}, "upstream_kind must be one of"),
    ],
)
def test_what_a_hosted_upstream_cannot_do_is_refused_at_start(settings, says):
    settings = {"upstream": "https://api.openai.com", "upstream_kind": "openai", **settings}
    if "upstreams" in settings:
        settings.pop("upstream")
    with pytest.raises(ConfigError, match=says):
        ProxyConfig(**settings)


def test_a_records_upstream_names_no_path():
    # A user, password or query is refused in the URL (tests/test_hosted_attacks.py).
    config = ProxyConfig(upstream="https://gateway.example:8443/openai", upstream_kind="openai")
    assert HostedUpstream(config).label == "openai gateway.example:8443"


async def test_ui_and_admin_show_the_hosted_upstream_and_its_model(start, hosted, tmp_path):
    proxy = await start()
    await (await proxy.post("/v1/chat/completions", json=CHAT, headers=ROLLOUT)).read()
    await wait_for_rows(tmp_path / "data", 1)
    state = await (await proxy.get("/admin/adapters")).json()
    assert (state["upstream"], state["base_model"], state["current"]) == (
        label(hosted),
        MODEL,
        None,
    )
    page = await (await proxy.get("/ui/adapters")).text()
    assert f'<strong id="upstream">{label(hosted)}</strong>' in page
    assert MODEL + SNAPSHOT in page  # when each model served: the one that answered


# -- https: a hosted API's certificate is verified, its name sent (SNI) ------------------


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for `localhost` and its key, as files (cryptography comes with the
    test extra: moto requires it)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_file), str(key_file)


async def test_https_upstream_is_verified_and_named(
    aiohttp_client, aiohttp_server, tmp_path, monkeypatch
):
    cert, key = _self_signed(tmp_path)
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    names: list[str | None] = []
    server_side.sni_callback = lambda _sock, name, _ctx: names.append(name)
    hosted = await aiohttp_server(create_hosted_upstream(UPSTREAM_KEY), ssl=server_side)
    url = f"https://localhost:{hosted.port}"
    # Not trusted: the hop refuses it, as any client of a hosted API must.
    with pytest.raises(aiohttp.ClientOSError, match="certificate"):
        await UpstreamPool(url, 5.0, 4.0).post("/v1/chat/completions", b"{}", {})
    monkeypatch.setenv("SSL_CERT_FILE", cert)  # now trusted, as a CA's bundle would be
    config = ProxyConfig(
        upstream=url,
        upstream_kind="openai",
        upstream_api_key=UPSTREAM_KEY,
        data_dir=tmp_path / "data",
        commit_interval=0.0,
    )
    proxy = await aiohttp_client(create_app(config))
    r = await proxy.post("/v1/chat/completions", json={**CHAT, "model": MODEL})
    assert r.status == 200, await r.text()
    assert await r.read() == hosted.app[ANSWERS][-1]
    assert names[-1] == "localhost"  # SNI: the host's name went with the handshake


# -- `overnight serve`: auto settled at start ----------------------------------------------


async def test_auto_asks_models_once_and_falls_back_to_vllm(aiohttp_server, hosted):
    url = str(hosted.make_url("")).rstrip("/")
    kind, line = await asyncio.to_thread(detect_kind, url, UPSTREAM_KEY)
    assert kind == "openai" and "hosted" in line
    kind, line = await asyncio.to_thread(detect_kind, url)  # 401 without a key: cannot tell
    assert kind == "vllm" and "--upstream-kind" in line
    fake_vllm = await aiohttp_server(create_fake_upstream())
    kind, _ = await asyncio.to_thread(detect_kind, str(fake_vllm.make_url("")).rstrip("/"))
    assert kind == "vllm"


@pytest.mark.slow
def test_serve_detects_a_hosted_upstream_and_sends_it_nothing_extra(tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "overnight.testing.hosted_upstream", "--key", UPSTREAM_KEY]
    data = tmp_path / "data"
    with (
        spawn(
            [*command, "--port", str(port)], f"http://127.0.0.1:{port}", health="/v1/models"
        ) as upstream,
        spawn_serve(
            data,
            *("--upstream", upstream.url, "--upstream-model", MODEL),
            log_level="INFO",
            env={**os.environ, "OVERNIGHT_UPSTREAM_API_KEY": UPSTREAM_KEY},
        ) as serve,
    ):
        assert post_status(serve.url + "/v1/chat/completions", CHAT) == 200
        log = serve.log_tail(20_000)
    assert "is a hosted OpenAI-compatible API" in log and "logprobs mode" not in log
    assert UPSTREAM_KEY not in log
    (row,) = rows(data, "SELECT model_served, notes FROM completions")
    assert row["model_served"] == MODEL + SNAPSHOT
    assert json.loads(row["notes"])["upstream"] == f"openai 127.0.0.1:{port}"


async def test_a_span_names_the_hosted_provider_and_holds_no_key(
    start, monkeypatch, aiohttp_server
):
    from .test_tracing import SPANS, _receiver_app, flushed

    receiver = await aiohttp_server(_receiver_app())
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", str(receiver.make_url("")))
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    proxy = await start(api_keys=(PROXY_KEY,), trace_contents=True)
    r = await proxy.post(
        "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {PROXY_KEY}"}
    )
    assert r.status == 200, await r.text()
    await flushed(proxy)
    (span,) = receiver.app[SPANS]
    assert span.attributes["gen_ai.provider.name"] == "openai"
    assert span.attributes["gen_ai.response.model"] == MODEL + SNAPSHOT
    assert UPSTREAM_KEY not in repr(span) and PROXY_KEY not in repr(span)
