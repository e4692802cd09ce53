"""The handover from a hosted model to the local one (issue 28, part 3): a sticky share of
a policy's rollouts goes to the local vLLM, the rest to the hosted API beside it; the
watch moves the share on live rewards. The in-process proxy fronts the fake vLLM and the
scripted hosted API (which refuses any field it does not know and any request without its
own key, as the real ones do); rewards are posted through the proxy's rewards route."""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.config import ConfigError, ProxyConfig, TrainConfig
from overnight.proxy.alias.promotions import in_canary, served_locally
from overnight.proxy.launch.launcher import free_port
from overnight.proxy.state import POLICIES
from overnight.storage import open_db
from overnight.testing.hosted_upstream import RECEIVED, SNAPSHOT, create_hosted_upstream
from overnight.trainer.grpo.logged_turns import HOSTED_SKIP, load_samples
from overnight.trainer.live import handover

from .helpers import adapter_dir, rows, wait_for_rows
from .test_keys import ADMIN, OPS, auth
from .test_policy_tokens import RESEARCH_OPS, TOKENS

HOSTED_KEY = "sk-hosted-0123456789abcdef"
VLLM_KEY = "vllm-key-fedcba9876543210"
MODEL = "hosted-large"
CLIENT_KEY = "ovn-client-key-0011223344556677"
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


@pytest.fixture
async def hosted(aiohttp_server):
    return await aiohttp_server(create_hosted_upstream(HOSTED_KEY))


@pytest.fixture
def start(make_proxy, hosted):
    """A proxy in front of the fake vLLM with the hosted API beside it."""

    async def start(**overrides):
        settings = {
            "hosted_upstream": str(hosted.make_url("")),
            "upstream_model": MODEL,
            "hosted_api_key": HOSTED_KEY,
            "upstream_api_key": VLLM_KEY,
            **overrides,
        }
        return await make_proxy(**settings)

    return start


def label(hosted) -> str:
    return f"openai 127.0.0.1:{hosted.port}"


async def set_share(proxy, share, **extra):
    return await proxy.post("/admin/handover", json={"share": share, **extra})


async def test_a_share_of_the_rollouts_is_served_locally_sticky_in_every_turn(start):
    proxy = await start()
    policies = proxy.app[POLICIES]

    def side(key, model="policy"):
        route = policies.route(model, key)
        policies.release(route)
        return "hosted" if route.hosted else route.served

    keys = [f"rollout-{i}" for i in range(4000)]
    # Before a handover starts the hosted model serves every rollout of the alias.
    assert {side(k) for k in keys[:200]} == {"hosted"}
    state = await (await set_share(proxy, 0.25, reason="the SFT adapter passed")).json()
    assert state["handover"]["share"] == 0.25 and state["handover"]["hosted_model"] == MODEL
    assert state["events"][-1]["action"] == "handover at 25%"
    assert state["events"][-1]["reason"] == "the SFT adapter passed"
    chosen = [side(k) for k in keys]
    local = [k for k, s in zip(keys, chosen, strict=True) if s != "hosted"]
    assert 0.22 < len(local) / len(keys) < 0.28
    assert local == [k for k in keys if served_locally(k, 0.25)]
    assert [side(k) for k in keys[:500]] == chosen[:500]  # the same side every turn
    # Its own salt: not the canary's rollouts (both drawn independently).
    assert local != [k for k in keys if in_canary(k, 0.25)]
    # Without a rollout id the hosted model answers; other model names pass to vLLM.
    assert {side(None) for _ in range(20)} == {"hosted"}
    assert {side("r1", "fake-base") for _ in range(20)} == {"fake-base"}
    # At 1 the handover is complete: nothing of the alias goes to the hosted model.
    await set_share(proxy, 1.0)
    assert "hosted" not in {side(k) for k in keys[:500]} and side(None) != "hosted"
    page = await (await proxy.get("/ui/adapters")).text()
    assert 'id="handover">handover: 100%' in page and MODEL in page


