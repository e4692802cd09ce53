"""A night's Weights & Biases run (`--report-to wandb`): one W&B run per night, or nothing.

`Report` is what train.py calls at each point of the night's story: `begin` (the config,
the judge's cost, a table of sample trajectories), `step` after each optimizer step,
`gate`, `promotion` and `finish`. Off (the default without WANDB_API_KEY, or on every
process but 0 under torchrun), each call returns at once, so the night reads the same
either way.

Why it is shaped so:
- The W&B run's id is the night's run id, resumed with `resume="allow"`: an interrupted
  night that resumes continues its W&B run, and its x-axis is `training_step` (ART's), so
  the resumed steps follow the ones logged before the interruption.
- W&B is an observer: a failure to reach it (init times out, a call raises) is logged once
  as a warning and the night goes on without it; offline runs (WANDB_MODE=offline) are
  written under the data directory and `wandb sync` uploads them later.
- `wandb` is imported only when the report is on (the `wandb` extra); asked for
  explicitly and missing, the night stops before it starts, naming the install.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from overnight.config import TrainConfig
from overnight.errors import ConfigError

log = logging.getLogger("overnight.trainer")

PROJECT = "overnight"  # when WANDB_PROJECT is unset
TABLE_ROWS = 32  # sample trajectories per night, whole groups first
PROMPT_TAIL = 400  # characters of a prompt's end shown in the table (its start is the system's)

# A step record (loop.py) -> its W&B name. `train/kl` is the KL to the base model, there
# only with --kl-coef above 0; `train/behaviour_kl` is how far training moved from the data.
STEP_METRICS = {
    "loss": "train/loss",
    "reward_mean": "train/reward_mean",
    "reward_std": "train/reward_std",
    "grad_norm": "train/grad_norm",
    "learning_rate": "train/learning_rate",
    "clipped_fraction": "train/clipped_fraction",
    "dual_clipped_fraction": "train/dual_clipped_fraction",
    "ratio_mean": "train/ratio_mean",
    "ratio_min": "train/ratio_min",
    "ratio_max": "train/ratio_max",
    "behaviour_kl": "train/behaviour_kl",
    "ref_kl": "train/kl",
    "nll": "train/nll",  # an --sft night's token-mean cross-entropy, before its update
    "logprob_gap": "train/logprob_gap",
    "tokens": "train/tokens",
    "sequences": "train/sequences",
    "groups": "train/groups",
    "epoch": "train/epoch",
    "seconds": "time/step_seconds",
}
GATE_NUMBERS = ("prompts", "candidate_mean", "served_mean", "diff_mean", "low", "high", "margin")
JUDGE_COUNTS = ("judged", "failed", "scored_by_function", "seconds")
JUDGE_CALLS = ("prompt_tokens", "completion_tokens", "cost_usd")  # judge/ruler.py's CallCounts


def wants_wandb(config: TrainConfig) -> bool:
    """--report-to wandb, or auto with WANDB_API_KEY set (as ART decides)."""
    if config.report_to == "auto":
        return bool(os.environ.get("WANDB_API_KEY"))
    return config.report_to == "wandb"


class Report:
    """The night's W&B run, or nothing (see the module's docstring)."""

    def __init__(self, config: TrainConfig, rank: int = 0, say=print):
        self._wandb = _import_wandb(config) if rank == 0 and wants_wandb(config) else None
        self._run = None
        self._say = say
        self._failed = False
        self._resumed = False

    @property
    def on(self) -> bool:
        return self._run is not None

    def begin(
        self,
        run_id: str,
        data_dir: Path,
        config: TrainConfig,
        base_model: str,
        start_adapter: str | None,
        plan,
        tokenizer=None,
        judge=None,
        resumed: bool = False,
    ) -> None:
        """Start (or resume) the night's W&B run: its config, the judge's cost, the table."""
        if self._wandb is None:
            return
        self._resumed = resumed
        wandb = self._wandb
        self._run = self._safely(
            "init",
            lambda: wandb.init(
                project=os.environ.get("WANDB_PROJECT") or PROJECT,
                id=run_id,
                name=f"{config.policy}/{run_id}" if config.policy else run_id,
                # One W&B group per policy: each agent's nights plotted together.
                group=config.policy,
                resume="allow",
                job_type="train",
                # Beside the night's other files unless WANDB_DIR says where.
                dir=None if os.environ.get("WANDB_DIR") else str(data_dir),
                config=_config(config, base_model, start_adapter, plan),
            ),
        )
        if self._run is None:
            self._safely("teardown", wandb.teardown)  # as finish does: nothing kept for later
            return
        self._say(f"W&B: reporting to run {run_id} ({_where(self._run)})")
        self._safely("define_metric", self._define_metrics)
        if judge is not None:
            self._safely("judge", lambda: self._judge(judge))
        self._safely("samples", lambda: self._samples(plan, tokenizer))

    def step(self, record: dict) -> None:
        """One optimizer step's figures (loop.py's record), at `training_step`."""
        if self._run is None:
            return
        row = {name: record[key] for key, name in STEP_METRICS.items() if key in record}
        if record.get("seconds"):
            row["time/tokens_per_second"] = record.get("tokens", 0) / record["seconds"]
        row = {k: v for k, v in row.items() if _finite(v)}
        self._safely("log", lambda: self._run.log({"training_step": record["step"], **row}))

    def gate(self, verdict) -> None:
        """The gate's verdict and numbers (the run's summary), its examples as a table."""
        if self._run is None or verdict is None:
            return

        def write():
            summary = {"gate/verdict": verdict.word, "gate/promote": verdict.promote}
            for key in ("mode", "reason", "failed", *GATE_NUMBERS):
                if getattr(verdict, key) is not None:
                    summary[f"gate/{key}"] = getattr(verdict, key)
            # Forgetting against the base model (trainer/gate/forgetting.py), nats/token.
            for key, value in (verdict.forgetting or {}).items():
                summary[f"forgetting/{key}"] = value
            self._run.summary.update(summary)
            if verdict.examples:
                columns = sorted({k for e in verdict.examples for k in e})
                rows = [[_cell(e.get(c)) for c in columns] for e in verdict.examples]
                self._run.log({"gate/examples": self._wandb.Table(columns=columns, data=rows)})

        self._safely("gate", write)

    def promotion(self, promoted_as: str | None, canary: str | None = None) -> None:
        """What the proxy serves after the night: the adapter's name, or its canary."""
        if self._run is None:
            return
        summary = {"promotion/promoted": bool(promoted_as or canary)}
        if promoted_as:
            summary["promotion/promoted_as"] = promoted_as
        if canary:
            summary["promotion/canary"] = canary
        self._safely("promotion", lambda: self._run.summary.update(summary))

    def finish(self, result=None, error: str | None = None) -> None:
        """Close the run: the night's totals; a failed night's run ends with exit code 1
        (a resumed night continues it)."""
        if self._run is None:
            return
        run, self._run = self._run, None
        if result is not None:
            metrics = result.metrics
            totals = {"night/steps": len(metrics.get("steps", []))}
            for key in ("seconds", "max_logprob_gap"):
                if metrics.get(key) is not None:
                    totals[f"night/{key}"] = metrics[key]
            self._safely("summary", lambda: run.summary.update(totals))
        if error:
            self._safely("summary", lambda: run.summary.update({"night/error": error}))
        self._safely("finish", lambda: run.finish(exit_code=1 if error else 0))
        # wandb keeps one service and the settings it read from the environment per
        # process: torn down, the next night in this process reads them afresh.
        self._safely("teardown", self._wandb.teardown)

    # -- inside ------------------------------------------------------------------------------

    def _define_metrics(self) -> None:
        # ART's axes: every metric is plotted against the night's optimizer step.
        self._run.define_metric("training_step")
        self._run.define_metric("*", step_metric="training_step")

    def _judge(self, summary) -> None:
        """The judge's batch before training (judge/run.py's Summary): added to what a
        resumed run's earlier part counted."""
        totals = {}
        counted = [(key, getattr(summary, key, None)) for key in JUDGE_COUNTS]
        calls = getattr(summary, "calls", None)
        counted += [(key, getattr(calls, key, None)) for key in JUDGE_CALLS]
        for key, value in counted:
            if value is None:
                continue
            before = self._run.summary.get(f"judge/{key}") if self._resumed else None
            totals[f"judge/{key}"] = value + (before or 0)
        self._run.summary.update(totals)

    def _samples(self, plan, tokenizer) -> None:
        rows = sample_rows(plan, tokenizer)
        if rows:
            table = self._wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
            self._run.log({"samples": table})

    def _safely(self, what: str, call) -> Any:
        """`call()`, or None when it raises: warned once, then the night goes on."""
        try:
            return call()
        except Exception as e:  # an observer: nothing W&B does may fail the night
            line = f"warning: W&B {what} failed ({type(e).__name__}: {e}); the night goes on"
            if not self._failed:
                self._failed = True
                log.warning(line)
                self._say(line)
            else:
                log.debug(line)
            return None


