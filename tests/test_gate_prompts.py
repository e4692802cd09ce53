"""The gate's held-out prompts come from outside tonight's plan where the night allows, so
that tonight's per-turn groups train tonight (issue 21). Single calls, their siblings and
the judge's scores are written to a real on-disk store as the proxy, the resampling
stage and the judge write them; a night is planned as `overnight train` plans it."""

from __future__ import annotations

from pathlib import Path

from overnight.config import TrainConfig
from overnight.storage import new_id, now_us
from overnight.storage.read.siblings import turn_group_id
from overnight.trainer.choose.inputs import Selection
from overnight.trainer.choose.plan import TURN_PENDING_KEY, plan_run
from overnight.trainer.choose.selection import TURN_HELD_KEY
from overnight.trainer.choose.turn_groups import HELD_BY_A_GATE, add_turn_groups, conversation_key
from overnight.trainer.gate.prompts import (
    GIVEN_TO_THE_GATE,
    TURNS_GIVEN_TO_THE_GATE,
    held_out_prompts,
)
from overnight.trainer.train import RunResult, record_run

from .helpers import chat_response, completion_row
from .test_resample import PROMPT
from .test_turn_groups import EARLIER, append, resample, score


def single_call(data: Path, name: str) -> tuple[str, dict]:
    """One production call (no group): its record id and its request."""
    request = {"model": "policy", "messages": [{"role": "user", "content": f"How many {name}?"}]}
    row = completion_row(name, name, started_at=EARLIER, ended_at=EARLIER, model_served="tiny",
                         request=request, response=chat_response("seven"),
                         prompt_token_ids=PROMPT, completion_token_ids=[21, 22],
                         completion_logprobs=[-1.0, -2.0], finish_reason="stop")  # fmt: skip
    append(data, "completions", [row])
    return name, request


def a_night_of_single_calls(data: Path, with_signal: int, without: int) -> dict[str, dict]:
    """Single calls each resampled twice and scored: `with_signal` of them whose members
    scored differently, `without` whose members all scored 0. Request by record."""
    requests = {}
    for i in range(with_signal + without):
        record, requests[f"call{i}"] = single_call(data, f"call{i}")
        members = resample(data, record, ["7", "a cat"])
        rewards = [0.0, 1.0, 0.0] if i < with_signal else [0.0, 0.0, 0.0]
        score(data, dict(zip(members, rewards, strict=True)), at=EARLIER)
    return requests


def plan_night(data: Path, config: TrainConfig):
    plan = plan_run(Selection(data, settle_seconds=600), config)
    return add_turn_groups(Selection(data), plan, config)


def test_one_off_calls_are_the_gates_and_every_per_turn_group_trains(tmp_path):
    """Calls nobody resampled are the gate's prompts: nothing of tonight waits."""
    data = tmp_path / "data"
    a_night_of_single_calls(data, with_signal=6, without=6)
    for i in range(8):
        single_call(data, f"one-off{i}")
    plan = plan_night(data, TrainConfig())
    trainable = [turn_group_id(f"call{i}") for i in range(6)]
    assert plan.groups == trainable, plan.lines()
    prompts, gated = held_out_prompts(data, plan, 8)
    assert sorted(p.group_id for p in prompts) == sorted(f"one-off{i}" for i in range(8))
    assert gated.groups == trainable and GIVEN_TO_THE_GATE not in gated.skipped


def test_with_only_resampled_calls_the_gate_keeps_the_nights_mix_and_says_what_waits(tmp_path):
    """Every call was resampled: the gate takes the night's conversations in the share the
    night has them, those of the plan capped at a quarter of it. The per-turn groups it
    takes are held out for good, listed with the reason (a night later they would train
    a promotion stale); the rest of tonight's per-turn groups train tonight."""
    data = tmp_path / "data"
    requests = a_night_of_single_calls(data, with_signal=8, without=8)
    plan = plan_night(data, TrainConfig())
    assert len(plan.groups) == 8, plan.lines()
    assert plan.skipped["per-turn groups: all rewards equal: no signal"] == 8
    prompts, gated = held_out_prompts(data, plan, 8)
    assert len(prompts) == 8
    # Half the night's conversations are the plan's: half of 8, capped at 8 // 4 = 2.
    given = [g for g in plan.groups if g not in gated.groups]
    assert len(given) == 2 and gated.skipped[TURNS_GIVEN_TO_THE_GATE] == 2, gated.lines()
    assert len(gated.groups) == 6 and GIVEN_TO_THE_GATE not in gated.skipped
    # Decided: not pending, recorded as held; and what trains is never a gate prompt.
    assert not set(given) & set(gated.selection[TURN_PENDING_KEY])
    assert gated.selection[TURN_HELD_KEY] == sorted(given)
    trained = {
        conversation_key(requests[g.split(":", 1)[1]]["messages"], None) for g in gated.groups
    }
    assert not trained & {p.key for p in prompts}
    assert any(TURNS_GIVEN_TO_THE_GATE in line for line in gated.lines())
    # The next night reads them again (a member's score changed) and still trains none.
    config = TrainConfig()
    record_run(data, RunResult(f"run-{new_id()}", gated), config, "base", None, now_us(), None)
    held = given[0]
    score(data, {f"{held}:served": 0.5})
    later = plan_night(data, config)
    assert held in later.considered and not set(given) & set(later.groups), later.lines()
    assert later.skipped[f"per-turn groups: {HELD_BY_A_GATE}"] >= 1
    assert held in later.selection[TURN_HELD_KEY]  # still found, still decided


def test_a_resumed_run_gives_the_gate_nothing_of_its_plan(tmp_path):
    data = tmp_path / "data"
    a_night_of_single_calls(data, with_signal=4, without=0)
    plan = plan_night(data, TrainConfig())
    prompts, gated = held_out_prompts(data, plan, 8, take_from_plan=False)
    assert prompts == [] and gated.groups == plan.groups


def test_a_rollout_that_starts_with_worked_examples_is_a_first_turn(tmp_path):
    """An agent that shows the model worked examples as earlier turns (few-shot: the
    reasoning-gym agent's two) sends turn 2 first: the proxy counts the assistant turns a
    request carries. Its rollout's first logged turn is the gate's prompt all the same;
    a rollout's later turns are not (the gate asks its conversations from their start)."""
    data = tmp_path / "data"
    example = [{"role": "user", "content": "2 + 2 ="}, {"role": "assistant", "content": "4"}]
    rows = []
    for i in range(9):
        asked = [*example, *example, {"role": "user", "content": f"{i} + 1 ="}]
        request = {"model": "policy", "messages": asked, "max_tokens": 8}
        rows.append(completion_row(f"shot{i}", f"shot{i}", turn_index=2, request=request,
                                   response=chat_response(str(i + 1)), sent_by="eval"))  # fmt: skip
        if i == 0:  # the same rollout goes on: its turn 3 is no first turn
            later = {**request, "messages": [*asked, {"role": "assistant", "content": "1"},
                                             {"role": "user", "content": "and 5 + 1?"}]}  # fmt: skip
            rows.append(completion_row("shot0", "shot0", record_id="shot0-later", turn_index=3,
                                       request=later, response=chat_response("6"),
                                       sent_by="eval"))  # fmt: skip
    append(data, "completions", rows)
    plan = plan_night(data, TrainConfig())
    prompts, _ = held_out_prompts(data, plan, 16)
    assert sorted(p.group_id for p in prompts) == sorted(f"shot{i}" for i in range(9))
    assert all(p.messages[-1]["content"] != "and 5 + 1?" for p in prompts)
    assert all(p.messages[:4] == [*example, *example] for p in prompts)
