"""Each policy's night scores and plans its own groups with its own options (issue 27):
`overnight judge --policy`, the scoring step of `overnight train` per policy, and
`overnight train --dry-run` planning per policy as a real night would (overnight/
cli/policy_runs.py). Groups are written directly; the proxy's answer is stubbed where a
night asks for it (its HTTP side is tests/test_policies.py's)."""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner

import overnight.trainer.serving.proxy_client
import overnight.trainer.train
from overnight.cli.main import main
from overnight.judge.rewards import RewardFunction
from overnight.judge.run import run_judge
from overnight.storage import LogWriter, WriterConfig, now_us
from overnight.storage.read.policy_scope import PolicyScope

from .helpers import completion_row, rows
from .test_resample import NUMBERS_ONLY, served, store

# The groups of three policies (and the base model's), as several agents leave them.
GROUPS = {"s1": "support", "s2": "support", "r1": "research", "p1": "policy", "b1": "fake-base"}
SERVED = ["policy", "support", "research"]  # the proxy's policies, its default first


def unscored_groups(data_dir, groups: dict[str, str]) -> None:
    """Two finished rollouts per group, every turn asking for the model given; no reward."""
    writer = LogWriter(WriterConfig(data_dir, commit_interval=0.0))
    writer.start()
    now = now_us() - 3_600_000_000  # settled
    for group, model in groups.items():
        for i in range(2):
            rollout = f"{group}.{i}"
            request = {"model": model, "messages": [{"role": "user", "content": group}]}
            response = {"choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": f"a{i}"}}]}  # fmt: skip
            writer.append("completions", completion_row(
                rollout, group, started_at=now, ended_at=now, model_requested=model,
                model_served=model, prompt_token_ids=[1, 2, 3], completion_token_ids=[10 + i],
                completion_logprobs=[-0.5], request=json.dumps(request),
                response=json.dumps(response),
            ))  # fmt: skip
            writer.append("finishes", {"rollout_id": rollout, "schema_version": 1,
                                       "finished_at": now})  # fmt: skip
    writer.close()


@pytest.fixture
def data(tmp_path):
    data = tmp_path / "data"
    unscored_groups(data, GROUPS)
    (tmp_path / "rewards.py").write_text(
        "def high(rollout):\n    return 1.0 + (rollout['messages'][-1]['content'] == 'a1')\n"
        "def low(rollout):\n    return -1.0 - (rollout['messages'][-1]['content'] == 'a1')\n"
    )
    return data


def scored(data) -> dict[str, float]:
    """rollout -> its function reward."""
    found = rows(data, "SELECT rollout_id, reward FROM rewards WHERE source = 'function'")
    return {r["rollout_id"]: r["reward"] for r in found}


@pytest.fixture
def proxy_answers(monkeypatch):
    """The proxy's /admin/adapters, as a night reads it: three policies; the calls kept."""
    asked: list[str | None] = []

    def serving_state(url, token, policy=None):
        asked.append(policy)
        if not url:
            return {}
        return {"alias": policy or SERVED[0], "policies": SERVED, "default": SERVED[0],
                "others_trained": False, "current": None, "adapters": []}  # fmt: skip

    monkeypatch.setattr(overnight.trainer.serving.proxy_client, "serving_state", serving_state)
    return asked


@pytest.fixture
def nights(monkeypatch):
    """Every night `overnight train` starts: (its config, its scope), not trained."""
    started = []
    monkeypatch.setattr(
        overnight.trainer.train, "train",
        lambda _, config, **kw: started.append((config, kw.get("scope"))),
    )  # fmt: skip
    return started


def test_judge_policy_scores_that_policys_groups_only(data, tmp_path):
    reward = f"{tmp_path / 'rewards.py'}:high"
    out = CliRunner().invoke(
        main, ["judge", "--data", str(data), "--reward", reward, "--policy", "support"]
    )
    assert out.exit_code == 0, out.output
    assert sorted(scored(data)) == ["s1.0", "s1.1", "s2.0", "s2.1"]
    out = CliRunner().invoke(main, ["judge", "--data", str(data), "--reward", reward])
    assert out.exit_code == 0, out.output
    assert sorted({r.split(".")[0] for r in scored(data)}) == sorted(GROUPS)  # the rest too


def test_judge_policy_takes_its_tables_reward_and_the_command_line_wins(data, tmp_path):
    rewards = tmp_path / "rewards.py"
    config = tmp_path / "overnight.toml"
    config.write_text(f'[policies.support]\nreward = "{rewards}:high"\n'
                      f'[policies.research]\nreward = "{rewards}:low"\n')  # fmt: skip
    cli = CliRunner()
    base = ["--config", str(config), "judge", "--data", str(data), "--proxy", ""]
    for policy in ("support", "research"):
        out = cli.invoke(main, [*base, "--policy", policy])
        assert out.exit_code == 0, out.output
    got = scored(data)
    assert {got["s1.0"], got["s1.1"], got["r1.0"], got["r1.1"]} == {1.0, 2.0, -1.0, -2.0}
    assert got["s1.1"] == 2.0 and got["r1.1"] == -2.0
    assert "p1.0" not in got  # the default policy has no table: nothing scores it
    out = cli.invoke(main, [*base, "--policy", "policy"])
    assert out.exit_code != 0 and "give --judge-model, --reward" in out.output
    out = cli.invoke(main, [*base, "--policy", "policy", "--reward", f"{rewards}:low"])
    assert out.exit_code == 0, out.output
    assert scored(data)["p1.1"] == -2.0


