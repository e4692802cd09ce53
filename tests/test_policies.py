"""Several policies behind one proxy (issue 27): one alias each, each with its own
promotion stack, canary and state file, against the fake vLLM."""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from overnight.cli.main import main
from overnight.config import ProxyConfig, TrainConfig
from overnight.errors import ConfigError, OvernightError
from overnight.proxy.alias.promotions import offline_state_path, policy_state_paths, state_path
from overnight.proxy.state import POLICIES
from overnight.storage import LogWriter, WriterConfig, now_us, open_db
from overnight.storage.read.policy_scope import PolicyScope
from overnight.trainer.choose.inputs import Selection
from overnight.trainer.choose.plan import plan_run
from overnight.trainer.choose.selection import last_selection
from overnight.trainer.gate.prompts import _first_turns
from overnight.trainer.live.rewards import live_rewards, policy_of
from overnight.trainer.run.checkpoint import RunDir, unfinished_run
from overnight.trainer.run.record import RunResult, record_run
from overnight.trainer.serving.proxy_client import promote_adapter, proxy_policies, serving_state
from overnight.view.display import adapter_events
from overnight.view.report import write_report

from .helpers import (
    adapter_dir,
    await_until,
    completion_row,
    lora_calls,
    rows,
    version_of,
    wait_for_rows,
)
from .test_bucket_promotion import machines, weights  # noqa: F401 (the fixture)
from .test_object_storage import objects, s3  # noqa: F401 (the fixture)


