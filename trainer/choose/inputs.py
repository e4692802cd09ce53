"""What every planner selects from: one typed bundle, made once by the night.

A night's planners (plan.py, sft_plan.py, turn_groups.py, lone_turns.py, resample.py)
all look at the same window of the same data directory, for the same policy, and read
records the same way. They take this one value instead of the same nine parameters each;
`TrainConfig` travels beside it, for the options.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overnight.config import SETTLE_SECONDS
from overnight.storage.read.policy_scope import PolicyScope


@dataclass(frozen=True)
class Selection:
    data_dir: Path
    # An unfinished rollout idle this long counts as finished (the agent never said so).
    settle_seconds: float = SETTLE_SECONDS
    # Only groups started at or after it (--since): days before it are not even listed.
    since: dt.datetime | None = None
    # At most this many groups tonight (--max-groups); the rest wait, undecided.
    max_groups: int | None = None
    # A resumed run's groups: exactly these, selected again; None: look for new ones.
    only: list[str] | None = None
    # The base model's tokenizer, for records logged without token ids (None: skip them).
    tokenizer: Any = None
    # vLLM's sampling defaults for the base model, where a request left them unsaid.
    sampling_defaults: dict | None = None
    # The night's policy's own groups (storage/read/policy_scope.py); None: every group.
    scope: PolicyScope | None = None
    # A vision-language model's reader of stored images (images.py); None: a text model.
    vision: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))

    def but(self, **changes: Any) -> Selection:
        """The same selection with `changes` (a served-only `only`, another tokenizer)."""
        return dataclasses.replace(self, **changes)
