"""What a run leaves on disk, so that an interrupted night resumes where it stopped.

    runs/<run_id>/run.json     the groups it trains on and the adapter it started from
    runs/<run_id>/checkpoint/  adapter + optimizer state after the last finished step
    runs/<run_id>/finished     written once the adapter is saved (and promoted)
    adapters/<run_id>/         the trained adapter, as peft saves it

A run directory without `finished` is an interrupted run: the next `overnight train`
resumes it on the same groups before selecting new ones.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from .parallel import Parallel


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoint"

    def saved(self) -> dict:
        """What `begin` wrote: {"groups": [...], "start_adapter": path or None}."""
        return json.loads((self.path / "run.json").read_text())

    def begin(self, groups: list[str], start_adapter: str | None) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "run.json").write_text(
            json.dumps({"groups": groups, "start_adapter": start_adapter})
        )

    def finish(self) -> None:
        (self.path / "finished").touch()
        # The checkpoint (adapter + optimizer state) only serves resuming: gone once done.
        shutil.rmtree(self.checkpoint, ignore_errors=True)


def unfinished_run(data_dir: Path) -> Path | None:
    """The newest run directory that began training and never finished, if any."""
    runs = sorted((Path(data_dir) / "runs").glob("*/run.json"))
    for run in reversed(runs):
        if not (run.parent / "finished").exists():
            return run.parent
    return None


def save_adapter(path: Path, parallel: Parallel, model) -> None:
    """The adapter as peft saves it, written by process 0 (every process gathers)."""
    state = parallel.adapter_state(model)
    if parallel.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path, state_dict=state)


def save_checkpoint(
    path: Path, parallel: Parallel, model, optimizer, steps: list[dict], max_gap: float
) -> None:
    """Adapter and optimizer after a step, replaced atomically (a crash leaves the old one)."""
    import torch

    optimizer_state = parallel.optimizer_state(model, optimizer)  # every process gathers
    tmp = path.with_name(path.name + ".tmp")
    if parallel.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(tmp / "adapter", parallel, model)
    if parallel.rank != 0:
        return
    torch.save(
        {"optimizer": optimizer_state, "steps": steps, "max_gap": max_gap, "fsdp": parallel.fsdp},
        tmp / "state.pt",
    )
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def load_checkpoint(path: Path | None) -> dict | None:
    """{"optimizer", "steps", "max_gap", "fsdp"} saved after the last step; None if none.

    The adapter beside it is at `path / "adapter"`."""
    if path is None or not (path / "state.pt").exists():
        return None
    import torch

    return torch.load(path / "state.pt", weights_only=False)
