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
    with pytest.raises(SystemExit):
        parse_args(["--peer", "trl"])  # a later item: it says "not yet"


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