def chat(model: str, rollout: str | None = None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    if rollout is not None:
        body["metadata"] = {"rollout_group": f"g-{rollout}", "rollout_id": rollout}
    return body


def served(received) -> list[str | None]:
    """The model names the fake was asked for, versioned names without their tail."""
    return [version_of(r["body"]["model"]) for r in received if r["path"].endswith("completions")]


async def promote(proxy, path: str, policy: str | None = None, **body):
    query = {"policy": policy} if policy else {}
    return await proxy.post("/admin/adapters/promote", params=query, json={"path": path, **body})


async def state_of(proxy, policy: str | None = None) -> dict:
    r = await proxy.get("/admin/adapters", params={"policy": policy} if policy else {})
    assert r.status == 200, await r.text()
    return await r.json()


def test_the_policies_are_the_alias_and_each_named_one():
    config = ProxyConfig(upstream="http://x", policies=("support", "research"))
    assert config.policy_names == ("policy", "support", "research")
    assert ProxyConfig(upstream="http://x").policy_names == ("policy",)
    named = ProxyConfig(upstream="http://x", alias="support", policies=("support", "coding"))
    assert named.policy_names == ("support", "coding")  # the alias given again: once
    for bad in (("a/b",), ("..",), ("",), ("x" * 65,), ("same", "same")):
        with pytest.raises(ConfigError):
            ProxyConfig(upstream="http://x", policies=bad)


def test_the_default_policy_keeps_adapters_json(tmp_path):
    assert state_path(tmp_path, "policy", "policy") == tmp_path / "adapters.json"
    assert state_path(tmp_path, "support", "policy") == (
        tmp_path / "policies" / "support" / "adapters.json"
    )


async def test_each_alias_has_its_own_stack(make_proxy, received, tmp_path):
    proxy = await make_proxy(policies=("support", "research"))
    r = await promote(proxy, adapter_dir(tmp_path, "s1"), "support")
    assert r.status == 200, await r.text()
    promoted = await r.json()
    assert version_of(promoted["promoted"]) == "support-v1"  # vLLM's one namespace
    assert promoted["alias"] == "support"
    for model in ("support", "research", "policy", "fake-base"):
        assert (await proxy.post("/v1/chat/completions", json=chat(model))).status == 200
    # Only the promoted policy's alias moved; the others still mean the base model.
    assert served(received) == ["support-v1", "fake-base", "fake-base", "fake-base"]
    rows = await wait_for_rows(tmp_path / "data", 4)
    assert [(r["model_requested"], version_of(r["model_served"])) for r in rows] == [
        ("support", "support-v1"),
        ("research", "fake-base"),
        ("policy", "fake-base"),
        ("fake-base", "fake-base"),
    ]
    # Each state in its own file: the default's stays DATA/adapters.json.
    data = tmp_path / "data"
    support = json.loads((data / "policies" / "support" / "adapters.json").read_text())
    assert support["alias"] == "support" and len(support["stack"]) == 1
    assert not (data / "adapters.json").exists()
    assert not (data / "policies" / "research" / "adapters.json").exists()
    default = await state_of(proxy)
    assert default["alias"] == "policy" and default["current"] is None
    assert default["policies"] == ["policy", "support", "research"]
    assert (await state_of(proxy, "support"))["current"]["name"] == promoted["promoted"]


async def test_rolling_back_one_policy_leaves_the_others(make_proxy, received, tmp_path):
    proxy = await make_proxy(policies=("support", "research"))
    await promote(proxy, adapter_dir(tmp_path, "s1"), "support")
    await promote(proxy, adapter_dir(tmp_path, "s2"), "support")
    await promote(proxy, adapter_dir(tmp_path, "r1"), "research")
    r = await proxy.post("/admin/adapters/rollback", params={"policy": "research"})
    assert r.status == 200, await r.text()
    assert (await r.json())["current"] is None  # research: the base model again
    support = await state_of(proxy, "support")
    assert version_of(support["current"]["name"]) == "support-v2"
    assert [version_of(n) for n in support["stack"]] == ["support-v1", "support-v2"]
    # A rollback of a policy that serves the base model is refused for that one only.
    r = await proxy.post("/admin/adapters/rollback", params={"policy": "research"})
    assert r.status == 400
    received.clear()
    await proxy.post("/v1/chat/completions", json=chat("support"))
    await proxy.post("/v1/chat/completions", json=chat("research"))
    assert served(received) == ["support-v2", "fake-base"]


async def test_a_canary_on_one_policy(make_proxy, received, tmp_path):
    proxy = await make_proxy(policies=("support", "research"))
    await promote(proxy, adapter_dir(tmp_path, "r1"), "research")
    r = await promote(proxy, adapter_dir(tmp_path, "r2"), "research", canary=0.5)
    assert r.status == 200, await r.text()
    canary = (await r.json())["canary"]
    assert version_of(canary["name"]) == "research-v2" and canary["fraction"] == 0.5
    assert (await state_of(proxy, "support"))["canary"] is None
    for i in range(40):
        await proxy.post("/v1/chat/completions", json=chat("research", f"r{i}"))
        await proxy.post("/v1/chat/completions", json=chat("support", f"s{i}"))
    research = [m for m in served(received) if m.startswith("research")]
    support = [m for m in served(received) if not m.startswith("research")]
    assert set(research) == {"research-v1", "research-v2"}  # both halves of the share
    assert set(support) == {"fake-base"}  # no canary reaches the other alias
    # Dropping it (research only) leaves support as it was.
    r = await proxy.post(
        "/admin/adapters/rollback", params={"policy": "research"}, json={"canary": True}
    )
    assert (await r.json())["canary"] is None


async def test_an_unknown_policy_is_refused(make_proxy, tmp_path):
    proxy = await make_proxy(policies=("support",))
    for method, path in (
        ("GET", "/admin/adapters"),
        ("POST", "/admin/adapters/promote"),
        ("POST", "/admin/adapters/rollback"),
        ("POST", "/admin/adapters/prune"),
    ):
        body = {"path": adapter_dir(tmp_path, "x")} if path.endswith("promote") else {}
        r = await proxy.request(method, path, params={"policy": "research"}, json=body)
        assert r.status == 404, (path, await r.text())
        error = (await r.json())["error"]
        assert error["code"] == "unknown_policy" and "policy, support" in error["message"]
    assert not (tmp_path / "data" / "policies" / "research").exists()
    twice = await proxy.get("/admin/adapters?policy=support&policy=policy")
    assert twice.status == 400 and "name one policy" in (await twice.json())["error"]["message"]


async def test_models_lists_every_alias(make_proxy, tmp_path):
    proxy = await make_proxy(policies=("support", "research"))
    await promote(proxy, adapter_dir(tmp_path, "s1"), "support")
    listing = await (await proxy.get("/v1/models")).json()
    ids = [m["id"] for m in listing["data"]]
    assert {"policy", "support", "research", "fake-base"} <= set(ids)
    assert [version_of(i) for i in ids if i.startswith("support-")] == ["support-v1"]
    cards = {m["id"]: m for m in listing["data"]}
    assert cards["support"]["parent"] == "fake-base" and cards["support"]["owned_by"] == "overnight"


async def test_an_old_data_directory_reads_as_the_default_policy(make_proxy, received, tmp_path):
    """A directory written by a proxy of one alias: started again with more policies, the
    default one keeps serving its adapter and stack; the new ones start on the base model."""
    data = tmp_path / "data"
    old = await make_proxy(data_dir=data)
    await promote(old, adapter_dir(tmp_path, "a1"))
    await promote(old, adapter_dir(tmp_path, "a2"))
    before = await state_of(old)
    await old.close()
    assert policy_state_paths(data) == [data / "adapters.json"]
    new = await make_proxy(data_dir=data, policies=("support",))
    after = await state_of(new)
    assert after["current"]["name"] == before["current"]["name"]  # the same name, restored
    assert after["stack"] == before["stack"]
    received.clear()
    await new.post("/v1/chat/completions", json=chat("policy"))
    await new.post("/v1/chat/completions", json=chat("support"))
    assert served(received) == ["policy-v2", "fake-base"]
    # The other policy's promotion numbers its own adapters from 1.
    r = await promote(new, adapter_dir(tmp_path, "s1"), "support")
    assert version_of((await r.json())["promoted"]) == "support-v1"
    assert policy_state_paths(data) == [
        data / "adapters.json",
        data / "policies" / "support" / "adapters.json",
    ]


async def test_a_second_proxy_follows_each_policy(make_proxy, tmp_path):
    data = tmp_path / "data"
    a = await make_proxy(data_dir=data, policies=("support",), state_poll_interval=0.05)
    b = await make_proxy(data_dir=data, policies=("support",), state_poll_interval=0.05)
    r = await promote(a, adapter_dir(tmp_path, "s1"), "support")
    name = (await r.json())["promoted"]

    async def b_serves() -> bool:
        return ((await state_of(b, "support"))["current"] or {}).get("name") == name

    await await_until(b_serves, what="B follows the support policy")
    assert (await state_of(b))["current"] is None  # the default policy did not move


async def test_prune_through_one_policy_keeps_every_policys_adapters(make_proxy, tmp_path):
    proxy = await make_proxy(policies=("support",))
    data = tmp_path / "data"
    nights = []
    for i in range(3):
        night = data / "adapters" / f"night-{i}"
        night.mkdir(parents=True)
        (night / "adapter_config.json").write_text("{}")
        nights.append(str(night.resolve()))
    await promote(proxy, nights[0], "support")
    await promote(proxy, nights[1])  # the default policy
    r = await proxy.post(
        "/admin/adapters/prune", params={"policy": "support"}, json={"keep": 0, "dry_run": True}
    )
    assert r.status == 200, await r.text()
    pruned = await r.json()
    kept = " ".join(pruned["kept"])
    assert nights[0] in kept and nights[1] in kept  # each policy's served adapter
    assert pruned["deleted"] == []  # night-2 is the newest night's: kept too


async def test_adapter_info_per_policy(make_proxy, tmp_path):
    proxy = await make_proxy(policies=("support",))
    r = await promote(proxy, adapter_dir(tmp_path, "s1"), "support")
    name = (await r.json())["promoted"]
    text = await (await proxy.get("/metrics")).text()
    info = [
        dict(s.labels)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "overnight_adapter_info"
    ]
    by_policy = {i["policy"]: i for i in info}
    assert set(by_policy) == {"policy", "support"}
    assert by_policy["support"]["adapter"] == name and by_policy["support"]["alias"] == "support"
    assert by_policy["policy"]["adapter"] == "" and by_policy["policy"]["version"] == "0"


async def test_a_replica_is_live_only_once_it_serves_every_policys_adapter(
    make_proxy, received, tmp_path
):
    """A replica is synced (takes traffic) only while it serves each policy's adapter:
    one missing the support adapter would 404 that alias, whatever the default serves."""
    proxy = await make_proxy(policies=("support",))
    await promote(proxy, adapter_dir(tmp_path, "p1"))
    await promote(proxy, adapter_dir(tmp_path, "s1"), "support")
    assert [version_of(n) for _, n in lora_calls(received)] == ["policy-v1", "support-v1"]
    policies = proxy.app[POLICIES]
    (replica,) = policies.get(None).balancer.replicas
    assert replica.synced
    support = policies.get("support").current.name
    replica.served.discard(support)  # as if vLLM lost it
    policies.get(None)._mark_synced()  # the default policy's check: its adapter is there
    assert not replica.synced
    await policies.check_upstream()  # the replicas asked again: vLLM lists both
    assert replica.synced


# -- the batch: a policy's night trains on its own groups --------------------------------

POLICIES_STATE = {"policies": ["policy", "support", "research"], "default": "policy"}


def write_groups(data_dir, groups: dict[str, str], at: int | None = None) -> None:
    """Two-rollout groups (rewards 1 and 0, finished), each asking for the model given."""
    writer = LogWriter(WriterConfig(data_dir, commit_interval=0.0))
    writer.start()
    now = now_us() if at is None else at
    for group, model in groups.items():
        for i in range(2):
            rollout = f"{group}.{i}"
            writer.append("completions", completion_row(
                rollout, group, started_at=now, ended_at=now, model_requested=model,
                model_served=model, prompt_token_ids=[1, 2, 3],
                completion_token_ids=[10 + i, 11], completion_logprobs=[-0.5, -0.25],
                request=json.dumps({"model": model, "messages": [
                    {"role": "user", "content": f"task of {group}"}]}),
            ))  # fmt: skip
            writer.append("finishes", {"rollout_id": rollout, "schema_version": 1,
                                       "finished_at": now})  # fmt: skip
            writer.append("rewards", {"reward_id": f"{rollout}.agent", "schema_version": 1,
                                      "rollout_id": rollout, "reward": float(1 - i),
                                      "source": "agent", "created_at": now})  # fmt: skip
    writer.close()


def scope(name: str | None) -> PolicyScope | None:
    return PolicyScope.of(name, POLICIES_STATE)


def test_a_policys_night_plans_its_own_groups_only(tmp_path):
    write_groups(tmp_path, {"s1": "support", "r1": "research", "s2": "support",
                            "p1": "policy", "b1": "fake-base"})  # fmt: skip
    config = TrainConfig()

    def planned(name: str | None) -> list[str]:
        return sorted(
            plan_run(Selection(tmp_path, settle_seconds=600, scope=scope(name)), config).groups
        )

    assert planned("support") == ["s1", "s2"]
    assert planned("research") == ["r1"]
    # What asked for no policy (the base model) trains none of several: any policy's key
    # may be let ask for it, and no key steers a policy it may not use.
    assert planned("policy") == ["p1"]
    assert planned(None) == ["b1", "p1", "r1", "s1", "s2"]  # no proxy: every group
    # Without the proxy's list, a named policy is its own alias's groups.
    alone = PolicyScope.of("support", {})
    assert sorted(
        plan_run(Selection(tmp_path, settle_seconds=600, scope=alone), config).groups
    ) == [
        "s1",
        "s2",
    ]


def test_a_group_mixing_two_policies_trains_neither(tmp_path):
    """A rollout asking for another policy in a policy's group (across workers, where the
    proxy does not remember the group) is not the policy's: the group trains nobody,
    and with one policy the base model's groups train it, as before."""
    write_groups(tmp_path, {"s1": "support", "s2": "support", "b1": "fake-base"})
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0))
    writer.start()
    writer.append("completions", completion_row("s1.x", "s1", model_requested="research"))
    writer.close()
    config = TrainConfig()
    for name in ("support", "research"):
        planned = plan_run(
            Selection(tmp_path, settle_seconds=600, scope=scope(name)), config
        ).groups
        assert "s1" not in planned, name
    assert sorted(
        plan_run(Selection(tmp_path, settle_seconds=600, scope=scope("support")), config).groups
    ) == ["s2"]
    one = PolicyScope.of("policy", {"policies": ["policy"], "others_trained": True})
    assert "b1" in plan_run(Selection(tmp_path, settle_seconds=600, scope=one), config).groups


