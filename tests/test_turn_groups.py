"""Per-turn groups in the nightly plan: a turn trains once, and a group is decided once.

Rows are written to a real on-disk store as the proxy, the resampling stage and the
judge write them (no vLLM): served turns with their finishes and the agent's rewards,
sibling rows built from a vLLM-shaped response, and the reward function's scores of
each member. A night is `plan_run` then `add_turn_groups`, as `overnight train` plans,
recorded as it records a run that trained.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from pathlib import Path

from overnight.config import TrainConfig
from overnight.storage import LogWriter, WriterConfig, new_id, now_us
from overnight.storage.read.siblings import (
    completion_request,
    served_member_id,
    sibling_rows,
    turn_group_id,
)
from overnight.trainer.choose.inputs import Selection
from overnight.trainer.choose.plan import (
    TRAINED_AS_TURNS,
    TURN_PENDING_KEY,
    Plan,
    plan_run,
    without,
)
from overnight.trainer.choose.turn_groups import (
    OWN_GROUP_TRAINED,
    OWN_GROUP_WAITS,
    add_turn_groups,
)
from overnight.trainer.train import RunResult, record_run

from .helpers import chat_response, completion_row
from .test_resample import PROMPT, REQUEST, vllm_response

DAY_US = 86_400_000_000
EARLIER = now_us() - 2 * DAY_US  # before the last watermark, less its overlap


def append(data: Path, table: str, rows: list[dict]) -> None:
    writer = LogWriter(WriterConfig(data, compact_in_process=True))
    writer.start()
    for row in rows:
        writer.append(table, row)
    writer.close()


def serve(data: Path, group: str, agent_rewards: list[float], at: int = EARLIER) -> list[str]:
    """A finished group of one-turn rollouts `<group>.<i>` (record id = rollout id), each
    with the agent's reward; returns the record ids."""
    records = [f"{group}.{i}" for i in range(len(agent_rewards))]
    turns = [
        completion_row(
            r,
            group,
            started_at=at,
            ended_at=at,
            model_served="tiny",
            request=REQUEST,
            response=chat_response("seven cats"),
            prompt_token_ids=PROMPT,
            completion_token_ids=[21, 22],
            completion_logprobs=[-1.0, -2.0],
            finish_reason="stop",
        )
        for r in records
    ]
    append(data, "completions", turns)
    append(data, "finishes", [{"rollout_id": r, "schema_version": 1, "finished_at": at}
                              for r in records])  # fmt: skip
    score(data, dict(zip(records, agent_rewards, strict=True)), "agent", at)
    return records


def resample(data: Path, record: str, texts: list[str], at: int = EARLIER) -> list[str]:
    """Siblings of a served turn as the nightly stage stores them; returns the per-turn
    group's member ids, the served one first."""
    turn = {"record_id": record, "model_served": "tiny", "request": REQUEST,
            "prompt_token_ids": PROMPT, "endpoint": "chat.completions"}  # fmt: skip
    sent = completion_request(turn, len(texts))
    rows = sibling_rows(turn, vllm_response(texts), origin="resample", writer_id="w",
                        started_at=at, ended_at=at, sent=sent)  # fmt: skip
    append(data, "siblings", rows)
    return [served_member_id(record)] + [r["rollout_id"] for r in rows]


def score(data: Path, rewards: dict[str, float], source: str = "function", at: int | None = None):
    """Rewards as the judge (`function`) or an agent (`agent`) writes them."""
    at = now_us() if at is None else at
    append(data, "rewards", [{"reward_id": new_id(), "schema_version": 2, "rollout_id": r,
                              "reward": v, "source": source, "created_at": at}
                             for r, v in rewards.items()])  # fmt: skip


def night(data: Path, config: TrainConfig | None = None, **options) -> Plan:
    """One night's plan as `overnight train` makes it, recorded when it trains."""
    config = config or TrainConfig()
    plan = plan_run(Selection(data, settle_seconds=600, **options), config)
    plan = add_turn_groups(Selection(data, max_groups=options.get("max_groups")), plan, config)
    if plan.groups:
        record_run(data, RunResult(f"run-{new_id()}", plan), config, "base", None, now_us(), None)
    return plan


