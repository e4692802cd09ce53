"""One GRPO optimizer step: packed micro-batches, their losses, gradients summed, one update.

The token weights are normalised over the whole step (`loss.token_weights`), so the
micro-batches' losses add up to the step's loss whatever the micro-batch size and
however many processes share them (docs/grpo.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from overnight.config import TrainConfig
from overnight.telemetry import traced

from .attention import kernel, sharing_path, sharing_pays
from .data import Sample
from .loss import LossConfig, token_weights
from .parallel import Parallel

# Statistics averaged over a step's tokens (the ratio's min and max are taken whole).
TOKEN_MEANS = (
    "clipped_fraction", "ratio_mean", "behaviour_kl", "dual_clipped_fraction", "ref_kl", "nll"
)  # fmt: skip


def fresh_adapter(model, config: TrainConfig):
    """`model` with a new LoRA adapter (B = 0: it starts as the base model)."""
    from peft import LoraConfig, get_peft_model

    from .images import language_model_targets

    return get_peft_model(
        model,
        LoraConfig(
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            # A vision-language model's: in its language model, and with
            # --lora-vision-tower its tower and connector too (images.py).
            target_modules=language_model_targets(
                model, list(config.target_modules), tower=config.lora_vision_tower
            ),
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        ),
    )


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
    model,
    samples: list[Sample],
    weights: list[float],
    loss_config,
    share_prompts=True,
    chunk: int = TrainConfig.logit_chunk_tokens,
):
    """One packed micro-batch: (loss to backpropagate, statistics, largest |logp - logged|).

    `weights` is each sample's per-token weight, normalised over the whole step; `chunk`:
    trained tokens whose logits are computed at once (TrainConfig.logit_chunk_tokens).
    """
    import torch

    from .loss import policy_loss, sft_loss
    from .policy import batch_images, pack, trained_logprobs

    device = next(model.parameters()).device
    shared = shares_prompts(model, samples, share_prompts)
    batch = pack(samples, share_prompts=shared, attention=kernel(model))
    batch = {k: v.to(device) for k, v in batch.items()}
    images = batch_images(samples, batch)
    logp = trained_logprobs(model, batch, chunk, images)  # (N,)
    seq = batch["sequence_index"]
    if loss_config.objective == "sft":  # nothing logged to compare with: no gap
        loss, stats = sft_loss(logp, torch.tensor(weights, device=device)[seq])
        stats["prompts_shared"] = float("block" in batch)
        return loss, stats, 0.0
    ref = None
    if loss_config.kl_coef > 0:
        with torch.no_grad(), model.disable_adapter():
            ref = trained_logprobs(model, batch, chunk, images)
    loss, stats = policy_loss(
        logp,
        batch["behaviour_logprobs"],
        # pack() orders trained tokens by sample, then position: each sample's in order.
        torch.tensor([a for s in samples for a in s.trained_advantages()], device=device),
        torch.tensor(weights, device=device)[seq],
        torch.ones_like(logp, dtype=torch.bool),  # pack() keeps trained tokens only
        loss_config,
        sequence_index=seq,
        ref_logp=ref,
    )
    stats["prompts_shared"] = float("block" in batch)
    gap = (logp.detach().float() - batch["behaviour_logprobs"]).abs().max().item()
    return loss, stats, gap


def shares_prompts(model, samples: list[Sample], share_prompts: bool) -> bool:
    """Whether this micro-batch packs its groups' prompts once (attention.py): always under
    flex attention, under an explicit mask where that costs less than repeating them."""
    from .policy import row_shapes

    path = sharing_path(model, share_prompts)
    if path != "mask":
        return path == "flex"
    return sharing_pays(model, row_shapes(samples, True), row_shapes(samples, False))


@dataclass(frozen=True)
class StepResult:
    stats: dict  # token-weighted over the step's micro-batches (`merge_stats`)
    loss: float  # summed over the micro-batches of every process
    grad_norm: float  # before clipping
    logprob_gap: float  # largest |logp - logged logprob| of a trained token, all processes


@traced(
    "step",
    lambda out: {"loss": out.loss, "grad_norm": out.grad_norm, "logprob_gap": out.logprob_gap,
                 "tokens": out.stats.get("tokens")},
)  # fmt: skip
def optimizer_step(
    model,
    optimizer,
    parallel: Parallel,
    samples: list[Sample],
    loss_config: LossConfig,
    config: TrainConfig,
) -> StepResult:
    """One step over `samples`; this process takes its share of the micro-batches."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    per_sequence = token_weights([s.trained_tokens for s in samples], loss_config)
    weight_of = {id(s): w for s, w in zip(samples, per_sequence, strict=True)}
    optimizer.zero_grad(set_to_none=True)
    step_loss, stats_list, gap = 0.0, [], 0.0
    batches = micro_batches(samples, config.micro_batch_tokens)
    for batch_samples, counts in parallel.micro_batch_share(batches):
        weights = [weight_of[id(s)] if counts else 0.0 for s in batch_samples]
        loss, stats, batch_gap = micro_batch_loss(
            model,
            batch_samples,
            weights,
            loss_config,
            config.share_prompts,
            config.logit_chunk_tokens,
        )
        loss.backward()
        if not counts:
            continue  # an FSDP process's stand-in pass: zero gradient, no statistics
        gap = max(gap, batch_gap)
        step_loss += loss.item()
        stats_list.append(stats)
    parallel.sum_gradients(params)
    step_loss, stats_list, gap = parallel.gather_step(step_loss, stats_list, gap)
    norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
    grad_norm = parallel.grad_norm(norm)
    optimizer.step()
    return StepResult(merge_stats(stats_list), step_loss, grad_norm, gap)


