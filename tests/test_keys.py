"""Scoped keys, hashed keys, per-policy admin tokens and limits per key (issue 27).

The key matrix runs against the in-process proxy and fake vLLM with two policies: the
default `policy` (the support team's) and `research`."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import os

import pytest

from overnight.config import ConfigError, ProxyConfig
from overnight.config.keys import key_digest
from overnight.proxy.capture.records import add_key_note
from overnight.proxy.routes.key_buckets import BUCKETS_ENV, LocalBucket, SharedSlot
from overnight.proxy.routes.key_buckets import make_file as make_buckets_file
from overnight.proxy.routes.keys import KEYS, KeyRing
from overnight.storage import LogWriter, WriterConfig
from overnight.storage.read.rollout_lookup import DAYS, find_rollout
from overnight.testing.processes import spawn_fake_upstream, spawn_serve

from .helpers import (
    adapter_dir,
    await_until,
    completion_row,
    night_adapter,
    post_status,
    rows,
    wait_for_rows,
    wait_until,
)

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

    from overnight.cli.main import main

    runner = CliRunner()
    for given in (f"{RESEARCH}\n", RESEARCH, f"{RESEARCH}\r\n"):
        result = runner.invoke(main, ["key-hash"], input=given)
        assert result.exit_code == 0, result.output
        assert result.output.strip() == hashlib.sha256(RESEARCH.encode()).hexdigest()
        assert result.output.strip() == key_digest(RESEARCH)
    assert runner.invoke(main, ["key-hash"], input="").exit_code == 2  # no key: usage error


def test_serve_reads_the_keys_file_given_with_keys_file(tmp_path, monkeypatch):
    from overnight.cli.main import main
    from overnight.cli.options import build

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
    assert (await post_chat(proxy, "research", "r1", key=RESEARCH, group="r")).status == 200
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
    # The model list: a scoped key sees what it may ask for, without vLLM's paths (`root`).
    listed = await proxy.get("/v1/models", headers=auth(SUPPORT))
    assert listed.status == 200
    cards = (await listed.json())["data"]
    assert [c["id"] for c in cards] == ["policy"] and "root" not in cards[0]
    research = (await (await proxy.get("/v1/models", headers=auth(RESEARCH))).json())["data"]
    assert sorted(c["id"] for c in research) == ["fake-base", "research"]
    everything = (await (await proxy.get("/v1/models", headers=auth(ALL))).json())["data"]
    assert {"fake-base", "policy", "research"} <= {c["id"] for c in everything}
    assert any("root" in c for c in everything)  # an unscoped key: vLLM's list as it is
    await wait_for_rows(tmp_path / "data", 1)
    assert stored(tmp_path / "data", "completions") == ["r2"]  # a refusal is no completion
    sent = [r["body"].get("input") for r in received if r["path"].endswith("embeddings")]
    assert sent == []  # nothing refused reached vLLM


async def test_rewards_and_finishes_only_from_a_key_of_the_rollouts_policy(keyed, tmp_path):
    proxy = await keyed()
    assert (await post_chat(proxy, "policy", "support-1", key=SUPPORT)).status == 200
    assert (await post_chat(proxy, "research", "research-1", key=RESEARCH, group="r")).status == 200
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
    assert (await post_chat(proxy, "research", "shared", key=RESEARCH, group="r")).status == 200
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
    promote = {"path": night_adapter(tmp_path / "data", "a1", "policy")}  # its night's
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


async def test_a_record_names_its_key_and_the_refusals_since_the_keys_last_record(
    make_proxy, tmp_path
):
    """`overnight sql` answers which agent made a completion and how often it was turned
    away: the key's name on each of its records, its refusals on its next record."""
    table = (
        f'[[key]]\nname = "bot"\nsha256 = "{key_digest(SUPPORT)}"\npolicies = ["policy"]\n'
        "rate = 0.001\nburst = 3\n"
    )
    proxy = await make_proxy(keys_toml=table, api_keys=(ALL,))
    assert (await post_chat(proxy, "policy", "b0")).status == 200
    assert (await post_chat(proxy, "fake-base", "bx")).status == 403  # not its model
    assert (await post_chat(proxy, "policy", "b1")).status == 200
    assert [(await post_chat(proxy, "policy", f"r{i}")).status for i in range(2)] == [429, 429]
    bot = next(k for k in proxy.server.app[KEYS].live if k.name == "bot")
    bot.bucket.tokens = 1.0  # the bucket refilled (a second at rate 1000), without waiting
    assert (await post_chat(proxy, "policy", "b2")).status == 200
    assert (await post_chat(proxy, "policy", "p0", key=ALL)).status == 200  # a plain key
    data = tmp_path / "data"
    await wait_for_rows(data, 4)
    notes = {
        r["rollout_id"]: (r["k"], r["refused"])
        for r in rows(
            data,
            "SELECT rollout_id, json_extract_string(notes, '$.key') AS k, "
            "json_extract_string(notes, '$.key_refused') AS refused FROM completions",
        )
    }
    assert notes == {
        "b0": ("bot", None),
        "b1": ("bot", '{"model":1}'),
        "b2": ("bot", '{"rate":2}'),
        "p0": (None, None),
    }
    # The question as an operator asks it, over every record of the key.
    (summary,) = rows(
        data,
        "SELECT count(*) AS served, "
        "sum(CAST(json_extract(notes, '$.key_refused.rate') AS INT)) AS rate, "
        "sum(CAST(json_extract(notes, '$.key_refused.model') AS INT)) AS model "
        "FROM completions WHERE json_extract_string(notes, '$.key') = 'bot'",
    )
    assert summary == {"served": 3, "rate": 2, "model": 1}