def trained_records(plan: Plan) -> Counter:
    """How many times each record is trained: a served turn in its own group (one-turn
    rollouts here: the rollout is the record) or as the served member of its per-turn
    group (`turn:<record>:served`); a sibling (`turn:<served>:<record>`) in its group."""
    out: Counter = Counter()
    for s in plan.samples:
        if s.rollout_id.endswith(":served"):
            out[s.group_id.removeprefix("turn:")] += 1
        else:
            out[s.rollout_id.rsplit(":", 1)[-1]] += 1
    return out


def test_a_turn_trains_once_when_its_own_group_and_its_per_turn_group_are_both_trainable(
    tmp_path,
):
    """--resample-all-turns: the turns of a group of two have per-turn groups too. The
    own group trains, its turns' per-turn groups do not; those of a group without
    signal do. Later, neither order trains a turn twice."""
    data = tmp_path / "data"
    team = serve(data, "team", [1.0, 0.0])  # a signal: trained as a whole
    flat = serve(data, "flat", [1.0, 1.0])  # no signal as a whole
    for record in team + flat:
        members = resample(data, record, ["7", "a cat"])
        score(data, dict(zip(members, [0.0, 1.0, 0.0], strict=True)), at=EARLIER)
    plan = night(data)
    assert sorted(plan.groups) == ["team", *sorted(turn_group_id(r) for r in flat)]
    trained = trained_records(plan)
    assert max(trained.values()) == 1 and set(team + flat) <= set(trained), plan.lines()
    assert plan.skipped[f"per-turn groups: {OWN_GROUP_TRAINED}"] == 2
    assert any(OWN_GROUP_TRAINED in line for line in plan.lines())

    # The agent's late reward gives "flat" a signal, but its turns trained last night.
    score(data, {"flat.1": 0.0}, "agent")
    later = night(data)
    assert later.considered == ["flat"] and later.groups == [], later.lines()
    assert later.skipped == {TRAINED_AS_TURNS: 1}
    # Siblings of a turn whose own group an earlier run trained: not trained again.
    record = serve(data, "pair", [1.0, 0.0], at=now_us())[0]
    assert night(data).groups == ["pair"]
    members = resample(data, record, ["8", "a dog"], at=now_us())
    score(data, dict(zip(members, [1.0, 0.0, 0.5], strict=True)))
    after = night(data)
    assert turn_group_id(record) in after.considered and after.groups == []
    assert after.skipped[f"per-turn groups: {OWN_GROUP_TRAINED}"] == 1


def test_an_equal_reward_per_turn_group_is_read_once_and_again_when_it_changes(tmp_path):
    data = tmp_path / "data"
    signal, same = serve(data, "a", [1.0])[0], serve(data, "b", [1.0])[0]
    varied = resample(data, signal, ["7", "a cat"])
    score(data, dict(zip(varied, [0.0, 1.0, 0.0], strict=True)), at=EARLIER)
    equal = resample(data, same, ["cats", "a cat"])
    score(data, dict.fromkeys(equal, 0.0), at=EARLIER)
    a, b = turn_group_id(signal), turn_group_id(same)

    first = night(data)  # no earlier run: all are looked at
    assert first.groups == [a] and set(first.considered) == {"a", "b", a, b}
    assert first.loaded_groups == [a]  # b's records are not read: its rewards are equal
    assert first.skipped["per-turn groups: all rewards equal: no signal"] == 1
    assert first.selection[TURN_PENDING_KEY] == [a]

    nothing_new = night(data)  # nothing changed: nothing is read, nothing is skipped again
    assert nothing_new.considered == [] and nothing_new.loaded_groups == []
    assert nothing_new.skipped == {}, nothing_new.lines()
    assert b in night(data, TrainConfig(rescan=True)).considered  # --rescan: all

    # A new sibling (the shadow sampler, say): decided again; it waits for its score.
    (new,) = resample(data, same, ["8 9"], at=now_us())[1:]
    waiting = night(data)
    assert waiting.considered == [b] and waiting.groups == []
    assert waiting.skipped == {
        "per-turn groups: a member has no reward from the judge or the reward function": 1
    }
    score(data, {new: 1.0})  # the judge scores it: a signal now
    scored = night(data)
    assert scored.considered == [b] and scored.groups == [b]
    assert scored.rewards[new] == 1.0 and len(scored.samples) == 4