def merge_stats(stats: list[dict]) -> dict:
    """The micro-batches' statistics as the step's: token-weighted means, extremes."""
    tokens = sum(s.get("tokens", 0) for s in stats)
    if not tokens:
        return {"tokens": 0}
    out = {"tokens": tokens, "micro_batches": len(stats)}
    out["micro_batches_shared"] = int(sum(s.get("prompts_shared", 0) for s in stats))
    for key in TOKEN_MEANS:
        if key in stats[0]:
            out[key] = sum(s[key] * s["tokens"] for s in stats) / tokens
    if "ratio_max" in stats[0]:  # GRPO's (an --sft step has no ratios)
        out["ratio_max"] = max(s["ratio_max"] for s in stats)
        out["ratio_min"] = min(s["ratio_min"] for s in stats)
    return out


@dataclass(frozen=True)
class Gap:
    """How far the starting policy is from what was logged for one sample, before any
    update: its importance ratios at the first step."""

    max_gap: float  # largest |logp - logged logprob| of a trained token
    ratio_min: float  # exp(logp - logged), smallest and largest over its trained tokens
    ratio_max: float
    tokens: int


def behaviour_pass(
    model, samples: list[Sample], budget: int, chunk: int = TrainConfig.logit_chunk_tokens
) -> tuple[list[Sample], list[Gap | None]]:
    """One pass of the starting policy over every sample, no gradient, before any update.

    Re-tokenised samples (not exact: their sampling logprobs are unknown) get the
    starting policy's logprobs as their behaviour, as training then treats them; each
    exact one gets its `Gap` (None for the others). The figures are what the report
    calls the logprob gap: on records the starting adapter sampled itself it measures
    serving against training (dtype, logprobs mode); on older ones, drift."""
    passed, gaps = [], []
    for s, mine in zip(samples, sample_logprobs(model, samples, budget, chunk), strict=True):
        positions = [j for j, t in enumerate(s.trained) if t]
        if not s.exact:
            behaviour = list(s.behaviour_logprobs)
            for j, value in zip(positions, mine, strict=True):
                behaviour[j] = value
            passed.append(replace(s, behaviour_logprobs=behaviour))
            gaps.append(None)
            continue
        logged = [s.behaviour_logprobs[j] for j in positions]
        passed.append(s)
        gaps.append(_gap([p - q for p, q in zip(mine, logged, strict=True)]))
    return passed, gaps


def sample_logprobs(
    model, samples: list[Sample], budget: int, chunk: int = TrainConfig.logit_chunk_tokens
) -> list[list[float]]:
    """Each sample's trained tokens' logprobs under `model`, in order, no gradient: one
    forward pass a micro-batch (the behaviour pass's, and hindsight distillation's teacher
    and student passes: distill.py)."""
    import torch

    from .policy import batch_images, pack, trained_logprobs

    device = next(model.parameters()).device
    out: list[list[float]] = []
    for batch_samples in micro_batches(samples, budget):  # consecutive: the order kept
        batch = {k: v.to(device) for k, v in pack(batch_samples).items()}
        images = batch_images(batch_samples, batch)
        with torch.no_grad():
            logp = trained_logprobs(model, batch, chunk, images).float().tolist()
        for s in batch_samples:
            n = s.trained_tokens
            out.append(logp[:n])
            logp = logp[n:]
    return out


def _gap(deltas: list[float]) -> Gap:
    import math

    if not deltas:
        return Gap(0.0, 1.0, 1.0, 0)
    # exp of a clamped difference: a token the policy all but excludes would overflow.
    ratio = [math.exp(max(min(d, 50.0), -50.0)) for d in deltas]
    return Gap(max(abs(d) for d in deltas), min(ratio), max(ratio), len(deltas))
