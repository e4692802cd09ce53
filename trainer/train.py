"""`overnight train`: one nightly GRPO run over the groups no earlier run trained on.

  select finished, scored, untrained groups -> samples exactly as sampled, advantages
  -> start from the adapter the proxy serves (or a fresh LoRA) -> GRPO steps with
  micro-batches and gradient accumulation -> save the adapter -> promote it through
  the proxy's admin API -> record the run.

Progress goes to `say` (a line per stage and per step, with rates).
"""

from __future__ import annotations

import datetime as dt
import json
import random
import shutil
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from overnight.storage import SCHEMA_VERSION, LogWriter, WriterConfig, finished_groups, open_db

from overnight.config import TrainConfig
from overnight.errors import OvernightError

from .data import Sample, group_advantages
from .parallel import Parallel
from .records import load_samples
from overnight.view.report import write_report


class TrainError(OvernightError):
    code = "train_error"


@dataclass
class Plan:
    groups: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    rewards: dict[str, float] = field(default_factory=dict)  # rollout -> reward
    group_stats: dict[str, dict] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)  # reason -> groups
    retokenised: int = 0
    token_count_gaps: list[int] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [
            f"{len(self.groups)} group(s), {len(self.samples)} sequence(s), "
            f"{sum(s.trained_tokens for s in self.samples)} trained tokens"
        ]
        out += [f"  skipped {n} group(s): {reason}" for reason, n in self.skipped.most_common()]
        if self.retokenised:
            gaps = self.token_count_gaps
            worst = max((abs(g) for g in gaps), default=0)
            out.append(
                f"  {self.retokenised} turn(s) had no token ids and were re-tokenised from text (less "
                f"exact; starting policy used as behaviour): token counts differ from the upstream's "
                f"in {sum(g != 0 for g in gaps)} of {len(gaps)}, by up to {worst}"
            )
        return out


# -- selecting and scoring -------------------------------------------------------------


def chosen_rewards(con, sources: tuple[str, ...]) -> dict[str, float]:
    """Each rollout's reward from the first source in `sources` that has one (latest wins)."""
    rows = con.execute(
        "SELECT rollout_id, source, arg_max(reward, created_at) FROM rewards GROUP BY rollout_id, source"
    ).fetchall()
    rank = {s: i for i, s in enumerate(sources)}
    best: dict[str, tuple[int, float]] = {}
    for rollout, source, reward in rows:
        if source in rank and (rollout not in best or rank[source] < best[rollout][0]):
            best[rollout] = (rank[source], reward)
    return {r: v for r, (_, v) in best.items()}


def trained_groups(con) -> set[str]:
    rows = con.execute(
        "SELECT DISTINCT unnest(groups) FROM training_runs WHERE status = 'trained'"
    ).fetchall()
    return {g for (g,) in rows}


def plan_run(
    data_dir: Path,
    config: TrainConfig,
    settle_seconds: float,
    since: dt.datetime | None = None,
    max_groups: int | None = None,
    only: list[str] | None = None,
    tokenizer=None,
) -> Plan:
    plan = Plan()
    con = open_db(data_dir)
    try:
        done = trained_groups(con)
        candidates = [g for g in finished_groups(con, settle_seconds, None) if g not in done]
        if only is not None:  # a resumed run trains on exactly the groups it began with
            candidates = [g for g in only if g not in done]
        if since is not None:
            recent = {
                g
                for (g,) in con.execute(
                    "SELECT group_id FROM groups WHERE started_at >= ?", [since]
                ).fetchall()
            }
            candidates = [g for g in candidates if g in recent]
        rewards = chosen_rewards(con, config.reward_sources)
        loaded = load_samples(con, candidates, tokenizer)
    finally:
        con.close()
    for reason, n in loaded.skipped.items():
        plan.skipped[f"turns skipped: {reason}"] += n
    plan.retokenised, plan.token_count_gaps = loaded.retokenised, loaded.token_count_gaps
    by_group: dict[str, list[Sample]] = {}
    for s in loaded.samples:
        by_group.setdefault(s.group_id, []).append(s)
    for group_id in candidates:
        samples = by_group.get(group_id, [])
        rollouts = {s.rollout_id for s in samples}
        if len(rollouts) < config.min_group_size:
            plan.skipped[f"fewer than {config.min_group_size} trainable rollouts"] += 1
            continue
        if any(r not in rewards for r in rollouts):
            plan.skipped["a rollout has no reward (run overnight judge, or post rewards)"] += 1
            continue
        adv = group_advantages({r: rewards[r] for r in rollouts}, config.scale_by_std)
        if adv is None:
            plan.skipped["all rewards equal: no signal"] += 1
            continue
        for s in samples:
            s.advantage = adv.advantages[s.rollout_id]
        plan.groups.append(group_id)
        plan.samples += samples
        plan.rewards.update({r: rewards[r] for r in rollouts})
        plan.group_stats[group_id] = {"mean": adv.mean, "std": adv.std, "rollouts": len(rollouts)}
        if max_groups is not None and len(plan.groups) >= max_groups:
            break
    return plan


