"""Turns with nothing to compare with, trained against the night's pool
(trainer/choose/lone_turns.py): what a night takes, with which advantages, and what it
leaves; no model needed."""

from __future__ import annotations

import statistics

from overnight.config import TrainConfig
from overnight.storage import LogWriter, WriterConfig, now_us
from overnight.trainer.choose.inputs import Selection
from overnight.trainer.choose.lone_turns import LONE_POOL_MIN, add_lone_turns
from overnight.trainer.choose.turn_groups import add_turn_groups
from overnight.trainer.train import RunResult, plan_run, record_run

from .helpers import completion_row

IMPLICIT = TrainConfig(reward_sources=("agent", "implicit"))  # --lone-turns auto: pooled


def write(data_dir, rows: list[tuple[str, dict]]) -> None:
    writer = LogWriter(WriterConfig(data_dir, commit_interval=0.0))
    writer.start()
    for table, row in rows:
        writer.append(table, row)
    writer.close()


def turn(record: str, rollout: str, group: str, index: int = 0, at: int | None = None) -> list:
    """A finished one-turn record with token ids (its prompt 1 2 3, its reply its own)."""
    at = at or now_us() - 3_600_000_000
    row = completion_row(
        rollout, group, record_id=record, turn_index=index, started_at=at + index,
        ended_at=at + index, prompt_token_ids=[1, 2, 3 + index],
        completion_token_ids=[40 + index, 41], completion_logprobs=[-0.5, -0.25],
    )  # fmt: skip
    finish = {"rollout_id": rollout, "schema_version": 1, "finished_at": at + index}
    return [("completions", row), ("finishes", finish)]


def reward(target: str, value: float, source: str = "implicit") -> tuple[str, dict]:
    row = {"reward_id": f"{target}.{source}", "schema_version": 1, "rollout_id": target}
    return "rewards", {**row, "reward": value, "source": source, "created_at": now_us()}


def night(data_dir, config: TrainConfig, record: bool = True, **options):
    """A night's plan as trainer/train.py makes one: served groups, per-turn groups, then
    the lone turns; recorded as a trained run when it trains anything."""
    only = options.get("only")
    served = None if only is None else [g for g in only if not g.startswith("turn:")]
    plan = plan_run(Selection(data_dir, settle_seconds=600, **{**options, "only": served}), config)
    plan = add_turn_groups(Selection(data_dir, **options), plan, config)
    plan = add_lone_turns(Selection(data_dir, **options), plan, config)
    if plan.groups and record:
        record_run(data_dir, RunResult(f"run-{now_us()}", plan), config, "b", None, now_us(), None)
    return plan


def singles(n: int, first: int = 0) -> tuple[list, dict[str, float]]:
    """`n` single calls (groups of one), each with an implicit reward."""
    rows, values = [], {}
    for i in range(first, first + n):
        values[f"s{i}"] = [-1.0, -0.65, 0.3, 1.0][i % 4]
        rows += turn(f"rec-s{i}", f"s{i}", f"s{i}") + [reward(f"s{i}", values[f"s{i}"])]
    return rows, values


def test_single_calls_train_against_the_nights_mean_and_only_when_pooled(tmp_path):
    rows, values = singles(LONE_POOL_MIN + 2)
    write(tmp_path, rows + turn("rec-quiet", "quiet", "quiet"))  # no signal: no reward
    skip = night(tmp_path, TrainConfig(reward_sources=IMPLICIT.reward_sources, lone_turns="skip"),
                 record=False)  # fmt: skip
    assert skip.groups == [] and skip.skipped["fewer than 2 trainable rollouts"] == len(values) + 1

    plan = night(tmp_path, IMPLICIT)
    assert sorted(plan.groups) == sorted(values)  # the turn with no signal trains nothing
    mean, std = statistics.fmean(values.values()), statistics.stdev(values.values())
    for s in plan.samples:
        assert abs(s.advantage - (values[s.rollout_id] - mean) / (std + 1e-6)) < 1e-9
        assert s.tokens == [1, 2, 3, 40, 41] and s.trained == [False] * 3 + [True] * 2
    assert plan.skipped == {"fewer than 2 trainable rollouts": 1}  # "quiet"
    line = "\n".join(plan.lines())
    assert f"lone turns: {len(values)} trained against the night's pool" in line
    assert "by source: implicit 10" in line
    assert night(tmp_path, IMPLICIT, record=False).groups == []  # a turn trains once


def test_a_pool_too_small_waits_for_a_later_night(tmp_path):
    rows, _ = singles(LONE_POOL_MIN - 3)
    write(tmp_path, rows)
    first = night(tmp_path, IMPLICIT)
    assert first.groups == [] and first.pooled["turns"] == 0
    assert f"fewer than {LONE_POOL_MIN}" in "\n".join(first.lines())
    record_run(tmp_path, RunResult("empty", first), IMPLICIT, "b", None, now_us(), None)
    more, _ = singles(3, first=LONE_POOL_MIN - 3)
    write(tmp_path, more)
    second = night(tmp_path, IMPLICIT)  # the earlier ones were left pending: looked at again
    assert len(second.groups) == LONE_POOL_MIN


def test_a_conversations_turn_rewarded_on_its_own_trains_one_step_deep(tmp_path):
    rows, _ = singles(LONE_POOL_MIN - 1)
    # A two-turn conversation in a group whose other rollout has no reward: the group
    # cannot train, but its second turn's implicit reward (on its per-turn member) can.
    rows += turn("c-1", "conv", "g", 0) + turn("c-2", "conv", "g", 1) + turn("o-1", "other", "g")
    rows += [reward("turn:c-2:served", -1.0)]
    # A turn whose own group trains tonight (posted rewards that differ) trains there only.
    rows += turn("d-1", "d.0", "d") + turn("d-2", "d.1", "d")
    rows += [
        reward("d.0", 1.0, "agent"),
        reward("d.1", 0.0, "agent"),
        reward("turn:d-1:served", 1.0),
    ]
    write(tmp_path, rows)
    plan = night(tmp_path, IMPLICIT)
    assert "d" in plan.groups and "turn:d-1" not in plan.groups
    (conv,) = [s for s in plan.samples if s.group_id == "turn:c-2"]
    assert conv.rollout_id == "turn:c-2:served" and conv.turns == 1
    assert conv.tokens == [1, 2, 4, 41, 41]  # the second turn's prompt and reply alone
    assert plan.pooled["conversation_turns"] == 1 and plan.pooled["rollouts"] == LONE_POOL_MIN - 1
    assert "g" not in plan.groups


def test_a_resumed_night_pools_exactly_what_it_began_with(tmp_path):
    rows, _ = singles(LONE_POOL_MIN)
    rows += turn("c-1", "conv", "g", 0) + turn("c-2", "conv", "g", 1) + turn("o-1", "other", "g")
    write(tmp_path, rows + [reward("turn:c-2:served", -1.0)])
    first = night(tmp_path, IMPLICIT, record=False)
    again = night(tmp_path, IMPLICIT, record=False, only=first.groups)
    assert sorted(again.groups) == sorted(first.groups)
    assert {s.rollout_id: s.advantage for s in again.samples} == {
        s.rollout_id: s.advantage for s in first.samples
    }