def test_per_turn_groups_left_for_later_are_looked_at_again(tmp_path):
    """Past --max-groups, or waiting for their own group: pending, read the next night
    although nothing about them changed."""
    data = tmp_path / "data"
    records = serve(data, "x", [1.0]) + serve(data, "y", [1.0])
    for record in records:
        members = resample(data, record, ["7", "a cat"])
        score(data, dict(zip(members, [0.0, 1.0, 0.0], strict=True)), at=EARLIER)
    x, y = (turn_group_id(r) for r in records)
    capped = night(data, max_groups=1)
    assert capped.groups == [x] and capped.selection[TURN_PENDING_KEY] == [x, y]
    rest = night(data)
    assert rest.considered == [y] and rest.groups == [y]
    assert night(data).considered == []

    # Two groups of two with per-turn groups; the cap leaves the second for later: its
    # turns' per-turn groups wait for it rather than train its turns first.
    first = serve(data, "first", [1.0, 0.0], at=now_us())
    second = serve(data, "second", [1.0, 0.0], at=now_us())
    for record in first + second:
        members = resample(data, record, ["7", "a cat"], at=now_us())
        score(data, dict(zip(members, [0.0, 1.0, 0.0], strict=True)))
    one = night(data, max_groups=1)
    assert one.groups == ["first"], one.lines()
    assert one.skipped[f"per-turn groups: {OWN_GROUP_WAITS}"] == 2
    assert one.skipped[f"per-turn groups: {OWN_GROUP_TRAINED}"] == 2
    assert set(one.selection[TURN_PENDING_KEY]) == {turn_group_id(r) for r in second}
    two = night(data)
    assert two.groups == ["second"]
    # Rows this recent are within the overlap: the first group's turns are read again too.
    assert set(two.considered) == {"second", *(turn_group_id(r) for r in first + second)}
    assert two.skipped == {f"per-turn groups: {OWN_GROUP_TRAINED}": 4}
    trained = trained_records(one) + trained_records(two)
    assert max(trained.values()) == 1 and set(first + second) <= set(trained)


def test_a_selection_recorded_without_per_turn_groups_makes_the_next_night_read_them_all(
    tmp_path,
):
    """A run recorded by a planner that did not select per-turn groups (an older
    version) says nothing about them: the next night reads every one, once."""
    data = tmp_path / "data"
    serve(data, "g", [1.0, 0.0])
    (record,) = serve(data, "s", [1.0])
    score(data, dict.fromkeys(resample(data, record, ["7", "8"]), 1.0), at=EARLIER)
    (other,) = serve(data, "t", [1.0])
    members = resample(data, other, ["7", "a cat"])
    score(data, dict(zip(members, [0.0, 1.0, 0.0], strict=True)), at=EARLIER)
    served_only = plan_run(Selection(data, 600), TrainConfig())
    record_run(data, RunResult("old", served_only), TrainConfig(), "b", None, now_us(), None)
    assert TURN_PENDING_KEY not in served_only.selection
    plan = night(data)
    assert plan.looked_since == served_only.selection["watermark"]
    assert set(plan.considered) == {turn_group_id(record), turn_group_id(other)}
    assert plan.groups == [turn_group_id(other)]
    assert night(data).considered == []  # that night's record speaks for them


def test_a_since_run_never_trains_the_turns_of_a_group_the_gate_holds_out(tmp_path):
    """`--since` makes no selection record. The gate takes its prompts once the plan is
    whole: a served group it holds out of tonight's training waits for a later night,
    and its turns' per-turn groups, left out because their own group comes first, are
    not trained in its place."""
    data = tmp_path / "data"
    first, second = serve(data, "first", [1.0, 0.0]), serve(data, "second", [1.0, 0.0])
    for record in first + second:
        members = resample(data, record, ["7", "a cat"])
        score(data, dict(zip(members, [0.0, 1.0, 0.0], strict=True)), at=EARLIER)
    since = dt.datetime.fromtimestamp(EARLIER / 1e6 - 3600, dt.UTC)
    config = TrainConfig()
    plan = plan_run(Selection(data, 600, since=since), config)
    plan = add_turn_groups(Selection(data, since=since), plan, config)
    plan = without(plan, ["second"])  # as the gate does
    assert plan.selection is None and plan.groups == ["first"], plan.lines()
    assert plan.skipped[f"per-turn groups: {OWN_GROUP_TRAINED}"] == 4
