"""A colocated night's maintenance window, against the in-process fake vLLM, which refuses
generation while asleep as a real one cannot answer: nothing may reach it then.

What is checked: requests in flight finish before vLLM sleeps; requests during the window
are held and then served, or answered 503 with Retry-After after the hold and recorded as
such; promotions wait for the window's end; a lease that is not renewed wakes vLLM; a
vLLM found asleep with no window open is woken; with two replicas one sleeps and the
other serves without holding anything.
"""

from __future__ import annotations

import asyncio

import pytest

from overnight.proxy import vllm_sleep as maintenance_module
from overnight.testing.fake_upstream import RECEIVED, SETTINGS, create_fake_upstream

from .helpers import rows, wait_for_rows

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def begin(proxy, holder: str = "night-1", lease: float = 60.0) -> dict:
    r = await proxy.post("/admin/maintenance",
                         json={"action": "begin", "holder": holder, "lease_seconds": lease})  # fmt: skip
    assert r.status == 200, await r.text()
    return await r.json()


async def end(proxy, holder: str = "night-1") -> dict:
    r = await proxy.post("/admin/maintenance", json={"action": "end", "holder": holder})
    assert r.status == 200, await r.text()
    return await r.json()


def generations_while_asleep(fake) -> list:
    """Requests that reached the fake while it slept (it records them with no body)."""
    return [r for r in fake.app[RECEIVED] if r["body"] is None]


async def test_requests_in_flight_finish_then_requests_are_held_and_served_after(
    make_proxy, fake, fake_settings, tmp_path
):
    proxy = await make_proxy()
    fake_settings["delay"] = 0.3
    slow = asyncio.create_task(proxy.post("/v1/chat/completions", json=CHAT))
    await asyncio.sleep(0.05)  # on its way to vLLM when the night begins
    window = await begin(proxy)
    assert (await slow).status == 200, "the request in flight finished first"
    assert window["asleep"] == [str(fake.make_url("")).rstrip("/")] or window["asleep"]
    assert fake_settings["sleeps"] == ["sleep?level=1"]
    held = [asyncio.create_task(proxy.post("/v1/chat/completions", json=CHAT)) for _ in range(3)]
    embeddings = asyncio.create_task(proxy.post("/v1/embeddings", json={"input": "x"}))
    await asyncio.sleep(0.3)
    assert not any(t.done() for t in held) and not embeddings.done(), "held, not forwarded"
    state = await (await proxy.get("/admin/maintenance")).json()
    assert state["state"] == "maintenance" and state["window"]["held"] == 4
    done = await end(proxy)
    assert fake_settings["sleeps"] == ["sleep?level=1", "wake_up?tags=weights",
                                       "wake_up?tags=kv_cache"]  # fmt: skip
    assert [(await t).status for t in held] == [200, 200, 200]
    await embeddings  # the fake has no such route: whatever it answers, it was awake
    assert generations_while_asleep(fake) == []
    assert done["last"]["held"] == 4 and done["last"]["refused"] == 0
    assert done["last"]["seconds"] >= 0.3
    await wait_for_rows(tmp_path / "data", 4)
    statuses = [r["http_status"] for r in rows(tmp_path / "data", "SELECT * FROM completions")]
    assert statuses == [200] * 4


async def test_a_request_that_comes_while_the_window_drains_is_held_too(
    make_proxy, fake, fake_settings
):
    """The window opens, then drains what is in flight, then puts vLLM to sleep: a request
    that comes meanwhile must wait for the window's end, not reach a vLLM going to sleep
    (or be the in-flight request the drain waits for)."""
    proxy = await make_proxy()
    fake_settings["delay"] = 0.5
    slow = asyncio.create_task(proxy.post("/v1/chat/completions", json=CHAT))
    await asyncio.sleep(0.05)
    night = asyncio.create_task(begin(proxy))
    await asyncio.sleep(0.1)  # the window is open and draining `slow`
    state = await (await proxy.get("/admin/maintenance")).json()
    assert state["state"] == "maintenance" and not night.done()
    late = asyncio.create_task(proxy.post("/v1/chat/completions", json=CHAT))
    await night
    assert (await slow).status == 200
    await asyncio.sleep(0.2)
    assert not late.done(), "held while vLLM sleeps"
    done = await end(proxy)
    assert (await late).status == 200 and done["last"]["held"] == 1
    assert generations_while_asleep(fake) == []
    served = [r for r in fake.app[RECEIVED] if r["path"].endswith("/chat/completions")]
    assert len(served) == 2  # `slow`, then `late` after the wake


