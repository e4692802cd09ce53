"""What a training run selects, and why it leaves groups out (no model needed)."""

from __future__ import annotations

import time

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.config import TrainConfig
from overnight.storage import LogWriter, WriterConfig, now_us
from overnight.trainer.choose.inputs import Selection
from overnight.trainer.choose.plan import Plan
from overnight.trainer.train import RunResult, plan_run, record_run

from .helpers import chat_response, completion_row


def write(
    data_dir,
    groups: dict[str, list[float | None]],
    token_ids: bool = True,
    source: str = "agent",
    at: int | None = None,
):
    """One-turn rollouts with token ids; rewards as given (None: no reward); every row
    stamped `at` (microseconds; default now)."""
    writer = LogWriter(WriterConfig(data_dir, commit_interval=0.0))
    writer.start()
    now = time.time_ns() // 1000 if at is None else at
    for group, rewards in groups.items():
        for i, reward in enumerate(rewards):
            rollout = f"{group}.{i}"
            writer.append(
                "completions",
                completion_row(
                    rollout,
                    group,
                    started_at=now,
                    ended_at=now,
                    prompt_token_ids=[1, 2, 3] if token_ids else None,
                    completion_token_ids=[10 + i, 11] if token_ids else None,
                    completion_logprobs=[-0.5, -0.25] if token_ids else None,
                ),
            )
            writer.append(
                "finishes", {"rollout_id": rollout, "schema_version": 1, "finished_at": now}
            )
            if reward is not None:
                writer.append(
                    "rewards",
                    {
                        "reward_id": f"{rollout}.{source}",
                        "schema_version": 1,
                        "rollout_id": rollout,
                        "reward": reward,
                        "source": source,
                        "created_at": now,
                    },
                )
    writer.close()


def test_the_plan_takes_scored_varied_groups_and_says_why_not_others(tmp_path):
    write(
        tmp_path,
        {"good": [1.0, 0.0, 0.5], "flat": [1.0, 1.0], "unscored": [1.0, None], "alone": [1.0]},
    )
    write(tmp_path, {"no-ids": [1.0, 0.0]}, token_ids=False)
    plan = plan_run(Selection(tmp_path, settle_seconds=600), TrainConfig())
    assert plan.groups == ["good"]
    assert [round(s.advantage, 3) for s in plan.samples] == [1.0, -1.0, 0.0]
    assert (
        plan.samples[0].tokens == [1, 2, 3, 10, 11]
        and plan.samples[0].trained == [False] * 3 + [True] * 2
    )
    assert plan.skipped == {
        "all rewards equal: no signal": 1,
        "a rollout has no reward (run overnight judge, or post rewards)": 1,
        "fewer than 2 trainable rollouts": 2,  # "alone", and "no-ids" whose turns are skipped
        "turns skipped: no token ids logged": 2,
    }


DAY_US = 86_400_000_000


def post_reward(data_dir, rollout: str, reward: float) -> None:
    """A reward posted now, for a rollout logged earlier."""
    writer = LogWriter(WriterConfig(data_dir, commit_interval=0.0))
    writer.start()
    row = {"reward_id": f"{rollout}.late", "schema_version": 1, "rollout_id": rollout}
    writer.append("rewards", {**row, "reward": reward, "source": "agent", "created_at": now_us()})
    writer.close()


def night(data_dir, config: TrainConfig | None = None, **options) -> Plan:
    """One night's selection, recorded as `overnight train` records its run."""
    config = config or TrainConfig()
    plan = plan_run(Selection(data_dir, settle_seconds=600, **options), config)
    if plan.groups:
        result = RunResult(f"run-{now_us()}", plan)
        record_run(data_dir, result, config, "base", None, now_us(), None)
    return plan


