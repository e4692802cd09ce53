"""Bad input and broken upstreams: each gets a clear answer, and nothing is lost."""

from __future__ import annotations

import json

import aiohttp
import psutil
import pytest

from overnight.proxy.launch.launcher import free_port

from .helpers import await_until, sse_events, wait_for_rows

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def error_of(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) >= {"message", "type", "code"}, body
    return body["error"]


async def test_malformed_json_is_400(make_proxy, received):
    proxy = await make_proxy()
    r = await proxy.post(
        "/v1/chat/completions", data=b'{"model": ', headers={"Content-Type": "application/json"}
    )
    assert r.status == 400 and error_of(await r.json())["code"] == "invalid_json"
    r = await proxy.post("/v1/chat/completions", json=[1, 2])
    assert r.status == 400 and "JSON object" in error_of(await r.json())["message"]
    assert received == []


async def test_oversized_body_is_413(make_proxy, received):
    proxy = await make_proxy(max_body_bytes=4096)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 10_000}]}
    r = await proxy.post("/v1/chat/completions", json=big)
    assert r.status == 413
    assert "4096" in error_of(await r.json())["message"]
    assert received == []


async def test_api_keys_are_required_when_configured(make_proxy, received):
    proxy = await make_proxy(api_keys=("sk-good",), upstream_api_key="up-secret")
    r = await proxy.post("/v1/chat/completions", json=CHAT)
    assert r.status == 401 and error_of(await r.json())["code"] == "invalid_api_key"
    r = await proxy.post(
        "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-bad"}
    )
    assert r.status == 401
    assert (await proxy.get("/health")).status == 200  # health needs no key
    r = await proxy.post(
        "/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": "Bearer sk-good", "Accept-Encoding": "gzip", "X-Trace": "t1"},
    )
    assert r.status == 200
    # The client's key stays here; upstream gets its own.
    sent = received[-1]["headers"]
    assert sent["Authorization"] == "Bearer up-secret" and sent["X-Trace"] == "t1"
    # The proxy reads the answer, so it asks for it uncompressed.
    assert "Accept-Encoding" not in sent


async def test_upstream_down_is_502_and_recorded(make_proxy, tmp_path):
    proxy = await make_proxy(upstream=f"http://127.0.0.1:{free_port()}", connect_timeout=2)
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Rollout-Id": "down"})
    assert r.status == 502 and error_of(await r.json())["type"] == "upstream_error"
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert (
        row["http_status"] == 502 and "unreachable" in row["error"] and row["rollout_id"] == "down"
    )
    assert json.loads(row["request"]) == CHAT


@pytest.mark.parametrize("status", [500, 429])
async def test_upstream_error_status_passes_through_and_is_recorded(make_proxy, tmp_path, status):
    proxy = await make_proxy()
    r = await proxy.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True},
        headers={"X-Fake": f"status-{status}"},
    )
    assert r.status == status
    assert (await r.json())["error"]["message"] == f"fake {status}"
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["http_status"] == status and row["error"] == f"upstream HTTP {status}"
    assert f"fake {status}" in json.loads(row["response"])["error_body"]


async def test_upstream_garbage_passes_through_and_is_recorded(make_proxy, tmp_path):
    proxy = await make_proxy()
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Fake": "garbage"})
    assert r.status == 200 and "not json" in await r.text()
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert "not JSON" in row["error"]


async def test_slow_upstream_is_504(make_proxy, tmp_path):
    proxy = await make_proxy(read_timeout=0.3)
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Fake": "stall"})
    assert r.status == 504 and error_of(await r.json())["code"] == "upstream_timeout"
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["http_status"] == 504


async def test_upstream_reset_mid_stream_gives_an_error_event_and_a_partial_record(
    make_proxy, tmp_path
):
    proxy = await make_proxy()
    r = await proxy.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True, "max_tokens": 6},
        headers={"X-Fake": "reset-after-3"},
    )
    assert r.status == 200
    events = sse_events(await r.text())
    assert error_of(events[-1])["code"] == "upstream_disconnected"
    assert "[DONE]" not in events
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["partial"] is True and "stream broke" in row["error"]
    assert row["completion_token_ids"] == [100, 101]  # what arrived before the reset
    assert row["finish_reason"] is None


async def test_upstream_silent_mid_stream_is_cut_off_and_recorded(make_proxy, tmp_path):
    proxy = await make_proxy(read_timeout=0.3)
    r = await proxy.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True, "max_tokens": 6},
        headers={"X-Fake": "stall-after-3"},
    )
    events = sse_events(await r.text())
    assert (
        error_of(events[-1])["message"] == "upstream stream broke: upstream sent nothing for 0.3 s"
    )
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["partial"] is True and "sent nothing for 0.3 s" in row["error"]
    assert row["completion_token_ids"] == [100, 101]