def test_each_policy_reads_its_own_selection_record(tmp_path):
    """A night of one policy leaves a record only that policy's next night starts from;
    a record from before policies is the default policy's."""
    write_groups(tmp_path, {"s1": "support", "r1": "research"}, at=now_us() - 10_000_000)
    support = TrainConfig(policy="support")
    plan = plan_run(Selection(tmp_path, settle_seconds=0, scope=scope("support")), support)
    assert plan.groups == ["s1"] and plan.selection["policy"] == "support"
    record_run(tmp_path, RunResult("night-support", plan), support, "b", None, now_us(), None)
    old = plan_run(
        Selection(tmp_path, settle_seconds=0), TrainConfig()
    )  # no scope: before policies
    assert old.selection["policy"] is None

    def last(name: str | None) -> dict | None:
        con = open_db(tmp_path)
        try:
            return last_selection(con, TrainConfig(), scope(name))
        finally:
            con.close()

    assert last("support")["watermark"] == plan.selection["watermark"]
    assert last("research") is None  # support's night says nothing of research's groups
    assert last("policy") is None
    research = plan_run(Selection(tmp_path, settle_seconds=0, scope=scope("research")), TrainConfig(policy="research"))  # fmt: skip
    assert research.looked_since is None and research.groups == ["r1"]
    record_run(tmp_path, RunResult("night-old", old), TrainConfig(), "b", None, now_us(), None)
    assert last("policy")["watermark"] == old.selection["watermark"]  # an old record: default's
    assert last("support")["watermark"] == plan.selection["watermark"]
    (row,) = rows(tmp_path, "SELECT metrics FROM training_runs WHERE run_id = 'night-support'")
    assert json.loads(row["metrics"])["policy"] == "support"