def test_a_night_reads_only_groups_changed_since_the_last_selection(tmp_path):
    write(
        tmp_path,
        {"good": [1.0, 0.0], "flat": [1.0, 1.0], "unscored": [1.0, None]},
        at=now_us() - 2 * DAY_US,
    )
    first = night(tmp_path)  # no earlier run: every untrained group is looked at
    assert first.groups == ["good"] and first.looked_since is None
    assert sorted(first.considered) == ["flat", "good", "unscored"]
    assert first.loaded_groups == ["good"]  # token ids read only where rewards differ

    nothing_new = night(tmp_path)
    assert nothing_new.considered == [] and nothing_new.loaded_groups == []
    assert nothing_new.looked_since == first.selection["watermark"]

    post_reward(tmp_path, "unscored.1", 0.0)  # the missing reward arrives, late
    second = night(tmp_path)
    assert second.considered == ["unscored"] and second.loaded_groups == ["unscored"]
    assert second.groups == ["unscored"] and second.rewards == {
        "unscored.0": 1.0,
        "unscored.1": 0.0,
    }
    assert "looked at 1 group(s) changed since the last run's selection" in " ".join(second.lines())

    rescan = plan_run(Selection(tmp_path, settle_seconds=600), TrainConfig(rescan=True))
    assert rescan.considered == ["flat"] and rescan.loaded_groups == []
    assert rescan.skipped == {"all rewards equal: no signal": 1}


def test_groups_left_pending_are_looked_at_again_and_a_new_basis_looks_at_all(tmp_path):
    for i, group in enumerate(["a", "b", "flat"]):  # begun in this order
        rewards = [1.0, 1.0] if group == "flat" else [1.0, 0.0]
        write(tmp_path, {group: rewards}, at=now_us() - DAY_US + i)
    capped = night(tmp_path, max_groups=1)
    assert capped.groups == ["a"] and capped.selection["pending"] == ["a", "b"]
    # Nothing changed, but "b" was trainable and not trained: it is looked at again.
    second = night(tmp_path)
    assert second.considered == ["b"] and second.groups == ["b"]
    assert night(tmp_path).considered == []
    # Verdicts made under other reward sources are not trusted: everything is looked at.
    ruler = TrainConfig(reward_sources=("ruler", "agent"))
    assert plan_run(Selection(tmp_path, settle_seconds=600), ruler).considered == ["flat"]


def test_a_failed_runs_selection_is_not_used(tmp_path):
    write(tmp_path, {"good": [1.0, 0.0]}, at=now_us() - DAY_US)
    plan = plan_run(Selection(tmp_path, settle_seconds=600), TrainConfig())
    record_run(tmp_path, RunResult("failed", plan), TrainConfig(), "b", None, now_us(), "Boom")
    again = plan_run(Selection(tmp_path, settle_seconds=600), TrainConfig())
    assert again.looked_since is None and again.groups == ["good"]


def test_reward_sources_in_order_of_preference(tmp_path):
    write(tmp_path, {"g": [1.0, 0.0]}, source="ruler")
    write(tmp_path, {"g": [0.0, 1.0]}, source="agent")
    agent_first = plan_run(Selection(tmp_path, settle_seconds=600), TrainConfig())
    assert agent_first.rewards == {"g.0": 0.0, "g.1": 1.0}
    ruler_first = plan_run(
        Selection(tmp_path, settle_seconds=600), TrainConfig(reward_sources=("ruler", "agent"))
    )
    assert ruler_first.rewards == {"g.0": 1.0, "g.1": 0.0}


def test_dry_run_and_runs_from_the_command_line(tmp_path):
    write(tmp_path, {"good": [1.0, 0.0]})
    out = CliRunner().invoke(main, ["train", "--data", str(tmp_path), "--dry-run"])
    assert out.exit_code == 0, out.output
    assert "1 group(s), 2 sequence(s), 4 trained tokens" in out.output
    listing = CliRunner().invoke(main, ["runs", "--data", str(tmp_path)])
    assert listing.exit_code == 0 and "(0 row(s))" in listing.output
    down = CliRunner().invoke(main, ["rollback", "--proxy", "http://127.0.0.1:9"])
    assert down.exit_code != 0 and "cannot reach the proxy" in down.output


