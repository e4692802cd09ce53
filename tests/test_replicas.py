"""Beyond one machine: several vLLM replicas behind a proxy, several proxies on one data
directory. Fake upstreams in-process (and, to be killed, as processes)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections import Counter

import pytest
from aiohttp import web

from overnight.config import ProxyConfig
from overnight.proxy import create_app
from overnight.proxy.forward.balancer import Balancer
from overnight.proxy.state import ADAPTERS, UPSTREAM
from overnight.testing.fake_upstream import RECEIVED, SETTINGS, create_fake_upstream
from overnight.testing.processes import spawn_fake_upstream, spawn_serve

from .helpers import adapter_dir, await_until, rows, wait_for_rows, wait_until

CHAT = {"model": "policy", "max_tokens": 2}


def chat(text: str, **extra) -> dict:
    return {**CHAT, "messages": [{"role": "user", "content": text}], **extra}


async def start_fakes(aiohttp_server, n: int, refuse_loads: int | None = None) -> list:
    fakes = []
    for i in range(n):
        app = create_fake_upstream()
        if i == refuse_loads:
            app.middlewares.append(_refuse_loads)
        fakes.append(await aiohttp_server(app))
    return fakes


@web.middleware
async def _refuse_loads(request: web.Request, handler):
    if request.path == "/v1/load_lora_adapter":
        return web.json_response({"error": {"message": "out of memory", "code": 500}}, status=500)
    return await handler(request)


@pytest.fixture
def make_proxy(aiohttp_client, tmp_path):
    """A proxy in front of the given replicas: `client = await make_proxy(urls, **config)`."""

    async def start(upstreams, **overrides):
        config = ProxyConfig(
            upstreams=tuple(str(u) for u in upstreams),
            data_dir=overrides.pop("data_dir", tmp_path / "data"),
            commit_interval=0.0,
            **overrides,
        )
        return await aiohttp_client(create_app(config))

    return start


def urls(fakes) -> list[str]:
    return [str(f.make_url("")) for f in fakes]


def contents(fake) -> list[str]:
    return [
        r["body"]["messages"][-1]["content"]
        for r in fake.app[RECEIVED]
        if r["path"].endswith("completions")
    ]


async def test_every_turn_of_a_rollout_reaches_one_replica(aiohttp_server, make_proxy):
    fakes = await start_fakes(aiohttp_server, 3)
    proxy = await make_proxy(urls(fakes))
    for _turn in range(3):
        await asyncio.gather(
            *(
                proxy.post(
                    "/v1/chat/completions",
                    json=chat(f"r{i}"),
                    headers={"X-Rollout-Group": "g", "X-Rollout-Id": f"r{i}"},
                )
                for i in range(30)
            )
        )
    where = {i: {k for k, f in enumerate(fakes) if f"r{i}" in contents(f)} for i in range(30)}
    assert all(len(replicas) == 1 for replicas in where.values()), where
    assert all(Counter(contents(f)).most_common(1)[0][1] == 3 for f in fakes)  # 3 turns each
    assert len({next(iter(r)) for r in where.values()}) == 3  # the rollouts spread
    # Without ids: least outstanding, so one at a time they still reach every replica.
    for i in range(6):
        await proxy.post("/v1/chat/completions", json=chat(f"anon{i}"))
    assert all(any(c.startswith("anon") for c in contents(f)) for f in fakes)


def test_the_same_rollout_picks_the_same_replica_in_every_process():
    """Rendezvous hashing is not Python's salted hash: proxies agree on the replica."""
    urls = [f"http://10.0.0.{i}:8000" for i in range(4)]
    a, b = Balancer(urls, 1, 1), Balancer(list(reversed(urls)), 1, 1)
    assert all(a.pick(f"r{i}").url == b.pick(f"r{i}").url for i in range(100))
    chosen = {f"r{i}": a.pick(f"r{i}").url for i in range(100)}
    a.replicas[0].healthy = False
    a.refresh()
    moved = [k for k, url in chosen.items() if a.pick(k).url != url]
    assert moved and all(chosen[k] == urls[0] for k in moved)  # only the lost replica's move


async def test_a_health_answer_older_than_a_failure_does_not_put_the_replica_back():
    """A check under way when a request fails on the replica answered before the failure:
    the replica stays out until a check that began after it (seen under load: the killed
    replica's last answer arrived with the other's, later than its failure)."""
    from overnight.proxy.replicas.health import check_replicas

    balancer = Balancer(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], 1, 1)
    slow, other = balancer.replicas
    answered = asyncio.Event()

    class Lora:  # what each replica lists; the first answers, then waits for the second
        async def served_models(self, replica):
            if replica is other:
                await answered.wait()
            return [{"id": "base"}]

    check = asyncio.create_task(check_replicas(Lora(), balancer.replicas))
    await asyncio.sleep(0)  # both asked; `slow` has answered
    balancer.mark_down(slow, ConnectionResetError("killed"))
    answered.set()
    await check
    assert not slow.healthy and other.healthy
    await check_replicas(Lora(), balancer.replicas)  # a check begun after the failure
    assert slow.healthy