def test_a_policy_resumes_only_its_own_interrupted_run(tmp_path):
    RunDir(tmp_path / "runs" / "20260101-000000-aaaaaa").begin(["s1"], None, "support")
    RunDir(tmp_path / "runs" / "20260101-000001-bbbbbb").begin(["p1"], None, None)
    research = scope("research")
    assert unfinished_run(tmp_path, research.owns) is None
    assert unfinished_run(tmp_path, scope("support").owns).name.endswith("aaaaaa")
    assert unfinished_run(tmp_path, scope("policy").owns).name.endswith("bbbbbb")  # from before


async def test_the_batchs_admin_calls_name_the_policy(make_proxy, tmp_path):
    """The batch's side of the admin API (urllib, as a night runs it) carries ?policy=."""
    proxy = await make_proxy(policies=("support",))
    url = str(proxy.make_url("")).rstrip("/")
    assert await asyncio.to_thread(proxy_policies, url, None) == ["policy", "support"]
    path = adapter_dir(tmp_path, "s1")
    name = await asyncio.to_thread(promote_adapter, url, None, path, "support")
    assert version_of(name) == "support-v1"
    support = await asyncio.to_thread(serving_state, url, None, "support")
    assert support["current"]["name"] == name and support["alias"] == "support"
    assert (await asyncio.to_thread(serving_state, url, None))["current"] is None