def test_a_keys_note_joins_the_records_other_notes_and_counts_refusals_once():
    """n choices: the key on every row, its refusals on the first only (a sum over rows
    counts each once); a note already there (the token ids') stays."""
    rows_ = [{"notes": {"completion_token_ids": "no ids"}}, {}]
    add_key_note(rows_, {"key": "bot", "key_refused": {"rate": 2}})
    assert rows_ == [
        {"notes": {"completion_token_ids": "no ids", "key": "bot", "key_refused": {"rate": 2}}},
        {"notes": {"key": "bot"}},
    ]
    plain = [{}]
    add_key_note(plain, None)  # no scoped key: nothing said
    assert plain == [{}]


def test_the_workers_of_one_proxy_share_a_keys_bucket(tmp_path, monkeypatch):
    """Two workers' key rings (as `--workers 2` makes them) on the supervisor's file: the
    burst is the key's, not each worker's; a ring made later (a restarted worker) finds
    the bucket as it was, and a key without a rate has none."""
    table = (
        f'[[key]]\nname = "bot"\nsha256 = "{key_digest(SUPPORT)}"\nrate = 0.001\nburst = 3\n'
        f'[[key]]\nname = "free"\nsha256 = "{key_digest(RESEARCH)}"\n'
    )
    config = ProxyConfig(upstream="http://x", data_dir=tmp_path, keys_toml=table, workers=2)
    monkeypatch.setenv(BUCKETS_ENV, "")  # so that the name make_file sets is undone after
    made = make_buckets_file(config)
    assert os.environ[BUCKETS_ENV] == str(made) and made.stat().st_size == 0
    one, two = KeyRing(config), KeyRing(config)
    bot_one, bot_two = one.live[0], two.live[0]
    assert isinstance(bot_one.bucket, SharedSlot) and one.live[1].bucket is None
    taken = [bot_one.bucket.take(), bot_two.bucket.take(), bot_one.bucket.take()]
    taken.append(bot_two.bucket.take())
    assert taken[:3] == [0.0, 0.0, 0.0] and taken[3] > 0  # three in all, not three each
    assert KeyRing(config).live[0].bucket.take() > 0  # a restarted worker: still empty
    alone = KeyRing(dataclasses.replace(config, workers=1))  # one process: its own bucket
    assert isinstance(alone.live[0].bucket, LocalBucket) and alone.live[0].bucket.take() == 0.0
    made.unlink()


