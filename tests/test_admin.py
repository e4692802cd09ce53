"""The alias, promotion, draining and rollback, against the fake vLLM's LoRA endpoints."""

from __future__ import annotations

import asyncio
import json

import pytest

from .helpers import adapter_dir, await_until, lora_calls, version_of, wait_for_rows

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


async def test_promote_switches_the_alias_and_records_the_adapter(make_proxy, received, tmp_path):
    proxy = await make_proxy()
    await proxy.post("/v1/chat/completions", json=CHAT)
    r = await proxy.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})
    assert r.status == 200
    state = await r.json()
    assert version_of(state["promoted"]) == "policy-v1" and state["current"]["version"] == 1
    await proxy.post("/v1/chat/completions", json=CHAT)
    # Other model names pass through unchanged.
    await proxy.post("/v1/chat/completions", json={**CHAT, "model": "fake-base"})
    found = await wait_for_rows(tmp_path / "data", 3)
    assert [(version_of(f["model_served"]), f["adapter_version"]) for f in found] == [
        ("fake-base", None),
        ("policy-v1", 1),
        ("fake-base", None),
    ]
    assert [
        version_of(r["body"]["model"]) for r in received if r["path"].endswith("completions")
    ] == [
        "fake-base",
        "policy-v1",
        "fake-base",
    ]


async def test_promotion_drains_the_old_adapter_before_unloading_it(
    make_proxy, received, fake_settings, tmp_path
):
    proxy = await make_proxy()
    await proxy.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})
    fake_settings["delay"] = 0.5  # a request in flight on policy-v1 during the swap
    in_flight = asyncio.create_task(proxy.post("/v1/chat/completions", json=CHAT))

    async def routed() -> dict:
        return (await (await proxy.get("/admin/adapters")).json())["in_flight"]

    await await_until(routed, what="the request in flight")
    r = await proxy.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a2")})
    assert {version_of(k): v for k, v in (await r.json())["in_flight"].items()} == {"policy-v1": 1}
    assert ("unload_lora_adapter", "policy-v1") not in lora_calls(received)  # still serving
    response = await in_flight
    assert response.status == 200
    await await_until(
        lambda: ("unload_lora_adapter", "policy-v1") in lora_calls(received),
        what="policy-v1 unloaded once drained",
    )
    assert lora_calls(received) == [
        ("load_lora_adapter", "policy-v1"),
        ("load_lora_adapter", "policy-v2"),
        ("unload_lora_adapter", "policy-v1"),
    ]
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert version_of(row["model_served"]) == "policy-v1"  # the adapter that really served it


async def test_rollback_reloads_the_previous_adapter_under_a_new_name(
    make_proxy, received, tmp_path
):
    proxy = await make_proxy()
    r = await proxy.post("/admin/adapters/rollback")
    assert r.status == 400 and "base model" in (await r.json())["error"]["message"]
    a1 = adapter_dir(tmp_path, "a1")
    await proxy.post("/admin/adapters/promote", json={"path": a1})
    await proxy.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a2")})
    state = await (await proxy.post("/admin/adapters/rollback")).json()
    assert version_of(state["current"]["name"]) == "policy-v3" and state["current"]["path"] == a1
    assert state["current"]["reason"] == "rollback"
    state = await (await proxy.post("/admin/adapters/rollback")).json()
    assert state["current"] is None  # back to the base model
    # Each adapter left behind is unloaded in the background: wait, so that the next
    # thing the fake receives is the completion.
    unloaded = {("unload_lora_adapter", f"policy-v{k}") for k in (1, 2, 3)}
    await await_until(lambda: unloaded <= set(lora_calls(received)), what="v1-v3 unloaded")
    r = await proxy.post("/v1/chat/completions", json=CHAT)
    assert received[-1]["body"]["model"] == "fake-base"
    assert r.status == 200


async def test_offline_rollback_is_restored_by_the_next_proxy(make_proxy, received, tmp_path):
    """`overnight rollback --offline`: no proxy runs; the next one serves the previous
    adapter (loaded under a new name, as after any restart)."""
    from click.testing import CliRunner

    from overnight.cli.main import main

    data = tmp_path / "data"
    first = await make_proxy(data_dir=data, state_poll_interval=0.05)
    a1 = adapter_dir(tmp_path, "a1")
    await first.post("/admin/adapters/promote", json={"path": a1})
    await first.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a2")})
    await await_until(
        lambda: ("unload_lora_adapter", "policy-v1") in lora_calls(received), what="v1 unloaded"
    )
    await first.close()  # the proxy stops

    runner = CliRunner()
    result = runner.invoke(main, ["rollback", "--data", str(data), "--offline"])
    assert result.exit_code == 0 and f"will serve {a1}" in result.output
    second = await make_proxy(data_dir=data)
    state = await (await second.get("/admin/adapters")).json()
    assert state["current"]["path"] == a1 and state["current"]["reason"] == "restore"
    await second.post("/v1/chat/completions", json=CHAT)
    assert received[-1]["body"]["model"] == state["current"]["name"]
    result = runner.invoke(main, ["rollback", "--data", str(data), "--offline"])
    assert "will serve the base model" in result.output
    result = runner.invoke(main, ["rollback", "--data", str(data), "--offline"])
    assert result.exit_code != 0 and "already serves the base model" in result.output