# -- the views: runs, ls, the report and /ui per policy ----------------------------------


def two_nights_recorded(data) -> None:
    """A night of each policy, and one from before policies, in training_runs."""
    write_groups(data, {"s1": "support", "p1": "policy"})
    for name, policy, groups in (("night-old", None, ["p0"]), ("night-support", "support", ["s1"]),
                                 ("night-policy", "policy", ["p1"])):  # fmt: skip
        plan = plan_run(Selection(data, settle_seconds=600), TrainConfig())
        plan.groups = groups
        config = TrainConfig(policy=policy)
        record_run(data, RunResult(name, plan), config, "b", None, now_us(), None)


def test_runs_and_ls_show_and_filter_by_policy(tmp_path):
    two_nights_recorded(tmp_path)
    cli = CliRunner()
    listing = cli.invoke(main, ["runs", "--data", str(tmp_path)])
    assert listing.exit_code == 0, listing.output
    assert "policy" in listing.output.splitlines()[0]
    assert all(n in listing.output for n in ("night-old", "night-support", "night-policy"))
    support = cli.invoke(main, ["runs", "--data", str(tmp_path), "--policy", "support"])
    assert "night-support" in support.output
    assert "night-policy" not in support.output and "night-old" not in support.output
    groups = cli.invoke(main, ["ls", "--data", str(tmp_path), "--policy", "support"])
    assert groups.exit_code == 0, groups.output
    assert "group s1:" in groups.output and "group p1:" not in groups.output
    assert "asked for support" in groups.output
    none = cli.invoke(main, ["ls", "--data", str(tmp_path), "--policy", "research"])
    assert "no group asked for the policy 'research'" in none.output


def test_the_report_has_a_page_per_policy(tmp_path):
    two_nights_recorded(tmp_path)
    whole = write_report(tmp_path).read_text()
    assert all(n in whole for n in ("night-old", "night-support", "night-policy"))
    page = write_report(tmp_path, "support")
    assert page.name == "training-support.html"
    text = page.read_text()
    assert "night-support" in text and "night-policy" not in text
    assert "of the policy support" in text


async def test_runs_and_adapter_events_per_policy_offline(make_proxy, tmp_path):
    proxy = await make_proxy(policies=("support",))
    await promote(proxy, adapter_dir(tmp_path, "s1"), "support")
    await promote(proxy, adapter_dir(tmp_path, "s2"), "support")
    await proxy.post("/admin/adapters/rollback", params={"policy": "support"},
                     json={"reason": "answers got longer"})  # fmt: skip
    await promote(proxy, adapter_dir(tmp_path, "p1"))
    data = tmp_path / "data"
    events = adapter_events(data, "support")
    assert [e["action"] for e in events] == ["promote", "promote", "rollback"]
    assert {e["policy"] for e in events} == {"support"}
    assert [e["policy"] for e in adapter_events(data)].count("policy") == 1
    # The offline rollback finds the policy's own state file by its alias.
    await proxy.close()
    assert offline_state_path(data, "support") == data / "policies" / "support" / "adapters.json"
    assert offline_state_path(data, "policy") == data / "adapters.json"
    with pytest.raises(OvernightError, match="no promotion state of a policy 'research'"):
        offline_state_path(data, "research")
    out = CliRunner().invoke(
        main, ["rollback", "--data", str(data), "--offline", "--policy", "support"]
    )
    assert out.exit_code == 0 and "will serve the base model" in out.output, out.output
    state = json.loads((data / "policies" / "support" / "adapters.json").read_text())
    assert state["stack"] == []
    assert len(json.loads((data / "adapters.json").read_text())["stack"]) == 1  # untouched


