"""Reward functions: Python code that scores a rollout, beside or instead of the judge.

`--reward module:function` (or `path/to/file.py:function`) names a function that takes
one rollout, `{"rollout_id", "group_id", "messages", "tools"}` with `messages` the
whole conversation of its last turn, and returns a number (higher is better). It may
be async.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path
from typing import Any

from overnight.errors import OvernightError

from .trajectories import Group


class RewardFunctionError(OvernightError):
    code = "reward_function_error"


class RewardFunction:
    def __init__(self, spec: str):
        self.name = spec
        self.fn = load_function(spec)

    async def score_group(self, group: Group) -> dict[str, float]:
        scores = {}
        for t in group.trajectories:
            rollout = {
                "rollout_id": t.rollout_id,
                "group_id": group.group_id,
                "messages": t.last_conversation,
                "tools": t.tools,
            }
            value: Any = self.fn(rollout)
            if inspect.isawaitable(value):
                value = await value
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise RewardFunctionError(
                    f"{self.name} returned {value!r:.80} for {t.rollout_id}; "
                    "expected a finite number"
                )
            scores[t.rollout_id] = float(value)
        return scores


def load_function(spec: str):
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise RewardFunctionError(
            f"--reward takes module:function or file.py:function, got {spec!r}"
        )
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            loaded = importlib.util.spec_from_file_location(path.stem, path)
            if loaded is None or not path.exists():
                raise RewardFunctionError(f"no file {path}")
            module = importlib.util.module_from_spec(loaded)
            # As `python file.py` would: the file's folder is importable (its helpers).
            if str(path.parent) not in sys.path:
                sys.path.insert(0, str(path.parent))
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardFunctionError(f"cannot import {module_name}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardFunctionError(f"{module_name} has no function {attr!r}")
    return fn
