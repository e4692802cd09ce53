"""Data parallel: `torchrun` with two CPU processes (gloo) trains the same adapter as one."""

from __future__ import annotations

import subprocess
import sys

import pytest
from safetensors.torch import load_file

from .helpers import rows
from .test_train_plan import write

pytestmark = pytest.mark.slow


def test_two_processes_train_the_same_adapter_as_one(tmp_path, tiny_model_dir):
    groups = {f"g{i}": [1.0, 0.0, 0.5, 0.25] for i in range(4)}
    for name in ("one", "two"):
        write(tmp_path / name, groups)

    def args(name: str) -> list[str]:
        # 16-token micro-batches: several per step, so both processes have work.
        return [
            "-m",
            "overnight.cli",
            "train",
            "--data",
            str(tmp_path / name),
            "--proxy",
            "",
            "--base-model",
            str(tiny_model_dir),
            "--lora-rank",
            "4",
            "--learning-rate",
            "1e-2",
            "--groups-per-step",
            "2",
            "--micro-batch-tokens",
            "16",
            "--epochs",
            "2",
        ]

    subprocess.run([sys.executable, *args("one")], check=True, capture_output=True)
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            *args("two"),
        ],
        capture_output=True,
        text=True,
    )
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert two.stdout.count("step 4/4") == 1  # only process 0 reports
    (one_run,) = rows(tmp_path / "one", "SELECT adapter_path, steps, metrics FROM training_runs")
    (two_run,) = rows(tmp_path / "two", "SELECT adapter_path, steps, metrics FROM training_runs")
    assert one_run["steps"] == two_run["steps"] == 4
    a = load_file(f"{one_run['adapter_path']}/adapter_model.safetensors")
    b = load_file(f"{two_run['adapter_path']}/adapter_model.safetensors")
    assert a.keys() == b.keys()
    gap = max((a[k] - b[k]).abs().max().item() for k in a)
    assert gap < 1e-5, gap  # the same gradients, summed in another order