async def test_ui_pages_per_policy(make_proxy, tmp_path):
    proxy = await make_proxy(policies=("support",))
    r = await promote(proxy, adapter_dir(tmp_path, "s1"), "support")
    name = (await r.json())["promoted"]
    page = await (await proxy.get("/ui/adapters", params={"policy": "support"})).text()
    assert f'<strong id="current">{name}</strong>' in page
    assert 'href="adapters?policy=policy"' in page  # the other policy's page
    default = await (await proxy.get("/ui/adapters")).text()
    assert '<strong id="current">the base model</strong>' in default
    r = await proxy.get("/ui/adapters", params={"policy": "research"})
    assert r.status == 404
    two_nights_recorded(tmp_path / "data")
    runs = await (await proxy.get("/ui/runs", params={"policy": "support"})).text()
    assert "night-support" in runs and "night-policy" not in runs


async def test_ui_groups_pages_per_policy(make_proxy, tmp_path):
    """The groups, a group and a rollout per policy: a group is the policy's whose first
    turn asked for its alias; what asked for none is no policy's when there are several
    (storage/read/policy_scope.py)."""
    proxy = await make_proxy(policies=("support",))

    async def turn(group: str, rollout: str, model: str) -> None:
        headers = {"X-Rollout-Group": group, "X-Rollout-Id": rollout}
        r = await proxy.post("/v1/chat/completions", json=chat(model), headers=headers)
        assert r.status == 200, await r.text()

    await turn("s-1", "s-1.a", "support")
    await turn("s-1", "s-1.a", "policy")  # a later turn asks elsewhere: still support's
    await turn("p-1", "p-1.a", "policy")
    await turn("b-1", "b-1.a", "fake-base")  # no policy asked for: none of several
    await wait_for_rows(tmp_path / "data", 4)

    async def page(path: str, status: int = 200, **query) -> str:
        r = await proxy.get(path, params=query)
        text = await r.text()
        assert r.status == status, text
        return text

    support = await page("/ui", policy="support")
    assert "1 of 1 group(s) shown" in support
    assert '<a href="/ui/groups/s-1?policy=support">s-1</a>' in support
    assert "groups/p-1" not in support and "groups/b-1" not in support
    assert '<input type="hidden" name="policy" value="support">' in support  # filters stay
    assert '<a href="/ui/adapters?policy=support">adapters</a>' in support  # so do the links
    default = await page("/ui", policy="policy")
    assert "1 of 1 group(s) shown" in default and "groups/s-1" not in default
    assert "groups/b-1" not in default
    every = await page("/ui")
    assert "3 of 3 group(s) shown" in every
    assert '<a href="/ui?policy=support">support</a>' in every  # the switcher
    assert "1 of 3 group(s)" in await page("/ui", q="b-")  # filters within
    assert "0 of 1 group(s)" in await page("/ui", policy="support", q="p-")  # within one

    group = await page("/ui/groups/s-1")
    assert '<p id="policy">policy <a href="/ui?policy=support">support</a></p>' in group
    assert 'id="policy"' not in await page("/ui/groups/b-1")  # no policy's
    assert "s-1.a?policy=support" in await page("/ui/groups/s-1", policy="support")
    await page("/ui/groups/s-1", 404, policy="policy")  # another policy's group
    assert "no rollout" in await page("/ui/rollouts/s-1.a", 404, policy="policy")
    assert "2 turn(s)" in await page("/ui/rollouts/s-1.a", policy="support")

    # A name from the browser that is no policy here: refused, and not said back.
    for path in ("/ui", "/ui/groups/s-1", "/ui/rollouts/s-1.a", "/ui/runs"):
        text = await page(path, 404, policy="<script>alert(1)</script>")
        assert "<script>" not in text and "serves policy, support" in text
    assert "3 of 3 group(s)" in await page("/ui", policy="")  # empty: every policy


def test_ls_and_the_nights_read_one_definition_of_a_policys_groups(tmp_path):
    """`overnight ls --policy` lists a group by its first turn, as the nights choose it."""
    write_groups(tmp_path, {"s1": "support", "p1": "policy"})
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0))
    writer.start()
    # A later turn of p1 asks for support: p1 stays the default policy's.
    writer.append("completions", completion_row("p1.x", "p1", model_requested="support"))
    writer.close()
    out = CliRunner().invoke(main, ["ls", "--data", str(tmp_path), "--policy", "support"])
    assert "group s1:" in out.output and "group p1:" not in out.output, out.output
    con = open_db(tmp_path)
    assert PolicyScope("support", default=False).groups(con, ["s1", "p1"]) == {"s1"}