@pytest.mark.slow
def test_a_keys_rate_holds_across_the_workers_of_a_real_serve(tmp_path):
    """`overnight serve --workers 2`, both workers serving (seen in the records of a key
    without a rate): the limited key still gets its burst of 3, not 3 from each."""
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f'[[key]]\nname = "bot"\nsha256 = "{key_digest(SUPPORT)}"\nrate = 0.001\nburst = 3\n'
        f'[[key]]\nname = "free"\nsha256 = "{key_digest(RESEARCH)}"\n'
    )
    body = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    data = tmp_path / "data"

    def post(url: str, key: str) -> int:
        return post_status(url + "/v1/chat/completions", body, auth(key))

    def both_serve(url: str) -> bool:
        assert post(url, RESEARCH) == 200
        return len(rows(data, "SELECT DISTINCT proxy_id FROM completions")) == 2

    args = ("--workers", "2", "--keys-file", str(keys))
    with (
        spawn_fake_upstream() as upstream,
        spawn_serve(data, "--upstream", upstream.url, *args) as serve,
    ):
        wait_until(lambda: both_serve(serve.url), timeout=60, what="both workers serving")
        statuses = [post(serve.url, SUPPORT) for _ in range(24)]
    assert sorted(statuses) == [200] * 3 + [429] * 21, statuses


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


# -- a key steers no policy it may not use (the security review, issue 27) ----------------


async def test_a_key_may_not_serve_in_another_policys_group_nor_train_it(keyed, tmp_path):
    """research adding a rollout to support's group is refused; the base model research
    may ask for trains no policy when the proxy serves several; a group mixed across
    workers (where the proxy does not remember it) is trained by neither policy."""
    from overnight.storage import open_db
    from overnight.storage.read.policy_scope import PolicyScope

    proxy = await keyed()
    group = "support/ticket-4411"
    assert (await post_chat(proxy, "policy", "s-1", key=SUPPORT, group=group)).status == 200
    r = await post_chat(proxy, "research", "evil-1", key=RESEARCH, group=group)
    assert r.status == 403, await r.text()
    assert (await r.json())["error"]["code"] == "permission_denied"
    # The other way too: support may not serve in a group first served as the base model.
    assert (await post_chat(proxy, "fake-base", "b-1", key=RESEARCH, group="base")).status == 200
    assert (await post_chat(proxy, "policy", "s-2", key=SUPPORT, group="base")).status == 403
    other_worker = await keyed()  # a fresh memory: the proxy lets this one through
    assert (
        await post_chat(other_worker, "research", "evil-2", key=RESEARCH, group=group)
    ).status == 200
    await wait_for_rows(tmp_path / "data", 3)
    state = await (await proxy.get("/admin/adapters", headers=auth(ADMIN))).json()
    assert state["others_trained"] is False
    con = open_db(tmp_path / "data")
    try:
        for name in ("policy", "research"):
            assert PolicyScope.of(name, state).groups(con, [group, "base"]) == set(), name
    finally:
        con.close()
    stats = await (await proxy.get("/admin/stats", headers=auth(ADMIN))).json()
    assert stats["keys"]["research"]["refused"]["group"] == 1
    assert stats["keys"]["support"]["refused"]["group"] == 1