async def test_a_replica_killed_under_load(make_proxy, tmp_path):
    """Requests not yet answered move to the other replica; streams cut mid-way are
    recorded as partial."""
    slow, other = (spawn_fake_upstream("--delay", "0.3") for _ in range(2))
    try:
        proxy = await make_proxy([slow.url, other.url], upstream_check_interval=0.2)

        async def one(i: int):
            stream = i % 3 == 0
            headers = {"X-Rollout-Id": f"k{i}"}
            if stream:
                headers["X-Fake"] = "slow-chunks-0.3"
            r = await proxy.post(
                "/v1/chat/completions", json=chat(f"k{i}", stream=stream), headers=headers
            )
            return stream, r.status, await r.text()

        tasks = [asyncio.create_task(one(i)) for i in range(30)]
        await asyncio.sleep(0.45)  # streams have begun on both; whole answers still wait
        slow.process.send_signal(signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    finally:
        slow.stop()
        other.stop()
    assert all(status == 200 for _, status, _ in results)  # nothing failed before its answer
    broken = [text for stream, _, text in results if stream and "upstream_disconnected" in text]
    data = tmp_path / "data"
    found = await wait_for_rows(data, 30)
    assert len(found) == 30
    partial = [r for r in found if r["error"]]
    assert len(partial) == len(broken) and all(r["stream"] for r in partial)
    assert all("upstream stream broke" in r["error"] for r in partial)
    states = {r["url"]: r for r in proxy.app[ADAPTERS].describe()["replicas"]}
    assert not states[slow.url]["healthy"] and states[other.url]["healthy"]


async def test_promotion_everywhere_or_nowhere(aiohttp_server, make_proxy, tmp_path):
    fakes = await start_fakes(aiohttp_server, 3, refuse_loads=1)
    proxy = await make_proxy(urls(fakes))
    r = await proxy.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})
    assert r.status == 502 and "alias is unchanged" in (await r.json())["error"]["message"]
    state = await (await proxy.get("/admin/adapters")).json()
    assert state["current"] is None and state["stack"] == []
    assert all(f.app[SETTINGS]["loras"] == {} for f in fakes)  # nothing left loaded
    calls = [[r["path"].rsplit("/", 1)[1] for r in f.app[RECEIVED]] for f in fakes]
    # Loaded on two, refused by one (its middleware answered first), unloaded from both.
    assert calls == [["load_lora_adapter", "unload_lora_adapter"], [], calls[0]]
    await proxy.post("/v1/chat/completions", json=chat("hi"))
    (sent,) = [r for f in fakes for r in f.app[RECEIVED] if r["path"].endswith("completions")]
    assert sent["body"]["model"] == "fake-base"


async def test_a_replica_that_comes_back_gets_the_adapter_first(
    aiohttp_server, make_proxy, tmp_path
):
    fakes = await start_fakes(aiohttp_server, 2)
    proxy = await make_proxy(urls(fakes))
    registry = proxy.app[ADAPTERS]
    r = await proxy.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})
    name = (await r.json())["promoted"]
    assert all(list(f.app[SETTINGS]["loras"]) == [name] for f in fakes)
    # Replica 1 restarts: no adapters. Until the check it is still thought live; after
    # it, it is loaded again under the same name, and the alias stays where it was.
    fakes[1].app[SETTINGS]["loras"].clear()
    assert not await registry.check_upstream()
    assert list(fakes[1].app[SETTINGS]["loras"]) == [name] and registry.current.name == name
    # Down at the next check: out; back: loaded before it is live again.
    balancer = proxy.app[UPSTREAM]
    port = fakes[1].port
    await fakes[1].close()
    await registry.check_upstream()
    assert balancer.live == [balancer.replicas[0]]
    back = await aiohttp_server(create_fake_upstream(), port=port)
    await registry.check_upstream()
    assert list(back.app[SETTINGS]["loras"]) == [name] and len(balancer.live) == 2


