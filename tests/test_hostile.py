"""The proxy against hostile clients and odd requests (issue 10): each test is a class of
input, and each failed on the proxy before it was hardened."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from overnight.storage import open_db
from overnight.view.display import show_rollout

from .helpers import await_until, wait_for_rows
from .test_proxy_errors import error_of, sockets_to

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
JSON = {"Content-Type": "application/json"}


async def raw_exchange(proxy, data: bytes, read: bool = True, timeout: float = 5.0) -> bytes:
    """Send raw bytes to the proxy and read until it closes (or `timeout`)."""
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    writer.write(data)
    await writer.drain()
    out = b""
    if read:
        try:
            async with asyncio.timeout(timeout):
                while chunk := await reader.read(65536):
                    out += chunk
        except TimeoutError:
            pass
    writer.close()
    return out


def http_request(method: str, path: str, body: bytes = b"", headers: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{headers}"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


# -- the pass-through forwards an allowlist ---------------------------------------------


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/v1/load_lora_adapter", 403, "forbidden_path"),
        ("/v1/unload_lora_adapter", 403, "forbidden_path"),
        ("/rollouts/g/r/v1/load_lora_adapter", 403, "forbidden_path"),
        ("/v1/pause", 403, "forbidden_path"),
        ("/v1/anything", 404, "not_found"),
        ("/v1/%2e%2e/load_lora_adapter", 400, "invalid_path"),
        ("/v1/%2E%2E/health", 400, "invalid_path"),
        ("/v1/models/%2e%2e/%2e%2e/reset_prefix_cache", 400, "invalid_path"),
        ("/v1/responses/%2e%2e", 400, "invalid_path"),
        ("/v1/./models", 400, "invalid_path"),
    ],
)
async def test_administrative_and_unlisted_paths_never_reach_the_upstream(
    make_proxy, received, path, status, code
):
    proxy = await make_proxy(api_keys=("sk-client",))
    body = json.dumps({"lora_name": "policy-v1", "lora_path": "/tmp/evil"}).encode()
    auth = "Authorization: Bearer sk-client\r\nContent-Type: application/json\r\n"
    # Raw bytes: an HTTP client would normalise the dot segments away before sending.
    answer = await raw_exchange(proxy, http_request("POST", path, body, auth))
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status}".encode()), answer[:300]
    assert error_of(json.loads(payload))["code"] == code
    assert received == []


async def test_inference_and_read_paths_still_pass_through(make_proxy, received):
    proxy = await make_proxy()
    r = await proxy.get("/v1/models")
    assert r.status == 200 and (await r.json())["data"]
    r = await proxy.post("/v1/embeddings", json={"model": "policy", "input": "x"})
    assert r.status == 404  # the fake serves no embeddings: its own 404, passed through
    r = await proxy.delete("/v1/models")
    assert r.status == 405 and error_of(await r.json())["code"] == "method_not_allowed"


async def test_the_pass_through_honours_the_body_limit(make_proxy, fake):
    proxy = await make_proxy(max_body_bytes=4096)
    r = await proxy.post("/v1/embeddings", json={"model": "m", "input": "x" * 50_000})
    assert r.status == 413 and error_of(await r.json())["code"] == "request_too_large"
    # Chunked, with no length to check up front: still cut off at the limit.

    async def chunks():
        for _ in range(20):
            yield b"x" * 1024

    r = await proxy.post("/v1/embeddings", data=chunks(), headers=JSON)
    assert r.status == 413 and "4096" in error_of(await r.json())["message"]


# -- a client that leaves ----------------------------------------------------------------


async def test_a_client_that_never_reads_its_stream_is_recorded_as_gone(
    make_proxy, fake_settings, tmp_path
):
    fake_settings["tokens"] = 200
    proxy = await make_proxy()
    body = json.dumps({**CHAT, "max_tokens": None, "stream": True}).encode()
    headers = (
        "X-Rollout-Id: never-read\r\nX-Fake: slow-chunks-0.02\r\nContent-Type: application/json\r\n"
    )
    await raw_exchange(
        proxy, http_request("POST", "/v1/chat/completions", body, headers), read=False
    )
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["rollout_id"] == "never-read"
    assert (row["error"] or "").startswith("client disconnected"), row["error"]
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200


# -- every error is OpenAI-shaped JSON ----------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"model": {"name": "policy"}},
        {"model": ["policy"]},
        {"model": 5},
        {"model": True},
    ],
)
async def test_odd_types_in_fields_the_proxy_reads_are_400(make_proxy, received, fields):
    """`model` routes the request; `stream` and `stream_options` are read as vLLM reads
    them, and vLLM judges the rest (tests/test_transparent.py)."""
    proxy = await make_proxy()
    r = await proxy.post("/v1/chat/completions", json={**CHAT, **fields})
    assert r.status == 400 and error_of(await r.json())["code"] == "invalid_type"
    assert received == []


@pytest.mark.parametrize(
    "extra",
    [
        {"metadata": "x"},
        {"metadata": {"rollout_id": 5}},
        {"metadata": {"rollout_id": ["a"]}},
        {"metadata": {"rollout_group": {"a": 1}}},
        {"n": "two"},
        {"messages": "hi"},
        {"messages": [1, 2]},
        {"logprobs": "yes"},
        {"return_token_ids": {}},
    ],
)
async def test_odd_types_elsewhere_never_make_the_proxy_fail(make_proxy, received, extra):
    proxy = await make_proxy()
    r = await proxy.post("/v1/chat/completions", json={**CHAT, **extra})
    if r.status >= 500:  # only the upstream's own failure (the fake's int("two")) passes
        assert received, await r.text()
    elif r.status >= 400:
        error_of(await r.json())


async def test_a_deeply_nested_body_is_a_clear_400(make_proxy):
    proxy = await make_proxy()
    deep = "[" * 1000 + "]" * 1000
    body = '{"model": "policy", "messages": [], "extra": ' + deep + "}"
    r = await proxy.post("/v1/chat/completions", data=body, headers=JSON)
    assert r.status == 400 and error_of(await r.json())["code"] == "invalid_json"


async def test_header_values_outside_latin_1_are_forwarded_as_sent(make_proxy, received):
    proxy = await make_proxy()
    body = json.dumps(CHAT).encode()
    headers = "X-Note: caf\u00e9 \u2603 \U0001f600\r\nContent-Type: application/json\r\n".encode()
    for path in ("/v1/chat/completions", "/v1/models"):
        method = "POST" if "chat" in path else "GET"
        data = http_request(method, path, body if method == "POST" else b"").replace(
            b"Connection: close\r\n", b"Connection: close\r\n" + headers
        )
        answer = await raw_exchange(proxy, data)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert received[-1]["headers"]["X-Note"] == "caf\u00e9 \u2603 \U0001f600"
    # Bytes that are not UTF-8 (Latin-1 as some clients send it): passed on as they came.
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
        data = http_request(method, path, body if method == "POST" else b"").replace(
            b"Connection: close\r\n",
            b"Connection: close\r\nX-Raw: caf\xe9\r\nContent-Type: application/json\r\n",
        )
        answer = await raw_exchange(proxy, data)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


async def test_an_unexpected_failure_is_a_500_json_error_with_a_record(
    make_proxy, monkeypatch, tmp_path, caplog
):
    from overnight.proxy.capture import shapes

    def broken(body, endpoint):
        raise RuntimeError("a bug")

    monkeypatch.setattr(shapes, "add_training_fields", broken)
    proxy = await make_proxy()
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Rollout-Id": "bug"})
    assert r.status == 500
    error = error_of(await r.json())
    assert error["code"] == "internal_error" and "request id" in error["message"]
    request_id = error["message"].rsplit(" ", 1)[-1].rstrip(")")
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["request_id"] == request_id and row["http_status"] == 500
    assert "a bug" in row["error"]
    assert "a bug" in caplog.text and request_id in caplog.text


async def test_a_failure_anywhere_else_is_a_500_json_error(make_proxy, monkeypatch, caplog):
    proxy = await make_proxy()
    from overnight.proxy.state import STATS

    proxy.server.app[STATS] = None  # /admin/stats now fails on an attribute of None
    r = await proxy.get("/admin/stats")
    assert r.status == 500 and error_of(await r.json())["code"] == "internal_error"
    assert "Traceback" in caplog.text or "AttributeError" in caplog.text


# -- odd but loggable shapes in the views ------------------------------------------------


ODD = [
    ("text", {"messages": "hi"}),
    ("numbers", {"messages": [1, 2]}),
    ("text5", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
    (
        "call",
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": "x"}]}]},
    ),
    ("calls", {"messages": [{"role": 7, "content": {"a": 1}, "tool_calls": "x"}]}),
]


async def test_odd_shapes_render_in_ui_and_show(make_proxy, tmp_path):
    proxy = await make_proxy()
    for rollout, fields in ODD:
        r = await proxy.post(
            "/v1/chat/completions", json={**CHAT, **fields}, headers={"X-Rollout-Id": rollout}
        )
        assert r.status == 200
    await wait_for_rows(tmp_path / "data", len(ODD))
    for rollout, _ in ODD:
        r = await proxy.get(f"/ui/rollouts/{rollout}")
        assert r.status == 200, await r.text()
        con = open_db(tmp_path / "data")
        try:
            assert f"rollout {rollout}" in show_rollout(con, rollout)
        finally:
            con.close()
    assert "hi" in await (await proxy.get("/ui/rollouts/text")).text()


# -- cross-site and rebinding ------------------------------------------------------------


async def test_cross_site_and_rebinding_requests_are_refused(make_proxy, received):
    proxy = await make_proxy()
    evil = {"Origin": "http://evil.example"}
    rebound = {"Host": "evil.example:8000"}
    cases = [
        ("POST", "/admin/adapters/rollback", evil, None, 403, "cross_origin_forbidden"),
        ("POST", "/admin/adapters/promote", evil, {"path": "/x"}, 403, "cross_origin_forbidden"),
        ("POST", "/v1/rollouts/r1/reward", evil, {"reward": 1}, 403, "cross_origin_forbidden"),
        ("POST", "/v1/rollouts/r1/finish", {"Origin": "null"}, None, 403, "cross_origin_forbidden"),
        ("POST", "/v1/chat/completions", evil, CHAT, 403, "cross_origin_forbidden"),
        ("GET", "/admin/stats", rebound, None, 403, "host_not_allowed"),
        ("GET", "/ui", rebound, None, 403, "host_not_allowed"),
        ("POST", "/v1/rollouts/r1/reward", rebound, {"reward": 1}, 403, "host_not_allowed"),
        # A rebound page's Origin is its own Host: both are refused.
        (
            "POST",
            "/admin/adapters/rollback",
            {**rebound, "Origin": "http://evil.example:8000"},
            None,
            403,
            "host_not_allowed",
        ),
    ]
    for method, path, headers, body, status, code in cases:
        r = await proxy.request(method, path, json=body, headers=headers)
        assert r.status == status, (path, headers, await r.text())
        assert error_of(await r.json())["code"] == code, (path, headers)
    assert received == []
    # text/plain parses as JSON but is what a cross-site form sends without asking.
    r = await proxy.post(
        "/admin/adapters/promote", data='{"path": "/x"}', headers={"Content-Type": "text/plain"}
    )
    assert r.status == 415 and error_of(await r.json())["code"] == "unsupported_media_type"
    r = await proxy.post("/v1/rollouts/r1/reward", data='{"reward": 1}')
    assert r.status == 415


async def test_agents_and_the_proxys_own_pages_keep_working(make_proxy):
    proxy = await make_proxy(allowed_hosts=("proxy.lan",))
    own = f"http://127.0.0.1:{proxy.port}"
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200  # no Origin
    r = await proxy.post("/v1/rollouts/r1/reward", json={"reward": 1.0}, headers={"Origin": own})
    assert r.status == 200
    for host in (
        "proxy.lan",
        "PROXY.lan:8000",
        "localhost:8000",
        "10.1.2.3:8000",
        "[::1]:8000",
        socket.gethostname(),
    ):
        r = await proxy.get("/admin/stats", headers={"Host": host})
        assert r.status == 200, host
    r = await proxy.post(
        "/admin/adapters/rollback", headers={"Host": "proxy.lan", "Origin": "http://proxy.lan"}
    )
    assert r.status == 400  # nothing to roll back: past the guard


async def test_with_a_token_and_keys_any_host_name_may_carry_them(make_proxy):
    # A rebound page cannot send credentials, so a remote name needs no --allowed-host.
    proxy = await make_proxy(admin_token="s3cret", api_keys=("sk-1",))
    host = {"Host": "gpu-box.example:8000"}
    r = await proxy.get("/admin/stats", headers={**host, "Authorization": "Bearer s3cret"})
    assert r.status == 200
    r = await proxy.post(
        "/v1/rollouts/r1/reward",
        json={"reward": 1.0},
        headers={**host, "Authorization": "Bearer sk-1"},
    )
    assert r.status == 200
    r = await proxy.post("/v1/rollouts/r1/reward", json={"reward": 1.0}, headers=host)
    assert r.status == 401  # still the key


async def test_the_view_cookie_is_a_random_session_not_the_token(make_proxy):
    proxy = await make_proxy(admin_token="s3cret")
    r = await proxy.get("/ui?token=s3cret")
    assert r.status == 200
    cookie = r.cookies["overnight_ui"]
    assert cookie.value != "s3cret" and len(cookie.value) >= 32 and cookie["httponly"]
    assert not cookie["secure"]  # plain HTTP here; TLS sets it (request.secure)
    assert (await proxy.get("/ui/runs")).status == 200  # the session comes back
    proxy.session.cookie_jar.clear()
    r = await proxy.get("/ui/runs", cookies={"overnight_ui": "s3cret"})  # the token is no cookie
    assert r.status == 401


# -- ids, timeouts, what a 504 is recorded as -------------------------------------------


@pytest.mark.parametrize("rollout", [".", ".."])
async def test_dot_ids_are_refused(make_proxy, rollout):
    proxy = await make_proxy()
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Rollout-Id": rollout})
    assert r.status == 400 and error_of(await r.json())["code"] == "invalid_rollout_id"
    body = {**CHAT, "metadata": {"rollout_group": rollout}}
    r = await proxy.post("/v1/chat/completions", json=body)
    assert r.status == 400


@pytest.mark.parametrize("header", ["X-Rollout-Id", "X-Rollout-Group"])
async def test_ids_in_the_per_turn_namespace_are_refused(make_proxy, received, header):
    # "turn:<record>:served" is the member id the judge rewards for a per-turn group; a
    # client rollout of that name would take the reward meant for it.
    proxy = await make_proxy()
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={header: "turn:abc:served"})
    assert r.status == 400 and error_of(await r.json())["code"] == "invalid_rollout_id"
    assert "turn:" in error_of(await r.json())["message"] and received == []
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={header: "a turn:abc"})
    assert r.status == 200  # only the prefix is reserved


async def test_idle_upstream_connections_do_not_outlive_the_keepalive(make_proxy, fake):
    proxy = await make_proxy(keepalive_timeout=0.3)
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200
    assert sockets_to(fake.port) >= 1
    await await_until(lambda: sockets_to(fake.port) == 0, timeout=3, what="idle socket closed")


async def test_a_client_that_never_finishes_its_headers_is_cut_off(make_proxy):
    """Slowloris: 50 connections that send a partial request head and then nothing."""
    proxy = await make_proxy(header_timeout=0.5)
    conns = [await asyncio.open_connection(proxy.host, proxy.port) for _ in range(50)]
    started = time.monotonic()
    for _, writer in conns:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        await writer.drain()
    # The proxy keeps serving meanwhile.
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200

    async def closed(reader) -> float:
        async with asyncio.timeout(10):
            while await reader.read(1024):
                pass
        return time.monotonic() - started

    waited = await asyncio.gather(*(closed(reader) for reader, _ in conns))
    for _, writer in conns:
        writer.close()
    assert max(waited) < 3.0, f"closed after {min(waited):.2f}-{max(waited):.2f} s"
    assert min(waited) >= 0.4


async def test_a_504_is_recorded_as_what_the_client_was_told(make_proxy, tmp_path):
    proxy = await make_proxy(read_timeout=0.3)
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Fake": "stall"})
    told = error_of(await r.json())["message"]
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["http_status"] == 504 and row["error"] == told


async def test_the_documented_errors_are_what_the_proxy_sends(make_proxy):
    from pathlib import Path

    wire = (Path(__file__).parent.parent / "docs" / "wire.md").read_text()
    example = json.loads(next(line for line in wire.splitlines() if line.startswith('{"error"')))
    proxy = await make_proxy(max_body_bytes=4096)
    r = await proxy.post("/v1/chat/completions", json={**CHAT, "x": "y" * 5000})
    sent = error_of(await r.json())
    assert (sent["type"], sent["code"]) == (example["error"]["type"], example["error"]["code"])
    for path in ("/ui?limit=x", "/ui?min_reward=x", "/ui?status=x", "/ui/groups/none"):
        r = await proxy.get(path)
        code = error_of(await r.json())["code"]
        assert f"| {r.status} | `{code}` |" in wire, (path, r.status, code)


# -- when recording fails (the writer of storage/write/writer.py) ------------------------------


async def test_a_failing_store_answers_503_degrades_health_and_recovers(
    make_proxy, monkeypatch, tmp_path
):
    import errno

    from overnight.storage.write import wal as wal_module

    proxy = await make_proxy()
    r = await proxy.post("/v1/rollouts/r1/reward", json={"reward": 1.0})
    assert r.status == 200 and (await r.json())["recorded"] is True
    assert (await (await proxy.get("/health")).json())["status"] == "ok"

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(wal_module.LockedFile, "append", full)
        started = time.monotonic()
        r = await proxy.post("/v1/rollouts/r1/reward", json={"reward": 0.5})
        assert r.status == 503 and error_of(await r.json())["code"] == "store_unavailable"
        r = await proxy.post("/v1/rollouts/r1/finish")
        assert r.status == 503 and "not stored" in error_of(await r.json())["message"]
        assert time.monotonic() - started < 2  # promptly, not at a timeout
        # Serving goes on: an agent must not fail because logging does.
        assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200
        health = await (await proxy.get("/health")).json()
        assert health["status"] == "degraded" and "No space" in health["reason"], health
        stats = await (await proxy.get("/admin/stats")).json()
        assert stats["rows_lost"] >= 2 and "lines_quarantined" in stats, stats
    # The disk has room again: recording comes back by itself.
    r = await proxy.post("/v1/rollouts/r1/reward", json={"reward": 0.25})
    assert r.status == 200 and (await r.json())["recorded"] is True
    assert (await (await proxy.get("/health")).json())["status"] == "ok"