async def test_a_slow_but_steady_stream_is_not_cut_off(make_proxy, tmp_path):
    # Each chunk resets the silence clock: 8 chunks 0.1 s apart outlast read_timeout.
    proxy = await make_proxy(read_timeout=0.3)
    r = await proxy.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True, "max_tokens": 6},
        headers={"X-Fake": "slow-chunks-0.1"},
    )
    assert sse_events(await r.text())[-1] == "[DONE]"
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["error"] is None and row["latency_ms"] > 600


async def test_stream_without_done_is_recorded_as_broken(make_proxy, tmp_path):
    proxy = await make_proxy()
    r = await proxy.post(
        "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Fake": "no-done"}
    )
    events = sse_events(await r.text())
    assert error_of(events[-1])["code"] == "upstream_disconnected"
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert "without [DONE]" in row["error"] and row["completion_token_ids"] == [100, 101, 102]


async def test_client_disconnect_mid_stream_is_recorded_and_upstream_released(
    make_proxy, fake, fake_settings, tmp_path
):
    # 500 chunks 10 ms apart: still streaming when we leave, whatever the socket buffers hold.
    fake_settings["tokens"] = 500
    proxy = await make_proxy()
    url = proxy.make_url("/v1/chat/completions")
    body = {**CHAT, "max_tokens": None, "stream": True}
    headers = {"X-Rollout-Id": "gone", "X-Fake": "slow-chunks-0.01"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=headers) as r,
    ):
        seen = b""
        while b"w02" not in seen:  # a few tokens, then hang up
            seen += await r.content.readany()
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["error"] == "client disconnected mid-stream" and row["partial"] is True
    assert 3 <= len(row["completion_token_ids"]) < 100
    # The proxy keeps serving.
    r = await proxy.post("/v1/chat/completions", json=CHAT)
    assert r.status == 200


def sockets_to(port: int) -> int:
    """This process's open TCP sockets whose far end is `port` (the fake upstream's)."""
    return sum(
        1 for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port
    )


async def test_many_failures_leak_no_connection(make_proxy, fake):
    """Every connection the proxy opened to the upstream went back to its pool or was
    closed: the process holds no socket to the upstream beyond the pool's idle ones."""
    from overnight.proxy.state import UPSTREAM

    proxy = await make_proxy()
    pool = proxy.server.app[UPSTREAM]
    behaviours = ["status-500", "garbage", "reset-after-1", "no-done", ""] * 10
    for b in behaviours:
        r = await proxy.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": "reset" in b or "done" in b},
            headers={"X-Fake": b},
        )
        await r.read()

    def open_idle() -> int:
        return sum(1 for c in pool.idle if not c.closed)

    # Closing a socket completes on the loop's next turn: poll, not sleep.
    await await_until(
        lambda: sockets_to(fake.port) == open_idle(), what="only the pool's idle sockets open"
    )
    # One at a time, the successful answers reuse one kept-alive connection.
    assert open_idle() <= 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"reward": "high"}, "finite number"),
        ({"reward": float("nan")}, "not valid JSON"),  # NaN is not JSON
        ({"reward": True}, "finite number"),
        ({"reward": 1, "extra": 2}, "unknown field"),
        ({"reward": 1, "metrics": [1]}, "metrics"),
    ],
)
async def test_bad_rewards_are_refused(make_proxy, body, message):
    proxy = await make_proxy()
    r = await proxy.post(
        "/v1/rollouts/r1/reward",
        data=json.dumps(body),
        headers={"Content-Type": "application/json"},
    )
    assert r.status == 400 and message in error_of(await r.json())["message"]


async def test_rewards_and_finishes_are_stored_before_the_answer(make_proxy, tmp_path):
    from .helpers import rows

    proxy = await make_proxy()
    r = await proxy.post("/v1/rollouts/r1/reward", json={"reward": 0.75, "metrics": {"steps": 3}})
    assert r.status == 200 and (await r.json())["recorded"] is True
    # Durable when answered: no waiting needed.
    (reward,) = rows(tmp_path / "data", "SELECT * FROM rewards")
    assert (reward["rollout_id"], reward["reward"], reward["source"]) == ("r1", 0.75, "agent")
    assert json.loads(reward["metrics"]) == {"steps": 3}
    assert (await proxy.post("/v1/rollouts/r1/finish")).status == 200
    assert rows(tmp_path / "data", "SELECT rollout_id FROM finishes") == [{"rollout_id": "r1"}]
    r = await proxy.post("/v1/rollouts/bad%01id/finish")
    assert r.status == 400
