"""The best adapter so far (trainer/gate/storage/read/best_adapter.py): placed from the gate's records on disk,
and held against a candidate by run_gate on the tiny model."""

from __future__ import annotations

import json
import time

import pytest

from overnight.config import TrainConfig
from overnight.storage import LogWriter, WriterConfig
from overnight.storage.read.best_adapter import Best, best_so_far, levels, loadable_path, standing
from overnight.trainer.gate.prompts import GatePrompt
from overnight.trainer.gate.verdict import run_gate, sample_each

BASE = "/models/base"


def record_nights(data_dir, nights: list[dict]) -> None:
    """One `training_runs` row a night, in order: its verdict's figures as the gate
    records them (`gate`), its policy, base model and status."""
    writer = LogWriter(WriterConfig(data_dir, compact_in_process=True))  # as record_run's
    writer.start()
    now = time.time_ns() // 1000
    for i, night in enumerate(nights):
        gate = {"promote": True, **night.get("gate", {})}
        writer.append("training_runs", {
            "run_id": f"run{i}", "schema_version": 1, "started_at": now + i, "ended_at": now + i,
            "status": night.get("status", "trained"), "base_model": night.get("base", BASE),
            "metrics": json.dumps({"gate": gate, "policy": night.get("policy")}),
        })  # fmt: skip
    writer.close()


def verdict_row(candidate, served, diff, **extra) -> dict:
    return {"gate": {"candidate_adapter": candidate, "served_adapter": served, "diff_mean": diff,
                     **extra.pop("gate", {})}, **extra}  # fmt: skip


def default_policy(metrics: dict) -> bool:
    return metrics.get("policy") is None


def test_the_gates_verdicts_chain_into_levels_and_the_best_above_the_served_is_found(tmp_path):
    record_nights(tmp_path, [
        verdict_row("v1", None, 0.25),  # from the base model
        verdict_row("v2", "v1", -0.0625),  # forgiven
        verdict_row("v3", "v2", -0.0625),  # forgiven again: the slide
        verdict_row("x", "v3", 0.5, gate={"promote": False}),  # refused: not placed
        verdict_row("y", "v3", 0.5, status="failed"),  # failed: not placed
        verdict_row("z", "v3", float("nan")),  # no number: not placed
        verdict_row("other", None, 0.9, policy="support"),  # another policy's
        verdict_row("elsewhere", None, 0.9, base="/models/other"),  # another base model's
        {"gate": {"promote": True, "diff_mean": 0.9}},  # before verdicts named their sides
    ])  # fmt: skip
    placed = levels(tmp_path, default_policy, BASE)
    assert placed == {None: 0.0, "v1": 0.25, "v2": 0.1875, "v3": 0.125}
    on_stack = {"v1", "v2", "v3"}
    best = best_so_far(placed, "v3", on_stack, lambda a: f"/adapters/{a}")
    assert best == Best("v1", "/adapters/v1", 0.125)
    assert best.describe() == "v1 (+0.125 over the served)"
    # v1's files pruned, or v1 rolled back (off the stack): the next best above the served.
    assert best_so_far(placed, "v3", on_stack, lambda a: None if a == "v1" else a) == Best(
        "v2", "v2", 0.0625
    )
    assert best_so_far(placed, "v3", {"v2", "v3"}, lambda a: a) == Best("v2", "v2", 0.0625)
    # The best one served: nothing to hold to; nor for a served adapter no verdict placed.
    assert best_so_far(placed, "v1", on_stack, lambda a: a) is None
    assert best_so_far(placed, "by-hand", on_stack, lambda a: a) is None
    assert levels(tmp_path, lambda m: m.get("policy") == "support", BASE) == {
        None: 0.0, "other": 0.9
    }  # fmt: skip


def test_an_adapter_below_the_base_model_is_held_to_the_base_and_a_new_chain_forgets(tmp_path):
    record_nights(tmp_path, [verdict_row("v1", None, -0.1), verdict_row("v2", "v1", -0.1)])
    best = best_so_far(levels(tmp_path, default_policy, BASE), "v2", set(), lambda a: a)
    assert best == Best(None, None, pytest.approx(0.2)) and "the base model" in best.describe()
    # An adapter promoted by hand (not placed) served, then a night from it: a new chain,
    # the base model and v1, v2 no longer comparable with it.
    later = tmp_path / "later"
    record_nights(later, [verdict_row("v1", None, -0.1), verdict_row("v2", "v1", -0.1),
                          verdict_row("v3", "by-hand", 0.05)])  # fmt: skip
    placed = levels(later, default_policy, BASE)
    assert placed == {"by-hand": 0.0, "v3": 0.05}
    assert best_so_far(placed, "v3", {"by-hand", "v3"}, lambda a: a) is None
    assert best_so_far(placed, None, {"by-hand", "v3"}, lambda a: a) is None  # base: unplaced