def test_live_rewards_and_gate_prompts_are_the_policys_own(tmp_path):
    """The base model serves every policy before its first promotion: the watch and the
    canary count only the policy's own rollouts for it, and the gate's held-out prompts
    are the policy's own traffic."""
    write_groups(tmp_path, {"s1": "support", "r1": "research"})
    state = {"alias": "support", "policies": ["policy", "support", "research"]}
    assert policy_of(state) == "support" and policy_of({"alias": "policy"}) is None
    mine = live_rewards(tmp_path, ("agent",), requested=policy_of(state))
    # model_served is the alias in these rows; the rewards' order is the store's
    assert {k: sorted(v) for k, v in mine.items()} == {"support": [0.0, 1.0]}
    assert set(live_rewards(tmp_path, ("agent",))) == {"support", "research"}
    con = open_db(tmp_path)
    try:
        groups = {g for _, g, _ in _first_turns(con, 10, scope("support"))}
        everyone = {g for _, g, _ in _first_turns(con, 10)}
    finally:
        con.close()
    assert groups == {"s1"} and everyone == {"s1", "r1"}


async def test_with_a_bucket_each_policy_has_its_own_state_object(machines, s3, tmp_path):  # noqa: F811
    """`--data s3://...`: a policy's state is policies/NAME/adapters.json in the bucket,
    followed by the other machine's proxy; the default policy's stays adapters.json."""
    _, client = s3
    a, b = await machines("policies", policies=("support",))
    original = weights(tmp_path, "night-1", b"\x03")
    r = await promote(a, str(original), "support")
    assert r.status == 200, await r.text()
    name = (await r.json())["promoted"]

    async def b_serves() -> bool:
        return ((await state_of(b, "support"))["current"] or {}).get("name") == name

    await await_until(b_serves, what="the other machine follows the support policy")
    stored = objects(client, "policies")
    assert "policies/support/adapters.json" in stored and "adapters.json" not in stored
    assert (await state_of(b))["current"] is None
    mirror = json.loads((b.local / "policies" / "support" / "adapters.json").read_text())
    assert mirror["stack"] == [name]


async def test_the_last_nights_per_policy_in_the_metrics(make_proxy, tmp_path):
    data = tmp_path / "data"
    two_nights_recorded(data)  # support's, the default policy's, and one from before policies
    proxy = await make_proxy(data_dir=data, policies=("support", "research"))
    text = await (await proxy.get("/metrics")).text()
    found = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("overnight_policy_")
    }
    runs = {k[1]: v for k, v in found.items() if k[0] == "overnight_policy_training_runs"}
    assert runs == {
        (("policy", "policy"), ("status", "trained")): 2,  # its own and the one from before
        (("policy", "support"), ("status", "trained")): 1,
    }
    ended = [k[1] for k in found if k[0].endswith("successful_training_run_end_timestamp_seconds")]
    assert sorted(ended) == [(("policy", "policy"),), (("policy", "support"),)]  # none: research


def test_a_table_per_policy_in_the_config_file(monkeypatch, tmp_path):
    """`[policies.NAME]`: the proxy serves NAME, and NAME's nights take its options (the
    command line still wins); a key no night has is refused, naming the table."""
    import overnight.cli.serve
    import overnight.trainer.train

    config = tmp_path / "overnight.toml"
    config.write_text(
        '[serve]\npolicy = ["research"]\n'
        "[train]\nlora_rank = 8\n"
        '[policies.support]\nlora_rank = 4\ngate = "off"\ntarget_module = "q_proj"\n'
        "[policies.coding]\ncanary = 0.2\n"
    )
    served, trained = [], []
    monkeypatch.setattr(overnight.cli.serve, "serve_forever", lambda *a, **kw: served.append(a))
    monkeypatch.setattr(overnight.trainer.train, "train", lambda _, c, **kw: trained.append(c))
    cli = CliRunner()
    base = ["--config", str(config)]
    out = cli.invoke(
        main, [*base, "serve", "--upstream", "http://127.0.0.1:9", "--data", str(tmp_path)]
    )
    assert out.exit_code == 0, out.output
    assert served.pop()[0].policy_names == ("policy", "research", "support", "coding")
    for policy in ("support", "coding", "research"):
        out = cli.invoke(
            main, [*base, "train", "--data", str(tmp_path), "--dry-run", "--policy", policy]
        )
        assert out.exit_code == 0, out.output
    support, coding, research = trained
    assert (support.policy, support.lora_rank, support.gate) == ("support", 4, "off")
    assert support.target_modules == ("q_proj",)
    assert (coding.lora_rank, coding.canary, coding.gate) == (8, 0.2, "not-worse")
    assert (research.lora_rank, research.canary) == (8, 0.0)  # no table: the [train] options
    cli.invoke(main, [*base, "train", "--data", str(tmp_path), "--dry-run", "--policy", "support",
                      "--lora-rank", "16"])  # fmt: skip
    assert trained.pop().lora_rank == 16  # the command line wins over the policy's table
    config.write_text("[policies.support]\njudge_model = 'x'\nrejudge = true\n")
    out = cli.invoke(main, [*base, "train", "--data", str(tmp_path), "--dry-run"])
    assert out.exit_code != 0 and "[policies.support] has no option ['rejudge']" in out.output


