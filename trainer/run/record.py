"""A run's row in `training_runs`: what it trained on, what it made, how it ended.

Written for failed runs too (the report shows them), and before a run is marked finished,
so a run killed in between is found recorded by the next night and never trained again
(checkpoint.py's `this_run`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from overnight.config import TrainConfig
from overnight.storage import SCHEMA_VERSION, LogWriter, WriterConfig
from overnight.trainer.choose.plan import Plan
from overnight.trainer.gate.verdict import Verdict


@dataclass
class RunResult:
    run_id: str
    plan: Plan
    adapter_path: Path | None = None
    promoted_as: str | None = None
    metrics: dict = field(default_factory=dict)
    gate: Verdict | None = None  # None: no promotion was asked for
    held_out: list[str] = field(default_factory=list)  # groups the gate took from the plan


def record_run(
    data_dir: Path,
    result: RunResult,
    config: TrainConfig,
    base_model: str,
    start_adapter: str | None,
    started: int,
    error: str | None,
    cycle: dict | None = None,
) -> None:
    """The run's row in `training_runs` (failed ones too: the report shows them).
    `cycle`: who ran it and why ({"by", "trigger"}: overnight/night/cycles.py)."""
    writer = LogWriter(WriterConfig(data_dir, compact_in_process=True))
    writer.start()
    plan, metrics = result.plan, result.metrics
    rewards = list(plan.rewards.values())
    writer.append(
        "training_runs",
        {
            "run_id": result.run_id,
            "schema_version": SCHEMA_VERSION,
            "started_at": started,
            "ended_at": time.time_ns() // 1000,
            "status": "failed" if error else "trained",
            "base_model": base_model,
            "start_adapter": start_adapter,
            "adapter_path": str(result.adapter_path) if result.adapter_path else None,
            "promoted_as": result.promoted_as,
            "groups": plan.groups,
            "rollouts": len(plan.rewards),
            "trained_tokens": sum(s.trained_tokens for s in plan.samples),
            "steps": len(metrics.get("steps", [])),
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "max_logprob_gap": metrics.get("max_logprob_gap"),
            "config": json.dumps(asdict(config)),
            "error": error,
            "proxy_id": writer.writer_id,
            "metrics": json.dumps(
                {
                    "steps": metrics.get("steps", []),
                    "groups": plan.group_stats,
                    "skipped": dict(plan.skipped),
                    "staleness": plan.staleness,  # groups by how many promotions old
                    "logprob_gaps": metrics.get("logprob_gaps"),  # by age, before any update
                    "maintenance": metrics.get("maintenance"),  # vLLM asleep: how long
                    "seconds": metrics.get("seconds"),
                    "gate": result.gate.as_dict() if result.gate else None,
                    # The served answers' shape, day against day (gate/gaming.py's `live`).
                    "answers": metrics.get("answers"),
                    "selection": plan.selection,  # where the next night's selection starts
                    "policy": config.policy,  # the night's policy (None: before policies)
                    # What it optimised; an --sft night's selection (sft_plan.py).
                    "objective": "sft" if config.sft else "grpo",
                    "sft": plan.sft,
                    # A --hindsight distill night's: what it took, what its teacher found.
                    "hindsight": plan.hindsight,
                    "teacher_pass": metrics.get("teacher_pass"),
                    "cycle": cycle,  # `overnight train` or `overnight learn`, and its trigger
                }
            ),
        },
    )
    writer.close()


def to_serving(
    data_dir: Path, groups: list[str], served_at: float, run_began_us: int | None = None
) -> dict | None:
    """Seconds from each trained group's data being in to `served_at`, when the adapter
    trained on it began serving: the loop's latency, data to policy. A group's data is in
    at its finish (its last rollout's `finish`, else its last turn) or at the last reward
    the agent posted for it, whichever came later, counting only rewards posted before the
    run began at `run_began_us` (its data; a judged or scored group is scored by the cycle
    itself). {"median", "max", "groups", "waits": each group's, to a tenth of a
    second (the histogram of /metrics: storage/read/runs.py)}; None without groups."""
    from overnight.storage import open_db

    if not groups:
        return None
    con = open_db(data_dir)
    try:
        before_run = "" if run_began_us is None else "AND epoch_us(created_at) <= ? "
        rows = con.execute(
            "WITH trained AS (SELECT group_id, rollout_id, coalesce(finished_at, ended_at) "
            "AS done FROM rollouts WHERE group_id IN (SELECT unnest(?))), "
            "posted AS (SELECT rollout_id, max(created_at) AS posted_at FROM rewards "
            "WHERE source = 'agent' AND rollout_id IN (SELECT rollout_id FROM trained) "
            f"{before_run}GROUP BY rollout_id) "
            "SELECT epoch_us(max(greatest(done, coalesce(posted_at, done)))) "
            "FROM trained LEFT JOIN posted USING (rollout_id) GROUP BY group_id",
            [groups] if run_began_us is None else [groups, run_began_us],
        ).fetchall()
    finally:
        con.close()
    waits = sorted(max(0.0, served_at - us / 1e6) for (us,) in rows if us is not None)
    if not waits:
        return None
    return {"median": statistics.median(waits), "max": waits[-1], "groups": len(waits),
            "waits": [round(w, 1) for w in waits]}  # fmt: skip