async def test_two_proxies_on_one_data_directory(aiohttp_client, aiohttp_server, tmp_path):
    """One promotion reaches both; the records of both are in one table."""
    fakes = await start_fakes(aiohttp_server, 2)
    data = tmp_path / "data"
    proxies = []
    for fake in fakes:  # each proxy in front of its own replica: the follower loads it too
        config = ProxyConfig(
            upstream=str(fake.make_url("")),
            data_dir=data,
            commit_interval=0.0,
            state_poll_interval=0.05,
        )
        proxies.append(await aiohttp_client(create_app(config)))
    a, b = proxies
    r = await a.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})
    name = (await r.json())["promoted"]

    async def follows() -> bool:
        return (await (await b.get("/admin/adapters")).json())["stack"] == [name]

    await await_until(follows, what="the second proxy follows")
    assert all(list(f.app[SETTINGS]["loras"]) == [name] for f in fakes)
    for proxy in proxies:
        assert (await proxy.post("/v1/chat/completions", json=chat("x"))).status == 200
    found = await wait_for_rows(data, 2)
    assert [r["model_served"] for r in found] == [name, name]
    assert len({r["proxy_id"] for r in found}) == 2
    # A rollback through the second reaches the first.
    await b.post("/admin/adapters/rollback")

    async def base() -> bool:
        return (await (await a.get("/admin/adapters")).json())["current"] is None

    await await_until(base, what="the first proxy follows the rollback")
    version = json.loads((data / "adapters.json").read_text())["version"]
    assert version == 2


def holding(arrived: asyncio.Event, release: asyncio.Event):
    """A fake's middleware that holds a request marked `X-Hold` until `release`."""

    @web.middleware
    async def hold(request: web.Request, handler):
        if request.headers.get("X-Hold"):
            arrived.set()
            await release.wait()
        return await handler(request)

    return hold


async def test_an_adapter_is_not_unloaded_under_another_proxys_request(
    aiohttp_client, aiohttp_server, tmp_path
):
    """Issue 14: proxy B routed a request to v1 before it saw the promotion of v2 that
    proxy A made; A, with nothing of its own in flight, must not unload v1 from the shared
    replica until B's request is done (B says so in adapters.json.draining/)."""
    arrived, release = asyncio.Event(), asyncio.Event()
    app = create_fake_upstream()
    app.middlewares.append(holding(arrived, release))
    fake = await aiohttp_server(app)
    data, poll = tmp_path / "data", 0.05
    a, b = [
        await aiohttp_client(
            create_app(
                ProxyConfig(
                    upstream=str(fake.make_url("")),
                    data_dir=data,
                    commit_interval=0.0,
                    state_poll_interval=poll,
                    drain_timeout=120,
                )
            )
        )
        for _ in range(2)
    ]
    r = await a.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})
    v1 = (await r.json())["promoted"]
    await await_until(lambda: b.app[ADAPTERS].stack and b.app[ADAPTERS].current.name == v1)
    held = asyncio.create_task(
        b.post("/v1/chat/completions", json=chat("long"), headers={"X-Hold": "1"})
    )
    await arrived.wait()  # in flight on v1, through B
    r = await a.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a2")})
    v2 = (await r.json())["promoted"]
    await await_until(lambda: b.app[ADAPTERS].current.name == v2, what="B follows")
    b_id = b.app[ADAPTERS].flight.marks.proxy_id

    async def a_sees_b_draining() -> bool:
        state = await (await a.get("/admin/adapters")).json()
        return state["draining_elsewhere"] == {v1: [b_id]}

    await await_until(a_sees_b_draining, what="A sees B's request on v1")
    unloads = lambda: [  # noqa: E731
        r["body"]["lora_name"]
        for r in fake.app[RECEIVED]
        if r["path"].endswith("unload_lora_adapter")
    ]
    await asyncio.sleep(20 * poll)  # ten times what A waited for before (2 polls)
    assert unloads() == [] and v1 in fake.app[SETTINGS]["loras"]
    release.set()
    response = await held
    assert response.status == 200 and (await response.json())["choices"]
    await await_until(lambda: v1 in unloads(), what="v1 unloaded once B's request finished")
    assert v1 not in fake.app[SETTINGS]["loras"] and v2 in fake.app[SETTINGS]["loras"]
    assert not (data / "adapters.json.draining" / f"{b_id}.json").exists()
    (row,) = await wait_for_rows(data, 1)
    assert row["model_served"] == v1 and row["error"] is None


def test_workers_share_the_port_and_the_promotion_state(tmp_path):
    """`overnight serve --workers 2`: two processes, one port, one truth."""
    upstream = spawn_fake_upstream()
    data = tmp_path / "data"
    try:
        with spawn_serve(data, "--upstream", upstream.url, "--workers", "2") as serve:
            path = adapter_dir(tmp_path, "a1")
            name = _post(serve.url + "/admin/adapters/promote", {"path": path})["promoted"]

            def all_follow() -> bool:  # a new connection each time: either worker answers
                return all(
                    _get(serve.url + "/admin/adapters")["stack"] == [name] for _ in range(16)
                )

            wait_until(all_follow, what="both workers follow")
            time.sleep(2.0)  # twice the poll interval: the other worker has followed too
            for i in range(20):
                _post(serve.url + "/v1/chat/completions", chat(f"w{i}"))
        found = rows(data, "SELECT proxy_id, model_served FROM completions")
        assert len(found) == 20 and {r["model_served"] for r in found} == {name}
        assert len({r["proxy_id"] for r in found}) == 2  # both served (SO_REUSEPORT)
    finally:
        upstream.stop()


def _post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())