async def test_each_side_gets_its_own_key_and_fields_and_records_say_who_served(
    start, hosted, received, tmp_path
):
    proxy = await start(api_keys=(CLIENT_KEY,))
    await set_share(proxy, 0.5)
    ids = [f"r{i}" for i in range(12)]
    for rollout in ids:
        for _turn in range(2):
            headers = {"X-Rollout-Group": "g1", "X-Rollout-Id": rollout, **auth(CLIENT_KEY)}
            r = await proxy.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status == 200, await r.text()
    local = [r for r in ids if served_locally(r, 0.5)]
    assert 0 < len(local) < len(ids)
    to_vllm = [r for r in received if r["path"] == "/v1/chat/completions"]
    to_hosted = hosted.app[RECEIVED]
    assert len(to_vllm) == 2 * len(local) and len(to_hosted) == 2 * (len(ids) - len(local))
    for sent in to_vllm:  # the proxy's additions and vLLM's key
        headers = {k.lower(): v for k, v in sent["headers"].items()}
        assert sent["body"]["return_token_ids"] is True and sent["body"]["logprobs"] is True
        assert headers["authorization"] == f"Bearer {VLLM_KEY}"
        assert HOSTED_KEY not in repr(sent) and CLIENT_KEY not in repr(sent)
    for sent in to_hosted:  # the client's request as sent, the hosted key only
        headers = {k.lower(): v for k, v in sent["headers"].items()}
        assert sent["body"] == {**CHAT, "model": MODEL}
        assert headers["authorization"] == f"Bearer {HOSTED_KEY}"
        assert VLLM_KEY not in repr(sent) and CLIENT_KEY not in repr(sent)
        assert not [h for h in headers if h.startswith("x-rollout-")]

    await wait_for_rows(tmp_path / "data", 2 * len(ids))
    logged = rows(tmp_path / "data", "SELECT * FROM completions ORDER BY started_at")
    for row in logged:
        notes = json.loads(row["notes"]) if row["notes"] else {}
        if row["rollout_id"] in local:
            assert row["completion_token_ids"] and "upstream" not in notes
            assert row["model_served"] != MODEL + SNAPSHOT
        else:
            assert notes["upstream"] == label(hosted) and row["completion_token_ids"] is None
            assert row["model_served"] == MODEL + SNAPSHOT
    # GRPO leaves the hosted turns out, saying why; the local ones are samples.
    con = open_db(tmp_path / "data")
    try:
        loaded = load_samples(con, ["g1"], None)
    finally:
        con.close()
    assert loaded.skipped == {HOSTED_SKIP: 2 * (len(ids) - len(local))}
    assert sorted({s.rollout_id for s in loaded.samples}) == sorted(local)
    # Streamed on the hosted side too: sent as the client sent it, relayed as it came.
    away = next(r for r in ids if r not in local)
    stream = {**CHAT, "stream": True}
    headers = {"X-Rollout-Id": away, **auth(CLIENT_KEY)}
    r = await proxy.post("/v1/chat/completions", json=stream, headers=headers)
    assert r.status == 200 and "data: [DONE]" in await r.text()
    assert to_hosted[-1]["body"] == {**stream, "model": MODEL}


async def test_an_anthropic_api_beside_vllm_gets_its_own_key_and_header(
    start, hosted, received, tmp_path
):
    # Messages, the kind's own API: the hosted side gets x-api-key and anthropic-version,
    # never vLLM's key or a Bearer; the local side gets vLLM's key and nothing hosted.
    proxy = await start(hosted_kind="anthropic")
    await set_share(proxy, 0.5)
    ids = [f"m{i}" for i in range(10)]
    body = {"model": "policy", "max_tokens": 8, "messages": CHAT["messages"]}
    for rollout in ids:
        headers = {"X-Rollout-Group": "g2", "X-Rollout-Id": rollout}
        r = await proxy.post("/v1/messages", json=body, headers=headers)
        assert r.status == 200, await r.text()
        assert (await r.json())["type"] == "message"
    local = [r for r in ids if served_locally(r, 0.5)]
    assert 0 < len(local) < len(ids)
    to_vllm = [r for r in received if r["path"] == "/v1/messages"]
    to_hosted = hosted.app[RECEIVED]
    assert len(to_vllm) == len(local) and len(to_hosted) == len(ids) - len(local)
    for sent in to_hosted:
        headers = {k.lower(): v for k, v in sent["headers"].items()}
        assert sent["body"] == {**body, "model": MODEL}
        assert headers["x-api-key"] == HOSTED_KEY and headers["anthropic-version"]
        assert "authorization" not in headers and VLLM_KEY not in repr(sent)
    for sent in to_vllm:
        headers = {k.lower(): v for k, v in sent["headers"].items()}
        assert headers["authorization"] == f"Bearer {VLLM_KEY}"
        assert HOSTED_KEY not in repr(sent) and "x-api-key" not in headers
    await wait_for_rows(tmp_path / "data", len(ids))
    logged = rows(tmp_path / "data", "SELECT rollout_id, notes FROM completions")
    upstream = {r["rollout_id"]: json.loads(r["notes"] or "{}").get("upstream") for r in logged}
    assert upstream == {
        r: None if r in local else f"anthropic 127.0.0.1:{hosted.port}" for r in ids
    }