async def test_with_one_policy_the_base_model_trains_it_as_before(make_proxy, tmp_path):
    """With one policy every key limited to policies has it: the base model trains it."""
    from overnight.storage import open_db
    from overnight.storage.read.policy_scope import PolicyScope
    from overnight.trainer.live.rewards import policy_of

    table = (
        f'[[key]]\nname = "s"\nsha256 = "{key_digest(SUPPORT)}"\npolicies = ["policy"]\n'
        'models = ["fake-base"]\n'
    )
    proxy = await make_proxy(keys_toml=table)
    state = await (await proxy.get("/admin/adapters")).json()
    assert state["others_trained"] is True
    assert (await post_chat(proxy, "fake-base", "b-1", group="x")).status == 200
    await wait_for_rows(tmp_path / "data", 1)
    con = open_db(tmp_path / "data")
    try:
        assert PolicyScope.of("policy", state).groups(con, ["x"]) == {"x"}
    finally:
        con.close()
    assert policy_of(state) is None  # the watch counts every rollout, as before


async def test_a_reused_rollout_id_is_nobodys_by_branch_restart_or_another_worker(keyed, tmp_path):
    """A second team serving an id another served (as a branch `x.1` of an n=3 request,
    after a restart, on another worker) gets no reward into it, nor does the first."""
    data = tmp_path / "data"
    proxy = await keyed()
    body, headers = chat("research", "x", key=RESEARCH, group="r")
    r = await proxy.post("/v1/chat/completions", json={**body, "n": 3}, headers=headers)
    assert r.status == 200, await r.text()
    assert (await post_chat(proxy, "policy", "x.1", key=SUPPORT, group="s")).status == 200
    for key in (SUPPORT, RESEARCH):
        r = await proxy.post("/v1/rollouts/x.1/reward", json={"reward": 1}, headers=auth(key))
        assert r.status == 403, key
    own = await proxy.post("/v1/rollouts/x.2/reward", json={"reward": 1}, headers=auth(RESEARCH))
    assert own.status == 200  # research's other branches stay its own
    assert (await post_chat(proxy, "research", "ep-1", key=RESEARCH, group="r")).status == 200
    await wait_for_rows(data, 5)
    await proxy.close()  # a restart: ep-1 is in Parquet only
    assert find_rollout(data, "ep-1") == ("research", "r")
    second = await keyed()
    other_worker = await keyed()  # the same directory, another memory
    assert (await post_chat(second, "policy", "ep-1", key=SUPPORT, group="s")).status == 200
    assert (await post_chat(second, "research", "ep-2", key=RESEARCH, group="r")).status == 200
    await wait_for_rows(data, 7)
    assert (await post_chat(other_worker, "policy", "ep-2", key=SUPPORT, group="s")).status == 200
    for proxy, rollout in ((second, "ep-1"), (other_worker, "ep-2")):
        for key in (SUPPORT, RESEARCH):
            r = await proxy.post(
                f"/v1/rollouts/{rollout}/reward", json={"reward": 1}, headers=auth(key)
            )
            assert r.status == 403, (rollout, key)
    # The store's answer joins the live logs' (support's ep-1) and Parquet's (research's).
    assert find_rollout(data, "ep-1") == (None, None)
    assert stored(data, "rewards") == ["x.2"]


async def test_a_non_ascii_rollout_id_is_found_in_the_live_logs(keyed, tmp_path):
    first, other_worker = await keyed(), await keyed()
    assert (await post_chat(first, "policy", "épisode-1", key=SUPPORT)).status == 200
    await wait_for_rows(tmp_path / "data", 1)
    assert find_rollout(tmp_path / "data", "épisode-1") == ("policy", "g")
    r = await other_worker.post(
        "/v1/rollouts/%C3%A9pisode-1/reward", json={"reward": 1}, headers=auth(SUPPORT)
    )
    assert r.status == 200, await r.text()


