"""The canary (`overnight train --canary 0.1`): a sticky share of the alias's rollouts goes
to the candidate; the watch promotes or drops it on live rewards. The proxy in front of
the fake vLLM; records and rewards written as the proxy and agents write them."""

from __future__ import annotations

import asyncio
import datetime as dt
import shutil

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.config import ProxyConfig, TrainConfig
from overnight.proxy import create_app
from overnight.proxy.alias.promotions import in_canary
from overnight.proxy.state import ADAPTERS
from overnight.storage import LogWriter, WriterConfig
from overnight.trainer.live import canary

from .helpers import adapter_dir, await_until, completion_row, lora_calls, version_of


async def state_of(proxy) -> dict:
    return await (await proxy.get("/admin/adapters")).json()


async def test_a_canary_serves_a_sticky_share_of_the_alias_in_every_proxy(
    make_proxy, aiohttp_client, fake, received, tmp_path
):
    data = tmp_path / "data"
    a = await make_proxy(data_dir=data, state_poll_interval=0.05)
    b = await aiohttp_client(
        create_app(
            ProxyConfig(
                upstream=str(fake.make_url("")),
                data_dir=data,
                commit_interval=0.0,
                state_poll_interval=0.05,
            )
        )
    )
    served = (await (await a.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})).json())["promoted"]  # fmt: skip
    r = await a.post(
        "/admin/adapters/promote",
        json={"path": adapter_dir(tmp_path, "a2"), "canary": 0.25, "reason": "passed the gate"},
    )
    state = await r.json()
    name = state["promoted"]
    assert state["canary"] == {"name": name, "fraction": 0.25}
    assert state["current"]["name"] == served  # the alias still serves a1 to the rest
    await await_until(lambda: b.app[ADAPTERS].canary is not None, what="B follows the canary")
    page = await (await b.get("/ui/adapters")).text()
    assert f"canary: <strong>{name}</strong> serves 25%" in page and "passed the gate" in page
    registries = [a.app[ADAPTERS], b.app[ADAPTERS]]

    def choose(registry, key, model="policy"):
        route = registry.route(model, key)
        registry.release(route)
        return route.served

    keys = [f"rollout-{i}" for i in range(4000)]
    chosen = [choose(registries[0], k) for k in keys]
    share = chosen.count(name) / len(keys)
    assert 0.22 < share < 0.28 and set(chosen) == {name, served}, share
    # Sticky: the same rollout gets the same adapter every turn, from either proxy.
    assert [choose(registries[0], k) for k in keys[:500]] == chosen[:500]
    assert [choose(registries[1], k) for k in keys] == chosen
    assert [k for k in keys if in_canary(k, 0.25)] == [
        k for k, c in zip(keys, chosen, strict=True) if c == name
    ]
    # Without an id nothing goes to the canary; other model names pass through.
    assert {choose(registries[0], None) for _ in range(50)} == {served}
    assert {choose(registries[0], "r1", "fake-base") for _ in range(50)} == {"fake-base"}
    assert registries[0].in_flight == {}

    # Promoting the canary's path makes it the alias's adapter as it is: no new load.
    loads = len([c for c in lora_calls(received) if c[0] == "load_lora_adapter"])
    canary_path = state["adapters"][-1]["path"]
    r = await b.post("/admin/adapters/promote", json={"path": canary_path, "reason": "fine"})
    promoted = await r.json()
    assert promoted["promoted"] == name and promoted["current"]["name"] == name
    assert promoted["canary"] is None
    assert len([c for c in lora_calls(received) if c[0] == "load_lora_adapter"]) == loads
    assert [e["action"] for e in promoted["events"]] == [
        "promote",
        "canary at 25%",
        "canary promoted",
    ]
    await await_until(lambda: a.app[ADAPTERS].current.name == name, what="A follows")
    await await_until(
        lambda: ("unload_lora_adapter", version_of(served)) in lora_calls(received),
        what="the replaced adapter unloaded",
    )
    assert ("unload_lora_adapter", version_of(name)) not in lora_calls(received)

    # A canary dropped: the alias is unchanged and the canary is unloaded.
    r = await a.post(
        "/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a3"), "canary": 0.5}
    )
    third = (await r.json())["promoted"]
    r = await a.post("/admin/adapters/rollback", json={"canary": True, "reason": "worse"})
    dropped = await r.json()
    assert dropped["canary"] is None and dropped["current"]["name"] == name
    assert dropped["events"][-1]["action"] == "canary dropped"
    assert dropped["events"][-1]["reason"] == "worse"
    await await_until(
        lambda: ("unload_lora_adapter", version_of(third)) in lora_calls(received),
        what="the dropped canary unloaded",
    )
    r = await a.post("/admin/adapters/rollback", json={"canary": True})
    assert r.status == 400 and "no canary" in (await r.json())["error"]["message"]
    r = await a.post(
        "/admin/adapters/promote", json={"path": state["current"]["path"], "canary": 1.5}
    )
    assert r.status == 400 and "between 0 and 1" in (await r.json())["error"]["message"]