async def test_the_handover_admin_call_and_its_refusals(start, make_proxy, tmp_path):
    proxy = await start(admin_token=ADMIN, policies=("research",), keys_toml=TOKENS)
    ops = auth(ADMIN)
    for body, why in [
        ({"share": 1.5}, "within [0, 1]"),
        ({"share": -0.1}, "within [0, 1]"),
        ({}, "missing: ['share']"),
        ({"share": "half"}, "wrong types: ['share']"),
        ({"share": 0.5, "canary": 0.1}, "unknown fields"),
    ]:
        r = await proxy.post("/admin/handover", json=body, headers=ops)
        assert r.status == 400 and why in (await r.json())["error"]["message"], body
    assert (await proxy.post("/admin/handover", json={"share": 0.5})).status == 401
    # A policy's own admin token sets its policy's share, and no other's.
    research = auth(RESEARCH_OPS)
    r = await proxy.post("/admin/handover?policy=research", json={"share": 0.5}, headers=research)
    assert r.status == 200 and (await r.json())["handover"]["share"] == 0.5
    r = await proxy.post("/admin/handover", json={"share": 0.5}, headers=research)
    assert r.status == 403
    r = await proxy.post("/admin/handover?policy=research", json={"share": 0.9}, headers=auth(OPS))
    assert r.status == 403
    state = await (await proxy.get("/admin/adapters", headers=ops)).json()
    assert state["handover"]["share"] == 0.0  # the default policy's is its own
    # Stopped: share 0, the hosted model serves all again.
    r = await proxy.post(
        "/admin/handover?policy=research", json={"share": 0, "reason": "worse"}, headers=ops
    )
    event = (await r.json())["events"][-1]
    assert (event["action"], event["reason"]) == ("handover stopped", "worse")
    # Without a hosted upstream there is nothing to hand over from.
    plain = await make_proxy(data_dir=tmp_path / "plain")
    r = await set_share(plain, 0.5)
    assert r.status == 409 and "--hosted-upstream" in (await r.json())["error"]["message"]


