"""The training loop: GRPO steps over the plan's samples, a checkpoint after each.

`run_training` loads the policy (the adapter a run starts from, a fresh LoRA, or the
checkpoint of an interrupted run), fills in the behaviour logprobs where the records lack
them, takes the steps `step_schedule` lays out (shuffled per epoch from the seed, so a
resumed run replays the same steps), saves a checkpoint after every step and the adapter
at the end; each step's record and line (tokens per second, the time left) are
`StepRecorder`'s. The numerics are grpo/'s; what a run keeps on disk is checkpoint.py's.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from overnight.config import TrainConfig
from overnight.errors import OvernightError
from overnight.progress import time_left
from overnight.telemetry import traced
from overnight.trainer.choose.plan import Plan
from overnight.trainer.grpo.distill import teacher_advantages
from overnight.trainer.grpo.parallel import Parallel
from overnight.trainer.grpo.step import Gap, behaviour_pass, fresh_adapter, optimizer_step

from .checkpoint import kill_point, load_checkpoint, save_adapter, save_checkpoint
from .memory import check_fits


class TrainError(OvernightError):
    code = "train_error"


@traced("training", lambda metrics: {"steps": len(metrics["steps"])})
def run_training(
    plan: Plan,
    config: TrainConfig,
    base_model: str,
    start_adapter: str | None,
    out_dir: Path,
    say=print,
    checkpoint: Path | None = None,
    on_step=None,
    parallel: Parallel | None = None,
) -> dict:
    """Train on the plan's samples; saves the adapter to `out_dir`; returns metrics.

    With `checkpoint`, the adapter and optimizer are saved there after every step, and
    a checkpoint found there is resumed: the steps it covers are skipped (the shuffles
    replay from the seed, so the remaining steps see the data they would have seen).
    `on_step(record)` is called after each step's checkpoint (the night's W&B report).
    `parallel`: the night's processes (trainer/train.py started them); None: joined here.
    """
    import torch

    from overnight.trainer.grpo.checkpointing import memory_settings
    from overnight.trainer.grpo.loss import LossConfig

    torch.manual_seed(config.seed)  # before the fresh adapter's initialisation
    parallel = parallel if parallel is not None else Parallel.start(fsdp=config.fsdp)
    need = _check_fits(plan, config, base_model, parallel, say)
    model, optimizer, state = _start_policy(
        config, base_model, start_adapter, checkpoint, parallel, say, need.checkpointing
    )
    samples, gaps = _before_any_update(model, plan, config, state)
    taught = None
    if plan.teachers:  # a --hindsight distill night: each token's advantage (grpo/distill.py)
        samples, taught = teacher_advantages(
            model, samples, plan.teachers, config.micro_batch_tokens, config.logit_chunk_tokens
        )
        say(taught.line())
    # Groups with something to train (an --sft night's duplicates are recorded, not trained).
    with_samples = {s.group_id for s in samples}
    schedule = step_schedule([g for g in plan.groups if g in with_samples], config)
    loss_config = LossConfig.from_train_config(config)
    recorder = StepRecorder(plan, config, list(state["steps"]) if state else [], len(schedule), say)
    for epoch, step_groups in schedule[recorder.resumed :]:  # past the steps done before
        step_samples = [s for s in samples if s.group_id in step_groups]
        step_started = time.perf_counter()
        out = optimizer_step(model, optimizer, parallel, step_samples, loss_config, config)
        lr = optimizer.param_groups[0]["lr"]
        record = recorder.record(out, epoch, step_groups, step_samples, lr, step_started)
        kill_point(f"step-{len(recorder.steps)}")  # computed, not yet checkpointed
        if checkpoint is not None:
            save_checkpoint(checkpoint, parallel, model, optimizer, recorder.steps, gaps)
        if on_step is not None:  # right after the checkpoint: a resumed run starts after it
            on_step(record)
        recorder.tell(record)
    save_adapter(out_dir, parallel, model)
    return {
        "steps": recorder.steps,
        "memory_settings": memory_settings(model, config),  # checkpointing, chunks, attention
        "max_logprob_gap": on_policy_gap(gaps),
        "logprob_gaps": gaps,
        "seconds": time.perf_counter() - recorder.started,
        "teacher_pass": taught.as_dict() if taught is not None else None,
    }


def _check_fits(plan: Plan, config: TrainConfig, base_model: str, parallel: Parallel, say):
    """Nothing loaded yet: a night that cannot fit stops now, saying what to change
    (memory.py); what it found (whether it fits only with gradient checkpointing)."""
    from overnight.trainer.grpo.policy import torch_dtype

    shards = parallel.world if parallel.fsdp else 1
    itemsize = torch_dtype(config.dtype).itemsize
    return check_fits(base_model, config, str(parallel.device), itemsize, say, shards=shards,
                      sequences=[s.tokens for s in plan.samples])  # fmt: skip


def _before_any_update(model, plan: Plan, config: TrainConfig, state: dict | None):
    """(the plan's samples with the behaviour logprobs the records lack, what the first
    step's ratios are by the records' age): a resumed run's gaps as its checkpoint kept
    them. An --sft night has no ratios, nor logged logprobs to compare with."""
    samples, first = plan.samples, [None] * len(plan.samples)
    if not config.sft:
        samples, first = behaviour_pass(
            model, plan.samples, config.micro_batch_tokens, config.logit_chunk_tokens
        )
    return samples, state.get("gaps", {}) if state else gaps_by_age(samples, first)


class StepRecorder:
    """A run's steps as they are taken: each one's metrics record (the run's `steps`, a
    resumed run's earlier ones first) and its line through `say`: the loss, the ratios
    (an --sft night's cross-entropy), tokens per second and the time left at the pace
    so far."""

    def __init__(self, plan: Plan, config: TrainConfig, steps: list[dict], total: int, say):
        self.plan, self.config, self.say = plan, config, say
        self.steps = steps
        self.resumed = len(steps)  # done before an interruption: they took no time here
        self.total = total  # the run's steps, a resumed run's earlier ones included
        self.started = time.perf_counter()

    def record(self, out, epoch: int, groups: set[str], samples: list, lr: float, since: float):
        """The step's record, added to the run's: `out` is the optimizer step's outcome,
        `since` when the step began."""
        # Each rollout's reward once, however many sequences it was cut into.
        rollouts = {s.rollout_id: 0 for s in samples}
        rewards = [self.plan.rewards[r] for r in rollouts if r in self.plan.rewards]
        record = {
            **out.stats,
            "step": len(self.steps) + 1,
            "epoch": epoch,
            "loss": out.loss,
            "grad_norm": out.grad_norm,
            "groups": len(groups),
            "sequences": len(samples),
            "reward_mean": statistics.fmean(rewards) if rewards else None,
            "reward_std": statistics.pstdev(rewards) if rewards else None,
            "logprob_gap": out.logprob_gap,  # this step's tokens, before its update
            "learning_rate": lr,
            "seconds": time.perf_counter() - since,
        }
        self.steps.append(record)
        return record

    def tell(self, record: dict) -> None:
        """The step's line: `step 3/10: loss ..., N tokens/s, about N s left`."""
        elapsed = time.perf_counter() - self.started
        # Tokens this process trained (a resumed run's earlier steps took no time here).
        rate = sum(s["tokens"] for s in self.steps[self.resumed :]) / elapsed
        what = (
            " (the assistant tokens' mean cross-entropy),"  # before the step's update
            if self.config.sft
            else f", clipped {record.get('clipped_fraction', 0):.3f}, ratio max "
            f"{record.get('ratio_max', 1):.3f},"
        )
        # The steps left at this run's pace so far (a CPU night runs for minutes).
        left = time_left(elapsed, len(self.steps) - self.resumed, self.total - len(self.steps))
        self.say(
            f"step {len(self.steps)}/{self.total}: loss {record['loss']:+.4f}{what} "
            f"grad norm {record['grad_norm']:.3f}, {rate:.0f} tokens/s, {left}"
        )


def gaps_by_age(samples: list, gaps: list[Gap | None]) -> dict[str, dict]:
    """The first step's logprob gap and ratio range over the exact samples, by how many
    promotions old they are ("0": on-policy; "unknown": no proxy said what served them)."""
    out: dict[str, dict] = {}
    for sample, gap in zip(samples, gaps, strict=True):
        if gap is None or not gap.tokens:
            continue
        age = "unknown" if sample.staleness is None else str(sample.staleness)
        seen = out.setdefault(
            age, {"sequences": 0, "tokens": 0, "max_gap": 0.0, "ratio_min": 1.0, "ratio_max": 1.0}
        )
        seen["sequences"] += 1
        seen["tokens"] += gap.tokens
        seen["max_gap"] = max(seen["max_gap"], gap.max_gap)
        seen["ratio_min"] = min(seen["ratio_min"], gap.ratio_min)
        seen["ratio_max"] = max(seen["ratio_max"], gap.ratio_max)
    return out


def on_policy_gap(gaps: dict[str, dict]) -> float | None:
    """The gap that measures serving against training: on records the starting adapter
    sampled itself (of unknown age, without a proxy, as before ages were known)."""
    for age in ("0", "unknown"):
        if age in gaps:
            return gaps[age]["max_gap"]
    return None


def step_schedule(groups: list[str], config: TrainConfig) -> list[tuple[int, set[str]]]:
    """Each step's (epoch, groups): shuffled every epoch from the seed, so a resumed run
    replays the same steps."""
    rng = random.Random(config.seed)
    groups, steps = list(groups), []
    for epoch in range(config.epochs):
        rng.shuffle(groups)
        for first in range(0, len(groups), config.groups_per_step):
            steps.append((epoch, set(groups[first : first + config.groups_per_step])))
    return steps


def _start_policy(
    config: TrainConfig,
    base_model: str,
    start_adapter: str | None,
    checkpoint: Path | None,
    parallel: Parallel,
    say,
    checkpointing: bool = False,
):
    """(model on this process's device, its optimizer, the checkpoint's state or None).
    `checkpointing`: the memory check found the night fits only with it."""
    import torch

    from overnight.trainer.grpo.checkpointing import (
        enable_gradient_checkpointing,
        memory_line,
        memory_settings,
        wants_checkpointing,
    )
    from overnight.trainer.grpo.policy import load_policy, torch_dtype

    state = load_checkpoint(checkpoint)
    dtype = torch_dtype(config.dtype)
    if state is not None:
        if state.get("fsdp", False) != parallel.fsdp:
            raise TrainError(
                f"the checkpoint in {checkpoint} was written {'with' if state['fsdp'] else 'without'}"
                " FSDP: resume the same way (or delete it to start the run over)"
            )
        model = load_policy(
            base_model,
            checkpoint / "adapter",
            trainable=True,
            dtype=dtype,
            attention=config.attention,
        )
        say(f"resuming after step {len(state['steps'])} from {checkpoint}")
    else:
        model = load_policy(
            base_model, start_adapter, trainable=True, dtype=dtype, attention=config.attention
        )
        if start_adapter is None:
            model = fresh_adapter(model, config)
    if checkpointing or wants_checkpointing(config.gradient_checkpointing):
        enable_gradient_checkpointing(model)
    say(memory_line(memory_settings(model, config)))
    model = parallel.prepare(model)
    if parallel.world > 1:
        kind = "FSDP" if parallel.fsdp else "data parallel"
        say(f"{parallel.world} processes, {kind} on {parallel.device}")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    if state is not None:
        parallel.load_optimizer_state(model, optimizer, state["optimizer"])
    return model, optimizer, state
