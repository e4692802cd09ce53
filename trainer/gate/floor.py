"""The floor of tonight's gate: the policy's best adapter so far, which a `not-worse`
candidate is held to besides the served one (storage/read/best_adapter.py places it from
the gate's records; verdict.py samples it beside the candidate). Found once a night, after
training, from the proxy's state read then (`state`: its promotion stack)."""

from __future__ import annotations

from pathlib import Path

import duckdb

from overnight.config import TrainConfig
from overnight.storage.read.best_adapter import (
    Best,
    best_so_far,
    levels,
    loadable_path,
    standing,
)
from overnight.storage.read.policy_scope import PolicyScope

from .verdict import MIN_PROMPTS


def tonights_floor(
    config: TrainConfig, data_dir: Path, scope: PolicyScope | None, base_model: str,
    state: dict, served: str | None, prompts: list, say=print,
) -> Best | None:  # fmt: skip
    """The adapter the candidate is also held to, if one is placed above the served one
    and --gate-best holds it (a gate with too few prompts decides nothing: none). Records
    that cannot be read are said and leave the night gated as before, on the served one."""
    if not config.gate_best or config.gate != "not-worse" or len(prompts) < MIN_PROMPTS:
        return None
    owns = scope.owns if scope else (lambda metrics: metrics.get("policy") is None)
    try:
        placed = levels(data_dir, owns, base_model)
        best = best_so_far(placed, served, standing(state), loadable_path(data_dir))
    except (duckdb.Error, OSError, ValueError, TypeError) as e:
        say(f"warning: gate: the best adapter so far not found ({e}); holding the "
            "candidate to the served one only")  # fmt: skip
        return None
    if best is not None:
        say(f"gate: also holding the candidate to the best adapter so far, {best.describe()}")
    return best