def test_train_scores_with_a_reward_function_then_trains_without_a_proxy(tmp_path, tiny_model_dir):
    import pytest

    pytest.importorskip("peft")
    write(tmp_path, {"g1": [None, None, None], "g2": [None, None]})
    reward = tmp_path / "reward.py"
    reward.write_text("def by_rollout(rollout):\n    return float(rollout['rollout_id'][-1])\n")
    out = CliRunner().invoke(
        main,
        [
            "train",
            "--data",
            str(tmp_path),
            "--reward",
            f"{reward}:by_rollout",
            "--base-model",
            str(tiny_model_dir),
            "--proxy",
            "",
            "--lora-rank",
            "4",
            "--learning-rate",
            "1e-3",
        ],
    )
    assert out.exit_code == 0, out.output
    assert "scored 2 group(s) with the reward function" in out.output
    assert "starting from a fresh LoRA adapter" in out.output and "step 1/1: loss" in out.output
    from .helpers import rows

    (run,) = rows(tmp_path, "SELECT status, promoted_as, rollouts, adapter_path FROM training_runs")
    assert run["status"] == "trained" and run["promoted_as"] is None and run["rollouts"] == 5


def test_report_charts_handle_no_data_and_data():
    from overnight.view.charts import line_chart

    assert "no data yet" in line_chart("Loss", {"loss": []}, "step")
    svg = line_chart("Loss", {"loss": [(1, 0.5), (2, 0.25)], "clip": [(1, 0.1), (2, 0.1)]}, "step")
    assert svg.count("<polyline") == 2 and svg.count("<circle") == 4 and "0.5" in svg


def test_an_interrupted_run_resumes_and_ends_where_an_uninterrupted_one_does(
    tmp_path, tiny_model_dir
):
    import pytest
    from safetensors.torch import load_file

    from overnight.trainer.train import train

    from .helpers import rows

    groups = {f"g{i}": [1.0, 0.0, 0.5] for i in range(4)}
    write(tmp_path / "a", groups)
    write(tmp_path / "b", groups)
    config = TrainConfig(
        base_model=str(tiny_model_dir),
        learning_rate=1e-2,
        lora_rank=4,
        lora_alpha=8,
        groups_per_step=1,
        epochs=2,
    )  # 8 steps
    whole = train(tmp_path / "a", config, say=lambda _line: None)

    class Killed(Exception):
        pass

    def killed_after_step_3(line: str) -> None:
        if line.startswith("step 3/"):
            raise Killed  # as if the machine went down right after step 3's checkpoint

    with pytest.raises(Killed):
        train(tmp_path / "b", config, say=killed_after_step_3)
    lines: list[str] = []
    resumed = train(tmp_path / "b", config, say=lines.append)
    assert any("resuming an interrupted run on its 4 group(s)" in line for line in lines)
    assert any(line.startswith("resuming after step 3") for line in lines)
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == [
        f"step {k}/8" for k in range(4, 9)
    ]
    assert resumed.run_id != whole.run_id and [s["step"] for s in resumed.metrics["steps"]] == list(
        range(1, 9)
    )
    run_dir = tmp_path / "b" / "runs" / resumed.run_id
    assert (run_dir / "finished").exists() and not (run_dir / "checkpoint").exists()
    a = load_file(whole.adapter_path / "adapter_model.safetensors")
    b = load_file(resumed.adapter_path / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-6 for k in a)
    statuses = [
        r["status"]
        for r in rows(tmp_path / "b", "SELECT status FROM training_runs ORDER BY ended_at")
    ]
    assert statuses == ["failed", "trained"]
    assert "nothing to train on" in " ".join(_lines_of(train, tmp_path / "b", config))


def _lines_of(train, data_dir, config) -> list[str]:
    lines: list[str] = []
    train(data_dir, config, say=lines.append)
    return lines


