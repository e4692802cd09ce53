"""On-policy nights: how old a record is, what a run does with old ones, and a gate margin
that means something on any reward (issue 21). Records on a real on-disk store; the
gate's statistics by hand; no vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from overnight.config import TrainConfig
from overnight.errors import ConfigError
from overnight.trainer.choose.plan import Plan
from overnight.trainer.choose.staleness import TOO_STALE, staleness_of, weigh_staleness
from overnight.trainer.gate.verdict import decide, margin_for, passes
from overnight.trainer.grpo.data import Sample

# -- how many promotions old ------------------------------------------------------------


def adapter(name: str, version: int, path: str, reason: str = "promote") -> dict:
    return {"name": name, "version": version, "path": path, "reason": reason}


# v1 promoted, v2 promoted, v1's weights back by a rollback (v3), a canary (v4).
STATE = {
    "alias": "policy",
    "base_model": "tiny",
    "adapters": [
        adapter("policy-v1", 1, "/a/one"),
        adapter("policy-v2", 2, "/a/two"),
        adapter("policy-v3", 3, "/a/one", "rollback"),
        adapter("policy-v4", 4, "/a/four", "canary"),
    ],
}


def test_a_record_is_as_old_as_the_promotions_since_its_adapter_served():
    age = staleness_of(STATE, "/a/one")  # the run starts from v3 (v1's weights)
    assert age(("policy-v3",)) == 0 and age(("policy-v1",)) == 0  # the same weights
    assert age(("policy-v2",)) == 1  # one promotion (the rollback) since it served
    assert age(("tiny",)) == 3 and age(("some-other-model",)) == 3  # the base: every load
    assert age(("policy-v4",)) == 1  # a canary is another policy, however recent
    assert age(("policy-v3", "policy-v2")) == 1  # a rollout over a promotion: its oldest
    assert age(()) == 0
    from_two = staleness_of(STATE, "/a/two")
    assert from_two(("policy-v2",)) == 0 and from_two(("policy-v1",)) == 1
    assert from_two(("tiny",)) == 2
    base = staleness_of({"alias": "policy", "base_model": "tiny", "adapters": []}, None)
    assert base(("tiny",)) == 0 and base(("policy",)) == 0
    assert staleness_of({}, None)(("policy-v1",)) is None  # no proxy: unknown


def sample(group: str, rollout: str, served_by: tuple[str, ...]) -> Sample:
    return Sample(rollout, group, [1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], 1,
                  served_by=served_by)  # fmt: skip


def a_plan() -> Plan:
    plan = Plan()
    for group, served in (("fresh", "policy-v3"), ("old", "policy-v2"), ("older", "tiny")):
        plan.groups.append(group)
        plan.samples += [sample(group, f"{group}.{i}", (served,)) for i in range(2)]
        plan.rewards.update({f"{group}.0": 1.0, f"{group}.1": 0.0})
    return plan


def test_stale_groups_are_counted_by_age_and_left_out_past_max_staleness():
    age = staleness_of(STATE, "/a/one")
    kept = weigh_staleness(a_plan(), age, None)
    assert kept.groups == ["fresh", "old", "older"]
    assert kept.staleness == {"0": 1, "1": 1, "3": 1}
    assert [s.staleness for s in kept.samples] == [0, 0, 1, 1, 3, 3]
    assert any("1 on-policy" in line and "1 1 promotion(s) old" in line for line in kept.lines())
    on_policy = weigh_staleness(a_plan(), age, 0)
    assert on_policy.groups == ["fresh"] and on_policy.staleness == {"0": 1}
    assert set(on_policy.rewards) == {"fresh.0", "fresh.1"}
    assert on_policy.skipped == {
        TOO_STALE.format(age=1, limit=0): 1,
        TOO_STALE.format(age=3, limit=0): 1,
    }
    one = weigh_staleness(a_plan(), age, 1)
    assert one.groups == ["fresh", "old"]
    unknown = weigh_staleness(a_plan(), staleness_of({}, None), 0)
    assert unknown.groups == ["fresh", "old", "older"] and unknown.staleness == {"unknown": 3}


def test_max_staleness_must_be_a_count():
    with pytest.raises(ConfigError, match="max_staleness"):
        TrainConfig(max_staleness=-1)


# -- a gate margin in the reward's own units ----------------------------------------------


def gate(config: TrainConfig, candidate: list[float], served: list[float]) -> bool:
    """The not-worse decision exactly as run_gate makes it from per-prompt scores."""
    margin, _ = margin_for(config, served)
    diffs = [c - s for c, s in zip(candidate, served, strict=True)]
    return decide(diffs, config.gate, margin, seed=config.seed)[0]


# 32 held-out prompts: the served adapter scores a little on a few of them.
SERVED_SMALL = [0.0] * 24 + [0.04, 0.03, 0.05, 0.02, 0.04, 0.01, 0.03, 0.04]
WORSE_SMALL = [0.0] * 28 + [0.01, 0.0, 0.02, 0.01]


def test_a_clearly_worse_candidate_is_refused_on_small_rewards_by_default():
    """Rewards all below 0.05: the candidate is worse on every prompt where the served
    adapter scored, and the interval lies wholly below zero. The old absolute default
    (0.05, a whole reward's worth here) promoted it; the relative default refuses."""
    diffs = [c - s for c, s in zip(WORSE_SMALL, SERVED_SMALL, strict=True)]
    _, numbers = decide(diffs, "not-worse", 0.0)
    assert numbers["high"] < 0, numbers  # measurably worse
    # The old rule (low end above -0.05, a whole reward's worth here) promoted it.
    assert numbers["low"] > -0.05
    assert gate(TrainConfig(), WORSE_SMALL, SERVED_SMALL) is False
    assert gate(TrainConfig(gate_margin=0.05), WORSE_SMALL, SERVED_SMALL) is False  # high < 0
    margin, how = margin_for(TrainConfig(), SERVED_SMALL)
    assert 0 < margin < 0.01 and "0.5 x the served adapter's reward spread" in how
    assert numbers["low"] < -margin  # refused by the margin too, not only as worse


@pytest.mark.parametrize("scale, offset", [(1.0, 0.0), (250.0, -5.0), (-1.0, 0.0)])
def test_the_default_margin_judges_the_same_at_any_scale(scale, offset):
    """Rewards in [-10, 10] (and the same task scaled or negated): one verdict, as the
    margin moves with the reward's spread. A negated reward turns better into worse."""
    rng = __import__("random").Random(5)
    served = [rng.uniform(-10, 10) for _ in range(32)]
    worse = [s - 4 + rng.uniform(-1, 1) for s in served]
    # A loss of 0.02 on average, well inside half the spread and not measurable.
    slightly = [s - 0.02 + rng.uniform(-1, 1) for s in served]
    config = TrainConfig()

    def scaled(values):
        return [scale * v + offset for v in values]

    assert gate(config, scaled(worse), scaled(served)) is (scale < 0)
    assert gate(config, scaled(slightly), scaled(served)) is True


def test_a_measurably_worse_candidate_is_refused_whatever_the_margin():
    """An interval wholly below zero, however small the loss and however wide the margin."""
    assert passes(-0.001, -0.0001, "not-worse", 10.0) is False
    assert gate(TrainConfig(gate_margin=1.0), [0.49] * 16, [0.5] * 16) is False
    assert passes(-0.3, 0.1, "not-worse", 0.5) is True  # not measurable, inside the margin


def test_equal_adapters_pass_not_worse_but_not_better():
    """Both score the same everywhere (a zero spread: any loss would count): an interval
    of exactly [0, 0] is not worse, and is no evidence of a gain."""
    same = [0.0] * 20
    assert gate(TrainConfig(), same, same) is True
    assert gate(TrainConfig(gate="better"), same, same) is False
    assert passes(-0.001, 0.0, "not-worse", 0.0) is False and passes(0.0, 0.0, "not-worse", 0.0)
    one_worse = [0.0] * 19 + [-1.0]
    assert gate(TrainConfig(), one_worse, same) is False  # low end below zero, margin 0


def test_the_margin_options_fail_loudly():
    with pytest.raises(ConfigError, match="gate_margin"):
        TrainConfig(gate_margin=-0.1)
    with pytest.raises(ConfigError, match="gate_margin_spread"):
        TrainConfig(gate_margin_spread=-1)
    assert margin_for(TrainConfig(gate_margin=0.3), [0.0, 1.0]) == (0.3, "--gate-margin 0.3")
    assert margin_for(SimpleNamespace(gate_margin=None, gate_margin_spread=0.5), [1.0])[0] == 0
