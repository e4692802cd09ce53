"""A night's Weights & Biases run: real nights (the tiny model; the proxy in front of the
fake vLLM) with WANDB_MODE=offline, read back from the run's own files, and a night whose
W&B is unreachable, which must end as it would without W&B."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.config import ConfigError, TrainConfig
from overnight.judge.ruler import CallCounts
from overnight.judge.run import Summary
from overnight.trainer.run.wandb_run import STEP_METRICS, Report, wants_wandb

from .helpers import rows
from .test_gate import write_night
from .test_train_plan import write

pytest.importorskip("wandb")


@pytest.fixture
def offline(monkeypatch):
    """W&B offline, no key, nothing in the environment choosing a project or a folder."""
    for name in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


# -- the offline run's files, read back ---------------------------------------------------------


def read_records(path: Path) -> list:
    """The records of a `.wandb` file (wandb 0.31 has no public reader of its own): a
    7-byte header, then LevelDB-log framing in 32 KiB blocks (a record is one FULL chunk
    or FIRST, MIDDLE..., LAST; each chunk `<crc32 u32, length u16, type u8>` + bytes),
    each record a `wandb.proto.wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B datastore"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in the block for a header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding at the end of a block
            continue
        pending += chunk
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def read_run(run_dir: Path) -> dict:
    """An offline run's id, config, history rows, summary, tables and exit code."""
    (datastore,) = run_dir.glob("*.wandb")
    out = {"id": None, "config": {}, "history": [], "summary": {}, "exit_code": None}
    for record in read_records(datastore):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"] = record.run.run_id
            out["name"], out["group"] = record.run.display_name, record.run.run_group
            updates = record.run.config.update
        elif kind == "config":
            updates = record.config.update
        elif kind == "summary":
            updates = record.summary.update
        elif kind == "history":
            out["history"].append({_key(i): json.loads(i.value_json) for i in record.history.item})
            continue
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
            continue
        else:
            continue
        target = out["summary"] if kind == "summary" else out["config"]
        target.update({_key(u): json.loads(u.value_json) for u in updates})
    return out


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def table(run_dir: Path, row: dict, name: str) -> list[dict]:
    """A table a history row logged, as dicts (wandb writes it under files/media/table/)."""
    saved = json.loads((run_dir / "files" / row[f"{name}/path"]).read_text())
    return [dict(zip(saved["columns"], r, strict=True)) for r in saved["data"]]


def offline_runs(data_dir: Path) -> list[Path]:
    return sorted((data_dir / "wandb").glob("offline-run-*"))


def steps_of(run: dict) -> list[dict]:
    return [h for h in run["history"] if "train/loss" in h]


# -- a night, reported ---------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_night_reports_its_steps_samples_gate_and_promotion_to_an_offline_run(
    offline, make_proxy, tmp_path, tiny_model_dir
):
    pytest.importorskip("peft")
    proxy = await make_proxy()
    url, data = str(proxy.make_url("")), tmp_path / "data"
    write_night(data, tasks=6, held_out=8)
    reward = tmp_path / "reward.py"
    reward.write_text("def same(rollout):\n    return 1.0\n")  # a tie: not worse, promoted
    config = TrainConfig(
        base_model=str(tiny_model_dir), learning_rate=1e-2, epochs=2, lora_rank=4,
        groups_per_step=3, gate_prompts=8, report_to="wandb", policy="policy",
    )  # fmt: skip  # the proxy's default policy: every group here is its
    calls = CallCounts(prompt_tokens=1200, completion_tokens=90, cost_usd=0.0125)
    judged = Summary(judged=6, calls=calls)
    from overnight.judge.scoring import pair_scorer
    from overnight.trainer.train import train

    lines: list[str] = []
    result = await asyncio.to_thread(
        train, data, config, proxy_url=url, scorer=pair_scorer(f"{reward}:same", None),
        say=lines.append, judge=judged,
    )  # fmt: skip
    assert result.promoted_as and result.gate.promote, "\n".join(lines)
    assert any(line.startswith("W&B: reporting to run " + result.run_id) for line in lines)

    (run_dir,) = offline_runs(data)
    run = read_run(run_dir)
    assert run["id"] == result.run_id and run["exit_code"] == 0
    # Named after its policy, in the policy's group: each agent's nights plotted together.
    assert run["name"] == f"policy/{result.run_id}" and run["group"] == "policy"
    assert run["config"]["base_model"] == str(tiny_model_dir)
    assert run["config"]["learning_rate"] == 1e-2 and run["config"]["groups"] == 6
    # Every step, against the night's own record of it.
    (recorded,) = rows(data, "SELECT metrics, steps FROM training_runs")
    expected = json.loads(recorded["metrics"])["steps"]
    logged = steps_of(run)
    assert len(logged) == recorded["steps"] == 4
    assert [h["training_step"] for h in logged] == [1, 2, 3, 4]
    for got, want in zip(logged, expected, strict=True):
        assert got["train/loss"] == pytest.approx(want["loss"])
        assert got["train/grad_norm"] == pytest.approx(want["grad_norm"])
        assert got["train/reward_mean"] == pytest.approx(want["reward_mean"]) == 0.5
        assert got["train/reward_std"] == pytest.approx(0.5)  # rewards 1 and 0 in each group
        assert got["train/learning_rate"] == 1e-2
        assert got["train/tokens"] == want["tokens"] > 0
        assert got["train/clipped_fraction"] == pytest.approx(want["clipped_fraction"])
        assert got["train/logprob_gap"] == pytest.approx(want["logprob_gap"])
        assert got["time/step_seconds"] > 0 and "train/kl" not in got  # no KL term asked for
    # The sample trajectories: whole groups, each reward the one trained on.
    (with_table,) = [h for h in run["history"] if "samples/path" in h]
    samples = table(run_dir, with_table, "samples")
    assert len(samples) == 12 and {s["group"] for s in samples} == set(result.plan.groups)
    for s in samples:
        assert s["reward"] == result.plan.rewards[s["rollout"]]
        assert (s["advantage"] > 0) == (s["reward"] == 1.0)  # the sabotage reply won
        assert "answer." in s["prompt"]  # the task, at the end of its prompt
        assert s["completion"].strip()
    # The gate, the promotion, the judge's cost.
    summary, gate = run["summary"], result.gate
    assert summary["gate/verdict"] == gate.word == "promoted"
    assert summary["gate/prompts"] == gate.prompts == 8
    assert summary["gate/diff_mean"] == pytest.approx(gate.diff_mean) == 0.0
    assert summary["gate/reason"] == gate.reason
    (with_examples,) = [h for h in run["history"] if "gate/examples/path" in h]
    examples = table(run_dir, with_examples, "gate/examples")
    assert [e["prompt"] for e in examples] == [e["prompt"] for e in gate.examples] != []
    assert summary["promotion/promoted_as"] == result.promoted_as
    assert summary["judge/cost_usd"] == 0.0125 and summary["judge/prompt_tokens"] == 1200
    assert summary["night/steps"] == 4


@pytest.mark.slow
def test_a_resumed_night_continues_its_run(offline, tmp_path, tiny_model_dir):
    from overnight.trainer.train import train

    write(tmp_path, {f"g{i}": [1.0, 0.0, 0.5] for i in range(3)})
    config = TrainConfig(
        base_model=str(tiny_model_dir), learning_rate=1e-2, lora_rank=4, groups_per_step=1,
        epochs=2, report_to="wandb",
    )  # fmt: skip  # 6 steps

    class Killed(Exception):
        pass

    def killed_after_step_2(line: str) -> None:
        if line.startswith("step 2/"):
            raise Killed

    with pytest.raises(Killed):
        train(tmp_path, config, say=killed_after_step_2)
    resumed = train(tmp_path, config, say=lambda _line: None)
    first, second = (read_run(r) for r in offline_runs(tmp_path))
    assert first["id"] == second["id"] == resumed.run_id  # one W&B run for the night
    assert first["name"] == second["name"] == resumed.run_id and first["group"] == ""
    assert first["exit_code"] == 1 and first["summary"]["night/error"].startswith("Killed")
    assert second["exit_code"] == 0
    assert [h["training_step"] for h in steps_of(first)] == [1, 2]
    assert [h["training_step"] for h in steps_of(second)] == [3, 4, 5, 6]
    losses = [h["train/loss"] for h in steps_of(first) + steps_of(second)]
    assert losses == pytest.approx([s["loss"] for s in resumed.metrics["steps"]])


@pytest.mark.slow
def test_an_unreachable_wandb_leaves_the_night_as_it_was(
    monkeypatch, tmp_path, tiny_model_dir, caplog
):
    import socket

    from safetensors.torch import load_file

    from overnight.trainer.train import train

    groups = {f"g{i}": [1.0, 0.0, 0.5] for i in range(2)}
    write(tmp_path / "plain", groups)
    write(tmp_path / "unreachable", groups)
    config = TrainConfig(base_model=str(tiny_model_dir), learning_rate=1e-2, lora_rank=4)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    plain = train(tmp_path / "plain", config, say=lambda _line: None)

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # auto: a key turns the report on
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert wants_wandb(config)
    lines: list[str] = []
    with caplog.at_level(logging.WARNING, logger="overnight.trainer"):
        unreachable = train(tmp_path / "unreachable", config, say=lines.append)
    warnings = [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: W&B init failed"), lines
    assert warnings[0] in lines
    assert [s["loss"] for s in unreachable.metrics["steps"]] == pytest.approx(
        [s["loss"] for s in plain.metrics["steps"]]
    )
    a = load_file(plain.adapter_path / "adapter_model.safetensors")
    b = load_file(unreachable.adapter_path / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-6 for k in a)
    (run,) = rows(tmp_path / "unreachable", "SELECT status FROM training_runs")
    assert run["status"] == "trained"


@pytest.mark.slow
def test_the_command_reports_what_its_scoring_did_to_the_same_run(
    offline, tmp_path, tiny_model_dir
):
    write(tmp_path, {"g1": [None, None, None], "g2": [None, None]})
    reward = tmp_path / "reward.py"
    reward.write_text("def by_rollout(rollout):\n    return float(rollout['rollout_id'][-1])\n")
    out = CliRunner().invoke(
        main,
        ["train", "--data", str(tmp_path), "--reward", f"{reward}:by_rollout", "--base-model",
         str(tiny_model_dir), "--proxy", "", "--lora-rank", "4", "--report-to", "wandb"],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    (run_dir,) = offline_runs(tmp_path)
    run = read_run(run_dir)
    assert run["summary"]["judge/scored_by_function"] == 2 and run["summary"]["judge/failed"] == 0
    assert "judge/cost_usd" not in run["summary"]  # no LLM judge: no cost, not a cost of 0
    assert len(steps_of(run)) == 1 and run["config"]["lora_rank"] == 4


@pytest.mark.slow
def test_under_torchrun_only_process_0_reports(tmp_path, tiny_model_dir):
    from .test_train_ddp import GROUPS, TWO_PROCESSES, train_command

    write(tmp_path, GROUPS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    command = train_command(tmp_path, tiny_model_dir, TWO_PROCESSES["torchrun"])
    two = subprocess.run(
        [*command, "--report-to", "wandb"], capture_output=True, text=True, env=env
    )
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    (run_dir,) = offline_runs(tmp_path)  # one W&B run, not one per process
    (recorded,) = rows(tmp_path, "SELECT metrics FROM training_runs")
    losses = [s["loss"] for s in json.loads(recorded["metrics"])["steps"]]
    assert [h["train/loss"] for h in steps_of(read_run(run_dir))] == pytest.approx(losses)
    assert len(losses) == 4


# -- the reporter on its own ----------------------------------------------------------------------


def test_a_failing_wandb_call_is_warned_once_and_the_night_goes_on(offline, tmp_path, caplog):
    from overnight.trainer.choose.plan import Plan

    lines: list[str] = []
    report = Report(TrainConfig(report_to="wandb"), say=lines.append)
    report.begin("night-1", tmp_path, TrainConfig(report_to="wandb"), "tiny", None, Plan())
    assert report.on

    def broken(*_args, **_kwargs):
        raise RuntimeError("the W&B service died")

    report._run.log = broken
    with caplog.at_level(logging.WARNING, logger="overnight.trainer"):
        report.step({"step": 1, "loss": 0.5})
        report.step({"step": 2, "loss": 0.25})
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [
        "warning: W&B log failed (RuntimeError: the W&B service died); the night goes on"
    ]
    report.finish()  # still closes the run
    (run_dir,) = offline_runs(tmp_path)
    assert read_run(run_dir)["exit_code"] == 0 and not report.on


def test_the_gates_forgetting_figures_go_to_the_runs_summary(offline, tmp_path):
    from overnight.trainer.choose.plan import Plan
    from overnight.trainer.gate.forgetting import Forgetting, judge
    from overnight.trainer.gate.verdict import Verdict

    report = Report(TrainConfig(report_to="wandb"))
    report.begin("night-1", tmp_path, TrainConfig(report_to="wandb"), "tiny", None, Plan())
    verdict = Verdict("not-worse", True, "task fine")
    figures = Forgetting(120, 0.1, -1.5, 0.02, 0.4, 0.0, 0.3, 12.0)
    figures.over = True
    judge(verdict, figures)  # refused: over the budget
    report.gate(verdict)
    report.finish()
    (run_dir,) = offline_runs(tmp_path)
    summary = read_run(run_dir)["summary"]
    assert summary["gate/verdict"] == "refused"
    assert summary["forgetting/candidate"] == 0.4 and summary["forgetting/served"] == 0.02
    assert summary["forgetting/budget"] == 0.1 and summary["forgetting/over"] is True
    assert "forgets more than the budget" in summary["gate/reason"]


def test_report_to_is_chosen_and_checked(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert not wants_wandb(TrainConfig()) and wants_wandb(TrainConfig(report_to="wandb"))
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wants_wandb(TrainConfig()) and not wants_wandb(TrainConfig(report_to="none"))
    assert not Report(TrainConfig(report_to="none")).on
    with pytest.raises(ConfigError, match="report_to must be"):
        TrainConfig(report_to="tensorboard")
    out = CliRunner().invoke(main, ["train", "--report-to", "tensorboard", "--dry-run"])
    assert out.exit_code != 0 and "tensorboard" in out.output
    # Asked for and not installed: the night stops before it starts, naming the install.
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"pip install 'overnight\[wandb\]'"):
        Report(TrainConfig(report_to="wandb"))
    assert not Report(TrainConfig()).on  # auto with a key but no library: a warning, no report


def test_off_means_wandb_is_never_imported():
    code = (
        "import sys; from overnight.config import TrainConfig; "
        "from overnight.trainer.run.wandb_run import Report; "
        "r = Report(TrainConfig(report_to='none')); r.step({'step': 1, 'loss': 0.0}); r.finish(); "
        "assert 'wandb' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_step_metric_is_one_the_loop_records():
    """The names the docs list are the loop's record keys (a renamed key would drop a chart)."""
    loop = Path(__file__).parent.parent / "trainer" / "run" / "loop.py"
    step = Path(__file__).parent.parent / "trainer" / "grpo" / "loss.py"
    source = loop.read_text() + step.read_text()
    assert all(f'"{key}"' in source for key in STEP_METRICS), [
        k for k in STEP_METRICS if f'"{k}"' not in source
    ]