# -- the proxy and vLLM ---------------------------------------------------------------


def admin_call(proxy_url: str, path: str, token: str | None, payload: dict | None = None) -> dict:
    request = urllib.request.Request(
        proxy_url.rstrip("/") + path,
        method="POST" if payload is not None else "GET",
        data=json.dumps(payload).encode() if payload is not None else None,
        headers={
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {token}"} if token else {}),
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise TrainError(
            f"the proxy answered {e.code} to {path}: {e.read().decode(errors='replace')[:500]}"
        ) from e
    except OSError as e:
        raise TrainError(f"cannot reach the proxy at {proxy_url}: {e}") from e


def serving_state(proxy_url: str | None, token: str | None) -> dict:
    return admin_call(proxy_url, "/admin/adapters", token) if proxy_url else {}


# -- training -------------------------------------------------------------------------


def micro_batches(samples: list[Sample], budget: int) -> list[list[Sample]]:
    """Consecutive samples packed up to `budget` tokens (a longer one goes alone)."""
    batches, current, size = [], [], 0
    for s in samples:
        if current and size + len(s.tokens) > budget:
            batches.append(current)
            current, size = [], 0
        current.append(s)
        size += len(s.tokens)
    if current:
        batches.append(current)
    return batches


def micro_batch_loss(
    model, samples: list[Sample], weights: list[float], loss_config, share_prompts=True
):
    """One packed micro-batch: (loss to backpropagate, statistics, largest |logp - logged|).

    `weights` is each sample's per-token weight, normalised over the whole step.
    """
    import torch

    from .loss import policy_loss
    from .policy import pack, takes_custom_mask, trained_logprobs

    device = next(model.parameters()).device
    batch = pack(samples, share_prompts=share_prompts and takes_custom_mask(model))
    batch = {k: v.to(device) for k, v in batch.items()}
    logp = trained_logprobs(model, batch)  # (N,)
    seq = batch["sequence_index"]
    ref = None
    if loss_config.kl_coef > 0:
        with torch.no_grad(), model.disable_adapter():
            ref = trained_logprobs(model, batch)
    loss, stats = policy_loss(
        logp,
        batch["behaviour_logprobs"],
        torch.tensor([s.advantage for s in samples], device=device)[seq],
        torch.tensor(weights, device=device)[seq],
        torch.ones_like(logp, dtype=torch.bool),  # pack() keeps trained tokens only
        loss_config,
        sequence_index=seq,
        ref_logp=ref,
    )
    gap = (logp.detach().float() - batch["behaviour_logprobs"]).abs().max().item()
    return loss, stats, gap


def fresh_adapter(model, config: TrainConfig):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model,
        LoraConfig(
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            target_modules=list(config.target_modules),
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        ),
    )


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

    from .loss import LossConfig, token_weights
    from .policy import load_policy, torch_dtype

    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    parallel = Parallel.start(fsdp=config.fsdp)
    state = _load_checkpoint(checkpoint)
    if state is not None:
        if state.get("fsdp", False) != parallel.fsdp:
            raise TrainError(
                f"the checkpoint in {checkpoint} was written {'with' if state['fsdp'] else 'without'}"
                " FSDP: resume the same way (or delete it to start the run over)"
            )
        model = load_policy(
            base_model, checkpoint / "adapter", trainable=True, dtype=torch_dtype(config.dtype)
        )
        say(f"resuming after step {len(state['steps'])} from {checkpoint}")
    else:
        model = load_policy(base_model, start_adapter, trainable=True, dtype=torch_dtype(config.dtype))
        if start_adapter is None:
            model = fresh_adapter(model, config)
    model = parallel.prepare(model)
    if parallel.world > 1:
        say(
            f"{parallel.world} processes, {'FSDP' if parallel.fsdp else 'data parallel'} "
            f"on {parallel.device}"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    if state is not None:
        parallel.load_optimizer_state(model, optimizer, state["optimizer"])
    loss_config = LossConfig.from_train_config(config)
    _fill_unknown_behaviour(
        model, [s for s in plan.samples if not s.exact], config.micro_batch_tokens
    )
    groups = list(plan.groups)
    steps: list[dict] = list(state["steps"]) if state else []
    done_steps = len(steps)
    max_gap = state["max_gap"] if state else 0.0
    step_number = 0
    started = time.perf_counter()
    total_steps = config.epochs * -(-len(groups) // config.groups_per_step)
    for epoch in range(config.epochs):
        rng.shuffle(groups)
        for first in range(0, len(groups), config.groups_per_step):
            step_number += 1
            if step_number <= done_steps:
                continue  # done before the interruption
            step_groups = set(groups[first : first + config.groups_per_step])
            samples = [s for s in plan.samples if s.group_id in step_groups]
            per_sequence = token_weights([s.trained_tokens for s in samples], loss_config)
            weight_of = {id(s): w for s, w in zip(samples, per_sequence, strict=True)}
            optimizer.zero_grad(set_to_none=True)
            step_loss, stats_list = 0.0, []
            batches = micro_batches(samples, config.micro_batch_tokens)
            for batch_samples, counts in parallel.micro_batch_share(batches):
                weights = [weight_of[id(s)] if counts else 0.0 for s in batch_samples]
                loss, stats, gap = micro_batch_loss(
                    model, batch_samples, weights, loss_config, config.share_prompts
                )
                loss.backward()
                if not counts:
                    continue  # an FSDP process's stand-in pass: zero gradient, no statistics
                if epoch == 0 and not steps:
                    max_gap = max(max_gap, gap)
                step_loss += loss.item()
                stats_list.append(stats)
            parallel.sum_gradients(params)
            step_loss, stats_list, max_gap = parallel.gather_step(step_loss, stats_list, max_gap)
            norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            grad_norm = parallel.grad_norm(norm)
            optimizer.step()
            record = _merge_stats(stats_list)
            record.update(
                step=len(steps) + 1,
                epoch=epoch,
                loss=step_loss,
                grad_norm=grad_norm,
                groups=len(step_groups),
                sequences=len(samples),
            )
            steps.append(record)
            if checkpoint is not None:
                _save_checkpoint(checkpoint, parallel, model, optimizer, steps, max_gap)
            # Tokens this process trained (a resumed run's earlier steps took no time here).
            rate = sum(s["tokens"] for s in steps[done_steps:]) / (time.perf_counter() - started)
            say(
                f"step {len(steps)}/{total_steps}: loss {step_loss:+.4f}, clipped "
                f"{record.get('clipped_fraction', 0):.3f}, ratio max {record.get('ratio_max', 1):.3f}, "
                f"grad norm {grad_norm:.3f}, {rate:.0f} tokens/s"
            )
    _save_adapter(out_dir, parallel, model)
    return {"steps": steps, "max_logprob_gap": max_gap, "seconds": time.perf_counter() - started}


def _fill_unknown_behaviour(model, samples: list[Sample], budget: int) -> None:
    """Re-tokenised samples have no sampling logprobs: take the starting policy's."""
    import torch

    from .policy import pack, trained_logprobs

    device = next(model.parameters()).device
    for batch_samples in micro_batches(samples, budget):
        batch = {k: v.to(device) for k, v in pack(batch_samples).items()}
        with torch.no_grad():
            logp = trained_logprobs(model, batch).tolist()
        for s in batch_samples:
            positions = [j for j, t in enumerate(s.trained) if t]
            for j, value in zip(positions, logp[: len(positions)], strict=True):
                s.behaviour_logprobs[j] = value
            logp = logp[len(positions) :]


def _save_adapter(path: Path, parallel: Parallel, model) -> None:
    """The adapter as peft saves it, written by process 0 (every process gathers)."""
    state = parallel.adapter_state(model)
    if parallel.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path, state_dict=state)


def _save_checkpoint(path: Path, parallel: Parallel, model, optimizer, steps, max_gap) -> None:
    """Adapter and optimizer after a step, replaced atomically (a crash leaves the old one)."""
    import torch

    optimizer_state = parallel.optimizer_state(model, optimizer)  # every process gathers
    tmp = path.with_name(path.name + ".tmp")
    if parallel.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _save_adapter(tmp / "adapter", parallel, model)
    if parallel.rank != 0:
        return
    torch.save(
        {"optimizer": optimizer_state, "steps": steps, "max_gap": max_gap, "fsdp": parallel.fsdp},
        tmp / "state.pt",
    )
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def _load_checkpoint(path: Path | None) -> dict | None:
    if path is None or not (path / "state.pt").exists():
        return None
    import torch

    return torch.load(path / "state.pt", weights_only=False)


def _merge_stats(stats: list[dict]) -> dict:
    tokens = sum(s.get("tokens", 0) for s in stats)
    if not tokens:
        return {"tokens": 0}
    out = {"tokens": tokens}
    for key in (
        "clipped_fraction",
        "ratio_mean",
        "behaviour_kl",
        "dual_clipped_fraction",
        "ref_kl",
    ):
        if key in stats[0]:
            out[key] = sum(s[key] * s["tokens"] for s in stats) / tokens
    out["ratio_max"] = max(s["ratio_max"] for s in stats)
    out["ratio_min"] = min(s["ratio_min"] for s in stats)
    return out


# -- the whole night ------------------------------------------------------------------


@dataclass
class RunResult:
    run_id: str
    plan: Plan
    adapter_path: Path | None = None
    promoted_as: str | None = None
    metrics: dict = field(default_factory=dict)


def unfinished_run(data_dir: Path) -> Path | None:
    """The newest run directory that began training and never finished, if any."""
    runs = sorted((Path(data_dir) / "runs").glob("*/run.json"))
    for run in reversed(runs):
        if not (run.parent / "finished").exists():
            return run.parent
    return None


def train(
    data_dir: Path,
    config: TrainConfig,
    *,
    proxy_url: str | None = None,
    admin_token: str | None = None,
    promote: bool = True,
    dry_run: bool = False,
    settle_seconds: float = 600.0,
    since: dt.datetime | None = None,
    max_groups: int | None = None,
    say=print,
) -> RunResult:
    """One night. A run that was interrupted is resumed first, on the same groups.

    Under torchrun every process runs this; process 0 decides what to train on and
    does everything with side effects (files, the run record, the promotion).
    """
    data_dir = Path(data_dir)
    parallel = Parallel() if dry_run else Parallel.start(fsdp=config.fsdp)
    rank = parallel.rank
    if rank != 0:
        say = _silent
    resumed = None if dry_run else unfinished_run(data_dir)
    saved = json.loads((resumed / "run.json").read_text()) if resumed is not None else {}
    if resumed is not None:
        run_id, only = resumed.name, saved["groups"]
    else:
        run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        only = None
    run_id, only, saved = parallel.agree((run_id, only, saved))
    if only is not None:
        say(f"run {run_id}: resuming an interrupted run on its {len(only)} group(s)")
    else:
        say(f"run {run_id}: selecting finished groups no earlier run trained on")
    started = time.time_ns() // 1000
    state = serving_state(proxy_url, admin_token)
    base_model = config.base_model or (_base_from_state(state) if not dry_run else None)
    plan = plan_run(
        data_dir,
        config,
        settle_seconds,
        since,
        max_groups,
        only=only,
        tokenizer=_tokenizer(base_model),
    )
    for line in plan.lines():
        say(line)
    result = RunResult(run_id, plan)
    if dry_run or not plan.groups:
        if not plan.groups:
            say("nothing to train on")
        return result
    current = (
        saved["start_adapter"] if only is not None else (state.get("current") or {}).get("path")
    )
    say(f"training on {base_model}, starting from {current or 'a fresh LoRA adapter'}")
    run_dir = data_dir / "runs" / run_id
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run.json").write_text(
            json.dumps({"groups": plan.groups, "start_adapter": current})
        )
    adapter_dir = data_dir / "adapters" / run_id
    error = None
    try:
        result.metrics = run_training(
            plan, config, base_model, current, adapter_dir, say, checkpoint=run_dir / "checkpoint"
        )
        if rank != 0:
            return result
        result.adapter_path = adapter_dir
        say(f"saved the adapter to {adapter_dir}")
        if promote and proxy_url:
            result.promoted_as = admin_call(
                proxy_url, "/admin/adapters/promote", admin_token, {"path": str(adapter_dir)}
            )["promoted"]
            say(f"promoted: the proxy now serves it as {result.promoted_as}")
        (run_dir / "finished").touch()
        # The checkpoint (adapter + optimizer state) only serves resuming: gone once done.
        shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        if rank == 0:
            _record(data_dir, result, config, base_model, current, started, error)
            say(f"report: {write_report(data_dir)}")
    return result


def _tokenizer(base_model: str | None):
    """The base model's tokenizer, for records without token ids; None if unavailable."""
    if base_model is None:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(base_model)
    except (OSError, ValueError):
        return None


def _silent(_line: str) -> None:
    pass


def _base_from_state(state: dict) -> str:
    base = state.get("base_model_path") or state.get("base_model")
    if not base:
        raise TrainError("which base model? give --base-model (or --proxy, whose vLLM knows it)")
    return base


def _record(
    data_dir: Path,
    result: RunResult,
    config: TrainConfig,
    base_model: str,
    start_adapter: str | None,
    started: int,
    error: str | None,
) -> None:
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
                }
            ),
        },
    )
    writer.close()