async def test_past_the_hold_a_request_gets_503_with_retry_after_and_a_record(
    make_proxy, fake, tmp_path
):
    proxy = await make_proxy(maintenance_hold=0.2)
    await begin(proxy, lease=60)
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Rollout-Id": "r1"})
    assert r.status == 503, await r.text()
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    error = (await r.json())["error"]
    assert (
        error["code"] == "maintenance"
        and "asleep while tonight's training runs" in error["message"]
    )
    assert generations_while_asleep(fake) == []
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["http_status"] == 503 and row["error"].startswith("maintenance:")
    assert row["rollout_id"] == "r1"
    assert (await end(proxy))["last"]["refused"] == 1


async def test_adapters_change_only_while_awake_and_one_night_holds_the_window(
    make_proxy, lora_dir
):
    proxy = await make_proxy()
    await begin(proxy)
    r = await proxy.post("/admin/adapters/promote", json={"path": str(lora_dir)})
    assert r.status == 409 and "asleep" in (await r.json())["error"]["message"]
    other = await proxy.post(
        "/admin/maintenance", json={"action": "begin", "holder": "night-2", "lease_seconds": 60}
    )
    assert other.status == 409 and "night-1" in (await other.json())["error"]["message"]
    again = await begin(proxy)  # the same holder: a renewal
    assert again["holder"] == "night-1"
    wrong = await proxy.post("/admin/maintenance", json={"action": "end", "holder": "night-2"})
    assert wrong.status == 409
    await end(proxy)
    r = await proxy.post("/admin/adapters/promote", json={"path": str(lora_dir)})
    assert r.status == 200, await r.text()


@pytest.fixture
def lora_dir(tmp_path):
    path = tmp_path / "adapter"
    path.mkdir()
    (path / "adapter_config.json").write_text("{}")
    return path


async def test_a_lease_not_renewed_wakes_vllm(make_proxy, fake_settings, monkeypatch):
    """The night died asleep (SIGKILL): its lease runs out and the proxy wakes vLLM."""
    monkeypatch.setattr(maintenance_module, "WATCH_SECONDS", 0.1)
    proxy = await make_proxy()
    await begin(proxy, lease=1.0)
    assert fake_settings["asleep"]
    held = asyncio.create_task(proxy.post("/v1/chat/completions", json=CHAT))
    r = await proxy.post(
        "/admin/maintenance", json={"action": "renew", "holder": "night-1", "lease_seconds": 1}
    )
    assert r.status == 200
    for _ in range(60):
        if not fake_settings["asleep"]:
            break
        await asyncio.sleep(0.1)
    assert not fake_settings["asleep"], "woken when the lease ran out"
    assert (await held).status == 200
    state = await (await proxy.get("/admin/maintenance")).json()
    assert state["state"] == "serving" and state["last"]["holder"] == "night-1"


async def test_a_vllm_left_asleep_is_woken_at_start(make_proxy, fake_settings):
    fake_settings["asleep"] = True  # asleep, and no night holds it: a proxy restarted
    proxy = await make_proxy()
    assert not fake_settings["asleep"]
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200


async def test_with_two_replicas_one_sleeps_and_the_other_serves(aiohttp_server, aiohttp_client,
                                                                 tmp_path):  # fmt: skip
    from overnight.config import ProxyConfig
    from overnight.proxy import create_app

    fakes = [await aiohttp_server(create_fake_upstream()) for _ in range(2)]
    config = ProxyConfig(upstreams=tuple(str(f.make_url("")) for f in fakes),
                         data_dir=tmp_path / "data", commit_interval=0.0, maintenance_hold=0.2)  # fmt: skip
    proxy = await aiohttp_client(create_app(config))
    window = await begin(proxy)
    asleep = [f for f in fakes if f.app[SETTINGS]["asleep"]]
    assert len(asleep) == 1 and len(window["asleep"]) == 1
    answers = [await proxy.post("/v1/chat/completions", json=CHAT,
                                headers={"X-Rollout-Id": f"r{i}"}) for i in range(6)]  # fmt: skip
    assert [a.status for a in answers] == [200] * 6, "nothing held: the other replica serves"
    assert generations_while_asleep(asleep[0]) == []
    done = await end(proxy)
    assert done["last"]["held"] == 0 and not asleep[0].app[SETTINGS]["asleep"]


async def test_a_proxy_of_several_workers_refuses_the_window(make_proxy, fake_settings):
    """Each worker process would hold requests on its own: the others would forward to
    a vLLM asleep. The night is told so, and vLLM never sleeps."""
    proxy = await make_proxy(workers=2)
    r = await proxy.post("/admin/maintenance",
                         json={"action": "begin", "holder": "n", "lease_seconds": 60})  # fmt: skip
    assert r.status == 409 and "--workers 1" in (await r.json())["error"]["message"]
    assert not fake_settings["asleep"] and fake_settings["sleeps"] == []