async def test_requests_with_a_rollout_id_reach_the_canary(make_proxy, received, tmp_path):
    # Through HTTP: the alias is resolved with the request's rollout id, so each rollout's
    # turns all go to one adapter, and the share that hashes under 0.5 to the canary.
    proxy = await make_proxy()
    await proxy.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})
    r = await proxy.post(
        "/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a2"), "canary": 0.5}
    )
    state = await r.json()
    name, served = state["promoted"], state["current"]["name"]
    chat = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for i in range(40):
        for _turn in range(2):
            headers = {"X-Rollout-Id": f"r{i}"}
            assert (await proxy.post("/v1/chat/completions", json=chat, headers=headers)).ok
    sent = [r["body"]["model"] for r in received if r["path"].endswith("completions")]
    expected = [name if in_canary(f"r{i}", 0.5) else served for i in range(40) for _ in range(2)]
    assert sent == expected and set(sent) == {name, served}


def write_live(data_dir, tag: str, model: str, rewards: list[float], hours_ago: float = 0) -> None:
    """One finished single-turn rollout per reward, served by `model`, reward posted."""
    writer = LogWriter(WriterConfig(data_dir, commit_interval=0.0))
    writer.start()
    at = int((dt.datetime.now(dt.UTC).timestamp() - 3600 * hours_ago) * 1e6)
    for i, reward in enumerate(rewards):
        rollout = f"{tag}.{i}"
        writer.append(
            "completions",
            completion_row(rollout, tag, model_served=model, started_at=at, ended_at=at),
        )
        writer.append(
            "rewards",
            {"reward_id": rollout, "schema_version": 1, "rollout_id": rollout, "reward": reward,
             "source": "agent", "created_at": at},
        )  # fmt: skip
    writer.close()


