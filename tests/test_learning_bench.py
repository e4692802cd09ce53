"""bench/learning.py's pure parts (the gate line read, the table, the page) and the reward
function its gate scores with (examples/reasoning_gym_rewards.py): no server, no training."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.learning import Row, index_specs, page, parse_args, parse_gate, table  # noqa: E402
from examples import reasoning_gym_rewards as rewards  # noqa: E402

GATE = (
    "gate (not-worse): promoted: candidate - served = +0.0246 on 16 held-out prompts "
    "(0.1 vs 0.0754), 90% interval [-0.01, +0.06], ...; forgetting on 120 reference answers: "
    "candidate +0.012 nats/token vs the base model (0% of them down by more than 1), served "
    "+0.000; budget 0.1"
)
ROWS = [
    Row("syllogism", 0, 0.25, 0.31, served="smollm2"),
    Row(
        "syllogism",
        1,
        0.33,
        0.38,
        served="policy-v1-abc",
        train_reward=0.27,
        verdict="promoted",
        gate_diff=0.0246,
        forgetting=0.012,
        gate_line=GATE,
    ),  # fmt: skip
]


def test_the_gate_line_gives_the_verdict_the_difference_and_the_forgetting():
    assert parse_gate(GATE) == ("promoted", 0.0246, 0.012)
    refused = "gate (not-worse): refused: candidate - served = -1.5e-02 on 16 held-out prompts"
    assert parse_gate(refused) == ("refused", -0.015, None)
    assert parse_gate("-") == ("-", None, None)


def test_the_table_has_a_line_per_night_with_the_scores_and_the_verdict():
    lines = table(ROWS).splitlines()
    assert len(lines) == 3 and lines[0].split()[:4] == ["task", "night", "sampled", "greedy"]
    assert lines[1].split() == ["syllogism", "0", "0.250", "0.310", "-", "-", "-", "-", "smollm2"]
    assert lines[2].split() == ["syllogism", "1", "0.330", "0.380", "0.270", "promoted",
                                "+0.025", "+0.012", "policy-v1-abc"]  # fmt: skip


def test_the_page_has_a_chart_and_a_table_per_task_and_the_gate_lines():
    html = page(ROWS + [Row("aiw", 0, 0.1, 0.0)], "python bench/learning.py", {"nights": 1})
    assert html.count("<svg") == 2 and html.count("<table>") == 2
    assert "<h2>syllogism</h2>" in html and "<h2>aiw</h2>" in html
    assert "night 1: gate (not-worse): promoted" in html and "held-out, greedy" in html


def test_the_index_names_the_held_out_questions_and_each_day_s():
    args = parse_args(["--tasks", "syllogism", "--nights", "2", "--held-out", "8"])
    specs = index_specs("syllogism", args)
    assert [(s["seed"], s["size"]) for s in specs] == [(1_000_003, 8), (101, 16), (102, 16)]
    assert parse_args(["--peer", "trl"]).peer == "trl"
    with pytest.raises(SystemExit):
        parse_args(["--peer", "other"])


def test_the_reward_function_finds_the_question_and_scores_it_as_the_agent_does(tmp_path):
    reasoning_gym = pytest.importorskip("reasoning_gym")
    spec = {"task": "syllogism", "difficulty": {}, "seed": 7, "size": 4}
    path = tmp_path / "index.json"
    path.write_text(json.dumps([spec]))
    ds = reasoning_gym.create_dataset("syllogism", size=4, seed=7)
    entry = ds[2]

    def rollout(reply: str) -> dict:
        """The agent's conversation: a worked example (another question, its answer) first,
        so only the last user message is the question scored."""
        return {"messages": [{"role": "system", "content": "Reply with the answer only."},
                             {"role": "user", "content": ds[0]["question"]},
                             {"role": "assistant", "content": str(ds[0]["answer"])},
                             {"role": "user", "content": entry["question"]},
                             {"role": "assistant", "content": reply}]}  # fmt: skip

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(rewards.INDEX_ENV, str(path))
        assert rewards.score_answer(rollout(f"  {entry['answer']}\n")) == 1.0
        wrong = "No" if entry["answer"] == "Yes" else "Yes"
        assert rewards.score_answer(rollout(wrong)) == ds.score_answer(wrong, entry) < 1.0
        assert rewards.score_answer(rollout("")) == ds.score_answer("", entry)
        with pytest.raises(LookupError):
            rewards.score_answer({"messages": [{"role": "user", "content": "unasked"},
                                               {"role": "assistant", "content": "Yes"}]})  # fmt: skip
        mp.delenv(rewards.INDEX_ENV)
        with pytest.raises(LookupError):
            rewards.score_answer(rollout("Yes"))


def test_the_base_models_reference_figures_are_shared_where_they_hold_more(tmp_path):
    from bench.learning import share_references

    shared, data = tmp_path / "shared", tmp_path / "data" / "references"
    share_references(shared, data)  # nothing shared yet: nothing done
    assert not data.exists()
    shared.mkdir()
    (shared / "m.json").write_text(json.dumps({"a": "1", "b": "2"}))
    share_references(shared, data)
    assert json.loads((data / "m.json").read_text()) == {"a": "1", "b": "2"}
    (data / "m.json").write_text(json.dumps({"a": "1", "b": "2", "c": "3"}))
    (data / "m.loglik.json").write_text(json.dumps({"k": 0.5}))
    share_references(shared, data)  # the fuller copy stays
    assert len(json.loads((data / "m.json").read_text())) == 3
    share_references(data, shared)
    assert len(json.loads((shared / "m.json").read_text())) == 3
    assert (shared / "m.loglik.json").exists()


def test_questions_that_depend_on_string_hashing_are_found_under_the_bench_s_hash_seed(tmp_path):
    """ransom_note's questions change with PYTHONHASHSEED: the agent's process and the
    gate's find the same ones only under the same seed, which bench/learning.py fixes."""
    pytest.importorskip("reasoning_gym")
    import subprocess

    spec = {"task": "ransom_note", "difficulty": {}, "seed": 3, "size": 4}
    (tmp_path / "index.json").write_text(json.dumps([spec]))
    ask = ("import json, reasoning_gym; ds = reasoning_gym.create_dataset('ransom_note', "
           "size=4, seed=3); print(json.dumps([ds[i]['question'] for i in range(4)]))")  # fmt: skip
    find = ("import json, sys; from examples.reasoning_gym_rewards import lookup; "
            "qs = json.loads(sys.stdin.read()); found = 0\n"
            "for q in qs:\n"
            "    try: lookup([{'role': 'user', 'content': q}]); found += 1\n"
            "    except LookupError: pass\n"
            "print(found)")  # fmt: skip

    def found(asker_seed: str) -> int:
        env = dict(os.environ, PYTHONHASHSEED=asker_seed, PYTHONPATH=str(ROOT))
        env["REASONING_GYM_INDEX"] = str(tmp_path / "index.json")
        asked = subprocess.run([sys.executable, "-c", ask], env=env, capture_output=True,
                               text=True, check=True).stdout.splitlines()[-1]  # fmt: skip
        env["PYTHONHASHSEED"] = "0"
        out = subprocess.run([sys.executable, "-c", find], env=env, input=asked,
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        return int(out.split()[-1])

    assert found("0") == 4
    assert found("1") < 4  # another hash seed: other questions


# -- the peer: TRL's GRPOTrainer on the same prompts and budget (bench/learning_trl.py) ----


def test_the_peer_s_budget_ends_each_night_where_ours_does():
    from bench.learning_trl import Budget, preset_budget

    budget = preset_budget(parse_args(["--nights", "3", "--size", "16", "--group-size", "4"]))
    assert (budget.groups_per_step, budget.epochs) == (4, 2)  # the smollm2-cpu preset's
    assert budget.batch == 16 and budget.completions_per_night == 64
    assert budget.steps_per_night == 8 and budget.max_steps == 24
    # each generation is trained on for two steps: after step 1 one batch was sampled
    assert [budget.completions_after(s) for s in (1, 2, 3, 8, 16, 24)] == [16, 16, 32, 64,
                                                                           128, 192]  # fmt: skip
    with pytest.raises(ValueError, match="whole number of steps"):
        Budget(nights=1, size=10, group_size=4, groups_per_step=4, epochs=2)


def test_the_peer_asks_our_days_questions_in_our_order_with_our_settings(tmp_path):
    from bench.learning_trl import question_order, spec_for

    assert question_order(2, 3, 100) == [(1, 101, 0), (1, 101, 1), (1, 101, 2),
                                         (2, 102, 0), (2, 102, 1), (2, 102, 2)]  # fmt: skip
    args = parse_args(["--tasks", "syllogism", "--nights", "2", "--size", "8",
                       "--group-size", "4", "--temperature", "0.8"])  # fmt: skip
    spec = spec_for("syllogism", {}, "model", tmp_path, args)
    days = [s["seed"] for s in index_specs("syllogism", args)[1:]]  # the index's day seeds
    assert sorted({seed for _, seed, _ in spec["order"]}) == days and len(spec["order"]) == 16
    grpo = spec["grpo"]
    assert grpo["shuffle_dataset"] is False  # the dataset's order is the days'
    assert (grpo["num_generations"], grpo["temperature"], grpo["max_completion_length"]) == (
        4, 0.8, 64)  # fmt: skip
    assert (grpo["top_p"], grpo["top_k"], grpo["beta"], grpo["loss_type"]) == (1.0, 0, 0.0, "dapo")
    # a step: 4 groups of 4, one group a forward pass, generated together, used twice
    assert (grpo["per_device_train_batch_size"], grpo["gradient_accumulation_steps"],
            grpo["steps_per_generation"], grpo["num_iterations"], grpo["max_steps"]) == (
        4, 4, 4, 2, 8)  # fmt: skip
    assert (grpo["learning_rate"], grpo["lr_scheduler_type"]) == (1e-3, "constant")
    assert spec["lora"] == {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}  # fmt: skip
    assert spec["shots"] == 2


def test_the_peer_s_prompts_are_the_agent_s_messages_and_its_reward_the_agent_s_score():
    pytest.importorskip("reasoning_gym")
    from bench.learning_trl import prompt_rows, question_order, task_reward
    from examples.reasoning_gym_agent import task_messages, worked_examples

    spec = {"task": "syllogism", "difficulty": {}, "size": 3, "shots": 2,
            "order": question_order(2, 3, 100)}  # fmt: skip
    days, rows = prompt_rows(spec)
    examples = worked_examples("syllogism", {}, 2)
    assert [(r["seed"], r["index"]) for r in rows] == [(s, i) for _, s, i in spec["order"]]
    assert rows[4]["prompt"] == task_messages(days[102][1]["question"], examples)
    scores: list[float] = []
    reward = task_reward(days, scores)
    right = str(days[101][2]["answer"])
    wrong = "No" if right == "Yes" else "Yes"
    completions = [[{"role": "assistant", "content": f"  {right}\n"}],
                   [{"role": "assistant", "content": wrong}]]  # fmt: skip
    got = reward(completions, seed=[101, 101], index=[2, 2], trainer_state=None)
    assert got == [1.0, days[101].score_answer(wrong, days[101][2])] and scores == got


def test_both_curves_side_by_side_in_the_table_and_on_the_page():
    from dataclasses import replace

    from bench.learning import side_by_side

    ours = [replace(ROWS[0], completions=0), replace(ROWS[1], completions=64, wall=300.0)]
    trl = [replace(ours[0], side="trl"),
           Row("syllogism", 1, 0.3, 0.25, side="trl", completions=64, wall=900.0)]  # fmt: skip
    lines = side_by_side(ours + trl).splitlines()
    assert lines[0].split()[:3] == ["task", "night", "completions"]
    assert lines[2].split() == ["syllogism", "1", "64", "0.330", "0.300", "0.380", "0.250",
                                "300", "900"]  # fmt: skip
    assert len(table(ours + trl).splitlines()) == 3  # ours only
    html = page(ours + trl, "python bench/learning.py --peer trl", {"nights": 1})
    assert html.count("<svg") == 3 and "TRL, sampled" in html and "seconds spent learning" in html


def test_a_game_is_a_task_its_agent_plays_boards_with_the_games_settings(tmp_path, monkeypatch):
    """A TextArena game in --tasks: examples/game_agent.py plays it with its settings, the
    bench's --size as boards; no TRL side for a game (its turns are many)."""
    import bench.learning as learning

    args = parse_args(["--tasks", "GuessTheNumber-v0", "syllogism"])
    assert args.tasks == ["GuessTheNumber-v0", "syllogism"]
    with pytest.raises(SystemExit):
        parse_args(["--tasks", "GuessTheNumber-v0", "--peer", "trl"])
    with pytest.raises(SystemExit):
        parse_args(["--tasks", "NoSuchGame-v0"])
    commands = []

    def run(command, **_):
        commands.append(command)
        summary = Path(command[command.index("--summary-json") + 1])
        summary.write_text(json.dumps({"mean_score": 0.5, "attempts": 8}))

    monkeypatch.setattr(learning.subprocess, "run", run)
    got = learning.run_agent({}, "GuessTheNumber-v0", tmp_path / "s.json", "--held-out",
                             "--seed", "0", "--size", "4", "--group-size", "2")  # fmt: skip
    assert got == {"mean_score": 0.5, "attempts": 8}
    (command,) = commands
    assert command[1] == str(learning.GAME_AGENT) and command[2:4] == ["--env", "GuessTheNumber-v0"]
    assert "--size" not in command and command[command.index("--games") + 1] == "4"
    settings = [c for c in command if c.startswith("--setting=")]
    assert settings == [
        "--setting=min_number=1",
        "--setting=max_number=10",
        "--setting=max_turns=4",
    ]
    assert "--held-out" in command and "--difficulty" not in command