async def test_a_rollback_keeps_its_reason_in_the_state_the_ui_and_overnight_runs(
    make_proxy, tmp_path
):
    from click.testing import CliRunner

    from overnight.cli.main import main
    from overnight.storage import open_db
    from overnight.view.display import adapter_events, list_runs

    data = tmp_path / "data"
    proxy = await make_proxy(data_dir=data)
    url = str(proxy.make_url(""))
    a1 = adapter_dir(tmp_path, "a1")
    await proxy.post("/admin/adapters/promote", json={"path": a1})
    r = await proxy.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a2")})
    v2 = (await r.json())["promoted"]
    args = ["rollback", "--data", str(data), "--proxy", url, "--reason", "answers got longer"]
    result = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert result.exit_code == 0, result.output
    assert "now serves policy-v3" in result.output and "(answers got longer)" in result.output
    state = await (await proxy.get("/admin/adapters")).json()
    event = state["events"][-1]
    assert (event["action"], event["adapter"], event["reason"]) == (
        "rollback",
        v2,
        "answers got longer",
    )
    assert event["serves"] == state["current"]["name"] and state["current"]["path"] == a1
    on_disk = json.loads((data / "adapters.json").read_text())["events"]
    assert [e["action"] for e in on_disk] == ["promote", "promote", "rollback"]
    page = await (await proxy.get("/ui/adapters")).text()
    assert "answers got longer" in page and f"<td>{v2}</td>" in page
    con = open_db(data)
    try:
        text = list_runs(con, 10, adapter_events(data))
    finally:
        con.close()
    assert f"rollback {v2}, then served {state['current']['name']}: answers got longer" in text
    # A reason that is not a string is refused, and nothing is rolled back.
    r = await proxy.post("/admin/adapters/rollback", json={"reason": 3})
    assert r.status == 400 and "'reason'" in (await r.json())["error"]["message"]
    assert (await (await proxy.get("/admin/adapters")).json())["current"] == state["current"]
    # Offline, the reason goes into the same history.
    await proxy.close()
    args = ["rollback", "--data", str(data), "--offline", "--reason", "vLLM is down for upgrade"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and "(vLLM is down for upgrade)" in result.output
    last = json.loads((data / "adapters.json").read_text())["events"][-1]
    assert (last["action"], last["reason"], last["serves"]) == (
        "rollback",
        "vLLM is down for upgrade",
        None,
    )


async def test_bad_promotions_are_refused(make_proxy, tmp_path):
    proxy = await make_proxy()
    r = await proxy.post("/admin/adapters/promote", json={"path": str(tmp_path)})
    assert r.status == 400 and "adapter_config.json" in (await r.json())["error"]["message"]
    r = await proxy.post("/admin/adapters/promote", json={"path": "x", "force": True})
    assert r.status == 400 and "unknown fields" in (await r.json())["error"]["message"]


async def test_admin_token(make_proxy, tmp_path):
    proxy = await make_proxy(admin_token="adm", api_keys=("sk",))
    assert (await proxy.get("/admin/adapters")).status == 401
    assert (
        await proxy.get("/admin/adapters", headers={"Authorization": "Bearer sk"})
    ).status == 401
    r = await proxy.get("/admin/adapters", headers={"Authorization": "Bearer adm"})
    assert r.status == 200 and (await r.json())["alias"] == "policy"


async def test_promoted_adapter_survives_a_restart(make_proxy, fake_settings, received, tmp_path):
    proxy = await make_proxy()
    a1 = adapter_dir(tmp_path, "a1")
    await proxy.post("/admin/adapters/promote", json={"path": a1})
    await proxy.close()
    fake_settings["loras"].clear()  # a restarted vLLM has no adapters
    proxy = await make_proxy()
    state = await (await proxy.get("/admin/adapters")).json()
    assert (
        version_of(state["current"]["name"]) == "policy-v2"
        and state["current"]["reason"] == "restore"
    )
    assert state["current"]["path"] == a1 and "policy-v2" in map(version_of, fake_settings["loras"])


@pytest.mark.parametrize("path", ["/admin/adapters", "/admin/stats"])
async def test_admin_is_loopback_only_without_a_token(make_proxy, path):
    from overnight.proxy.routes.auth import is_loopback

    proxy = await make_proxy()
    assert (await proxy.get(path)).status == 200  # the test client is on loopback
    assert is_loopback("127.0.0.1") and is_loopback("::1")
    assert not is_loopback("10.1.2.3") and not is_loopback(None)