async def test_a_refusal_consults_the_store_as_for_an_unknown_id(keyed, monkeypatch):
    """Another team's remembered id and an unknown one are refused after the same store
    lookup (the time tells nothing); the key's own remembered id needs one lookup only."""
    from overnight.proxy.routes import served_rollouts as lookups

    looked: list[str] = []

    def counting(data_dir, rollout_id):
        looked.append(rollout_id)
        return find_rollout(data_dir, rollout_id)

    monkeypatch.setattr(lookups, "find_rollout", counting)
    monkeypatch.setattr(lookups, "CACHE_SECONDS", 0.0)  # every answer looked up again
    proxy = await keyed()
    assert (await post_chat(proxy, "policy", "s-1", key=SUPPORT, group="s")).status == 200
    for key, rollout, status in (
        (SUPPORT, "s-1", 200),  # the first time: memory and the store merged
        (SUPPORT, "s-1", 200),  # then memory alone
        (RESEARCH, "s-1", 403),
        (RESEARCH, "unknown", 403),
    ):
        r = await proxy.post(f"/v1/rollouts/{rollout}/finish", headers=auth(key))
        assert r.status == status, (key, rollout)
    assert looked == ["s-1", "s-1", "unknown"]


async def test_store_lookups_are_bounded_per_key_and_in_time(keyed, monkeypatch):
    """While one lookup hangs: a key's next lookup past its cap gets 503 and Retry-After,
    another key's still waits its turn, until the queue is full; a lookup past its time
    limit is a 503 too (an unscoped key looks nothing up)."""
    import threading

    from overnight.proxy.routes import served_rollouts as lookups

    release = threading.Event()

    def hanging(data_dir, rollout_id):
        release.wait(10)
        return None

    monkeypatch.setattr(lookups, "find_rollout", hanging)
    monkeypatch.setattr(lookups, "PER_KEY", 1)
    monkeypatch.setattr(lookups, "LOOKUP_SECONDS", 30.0)
    proxy = await keyed()
    try:
        first = asyncio.create_task(proxy.post("/v1/rollouts/a/finish", headers=auth(SUPPORT)))
        served = proxy.app[lookups.SERVED]
        await await_until(lambda: served.waiting == 1)
        busy = await proxy.post("/v1/rollouts/b/finish", headers=auth(SUPPORT))
        assert busy.status == 503 and busy.headers["Retry-After"] == "1"
        assert (await busy.json())["error"]["code"] == "rollout_lookups_busy"
        other = asyncio.create_task(proxy.post("/v1/rollouts/c/finish", headers=auth(RESEARCH)))
        await await_until(lambda: served.waiting == 2)
        monkeypatch.setattr(lookups, "PER_KEY", 5)
        monkeypatch.setattr(lookups, "QUEUE", 2)
        full = await proxy.post("/v1/rollouts/d/finish", headers=auth(SUPPORT))
        assert full.status == 503  # the queue is full
        assert (await proxy.post("/v1/rollouts/d/finish", headers=auth(ALL))).status == 200
        release.set()
        assert (await first).status == 403 and (await other).status == 403
        release.clear()
        monkeypatch.setattr(lookups, "LOOKUP_SECONDS", 0.2)
        slow = await proxy.post("/v1/rollouts/e/finish", headers=auth(SUPPORT))
        assert slow.status == 503
    finally:
        release.set()


