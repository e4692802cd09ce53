"""What a run leaves on disk, so that an interrupted night resumes where it stopped.

    runs/<run_id>/run.json     the groups it trains on and the adapter it started from
    runs/<run_id>/checkpoint/  adapter + optimizer state after the last finished step
    runs/<run_id>/finished     written once the adapter is saved, promoted and the run recorded
    adapters/<run_id>/         the trained adapter, as peft saves it

A run directory without `finished` is an interrupted run: the next `overnight train`
resumes it on the same groups before selecting new ones. An adapter directory is only
ever complete: it is written under a temporary name and renamed, so a run killed while
saving leaves no half adapter where a promotion (or a rollback) could read it.

`kill_point(stage)` marks where the tests kill a real `overnight train` (SIGKILL, when
the environment variable OVERNIGHT_KILL_AT names the stage): between "step-N" and its
checkpoint, "saving" (adapter written, not renamed), "gated" (the gate's verdict given,
nothing promoted), "promoting" (the proxy serves it, the run not recorded), "recorded"
(recorded, not marked finished).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from overnight.storage import fsync_path, open_db
from overnight.trainer.grpo.parallel import Parallel


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
        """What `begin` wrote: {"groups": [...], "start_adapter": path or None, "policy",
        "sft": whether it is an --sft run}."""
        return json.loads((self.path / "run.json").read_text())

    def begin(
        self,
        groups: list[str],
        start_adapter: str | None,
        policy: str | None = None,
        sft: bool = False,
    ) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        saved = {"groups": groups, "start_adapter": start_adapter, "policy": policy, "sft": sft}
        (self.path / "run.json").write_text(json.dumps(saved))

    def finish(self) -> None:
        (self.path / "finished").touch()
        # The checkpoint (adapter + optimizer state) only serves resuming: gone once done.
        shutil.rmtree(self.checkpoint, ignore_errors=True)


def unfinished_run(data_dir: Path, owns: Callable[[dict], bool] | None = None) -> Path | None:
    """The newest run directory that began training and never finished, if any; of those
    `owns` accepts (what they saved: a policy's night resumes its own runs only)."""
    runs = sorted((Path(data_dir) / "runs").glob("*/run.json"))
    for run in reversed(runs):
        if (run.parent / "finished").exists():
            continue
        if owns is None or owns(json.loads(run.read_text())):
            return run.parent
    return None


KILL_AT_ENV = "OVERNIGHT_KILL_AT"


def kill_point(stage: str) -> None:
    """Die here, as a power cut would, when the tests ask for it (see the module's doc)."""
    if os.environ.get(KILL_AT_ENV) == stage:
        os.kill(os.getpid(), signal.SIGKILL)


def save_adapter(path: Path, parallel: Parallel, model) -> None:
    """The adapter as peft saves it, written by process 0 (every process gathers), into
    `path` whole or not at all: written beside it, fsynced, then renamed into place."""
    tmp = path.with_name(path.name + ".partial")
    if parallel.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _write_adapter(tmp, parallel, model)
    if parallel.rank == 0:
        kill_point("saving")
        replace_dir(tmp, path)


def _write_adapter(path: Path, parallel: Parallel, model) -> None:
    state = parallel.adapter_state(model)
    if parallel.rank != 0:
        return
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, state_dict=state)
    for file in path.iterdir():
        fsync_path(file)


def replace_dir(new: Path, path: Path) -> None:
    """Rename `new` to `path`; an older `path` (a complete earlier save) is moved aside
    first and deleted after, so `path` is never a mix of the two."""
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    new.rename(path)
    fsync_path(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    path: Path, parallel: Parallel, model, optimizer, steps: list[dict], gaps: dict
) -> None:
    """Adapter and optimizer after a step, replaced atomically (a crash leaves the old one)."""
    import torch

    optimizer_state = parallel.optimizer_state(model, optimizer)  # every process gathers
    tmp = path.with_name(path.name + ".tmp")
    if parallel.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _write_adapter(tmp / "adapter", parallel, model)  # tmp as a whole is renamed below
    if parallel.rank != 0:
        return
    torch.save(
        {"optimizer": optimizer_state, "steps": steps, "gaps": gaps, "fsdp": parallel.fsdp},
        tmp / "state.pt",
    )
    fsync_path(tmp / "state.pt")
    replace_dir(tmp, path)


def load_checkpoint(path: Path | None) -> dict | None:
    """{"optimizer", "steps", "gaps", "fsdp"} saved after the last step; None if none.

    The adapter beside it is at `path / "adapter"`."""
    if path is None:
        return None
    # A run killed inside replace_dir left the previous checkpoint aside as `.old`.
    for candidate in (path, path.with_name(path.name + ".old")):
        if (candidate / "state.pt").exists():
            if candidate != path:
                candidate.rename(path)
            import torch

            return torch.load(path / "state.pt", weights_only=False)
    return None


def this_run(
    data_dir: Path, dry_run: bool, owns: Callable[[dict], bool] | None = None
) -> tuple[RunDir, dict]:
    """The interrupted run to resume (of those `owns` accepts) and what it saved, or a
    new run ({} saved)."""
    resumed = None if dry_run else unfinished_run(data_dir, owns)
    while resumed is not None and recorded(data_dir, resumed.name):
        RunDir(resumed).finish()  # killed after it was recorded: it only missed this mark
        resumed = unfinished_run(data_dir, owns)
    if resumed is not None:
        run = RunDir(resumed)
        return run, run.saved()
    run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    return RunDir(data_dir / "runs" / run_id), {}


def recorded(data_dir: Path, run_id: str) -> bool:
    """Whether `training_runs` holds this run as trained."""
    con = open_db(data_dir)
    try:
        rows = con.execute(
            "SELECT count(*) FROM training_runs WHERE run_id = ? AND status = 'trained'", [run_id]
        ).fetchone()
    finally:
        con.close()
    return bool(rows and rows[0])