async def test_changing_the_default_policy_does_not_hand_it_the_old_ones_adapters(
    make_proxy, tmp_path
):
    """DATA/adapters.json is the default policy's: started with another `--alias`, the
    proxy refuses, naming the file's policy, instead of serving its adapters as the new."""
    old = await make_proxy()  # a directory of one alias, `policy`
    r = await old.post("/admin/adapters/promote", json={"path": adapter_dir(tmp_path, "a1")})
    assert r.status == 200, await r.text()
    await old.close()
    with pytest.raises(ConfigError, match="promotion state of policy 'policy', not of 'support'"):
        await make_proxy(alias="support", policies=("policy",))
    again = await make_proxy(alias="policy", policies=("support",))  # as it was: serves it
    state = await (await again.get("/admin/adapters")).json()
    assert state["alias"] == "policy" and len(state["stack"]) == 1


def test_a_policy_may_not_be_named_as_the_base_model_or_another_policys_adapter():
    for policies, base in ((("fake-base",), "fake-base"), (("policy-v1-abcdef",), None)):
        with pytest.raises(ConfigError, match="name the policy otherwise|name it otherwise"):
            ProxyConfig(upstream="http://x", policies=policies, base_model=base)
    assert ProxyConfig(upstream="http://x", base_model="fake-base").policies == ()  # one: as before


async def test_a_policy_named_as_the_base_model_vllm_reports_refuses_the_start(
    make_proxy, aiohttp_server, tmp_path, caplog
):
    """No --base-model given: the name vLLM serves its base model under is learned at the
    start and checked against the policies; learned later (vLLM was down), said loudly."""
    with pytest.raises(ConfigError, match="vLLM serves its base model as 'fake-base'"):
        await make_proxy(policies=("fake-base",))
    assert (await make_proxy(policies=("research",))).server is not None  # no clash: serves
    from overnight.proxy.launch.launcher import free_port
    from overnight.testing.fake_upstream import create_fake_upstream

    port = free_port()
    proxy = await make_proxy(
        upstream=f"http://127.0.0.1:{port}", policies=("fake-base",), data_dir=tmp_path / "later"
    )
    await aiohttp_server(create_fake_upstream(), port=port)  # vLLM up after the start
    with caplog.at_level("ERROR", logger="overnight.proxy"):
        await proxy.server.app[POLICIES].check_upstream()
        await proxy.server.app[POLICIES].check_upstream()
    said = [r for r in caplog.records if "a policy's name here" in r.getMessage()]
    assert len(said) == 1  # once


async def test_a_request_naming_a_policys_adapter_is_in_that_policys_flight(
    make_proxy, fake_settings
):
    """Asked for by its versioned name, research's adapter is counted in research's
    flight (its drain waits for the request), not the default policy's."""
    proxy = await make_proxy(policies=("research",))
    fake_settings["delay"] = 0.5
    name = "research-v1-abcdef"
    body = {"model": name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    slow = asyncio.create_task(proxy.post("/v1/chat/completions", json=body))

    async def flight(policy: str) -> dict:
        return (await (await proxy.get("/admin/adapters", params={"policy": policy})).json())[
            "in_flight"
        ]

    await await_until(lambda: flight("research"), what="the request in research's flight")
    assert (await flight("research")) == {name: 1} and (await flight("policy")) == {}
    assert (await slow).status == 200
    assert await flight("research") == {}


def test_a_rollout_with_a_turn_of_another_model_is_not_the_policys_live_reward(tmp_path):
    write_groups(tmp_path, {"s1": "support"})
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0))
    writer.start()  # a later turn of s1.0 asked for research (served the same name)
    writer.append(
        "completions",
        completion_row("s1.0", "s1", model_requested="research", model_served="support"),
    )
    writer.close()
    assert live_rewards(tmp_path, ("agent",), requested="support") == {"support": [0.0]}