def test_the_stack_and_the_files_say_which_adapters_can_be_the_best(tmp_path):
    """Only adapters on the alias's promotion stack (served, not rolled back), and only
    those whose directory still holds its config, can be sampled as the best."""
    state = {
        "adapters": [{"name": "policy-v1", "path": "/a/v1"},
                     {"name": "policy-v2", "path": "/a/v2", "source": "s3://b/adapters/k2"},
                     {"name": "policy-v3", "path": "/a/v3"}],  # v3: rolled back, or a canary
        "stack": ["policy-v1", "policy-v2", "gone-from-history"],
    }  # fmt: skip
    assert standing(state) == {"/a/v1", "/a/v2", "s3://b/adapters/k2"}
    assert standing({}) == set()
    whole, emptied = tmp_path / "whole", tmp_path / "emptied"
    whole.mkdir(), emptied.mkdir()
    (whole / "adapter_config.json").write_text("{}")
    find = loadable_path(tmp_path)
    assert find(str(whole)) == str(whole)
    assert find(str(emptied)) is None and find(str(tmp_path / "missing")) is None


def test_a_candidate_worse_than_the_best_so_far_is_refused_though_not_worse_than_served(
    tiny_model_dir, lora_adapter
):
    """run_gate on the tiny model: served and candidate are the same adapter (no loss
    against the served one); the best so far is the base model, and the scorer rewards
    exactly its replies, so the candidate is measurably worse than it. The same adapter
    as the best passes; a `better` gate is not held to it."""
    pytest.importorskip("peft")
    prompts = [GatePrompt(f"g{i}", [{"role": "user", "content": f"Question {i}?"}], [], 0.0,
                          1.0, 3) for i in range(8)]  # fmt: skip
    off = {"gaming_limit": "off", "gaming_length_limit": "off"}  # no base model sampled for it
    config = TrainConfig(gate="not-worse", **off)
    base = sample_each(str(tiny_model_dir), {"base": None}, prompts, config)["base"]
    by_prompt = {p.messages[-1]["content"]: reply for p, reply in zip(prompts, base, strict=True)}
    asked = []

    async def scorer(messages, tools, replies):
        asked.append(len(replies))
        wanted = by_prompt[messages[-1]["content"]]
        return [1.0 if r["content"] == wanted else 0.0 for r in replies]

    lines: list[str] = []
    base_best = Best(None, None, 0.3)
    verdict = run_gate(config, str(tiny_model_dir), lora_adapter, str(lora_adapter), prompts,
                       scorer, say=lines.append, best=base_best)  # fmt: skip
    assert verdict.diff_mean == 0.0 and not verdict.promote, verdict.reason
    held = verdict.best
    assert held["adapter"] is None and held["prompts"] == 8 and held["passes"] is False
    assert held["diff_mean"] == -1.0 and held["high"] < 0, held  # the base's replies win
    assert verdict.reason.startswith("worse than the best adapter so far: candidate - best so "
                                     "far = -1, interval [-1, -1] against the base model")  # fmt: skip
    assert "the task gate passed: candidate - served = +0" in verdict.reason
    assert len(asked) == 16, "eight pairs against the served, eight against the best"
    sampled = [line for line in lines if line.startswith("gate: sampled")]
    assert sampled[-1].startswith("gate: sampled 24 replies"), "three sides sampled"
    assert lines[-1].startswith("gate, against the best so far: scored 8 pairs in "), lines

    same = Best(str(lora_adapter), str(lora_adapter), 0.1)
    passed = run_gate(config, str(tiny_model_dir), lora_adapter, str(lora_adapter), prompts,
                      scorer, say=lines.append, best=same)  # fmt: skip
    assert passed.promote and passed.best["passes"] and passed.best["diff_mean"] == 0.0
    assert "; not worse than the best so far: candidate - best so far = +0" in passed.reason
    better = run_gate(TrainConfig(gate="better", **off), str(tiny_model_dir),
                      lora_adapter, str(lora_adapter), prompts, scorer, say=lines.append,
                      best=base_best)  # fmt: skip
    assert better.best is None and not better.promote  # refused as no gain, not for the best
    sampled = [line for line in lines if line.startswith("gate: sampled")]
    assert sampled[-1].startswith("gate: sampled 16 replies"), "two sides: no best sampled"
    # With the gaming check on, the base model is sampled for it already: used for both.
    lines.clear()
    gamed = run_gate(TrainConfig(gate="not-worse"), str(tiny_model_dir), lora_adapter,
                     str(lora_adapter), prompts, scorer, say=lines.append, best=base_best)  # fmt: skip
    assert gamed.best["diff_mean"] == -1.0 and not gamed.promote
    sampled = [line for line in lines if line.startswith("gate: sampled")]
    assert sampled[-1].startswith("gate: sampled 24 replies"), sampled