def test_records_without_token_ids_are_retokenised_less_exactly(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from overnight.trainer.train import train

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0))
    writer.start()
    now = time.time_ns() // 1000
    messages = [{"role": "system", "content": "Count."}, {"role": "user", "content": "Go"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_len = len(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    for i, (text, reward) in enumerate([("1 2 3", 1.0), ("one two", 0.0), ("3 4", 0.5)]):
        rollout = f"g.{i}"
        # A non-vLLM upstream: no token ids, but its own usage counts.
        writer.append(
            "completions",
            completion_row(
                rollout,
                "g",
                request={"messages": messages},
                response=chat_response(text),
                prompt_tokens=prompt_len,
                completion_tokens=len(tokenizer(text).input_ids) + (1 if i else 2),
            ),
        )
        writer.append("finishes", {"rollout_id": rollout, "schema_version": 1, "finished_at": now})
        writer.append(
            "rewards",
            {
                "reward_id": rollout,
                "schema_version": 1,
                "rollout_id": rollout,
                "reward": reward,
                "source": "agent",
                "created_at": now,
            },
        )
    writer.close()
    plan = plan_run(Selection(tmp_path, settle_seconds=600, tokenizer=tokenizer), TrainConfig())
    assert plan.groups == ["g"] and plan.retokenised == 3
    assert all(not s.exact for s in plan.samples)
    assert (
        plan.samples[0].tokens[-1] == tokenizer.eos_token_id
    )  # finish_reason stop: the EOS was sampled
    assert plan.token_count_gaps == [-1, 0, 0]  # the first one's upstream counted one token more
    assert "3 turn(s) had no token ids and were re-tokenised" in " ".join(plan.lines())
    without = plan_run(Selection(tmp_path, settle_seconds=600), TrainConfig())
    assert without.groups == [] and without.skipped["turns skipped: no token ids logged"] == 3
    result = train(
        tmp_path,
        TrainConfig(base_model=str(tiny_model_dir), lora_rank=4, lora_alpha=8),
        say=lambda _line: None,
    )
    # Nothing logged to compare with: no gap; the starting policy is the behaviour policy.
    assert result.metrics["max_logprob_gap"] is None
    first = result.metrics["steps"][0]
    assert first["ratio_min"] == pytest.approx(1.0, abs=1e-5) == first["ratio_max"]


def test_runs_and_the_report_flag_a_large_logprob_gap(tmp_path):
    from overnight.storage import SCHEMA_VERSION
    from overnight.view.report import write_report

    writer = LogWriter(WriterConfig(tmp_path, compact_in_process=True))
    writer.start()
    now = int(time.time() * 1e6)
    for run_id, gap, at in (("run-bf16", 0.0774, now), ("run-f32", 2.4e-6, now + 1)):
        writer.append(
            "training_runs",
            {
                "run_id": run_id,
                "schema_version": SCHEMA_VERSION,
                "started_at": at,
                "status": "trained",
                "groups": ["g"],
                "max_logprob_gap": gap,
            },
        )
    writer.close()
    listing = CliRunner().invoke(main, ["runs", "--data", str(tmp_path)])
    assert listing.exit_code == 0, listing.output
    assert "logprob_gap" in listing.output and "0.077 !" in listing.output
    assert "2.4e-06 " in listing.output and "2.4e-06 !" not in listing.output  # float32: fine
    assert "warning: logprob gap above 0.02 (marked !) in run-bf16:" in listing.output
    report = write_report(tmp_path).read_text()
    assert '<td class="warn"' in report and "0.0774 !" in report and "in run-bf16:" in report


def test_the_gap_warning_names_a_serving_mismatch_and_stale_data_apart():
    """On-policy records measure serving against training: a gap there is a warning with
    its fix. Records a promotion old measure drift: said, with their ratios, never blamed
    on the serving dtype. A night with neither says nothing."""
    from overnight.trainer.train import gap_lines

    def age(gap: float, low: float = 1.0, high: float = 1.0) -> dict:
        return {"sequences": 3, "tokens": 30, "max_gap": gap, "ratio_min": low, "ratio_max": high}

    assert gap_lines({}) == []
    (fine,) = gap_lines({"0": age(2.4e-6)})
    assert fine.startswith("on-policy: 3 sequence(s)") and "2.4e-06 nats" in fine
    (serving,) = gap_lines({"0": age(0.0774)})
    assert serving.startswith("warning: on 3 sequence(s) the starting adapter sampled itself")
    assert "0.0774" in serving and "--logprobs-mode processed_logprobs" in serving
    own, drift = gap_lines({"0": age(0.03), "1": age(2.5, 0.08, 12.2)})
    assert own.startswith("warning:") and "0.03 nats" in own
    assert drift.startswith("stale data: 3 sequence(s) sampled 1 promotion(s) before")
    assert "2.5 nats" in drift and "0.08 to 12.2" in drift and "not a serving mismatch" in drift
    assert "dtype" not in drift and not drift.startswith("warning")
    fine, drift = gap_lines({"0": age(1e-6), "2": age(0.9)})
    assert fine.startswith("on-policy:") and drift.startswith("stale data: 3 sequence(s) sampled 2")