async def test_the_watch_settles_a_canary_on_live_rewards(make_proxy, tmp_path):
    data = tmp_path / "data"
    proxy = await make_proxy(data_dir=data)
    url = str(proxy.make_url(""))
    config = TrainConfig(watch_min_rollouts=20, gate_margin=0.05)  # absolute: numbers below
    await proxy.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})
    served = (await state_of(proxy))["current"]["name"]
    # The served adapter's rewards before the canary began do not count: high ones here.
    write_live(data, "before", served, [1.0] * 40, hours_ago=2)
    first = await asyncio.to_thread(
        canary.start, url, None, adapter_dir(tmp_path, "a2"), 0.1, print
    )
    again = await asyncio.to_thread(
        canary.start, url, None, tmp_path / "a2", 0.1, print
    )  # a resumed run starts nothing
    assert again == first and (await state_of(proxy))["canary"]["name"] == first

    write_live(data, "s1", served, [0.6, 0.7, 0.8] * 4)
    write_live(data, "c1", first, [0.1, 0.2] * 15)
    lines: list[str] = []
    verdict = await asyncio.to_thread(canary.settle, data, url, None, config, lines.append)
    assert verdict.action == "wait" and "too few" in verdict.reason and verdict.served_n == 12
    assert (await state_of(proxy))["canary"]["name"] == first

    write_live(data, "s2", served, [0.6, 0.7, 0.8] * 6)  # 30 since the canary began
    watch = ["watch", "--data", str(data), "--proxy", url, "--watch-min-rollouts", "20"]
    result = await asyncio.to_thread(CliRunner().invoke, main, [*watch, "--dry-run"])
    assert f"canary: {first} would be dropped (--dry-run)" in result.output, result.output
    assert (await state_of(proxy))["canary"]["name"] == first
    result = await asyncio.to_thread(CliRunner().invoke, main, watch)
    assert result.exit_code == 0, result.output
    assert f"canary: dropped {first}: live reward 0.150 on 30 canary rollouts" in result.output
    state = await state_of(proxy)
    assert state["canary"] is None and state["current"]["name"] == served
    assert state["events"][-1]["reason"].startswith("canary: live reward 0.150")

    second = await asyncio.to_thread(
        canary.start, url, None, adapter_dir(tmp_path, "a3"), 0.1, print
    )
    write_live(data, "s3", served, [0.6, 0.7, 0.8] * 10)
    write_live(data, "c3", second, [0.3, 0.9, 0.6] * 3)
    verdict = canary.check(data, await state_of(proxy), config)
    assert verdict.action == "wait" and verdict.canary_n == 9
    # Enough rollouts, but the interval neither clears the margin nor shows it worse.
    write_live(data, "c3b", second, [0.3, 0.9, 0.8] * 5)
    verdict = canary.check(data, await state_of(proxy), config)
    assert verdict.action == "wait" and "keep it running" in verdict.reason, verdict.reason
    assert verdict.low < -config.gate_margin and verdict.high > 0
    write_live(data, "c3c", second, [0.8, 0.85, 0.8] * 40)
    verdict = await asyncio.to_thread(canary.settle, data, url, None, config, lines.append)
    assert verdict.action == "promote" and verdict.low > -config.gate_margin, verdict.reason
    assert lines[-1].startswith(f"canary: promoted {second}: live reward")
    state = await state_of(proxy)
    assert state["current"]["name"] == second and state["canary"] is None
    assert [e["action"] for e in state["events"]] == [
        "promote", "canary at 10%", "canary dropped", "canary at 10%", "canary promoted",
    ]  # fmt: skip


@pytest.mark.vllm
@pytest.mark.slow
async def test_a_canary_on_real_vllm_is_loaded_promoted_as_is_and_dropped(
    vllm_server, lora_adapter, make_proxy, tmp_path
):
    """vLLM loads the canary beside the served adapter, serves it under its own name,
    keeps it (no second load) when it is promoted, and unloads a dropped one."""
    proxy = await make_proxy(upstream=vllm_server.url, drain_timeout=30)
    second = tmp_path / "second"
    shutil.copytree(lora_adapter, second)

    async def models() -> set[str]:
        return {m["id"] for m in (await (await proxy.get("/v1/models")).json())["data"]}

    await proxy.post("/admin/adapters/promote", json={"path": str(lora_adapter)})
    r = await proxy.post("/admin/adapters/promote", json={"path": str(second), "canary": 0.2})
    assert r.status == 200, await r.text()
    state = await r.json()
    name, served = state["promoted"], state["current"]["name"]
    assert {name, served} <= await models()
    registry = proxy.app[ADAPTERS]
    route = registry.route("policy", next(f"r{i}" for i in range(100) if in_canary(f"r{i}", 0.2)))
    registry.release(route)
    chat = {"model": route.served, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    r = await proxy.post("/v1/chat/completions", json=chat)
    assert route.served == name and r.status == 200, await r.text()
    r = await proxy.post("/admin/adapters/promote", json={"path": str(second)})
    assert (await r.json())["current"]["name"] == name  # the loaded canary, not a reload
    await await_until(lambda: models_without(proxy, served), what="the replaced adapter unloaded")
    assert name in await models()
    r = await proxy.post("/admin/adapters/promote", json={"path": str(lora_adapter), "canary": 0.2})
    third = (await r.json())["promoted"]
    assert third in await models()
    await proxy.post("/admin/adapters/rollback", json={"canary": True, "reason": "test"})
    await await_until(lambda: models_without(proxy, third), what="the dropped canary unloaded")
    assert name in await models()


async def models_without(proxy, name: str) -> bool:
    return name not in {m["id"] for m in (await (await proxy.get("/v1/models")).json())["data"]}
