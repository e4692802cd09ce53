"""`overnight train`: one nightly GRPO run over the groups no earlier run trained on.

  resume an interrupted run, or begin one -> select finished, scored, untrained groups
  (plan.py) -> start from the adapter the proxy serves (or a fresh LoRA) -> GRPO steps
  (step.py), a checkpoint after each (checkpoint.py) -> save the adapter -> the gate
  compares it with the served adapter on held-out prompts (gate.py) -> promote it through
  the proxy's admin API (proxy_client.py) -> record the run, write the report. Before all
  that, the watch (watch.py) rolls back a promoted adapter that live rewards show worse.

Under torchrun every process runs this; process 0 decides what to train on and does
everything with side effects (files, the run record, the promotion). Progress goes to
`say` (a line per stage and per step, with rates).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from overnight.config import LOGPROB_GAP_WARNING, SETTLE_SECONDS, TrainConfig
from overnight.errors import OvernightError
from overnight.storage import SCHEMA_VERSION, LogWriter, WriterConfig, open_db
from overnight.view.report import write_report

from .grpo.parallel import Parallel
from .grpo.sampling import server_defaults
from .grpo.step import fresh_adapter, micro_batch_loss, optimizer_step, with_behaviour
from .night.canary import start as start_canary
from .night.checkpoint import (
    RunDir,
    kill_point,
    load_checkpoint,
    save_adapter,
    save_checkpoint,
    unfinished_run,
)
from .night.gate import Scorer, Verdict, held_out_prompts, run_gate, skipped
from .night.plan import Plan, plan_run
from .night.proxy_client import (
    admin_call,
    base_model_of,
    local_adapter,
    promote_adapter,
    served_adapter,
    serving_state,
    shared_adapter,
)
from .night.resample import resample_turns
from .night.turn_groups import add_turn_groups, is_turn_group
from .night.watch import watch as watch_served

# Re-exported: the CLI, the tests and the benchmarks import these from here.
__all__ = [
    "Plan",
    "RunResult",
    "TrainError",
    "admin_call",
    "fresh_adapter",
    "micro_batch_loss",
    "plan_run",
    "resample_turns",
    "run_training",
    "train",
    "unfinished_run",
]

log = logging.getLogger("overnight.trainer")


class TrainError(OvernightError):
    code = "train_error"


@dataclass
class RunResult:
    run_id: str
    plan: Plan
    adapter_path: Path | None = None
    promoted_as: str | None = None
    metrics: dict = field(default_factory=dict)
    gate: Verdict | None = None  # None: no promotion was asked for
    held_out: list[str] = field(default_factory=list)  # groups the gate took from the plan


def train(
    data_dir: Path,
    config: TrainConfig,
    *,
    proxy_url: str | None = None,
    admin_token: str | None = None,
    promote: bool = True,
    dry_run: bool = False,
    settle_seconds: float = SETTLE_SECONDS,
    since: dt.datetime | None = None,
    max_groups: int | None = None,
    say=print,
    scorer: Scorer | None = None,
) -> RunResult:
    """One night. A run that was interrupted is resumed first, on the same groups.

    Kept as one function on purpose: it is the night's story read top to bottom
    (resume, plan, train, save, promote, record); each step is a call.
    """
    data_dir = Path(data_dir)
    parallel = Parallel() if dry_run else Parallel.start(fsdp=config.fsdp)
    if parallel.rank != 0:
        say = _silent
    run_dir, saved = parallel.agree(_this_run(data_dir, dry_run))
    only = saved.get("groups")  # a resumed run's groups
    say(f"run {run_dir.run_id}: " + _what_it_trains_on(only))
    started = time.time_ns() // 1000
    if promote and proxy_url and config.watch and parallel.rank == 0:
        watch_served(data_dir, proxy_url, admin_token, config, say)
    state = parallel.agree(serving_state(proxy_url, admin_token))  # after the watch's rollback
    base_model = config.base_model or (None if dry_run else _base_model(state))
    defaults = server_defaults(base_model, config.generation_config)  # vLLM's, where unsaid
    served_only = None if only is None else [g for g in only if not is_turn_group(g)]
    plan = plan_run(
        data_dir, config, settle_seconds, since, max_groups, served_only, _tokenizer(base_model),
        defaults,
    )  # fmt: skip
    gate_prompts: list = []
    given: list[str] = []  # groups the gate took from the plan
    if promote and proxy_url and not dry_run and skipped(config, scorer) is None:
        gate_prompts, gated = held_out_prompts(data_dir, plan, config.gate_prompts, only is None)
        given = [g for g in plan.groups if g not in set(gated.groups)]
        plan = gated
        say(f"gate: {len(gate_prompts)} held-out prompt(s), {len(given)} of them from groups "
            "left out of tonight's training")  # fmt: skip
    # Per-turn groups (a served turn and its siblings: turn_groups.py), none held out.
    plan = add_turn_groups(
        data_dir, plan, config, since=since, max_groups=max_groups, only=only,
        sampling_defaults=defaults, held_out=gate_prompts,
    )  # fmt: skip
    for line in plan.lines():
        say(line)
    result = RunResult(run_dir.run_id, plan, held_out=given)
    if dry_run or not plan.groups:
        if not plan.groups:
            say("nothing to train on")
        return result
    start_adapter = (
        saved["start_adapter"] if only is not None
        else local_adapter(data_dir, served_adapter(state))
    )  # fmt: skip
    say(f"training on {base_model}, starting from {start_adapter or 'a fresh LoRA adapter'}")
    if parallel.rank == 0:
        run_dir.begin(plan.groups, start_adapter)
    adapter_dir = data_dir / "adapters" / run_dir.run_id
    try:
        result.metrics = run_training(
            plan, config, base_model, start_adapter, adapter_dir, say, run_dir.checkpoint
        )
        if parallel.rank != 0:
            return result
        result.adapter_path = adapter_dir
        say(f"saved the adapter to {adapter_dir}")
        if promote and proxy_url:
            shared = shared_adapter(data_dir, adapter_dir)  # with a bucket: uploaded
            result.gate = _gate(config, scorer, base_model, adapter_dir, shared, gate_prompts,
                                result, say, data_dir, proxy_url, admin_token)  # fmt: skip
            if result.gate.promote and config.canary:
                # Live traffic decides: the next watch promotes or drops it (canary.py).
                name = start_canary(proxy_url, admin_token, shared, config.canary, say)
                result.gate.reason += f"; serving it first as canary {name} to {config.canary:.0%}"
            elif result.gate.promote:
                result.promoted_as = _promote_once(proxy_url, admin_token, shared, say)
        kill_point("promoting")
    except Exception as e:
        if parallel.rank == 0:  # failed runs are recorded too: the report shows them
            error = f"{type(e).__name__}: {e}"
            record_run(data_dir, result, config, base_model, start_adapter, started, error)
            say(f"report: {write_report(data_dir)}")
        raise
    # Recorded before the run is marked finished: a run killed in between is found
    # recorded by the next night (and only marked finished), never trained again.
    record_run(data_dir, result, config, base_model, start_adapter, started, None)
    kill_point("recorded")
    run_dir.finish()
    say(f"report: {write_report(data_dir)}")
    return result


def _gate(
    config: TrainConfig,
    scorer: Scorer | None,
    base_model: str,
    adapter_dir: Path,
    shared: str,
    prompts: list,
    result: RunResult,
    say,
    data_dir: Path,
    proxy_url: str,
    token: str | None,
) -> Verdict:
    """The gate's verdict on the new adapter against the one served now; a resumed run
    whose adapter (`shared`: as the proxies name it) is served already passed it before
    it was interrupted."""
    served = served_adapter(serving_state(proxy_url, token))
    if served == shared:
        return Verdict(config.gate, True, "promoted before the run was interrupted")
    verdict = skipped(config, scorer) or run_gate(
        config, base_model, adapter_dir, local_adapter(data_dir, served), prompts, scorer,
        result.held_out,
    )  # fmt: skip
    say(verdict.line())
    if not verdict.promote:
        say(f"not promoted: the adapter stays in {adapter_dir}; the proxy keeps serving "
            f"{served or 'the base model'}")  # fmt: skip
    return verdict


def _promote_once(proxy_url: str, token: str | None, shared: str, say) -> str:
    """Promote the adapter (`shared`: its path, or its upload with a bucket) unless the
    proxy serves it already (a resumed run killed after its promotion); its name."""
    current = serving_state(proxy_url, token).get("current") or {}
    if current.get("path") == shared:
        say(f"the proxy already serves it as {current['name']}")
        return current["name"]
    promoted = promote_adapter(proxy_url, token, shared)
    say(f"promoted: the proxy now serves it as {promoted}")
    return promoted


def _this_run(data_dir: Path, dry_run: bool) -> tuple[RunDir, dict]:
    """The interrupted run to resume and what it saved, or a new run ({} saved)."""
    resumed = None if dry_run else unfinished_run(data_dir)
    while resumed is not None and _recorded(data_dir, resumed.name):
        RunDir(resumed).finish()  # killed after it was recorded: it only missed this mark
        resumed = unfinished_run(data_dir)
    if resumed is not None:
        run = RunDir(resumed)
        return run, run.saved()
    run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    return RunDir(data_dir / "runs" / run_id), {}


def _recorded(data_dir: Path, run_id: str) -> bool:
    """Whether `training_runs` holds this run as trained."""
    con = open_db(data_dir)
    try:
        rows = con.execute(
            "SELECT count(*) FROM training_runs WHERE run_id = ? AND status = 'trained'", [run_id]
        ).fetchone()
    finally:
        con.close()
    return bool(rows and rows[0])


def _what_it_trains_on(only: list[str] | None) -> str:
    if only is not None:
        return f"resuming an interrupted run on its {len(only)} group(s)"
    return "selecting finished groups no earlier run trained on"


def run_training(
    plan: Plan,
    config: TrainConfig,
    base_model: str,
    start_adapter: str | None,
    out_dir: Path,
    say=print,
    checkpoint: Path | None = None,
) -> dict:
    """Train on the plan's samples; saves the adapter to `out_dir`; returns metrics.

    With `checkpoint`, the adapter and optimizer are saved there after every step, and
    a checkpoint found there is resumed: the steps it covers are skipped (the shuffles
    replay from the seed, so the remaining steps see the data they would have seen).
    """
    import torch

    from .grpo.loss import LossConfig

    torch.manual_seed(config.seed)  # before the fresh adapter's initialisation
    parallel = Parallel.start(fsdp=config.fsdp)
    model, optimizer, state = _start_policy(
        config, base_model, start_adapter, checkpoint, parallel, say
    )
    loss_config = LossConfig.from_train_config(config)
    samples = with_behaviour(model, plan.samples, config.micro_batch_tokens)
    steps: list[dict] = list(state["steps"]) if state else []
    done_steps = len(steps)
    max_gap = state["max_gap"] if state else 0.0
    schedule = step_schedule(plan.groups, config)
    started = time.perf_counter()
    for number, (epoch, step_groups) in enumerate(schedule, start=1):
        if number <= done_steps:
            continue  # done before the interruption
        step_samples = [s for s in samples if s.group_id in step_groups]
        out = optimizer_step(model, optimizer, parallel, step_samples, loss_config, config)
        if not steps:  # the first step sees the starting policy: how far is it from the logs?
            max_gap = max(max_gap, out.logprob_gap)
        record = {
            **out.stats,
            "step": len(steps) + 1,
            "epoch": epoch,
            "loss": out.loss,
            "grad_norm": out.grad_norm,
            "groups": len(step_groups),
            "sequences": len(step_samples),
        }
        steps.append(record)
        kill_point(f"step-{len(steps)}")  # computed, not yet checkpointed
        if checkpoint is not None:
            save_checkpoint(checkpoint, parallel, model, optimizer, steps, max_gap)
        # Tokens this process trained (a resumed run's earlier steps took no time here).
        rate = sum(s["tokens"] for s in steps[done_steps:]) / (time.perf_counter() - started)
        say(
            f"step {len(steps)}/{len(schedule)}: loss {out.loss:+.4f}, clipped "
            f"{record.get('clipped_fraction', 0):.3f}, ratio max {record.get('ratio_max', 1):.3f}, "
            f"grad norm {out.grad_norm:.3f}, {rate:.0f} tokens/s"
        )
    save_adapter(out_dir, parallel, model)
    return {"steps": steps, "max_logprob_gap": max_gap, "seconds": time.perf_counter() - started}


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
):
    """(model on this process's device, its optimizer, the checkpoint's state or None)."""
    import torch

    from .grpo.policy import load_policy, torch_dtype

    state = load_checkpoint(checkpoint)
    dtype = torch_dtype(config.dtype)
    if state is not None:
        if state.get("fsdp", False) != parallel.fsdp:
            raise TrainError(
                f"the checkpoint in {checkpoint} was written {'with' if state['fsdp'] else 'without'}"
                " FSDP: resume the same way (or delete it to start the run over)"
            )
        model = load_policy(base_model, checkpoint / "adapter", trainable=True, dtype=dtype)
        say(f"resuming after step {len(state['steps'])} from {checkpoint}")
    else:
        model = load_policy(base_model, start_adapter, trainable=True, dtype=dtype)
        if start_adapter is None:
            model = fresh_adapter(model, config)
    model = parallel.prepare(model)
    if parallel.world > 1:
        kind = "FSDP" if parallel.fsdp else "data parallel"
        say(f"{parallel.world} processes, {kind} on {parallel.device}")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    if state is not None:
        parallel.load_optimizer_state(model, optimizer, state["optimizer"])
    return model, optimizer, state


def _base_model(state: dict) -> str:
    base = base_model_of(state)
    if not base:
        raise TrainError("which base model? give --base-model (or --proxy, whose vLLM knows it)")
    return base


def _tokenizer(base_model: str | None):
    """The base model's tokenizer, for records without token ids; None if unavailable."""
    if base_model is None:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(base_model)
    except (OSError, ValueError):
        return None


def _warn_on_gap(gap: float | None, say) -> None:
    if gap is None or gap <= LOGPROB_GAP_WARNING:
        return
    line = (
        f"warning: the policy's logprobs differ from the logged ones by up to {gap:.3g} nats "
        f"before any update (above {LOGPROB_GAP_WARNING}): serve in the trainer's dtype and "
        "with --logprobs-mode processed_logprobs (docs/grpo.md)"
    )
    log.warning(line)
    say(line)


def _silent(_line: str) -> None:
    pass


def record_run(
    data_dir: Path,
    result: RunResult,
    config: TrainConfig,
    base_model: str,
    start_adapter: str | None,
    started: int,
    error: str | None,
) -> None:
    """The run's row in `training_runs` (failed ones too: the report shows them)."""
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
                    "seconds": metrics.get("seconds"),
                    "gate": result.gate.as_dict() if result.gate else None,
                    "selection": plan.selection,  # where the next night's selection starts
                }
            ),
        },
    )
    writer.close()
