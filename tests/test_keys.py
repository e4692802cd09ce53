"""Scoped keys, hashed keys, per-policy admin tokens and limits per key (issue 27).

The key matrix runs against the in-process proxy and fake vLLM with two policies: the
default `policy` (the support team's) and `research`."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib

import pytest

from overnight.config import ConfigError, ProxyConfig
from overnight.config.keys import key_digest
from overnight.storage import LogWriter, WriterConfig
from overnight.storage.rollout_lookup import DAYS, find_rollout

from .helpers import adapter_dir, await_until, completion_row, rows, wait_for_rows, wait_until

SUPPORT, RESEARCH, ALL, ADMIN, OPS = "sk-support", "sk-research", "sk-all", "adm-root", "adm-ops"
KEYS_FILE = f"""
[[key]]
name = "support"
sha256 = "{hashlib.sha256(SUPPORT.encode()).hexdigest()}"
policies = ["policy"]

[[key]]
name = "research"
key_env = "TEST_RESEARCH_KEY"
policies = ["research"]
models = ["fake-base"]

[[admin]]
name = "support-ops"
policy = "policy"
sha256 = "{key_digest(OPS)}"
"""


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def chat(model: str, rollout: str, group: str = "g", key: str = SUPPORT, **headers):
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    headers = {**auth(key), "X-Rollout-Id": rollout, "X-Rollout-Group": group, **headers}
    return body, headers


@pytest.fixture
def keyed(make_proxy, monkeypatch):
    """A proxy with both policies, the two scoped keys, a plain key and both admin tokens."""
    monkeypatch.setenv("TEST_RESEARCH_KEY", RESEARCH)

    async def start(**overrides):
        return await make_proxy(
            policies=("research",),
            api_keys=(ALL,),
            admin_token=ADMIN,
            keys_toml=KEYS_FILE,
            **overrides,
        )

    return start


async def post_chat(proxy, model, rollout, **kw):
    body, headers = chat(model, rollout, **kw)
    return await proxy.post("/v1/chat/completions", json=body, headers=headers)


def stored(data, table: str) -> list[str]:
    return [r["rollout_id"] for r in rows(data, f"SELECT rollout_id FROM {table}")]


# -- configuration ------------------------------------------------------------------------


def test_a_keys_file_keeps_hashes_only_and_names_what_is_wrong(monkeypatch):
    monkeypatch.setenv("TEST_RESEARCH_KEY", RESEARCH)
    config = ProxyConfig(upstream="http://x", policies=("research",), keys_toml=KEYS_FILE)
    support, research = config.keys
    assert (support.name, support.policies, support.models) == ("support", ("policy",), ())
    assert research.sha256 == key_digest(RESEARCH) and research.models == ("fake-base",)
    assert RESEARCH not in repr(config)  # the plain key from the environment is not kept
    assert [(t.name, t.policy) for t in config.policy_tokens] == [("support-ops", "policy")]
    assert config.keys_toml == ""  # parsed once: replace() does not add the keys again
    assert dataclasses.replace(config).keys == config.keys

    bad = {
        'name = "a"\nsha256 = "abc"': "64 hex digits",
        f'name = "a"\nsha256 = "{"0" * 64}"\nkey_env = "X"': "one of them",
        f'name = "a"\nsha256 = "{"0" * 64}"\npolicies = ["nope"]': "no policy named",
        f'name = "a"\nsha256 = "{"0" * 64}"\nrate = 0': "rate must be",
        f'name = "a"\nsha256 = "{"0" * 64}"\nburst = 3': "burst needs a rate",
        f'name = "a"\nsha256 = "{"0" * 64}"\nmodels = ["m"]': "give policies too",
        f'name = "a"\nsha256 = "{"0" * 64}"\nscope = 1': "unknown fields",
        'name = "a"\nkey_env = "TEST_UNSET_KEY_VARIABLE"': "is not set",
        f'name = "a b"\nsha256 = "{"0" * 64}"': "name must be",
    }
    for table, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            ProxyConfig(upstream="http://x", keys_toml=f"[[key]]\n{table}\n")
    twice = f'[[key]]\nname = "a"\nsha256 = "{key_digest(ALL)}"\n'
    with pytest.raises(ConfigError, match="the same key is given twice"):
        ProxyConfig(upstream="http://x", api_keys=(ALL,), keys_toml=twice)
    with pytest.raises(ConfigError, match="given twice"):
        ProxyConfig(upstream="http://x", keys_toml=twice + twice.replace(key_digest(ALL), "1" * 64))


def test_key_hash_prints_what_a_keys_file_holds_for_a_key_on_stdin():
    """`overnight key-hash`: the key from standard input (not the command line, where the
    shell's history and the process list would keep it); one trailing newline dropped."""
    import hashlib

    from click.testing import CliRunner

    from overnight.cli import main

    runner = CliRunner()
    for given in (f"{RESEARCH}\n", RESEARCH, f"{RESEARCH}\r\n"):
        result = runner.invoke(main, ["key-hash"], input=given)
        assert result.exit_code == 0, result.output
        assert result.output.strip() == hashlib.sha256(RESEARCH.encode()).hexdigest()
        assert result.output.strip() == key_digest(RESEARCH)
    assert runner.invoke(main, ["key-hash"], input="").exit_code == 2  # no key: usage error


def test_serve_reads_the_keys_file_given_with_keys_file(tmp_path, monkeypatch):
    from overnight.cli import main
    from overnight.options import build

    monkeypatch.setenv("TEST_RESEARCH_KEY", RESEARCH)
    path = tmp_path / "keys.toml"
    path.write_text(KEYS_FILE)
    args = ["--upstream", "http://x", "--policy", "research", "--keys-file", str(path)]
    ctx = main.commands["serve"].make_context("serve", args)
    config = build(ProxyConfig, ctx.params)
    assert [k.name for k in config.keys] == ["support", "research"]
    assert [t.policy for t in config.policy_tokens] == ["policy"]


# -- the key matrix -----------------------------------------------------------------------


async def test_hashed_and_env_keys_work_and_wrong_ones_do_not(keyed, tmp_path):
    proxy = await keyed()
    assert (await post_chat(proxy, "policy", "s1", key=SUPPORT)).status == 200
    assert (await post_chat(proxy, "research", "r1", key=RESEARCH)).status == 200
    assert (await post_chat(proxy, "research", "a1", key=ALL)).status == 200
    wrong = await post_chat(proxy, "policy", "x", key=key_digest(SUPPORT))  # the hash is no key
    assert wrong.status == 401 and (await wrong.json())["error"]["code"] == "invalid_api_key"
    found = await wait_for_rows(tmp_path / "data", 3)
    assert sorted(r["rollout_id"] for r in found) == ["a1", "r1", "s1"]


async def test_a_key_of_one_policy_is_refused_the_other_alias(keyed, received, tmp_path):
    proxy = await keyed()
    r = await post_chat(proxy, "research", "s1", key=SUPPORT)
    assert r.status == 403
    assert (await r.json())["error"] == {
        "message": "key 'support' may not use model 'research'; it may use ['policy']",
        "type": "invalid_request_error",
        "code": "permission_denied",
    }
    # The base model (untrained traffic) only where the key lists it: research does.
    assert (await post_chat(proxy, "fake-base", "s2", key=SUPPORT)).status == 403
    assert (await post_chat(proxy, "fake-base", "r2", key=RESEARCH)).status == 200
    # A POST the proxy passes through unread could name any adapter: refused; reads pass.
    embed = await proxy.post(
        "/v1/embeddings", json={"model": "research", "input": "x"}, headers=auth(SUPPORT)
    )
    assert embed.status == 403 and (await embed.json())["error"]["code"] == "permission_denied"
    assert (await proxy.get("/v1/models", headers=auth(SUPPORT))).status == 200
    await wait_for_rows(tmp_path / "data", 1)
    assert stored(tmp_path / "data", "completions") == ["r2"]  # a refusal is no completion
    sent = [r["body"].get("input") for r in received if r["path"].endswith("embeddings")]
    assert sent == []  # nothing refused reached vLLM


async def test_rewards_and_finishes_only_from_a_key_of_the_rollouts_policy(keyed, tmp_path):
    proxy = await keyed()
    assert (await post_chat(proxy, "policy", "support-1", key=SUPPORT)).status == 200
    assert (await post_chat(proxy, "research", "research-1", key=RESEARCH)).status == 200
    reward = {"reward": 1.0}
    for path in ("reward", "finish"):
        other = await proxy.post(
            f"/v1/rollouts/support-1/{path}", json=reward, headers=auth(RESEARCH)
        )
        assert other.status == 403, path
        error = (await other.json())["error"]
        assert error["code"] == "permission_denied" and "support-1" in error["message"]
        unknown = await proxy.post(
            f"/v1/rollouts/never-served/{path}", json=reward, headers=auth(SUPPORT)
        )
        assert unknown.status == 403  # the same answer: no probing of other teams' ids
        own = await proxy.post(f"/v1/rollouts/support-1/{path}", json=reward, headers=auth(SUPPORT))
        assert own.status == 200, path
        # An unscoped key posts for any rollout, as before.
        assert (
            await proxy.post(f"/v1/rollouts/research-1/{path}", json=reward, headers=auth(ALL))
        ).status == 200
    data = tmp_path / "data"
    assert sorted(stored(data, "rewards")) == ["research-1", "support-1"]
    assert sorted(stored(data, "finishes")) == ["research-1", "support-1"]
    stats = await (await proxy.get("/admin/stats", headers=auth(ADMIN))).json()
    assert stats["keys"]["research"]["refused"]["rollout"] == 2
    assert stats["keys"]["support"]["refused"]["rollout"] == 2


async def test_a_rollout_served_by_another_proxy_or_before_a_restart_is_looked_up(keyed, tmp_path):
    first = await keyed()
    assert (await post_chat(first, "policy", "early", key=SUPPORT)).status == 200
    await wait_for_rows(tmp_path / "data", 1)
    second = await keyed()  # another worker on the same data directory: a live log
    for key, status in ((RESEARCH, 403), (SUPPORT, 200)):
        r = await second.post("/v1/rollouts/early/reward", json={"reward": 1}, headers=auth(key))
        assert r.status == status
    await first.close()
    await second.close()  # closed: the logs are compacted into Parquet
    assert find_rollout(tmp_path / "data", "early") == ("policy", "g")
    third = await keyed()  # after a restart: found in Parquet
    assert (await third.post("/v1/rollouts/early/finish", headers=auth(RESEARCH))).status == 403
    assert (await third.post("/v1/rollouts/early/finish", headers=auth(SUPPORT))).status == 200


async def test_a_rollout_id_used_under_two_policies_is_nobodys(keyed, tmp_path):
    proxy = await keyed()
    assert (await post_chat(proxy, "policy", "shared", key=SUPPORT)).status == 200
    assert (await post_chat(proxy, "research", "shared", key=RESEARCH)).status == 200
    for key in (SUPPORT, RESEARCH):
        r = await proxy.post("/v1/rollouts/shared/reward", json={"reward": 1}, headers=auth(key))
        assert r.status == 403
    assert stored(tmp_path / "data", "rewards") == []


def test_the_store_lookup_reads_recent_days_only_and_knows_a_shared_id(tmp_path):
    data = tmp_path / "data"
    writer = LogWriter(WriterConfig(data, commit_interval=0.0))
    writer.start()
    now = dt.datetime.now(dt.UTC)
    served = [("a", "policy", 0), ("a", "research", 1), ("b", "policy", 1)]
    for rollout, model, days_ago in [*served, ("old", "policy", DAYS + 1)]:
        at = int((now - dt.timedelta(days=days_ago)).timestamp() * 1e6)
        row = completion_row(rollout, "g", model_requested=model, started_at=at, ended_at=at)
        writer.append("completions", dict(row, record_id=f"{rollout}-{model}"))
    assert wait_until(lambda: find_rollout(data, "b")) == ("policy", "g")  # in the live log
    assert find_rollout(data, "a") == (None, None)
    writer.close()  # compacted into Parquet: each day its own folder
    assert find_rollout(data, "b") == ("policy", "g")
    assert find_rollout(data, "a") == (None, None)  # served under two models: nobody's
    assert find_rollout(data, "old") is None  # beyond the days looked at
    assert find_rollout(data, "never") is None


async def test_group_prefixes_limit_what_a_key_serves_and_rewards(make_proxy, tmp_path):
    table = (
        f'[[key]]\nname = "team"\nsha256 = "{key_digest(SUPPORT)}"\ngroup_prefixes = ["team/"]\n'
    )
    proxy = await make_proxy(api_keys=(ALL,), keys_toml=table)
    assert (await post_chat(proxy, "policy", "t1", group="team/1")).status == 200
    r = await post_chat(proxy, "policy", "t2", group="other/1")
    assert r.status == 403 and "team/" in (await r.json())["error"]["message"]
    body, headers = chat("policy", "t3")
    del headers["X-Rollout-Group"], headers["X-Rollout-Id"]  # its own group: no prefix
    assert (await proxy.post("/v1/chat/completions", json=body, headers=headers)).status == 403
    assert (await post_chat(proxy, "policy", "o1", group="other/2", key=ALL)).status == 200
    ok = await proxy.post("/v1/rollouts/t1/reward", json={"reward": 1}, headers=auth(SUPPORT))
    assert ok.status == 200
    other = await proxy.post("/v1/rollouts/o1/reward", json={"reward": 1}, headers=auth(SUPPORT))
    assert other.status == 403
    assert stored(tmp_path / "data", "rewards") == ["t1"]


# -- admin tokens ---------------------------------------------------------------------------


async def test_the_admin_token_and_a_policy_admin_token_do_what_they_should_only(keyed, tmp_path):
    proxy = await keyed()
    promote = {"path": adapter_dir(tmp_path, "a1")}
    r = await proxy.post("/admin/adapters/promote", json=promote, headers=auth(OPS))
    assert r.status == 200, await r.text()
    r = await proxy.post("/admin/adapters/promote?policy=policy", json=promote, headers=auth(OPS))
    assert r.status == 200
    assert (await proxy.get("/admin/adapters", headers=auth(OPS))).status == 200
    assert (await proxy.get("/admin/adapters?policy=policy", headers=auth(OPS))).status == 200
    assert (await proxy.post("/admin/adapters/rollback", headers=auth(OPS))).status == 200
    refused = [
        proxy.get("/admin/adapters?policy=research", headers=auth(OPS)),
        proxy.post("/admin/adapters/promote?policy=research", json=promote, headers=auth(OPS)),
        proxy.post("/admin/adapters/rollback?policy=research", headers=auth(OPS)),
        proxy.post("/admin/adapters/rollback?policy=policy&policy=research", headers=auth(OPS)),
        proxy.post("/admin/adapters/prune", json={}, headers=auth(OPS)),
        proxy.get("/admin/stats", headers=auth(OPS)),
        proxy.get("/admin/maintenance", headers=auth(OPS)),
        proxy.get("/ui", headers=auth(OPS)),
    ]
    for r in await asyncio.gather(*refused):
        assert r.status == 403, r.url
        assert (await r.json())["error"]["code"] == "admin_forbidden"
    # It is no client key, and a client key is no admin token.
    assert (await post_chat(proxy, "policy", "x", key=OPS)).status == 401
    assert (await proxy.get("/admin/adapters", headers=auth(SUPPORT))).status == 401
    # The operator's token does all of it.
    for r in [
        await proxy.get("/admin/adapters?policy=research", headers=auth(ADMIN)),
        await proxy.post(
            "/admin/adapters/promote?policy=research",
            json={"path": adapter_dir(tmp_path, "b1")},
            headers=auth(ADMIN),
        ),
        await proxy.get("/admin/stats", headers=auth(ADMIN)),
    ]:
        assert r.status == 200, await r.text()


# -- limits ---------------------------------------------------------------------------------


async def test_a_rate_limited_key_gets_429_with_retry_after_while_another_is_served(
    make_proxy,
):
    table = (
        f'[[key]]\nname = "loop"\nsha256 = "{key_digest(SUPPORT)}"\nrate = 0.001\nburst = 2\n'
        f'[[key]]\nname = "calm"\nsha256 = "{key_digest(RESEARCH)}"\nrate = 0.001\nburst = 2\n'
    )
    proxy = await make_proxy(keys_toml=table)
    assert [(await post_chat(proxy, "policy", f"l{i}")).status for i in range(2)] == [200, 200]
    limited = await post_chat(proxy, "policy", "l2")
    assert limited.status == 429
    assert (await limited.json())["error"]["code"] == "rate_limit_exceeded"
    assert limited.headers["Retry-After"].isdigit() and int(limited.headers["Retry-After"]) >= 1
    assert limited.headers["x-ratelimit-remaining-requests"] == "0"
    assert (await post_chat(proxy, "policy", "c0", key=RESEARCH)).status == 200
    stats = await (await proxy.get("/admin/stats")).json()
    assert stats["keys"]["loop"]["refused"]["rate"] == 1 and stats["keys"]["loop"]["requests"] == 2
    assert stats["keys"]["calm"]["refused"]["rate"] == 0
    metrics = await (await proxy.get("/metrics")).text()
    assert 'overnight_key_refusals_total{key="loop",reason="rate"} 1.0' in metrics


async def test_a_key_over_its_concurrency_gets_429_while_another_is_served(
    make_proxy, fake_settings
):
    table = (
        f'[[key]]\nname = "one"\nsha256 = "{key_digest(SUPPORT)}"\nconcurrency = 1\n'
        f'[[key]]\nname = "other"\nsha256 = "{key_digest(RESEARCH)}"\nconcurrency = 1\n'
    )
    proxy = await make_proxy(keys_toml=table)
    fake_settings["delay"] = 0.5
    slow = asyncio.create_task(post_chat(proxy, "policy", "slow"))

    async def in_flight():
        return (await (await proxy.get("/admin/stats")).json())["keys"]["one"]["in_flight"] == 1

    await await_until(in_flight)
    second = await post_chat(proxy, "policy", "second")
    assert second.status == 429 and second.headers["Retry-After"] == "1"
    assert (await post_chat(proxy, "policy", "o", key=RESEARCH)).status == 200
    assert (await slow).status == 200
    stats = await (await proxy.get("/admin/stats")).json()
    assert stats["keys"]["one"] == {
        "requests": 1,
        "in_flight": 0,
        "refused": {"model": 0, "group": 0, "rollout": 0, "path": 0, "rate": 0, "concurrency": 1},
    }