def test_train_scores_each_policys_groups_with_its_own_reward(
    data, tmp_path, proxy_answers, nights
):
    """Before its night, each policy's groups are scored with its own reward function
    (its table's), none of another policy's; the base model's traffic trains no policy
    of several, so nothing scores it either."""
    rewards = tmp_path / "rewards.py"
    config = tmp_path / "overnight.toml"
    config.write_text(f'[train]\nreward = "{rewards}:high"\n'
                      f'[policies.research]\nreward = "{rewards}:low"\n')  # fmt: skip
    args = ["--config", str(config), "train", "--data", str(data), "--proxy", "http://proxy",
            "--no-promote"]  # fmt: skip
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    got = scored(data)
    assert sorted(got) == ["p1.0", "p1.1", "r1.0", "r1.1", "s1.0", "s1.1", "s2.0", "s2.1"]
    assert (got["s1.1"], got["p1.1"], got["r1.1"]) == (2.0, 2.0, -2.0)
    assert [(c.policy, s.name, s.default) for c, s in nights] == [
        ("policy", "policy", True), ("support", "support", False), ("research", "research", False)
    ]  # fmt: skip
    assert out.output.count("judged 0 group(s)") == 3  # one scoring batch per policy


def test_a_dry_run_asks_the_proxy_for_its_policies(data, proxy_answers, nights):
    out = CliRunner().invoke(
        main, ["train", "--data", str(data), "--proxy", "http://proxy", "--dry-run"]
    )
    assert out.exit_code == 0, out.output
    assert [(c.policy, s.others) for c, s in nights] == [
        ("policy", ("support", "research")),
        ("support", ("policy", "research")),
        ("research", ("policy", "support")),
    ]
    assert set(proxy_answers) >= {"support", "research"}  # each one's answer, as a night's


def test_a_dry_run_without_a_proxy_plans_the_policies_the_data_and_config_show(
    data, tmp_path, nights
):
    # Promoted before (their states on disk), trained before (a run), named in the config.
    (data / "adapters.json").write_text(json.dumps({"alias": "policy", "stack": []}))
    (data / "policies" / "support").mkdir(parents=True)
    (data / "policies" / "support" / "adapters.json").write_text(json.dumps({"alias": "support"}))
    (data / "runs" / "r1").mkdir(parents=True)
    (data / "runs" / "r1" / "run.json").write_text(json.dumps({"policy": "research"}))
    config = tmp_path / "overnight.toml"
    config.write_text("[policies.coding]\ncanary = 0.1\n")
    base = ["--config", str(config), "train", "--data", str(data), "--proxy", "", "--dry-run"]
    out = CliRunner().invoke(main, base)
    assert out.exit_code == 0, out.output
    policies = ["policy", "support", "research", "coding"]
    assert [c.policy for c, _ in nights] == policies
    assert all(s.others == tuple(p for p in policies if p != s.name) for _, s in nights)
    assert nights[-1][0].canary == 0.1  # the table's options, as its night's
    assert nights[0][1].default and not nights[1][1].default


def test_a_dry_run_of_nothing_but_data_plans_every_group(data, nights):
    """No policy anywhere (no state, no run, no config): every group, as before policies."""
    out = CliRunner().invoke(main, ["train", "--data", str(data), "--proxy", "", "--dry-run"])
    assert out.exit_code == 0, out.output
    assert [(c.policy, s) for c, s in nights] == [(None, None)]


def test_a_real_dry_run_plans_each_policys_own_groups(data, tmp_path):
    """End to end, offline: the plan of each policy names its own groups' count."""
    (data / "adapters.json").write_text(json.dumps({"alias": "policy", "stack": []}))
    (data / "policies" / "support").mkdir(parents=True)
    (data / "policies" / "support" / "adapters.json").write_text(json.dumps({"alias": "support"}))
    reward = tmp_path / "rewards.py"
    CliRunner().invoke(main, ["judge", "--data", str(data), "--reward", f"{reward}:high"])
    out = CliRunner().invoke(main, ["train", "--data", str(data), "--proxy", "", "--dry-run"])
    assert out.exit_code == 0, out.output
    assert "policy policy:" in out.output and "policy support:" in out.output
    support = out.output.split("policy support:", 1)[1]
    default = out.output.split("policy support:", 1)[0]
    assert "2 group(s)" in support and "1 group(s)" in default, out.output


def test_a_policys_scoring_takes_its_own_per_turn_groups_only(tmp_path):
    """A per-turn group (a served turn and its siblings) is its served turn's group's
    policy's: scored in that policy's batch only."""
    data = tmp_path / "turns"
    ours, theirs = served(model_requested="support"), served(model_requested="research")
    store(data, [ours, theirs], {ours["record_id"]: ["7", "a cat"],
                                 theirs["record_id"]: ["8", "a dog"]})  # fmt: skip
    scope = PolicyScope.of("support", {"policies": SERVED, "default": SERVED[0]})
    reward = RewardFunction(NUMBERS_ONLY)
    summary = asyncio.run(
        run_judge(data, None, reward, progress=False, settle_seconds=0, scope=scope)
    )
    assert summary.turn_groups == 1, summary.lines()
    assert {r.split(":")[1] for r in scored(data)} == {ours["record_id"]}