async def test_a_key_may_not_continue_or_read_another_policys_response(keyed, tmp_path, received):
    """support naming research's response as `previous_response_id` is refused (vLLM would
    prompt with research's conversation), as is reading it back; research continues its
    own, and after a restart (the chain from the store) still."""
    proxy = await keyed()
    research = {**auth(RESEARCH), "X-Rollout-Id": "res-1", "X-Rollout-Group": "r"}
    body = {"model": "research", "input": "research's prompt"}
    r = await proxy.post("/v1/responses", json=body, headers=research)
    assert r.status == 200, await r.text()
    response_id = (await r.json())["id"]
    support = {**auth(SUPPORT), "X-Rollout-Id": "sup-1", "X-Rollout-Group": "s"}
    follow = {"model": "policy", "input": "next", "previous_response_id": response_id}
    r = await proxy.post("/v1/responses", json=follow, headers=support)
    assert r.status == 403 and (await r.json())["error"]["code"] == "permission_denied"
    unknown = {**follow, "previous_response_id": "resp_nowhere"}
    assert (await proxy.post("/v1/responses", json=unknown, headers=support)).status == 403
    assert (await proxy.get(f"/v1/responses/{response_id}", headers=auth(SUPPORT))).status == 403
    own = {**follow, "model": "research"}
    assert (await proxy.post("/v1/responses", json=own, headers=research)).status == 200
    await wait_for_rows(tmp_path / "data", 2)
    await proxy.close()
    again = await keyed()  # the chain from the store
    assert (await again.post("/v1/responses", json=follow, headers=support)).status == 403
    assert (await again.post("/v1/responses", json=own, headers=research)).status == 200
    sent = [
        r["body"].get("previous_response_id") for r in received if r["path"].endswith("responses")
    ]
    assert sent == [None, response_id, response_id]  # nothing refused reached vLLM
    requests = rows(tmp_path / "data", "SELECT model_requested, request FROM completions")
    assert all(
        "research's prompt" not in r["request"]
        for r in requests
        if r["model_requested"] == "policy"
    )


async def test_the_rollouts_memory_keeps_no_clients_model_string(make_proxy):
    """A model name no limited key may use is remembered as "" (a huge one pins nothing),
    and the memory stays within its bound when store answers are added too."""
    from overnight.proxy.routes.keys import SERVED

    table = f'[[key]]\nname = "x"\nsha256 = "{key_digest(SUPPORT)}"\npolicies = ["policy"]\n'
    proxy = await make_proxy(api_keys=(ALL,), keys_toml=table)
    big = "m" * 100_000
    for i in range(3):
        body, headers = chat(big, f"big-{i}", key=ALL)
        await proxy.post("/v1/chat/completions", json=body, headers=headers)
    assert (await post_chat(proxy, "policy", "mine", key=SUPPORT, group="s")).status == 200
    served = proxy.app[SERVED]
    assert {served.seen[f"big-{i}"] for i in range(3)} == {("", "g")}
    assert served.seen["mine"] == ("policy", "s") and served.groups == {"g": "", "s": "policy"}
    served.capacity = 2
    for rollout in ("mine", "big-0", "big-1"):  # store answers merged in, kept bounded
        await proxy.post(f"/v1/rollouts/{rollout}/finish", headers=auth(SUPPORT))
    assert len(served.seen) <= 2


def test_a_keys_file_refuses_unbounded_rates_and_the_empty_keys_digest():
    zero = "0" * 64
    bad = {
        f'sha256 = "{zero}"\nrate = nan': "rate must be",
        f'sha256 = "{zero}"\nrate = inf': "rate must be",
        f'sha256 = "{zero}"\nrate = 1e-320\nburst = 1': "rate must be",
        f'sha256 = "{zero}"\nrate = 1e300': "rate must be",
        f'sha256 = "{zero}"\nrate = 1\nburst = 10_000_000': "burst must be",
        f'sha256 = "{hashlib.sha256(b"").hexdigest()}"': "the empty key",
    }
    for table, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            ProxyConfig(upstream="http://x", keys_toml=f'[[key]]\nname = "a"\n{table}\n')
    empty_admin = (
        f'[[admin]]\nname = "a"\npolicy = "policy"\nsha256 = "{hashlib.sha256(b"").hexdigest()}"\n'
    )
    with pytest.raises(ConfigError, match="the empty key"):
        ProxyConfig(upstream="http://x", keys_toml=empty_admin)
    slow = ProxyConfig(
        upstream="http://x", keys_toml=f'[[key]]\nname = "a"\nsha256 = "{zero}"\nrate = 1e-6\n'
    )
    assert slow.keys[0].bucket == 1
