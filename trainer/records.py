"""Reading logged records for training: the turns of each rollout, in order."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pyarrow as pa

from .data import DataError, Sample, Turn, merge_turns


@dataclass
class Loaded:
    samples: list[Sample] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # reason -> turns


def load_samples(con, group_ids: list[str]) -> Loaded:
    """Samples of every rollout in `group_ids`, built from the logged token ids."""
    out = Loaded()
    if not group_ids:
        return out
    con.register("_train_groups", pa.table({"group_id": group_ids}))
    rows = con.execute(
        """
        SELECT group_id, rollout_id, prompt_token_ids, completion_token_ids, completion_logprobs, error
        FROM completions WHERE group_id IN (SELECT group_id FROM _train_groups)
        ORDER BY group_id, rollout_id, started_at, turn_index
        """
    ).fetchall()
    turns: dict[tuple[str, str], list[Turn]] = defaultdict(list)
    for group_id, rollout_id, prompt, completion, logprobs, error in rows:
        if error is not None:
            out.skipped["the turn failed or was cut off"] += 1
        elif not prompt or not completion:
            # Logged from an upstream that returns no token ids (not vLLM), or with
            # logging off: re-tokenising from text is not implemented yet.
            out.skipped["no token ids logged"] += 1
        else:
            try:
                turns[(group_id, rollout_id)].append(Turn(prompt, completion, logprobs or []))
            except DataError as e:
                out.skipped[str(e)] += 1
    for (group_id, rollout_id), rollout_turns in turns.items():
        out.samples += merge_turns(rollout_id, group_id, rollout_turns)
    return out