def sample_rows(plan, tokenizer=None, limit: int = TABLE_ROWS) -> list[dict]:
    """Up to `limit` trajectories of the plan, whole groups in the plan's order: what was
    asked (the prompt's end), what the policy said, its reward and advantage."""
    by_group: dict[str, list] = {}
    for sample in plan.samples:
        by_group.setdefault(sample.group_id, []).append(sample)
    rows = []
    for group in plan.groups:
        for sample in by_group.get(group, []):
            if len(rows) >= limit:
                return rows
            first = sample.trained.index(True) if True in sample.trained else len(sample.tokens)
            prompt = _text(tokenizer, sample.tokens[:first])
            rows.append(
                {
                    "group": sample.group_id,
                    "rollout": sample.rollout_id,
                    "prompt": prompt[-PROMPT_TAIL:],
                    # From the first sampled token on: later turns' context included.
                    "completion": _text(tokenizer, sample.tokens[first:]),
                    "reward": plan.rewards.get(sample.rollout_id),
                    "advantage": sample.advantage,
                    "turns": sample.turns,
                }
            )
    return rows


def _import_wandb(config: TrainConfig):
    try:
        import wandb
    except ImportError as e:
        if config.report_to == "wandb":
            raise ConfigError(
                "--report-to wandb needs the wandb library: pip install 'overnight[wandb]'"
            ) from e
        log.warning(
            "WANDB_API_KEY is set but wandb is not installed: not reporting to W&B "
            "(pip install 'overnight[wandb]', or --report-to none)"
        )
        return None
    return wandb


def _config(config: TrainConfig, base_model: str, start_adapter: str | None, plan) -> dict:
    return {
        **asdict(config),
        "base_model": base_model,
        "start_adapter": start_adapter,
        "groups": len(plan.groups),
        "sequences": len(plan.samples),
        "trained_tokens": sum(s.trained_tokens for s in plan.samples),
    }


def _text(tokenizer, ids: list[int]) -> str:
    if tokenizer is None:  # no tokenizer for this base model: the ids themselves
        return " ".join(map(str, ids))
    return tokenizer.decode(ids)


def _cell(value):
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _where(run) -> str:
    url = getattr(run, "url", None)
    return url or f"offline: `wandb sync {Path(run.dir).parent}` uploads it later"
