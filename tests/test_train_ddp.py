"""Two CPU processes (gloo) train the same adapter as one: data parallel under
`torchrun`, FSDP under `accelerate launch --use_fsdp` (the same code path, told apart
only by what the launcher puts in the environment)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from overnight.proxy.launch.launcher import free_port

from .helpers import rows
from .test_train_plan import write

pytestmark = pytest.mark.slow

GROUPS = {f"g{i}": [1.0, 0.0, 0.5, 0.25] for i in range(4)}
TWO_PROCESSES = {
    "torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
    "accelerate-fsdp": [
        "-m",
        "accelerate.commands.launch",
        "--use_fsdp",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ],
}


def train_command(data_dir: Path, model_dir: Path, launcher: list[str] = ()) -> list[str]:
    # 16-token micro-batches: several per step, so both processes have work; 4 steps.
    if "accelerate.commands.launch" in launcher:
        # Its own port: accelerate's default (29500) is every run's, and under `make
        # test`'s two workers two launches at once collided (the second exited 1).
        # torchrun --standalone picks a free one itself.
        launcher = [*launcher, "--main_process_port", str(free_port())]
    return [
        sys.executable,
        *launcher,
        "-m",
        "overnight.cli",
        "train",
        "--data",
        str(data_dir),
        "--proxy",
        "",
        "--base-model",
        str(model_dir),
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


def trained_adapter(data_dir: Path) -> dict:
    (run,) = rows(
        data_dir, "SELECT adapter_path, steps FROM training_runs WHERE status = 'trained'"
    )
    assert run["steps"] == 4
    return load_file(f"{run['adapter_path']}/adapter_model.safetensors")


def assert_same_adapter(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    gap = max((a[k] - b[k]).abs().max().item() for k in a)
    # lora_B starts at zero, so its size is how far training moved the adapter.
    moved = max(a[k].abs().max().item() for k in a if "lora_B" in k)
    print(f"{what}: gap {gap:.2e}, moved {moved:.2e}")
    # The same gradients summed in another order (measured: 4.4e-6 data parallel, 1.3e-5
    # FSDP, whose reduce-scatter sums in chunks), against a move of about 4e-2.
    assert gap < 1e-4 and moved > 100 * gap, (gap, moved)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir) -> dict:
    data_dir = tmp_path_factory.mktemp("one")
    write(data_dir, GROUPS)
    subprocess.run(train_command(data_dir, tiny_model_dir), check=True, capture_output=True)
    return trained_adapter(data_dir)


@pytest.mark.parametrize("launcher", TWO_PROCESSES)
def test_two_processes_train_the_same_adapter_as_one(
    tmp_path, tiny_model_dir, one_process, launcher
):
    """Two processes with gradient checkpointing on train the adapter one process trains
    without it: the processes' gradients summed, and the recomputed activations the
    stored ones (one process alone, off against on: test_trainer_scale.py; two processes
    without it: the FSDP resume below and W&B's torchrun run, test_wandb.py)."""
    write(tmp_path, GROUPS)
    two = subprocess.run(
        train_command(tmp_path, tiny_model_dir, TWO_PROCESSES[launcher])
        + ["--gradient-checkpointing", "on"],
        capture_output=True,
        text=True,
    )
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert two.stdout.count("step 4/4") == 1  # only process 0 reports
    mode = "FSDP" if launcher == "accelerate-fsdp" else "data parallel"
    assert f"2 processes, {mode} on cpu" in two.stdout
    assert "gradient checkpointing on" in two.stdout
    assert_same_adapter(one_process, trained_adapter(tmp_path), f"{launcher} checkpointed")


def test_fsdp_run_killed_midway_resumes_to_the_same_adapter(tmp_path, tiny_model_dir, one_process):
    write(tmp_path, GROUPS)
    command = train_command(tmp_path, tiny_model_dir, TWO_PROCESSES["accelerate-fsdp"])
    killed = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in killed.stdout:
        if line.startswith("step 2/4"):  # its checkpoint is on disk before the line
            # The launcher and both workers (torch's agent puts them in sessions of
            # their own, so a process-group kill would miss them), as a power cut would.
            everyone = [killed.pid] + [c.pid for c in psutil.Process(killed.pid).children(True)]
            for pid in everyone:
                os.kill(pid, signal.SIGKILL)
            break
    killed.wait()
    assert killed.returncode == -signal.SIGKILL
    assert "finished" not in " ".join(str(p) for p in (tmp_path / "runs").rglob("*"))
    resumed = subprocess.run(command, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming after step 2" in resumed.stdout
    assert "step 3/4" in resumed.stdout and "step 1/4" not in resumed.stdout
    assert_same_adapter(one_process, trained_adapter(tmp_path), "fsdp resumed")