async def test_a_hosted_upstream_that_is_down_is_named_in_the_error(start, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = await start(hosted_upstream=dead)  # share 0: the hosted model serves all
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Rollout-Id": "r1"})
    assert r.status == 502 and dead in (await r.json())["error"]["message"]
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert dead in row["error"] and json.loads(row["notes"])["upstream"].startswith("openai ")


async def test_the_hosted_side_serves_on_while_vllm_sleeps_for_a_night(start, hosted):
    proxy = await start(maintenance_hold=0.2)
    await set_share(proxy, 0.5)
    here = next(f"r{i}" for i in range(100) if served_locally(f"r{i}", 0.5))
    away = next(f"r{i}" for i in range(100) if not served_locally(f"r{i}", 0.5))
    window = {"action": "begin", "holder": "night-1", "lease_seconds": 60}
    assert (await proxy.post("/admin/maintenance", json=window)).status == 200
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Rollout-Id": away})
    assert r.status == 200 and hosted.app[RECEIVED][-1]["body"]["model"] == MODEL
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Rollout-Id": here})
    assert r.status == 503 and (await r.json())["error"]["code"] == "maintenance"


def test_a_hosted_upstream_beside_vllm_is_configured_or_refused_clearly():
    base = {"upstream": "http://127.0.0.1:8000", "hosted_upstream": "https://api.openai.com/v1"}
    config = ProxyConfig(**base, upstream_model="gpt-4o")
    assert (config.upstream_kind, config.hosted_upstream) == ("vllm", "https://api.openai.com")
    with pytest.raises(ConfigError, match="needs --upstream-model"):
        ProxyConfig(**base)
    with pytest.raises(ConfigError, match="needs --upstream to be vLLM"):
        ProxyConfig(**base, upstream_model="m", upstream_kind="openai")
    with pytest.raises(ConfigError, match="hosted_kind must be one of"):
        ProxyConfig(**base, upstream_model="m", hosted_kind="gemini")
    with pytest.raises(ConfigError, match="no user, password or query"):
        ProxyConfig(**{**base, "hosted_upstream": "https://u:p@api.openai.com"}, upstream_model="m")


async def serve_rollouts(proxy, tag: str, n: int, reward_of) -> tuple[int, int]:
    """`n` two-turn rollouts through the proxy, each rewarded through the rewards route by
    `reward_of(i, local)`; how many each side served."""
    share = proxy.app[POLICIES].get(None).handover["share"]
    sides = [0, 0]
    for i in range(n):
        rollout = f"{tag}.{i}"
        local = served_locally(rollout, share)
        sides[local] += 1
        for _turn in range(2):
            headers = {"X-Rollout-Group": tag, "X-Rollout-Id": rollout}
            assert (await proxy.post("/v1/chat/completions", json=CHAT, headers=headers)).ok
        reward = {"reward": reward_of(i, local)}
        assert (await proxy.post(f"/v1/rollouts/{rollout}/reward", json=reward)).ok
    return sides[1], sides[0]


async def test_the_watch_raises_the_share_when_local_is_not_worse_and_stops_it_when_worse(
    start, tmp_path
):
    data = tmp_path / "data"
    proxy = await start(data_dir=data)
    url = str(proxy.make_url(""))
    config = TrainConfig(watch_min_rollouts=10, gate_margin=0.05)
    await proxy.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "sft")})
    await set_share(proxy, 0.5, reason="start")
    state_of = lambda: proxy.get("/admin/adapters")  # noqa: E731

    verdict = handover.check(data, await (await state_of()).json(), config)
    assert verdict.action == "wait" and "too few" in verdict.reason

    # The local model no worse (a little better): the share doubles.
    def not_worse(i: int, is_local: bool) -> float:
        return [0.6, 0.7, 0.8][i % 3] + (0.1 if is_local else 0.0)

    local, hosted_n = await serve_rollouts(proxy, "a", 40, not_worse)
    await wait_for_rows(data, 80)
    watch = ["watch", "--data", str(data), "--proxy", url, "--watch-min-rollouts", "10"]
    result = await asyncio.to_thread(CliRunner().invoke, main, [*watch, "--dry-run"])
    assert "handover: would raise (50% served locally, --dry-run)" in result.output, result.output
    assert (await (await state_of()).json())["handover"]["share"] == 0.5
    result = await asyncio.to_thread(CliRunner().invoke, main, watch)
    assert result.exit_code == 0, result.output
    assert f"on {local} local rollouts" in result.output and f"{hosted_n} hosted" in result.output
    assert "handover: moved to 100% (was 50% served locally)" in result.output, result.output
    state = await (await state_of()).json()
    assert state["handover"]["share"] == 1.0
    assert state["events"][-1]["action"] == "handover complete"
    assert state["events"][-1]["reason"].startswith("watch: live reward")
    # Complete: the watch leaves it.
    assert handover.check(data, state, config).action == "none"
    # A share left in the state by a proxy that had a hosted model beside it, read
    # through one that has none: no handover to move.
    stale = {**state, "handover": {"share": 0.5, "since": None}}
    assert handover.check(data, stale, config).share is None

    # A second handover, where the local model does worse: stopped, the hosted serves all.
    await set_share(proxy, 0.5, reason="again")

    def worse(i: int, is_local: bool) -> float:
        return [0.1, 0.2][i % 2] + (0.0 if is_local else 0.7)

    await serve_rollouts(proxy, "b", 40, worse)
    await wait_for_rows(data, 160)
    lines: list[str] = []
    verdict = await asyncio.to_thread(handover.settle, data, url, None, config, lines.append)
    assert verdict.action == "stop" and verdict.high < 0 and verdict.new_share == 0.0
    assert verdict.local_mean < 0.25 and verdict.hosted_mean > 0.75, verdict.reason
    assert lines[-1].startswith("handover: stopped (was 50% served locally): live reward")
    state = await (await state_of()).json()
    assert state["handover"]["share"] == 0.0
    assert state["events"][-1]["action"] == "handover stopped"
    assert "the local model is worse" in state["events"][-1]["reason"]
    assert proxy.app[POLICIES].route("policy", "b.1").hosted  # every rollout
