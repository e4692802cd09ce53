"""The GRPO policy loss on packed tokens, with its normalisation variants.

Layout: every tensor is 1-D over the tokens of a micro-batch packed end to end
(no padding); `trained` marks the tokens the model sampled. The weights that
normalise the loss are computed once for the whole batch (`token_weights`), so
micro-batches with gradient accumulation sum to exactly the full-batch loss.
The math, with references, is in docs/grpo.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch


class Normalisation(StrEnum):
    """How token losses are summed into the batch loss."""

    GRPO = "grpo"
    """Mean over each sequence's tokens, then mean over sequences (Shao et al. 2024,
    DeepSeekMath). Long sequences weigh as much as short ones in total."""
    DR_GRPO = "dr_grpo"
    """Sum over all tokens divided by a constant, sequences x max_tokens (Liu et al.
    2025, "Understanding R1-Zero-Like Training"): no length bias from the normaliser."""
    DAPO = "dapo"
    """Sum over all tokens divided by the trained tokens in the batch (Yu et al. 2025,
    DAPO): every token weighs the same."""

    @classmethod
    def parse(cls, value: str) -> Normalisation:
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(v.value for v in cls)
            raise ValueError(f"unknown loss variant {value!r}; choose one of {known}") from None


@dataclass(frozen=True)
class LossConfig:
    variant: Normalisation = Normalisation.DAPO
    # PPO clip range, asymmetric as in DAPO ("clip-higher" leaves room to explore).
    clip_low: float = 0.2
    clip_high: float = 0.28
    # Dual clip (Ye et al. 2020): with a negative advantage the objective is bounded by
    # dual_clip x A, so a token whose ratio exploded (data from an old adapter) cannot
    # dominate the step. None turns it off. At or above 1 + clip_high it equals TRL's
    # `delta`; below, TRL's delta would also cap positive-advantage tokens, so it is refused.
    dual_clip: float | None = 3.0
    # token: a ratio per token (PPO/GRPO). sequence: one ratio per sequence, the
    # geometric mean of its tokens' (GSPO, Zheng et al. 2025).
    level: str = "token"
    # KL to the base model (k3 estimator); 0 turns it off and needs no reference pass.
    kl_coef: float = 0.0
    # The constant of dr_grpo: the longest completion the run allows, in tokens.
    max_tokens: int = 1024
    # "grpo": policy_loss. "sft": sft_loss, the trained tokens' cross-entropy, for --sft
    # nights (their tokens are to imitate: no advantage, ratio or clip).
    objective: str = "grpo"

    def __post_init__(self) -> None:
        object.__setattr__(self, "variant", Normalisation.parse(self.variant))
        if self.objective not in ("grpo", "sft"):
            raise ValueError(f"objective must be 'grpo' or 'sft', got {self.objective!r}")
        if self.level not in ("token", "sequence"):
            raise ValueError(f"level must be 'token' or 'sequence', got {self.level!r}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError("clip_low must be in [0, 1) and clip_high >= 0")
        if self.dual_clip is not None and self.dual_clip < 1 + self.clip_high:
            raise ValueError(
                f"dual_clip must be at least 1 + clip_high = {1 + self.clip_high:g} (or off): "
                "below it, it would cut into the clip window (docs/grpo.md)"
            )
        if self.kl_coef < 0 or self.max_tokens < 1:
            raise ValueError("kl_coef must be >= 0 and max_tokens >= 1")

    @classmethod
    def from_train_config(cls, config) -> LossConfig:
        """The loss options of an `overnight.config.TrainConfig`; an --sft night's is the
        token mean over the step, whatever --loss says (docs/grpo.md)."""
        return cls(
            variant=Normalisation.DAPO if config.sft else config.loss,
            clip_low=config.clip_low,
            clip_high=config.clip_high,
            dual_clip=config.dual_clip,
            level=config.ratio_level,
            kl_coef=config.kl_coef,
            max_tokens=config.max_tokens,
            objective="sft" if config.sft else "grpo",
        )


def token_weights(trained_per_sequence: list[int], config: LossConfig) -> list[float]:
    """The weight of each trained token of each sequence, for the whole batch."""
    sequences = len(trained_per_sequence)
    if config.variant is Normalisation.GRPO:
        return [1.0 / (n * sequences) if n else 0.0 for n in trained_per_sequence]
    if config.variant is Normalisation.DR_GRPO:
        return [1.0 / (config.max_tokens * sequences)] * sequences
    total = sum(trained_per_sequence)
    return [1.0 / total if total else 0.0] * sequences


def policy_loss(
    logp: torch.Tensor,  # (T,) current policy
    behaviour_logp: torch.Tensor,  # (T,) as sampled (logged)
    advantages: torch.Tensor,  # (T,) each token's sequence advantage
    weights: torch.Tensor,  # (T,) from token_weights, 0 where not trained
    trained: torch.Tensor,  # (T,) bool
    config: LossConfig,
    sequence_index: torch.Tensor | None = None,  # (T,) for level="sequence"
    ref_logp: torch.Tensor | None = None,  # (T,) base model, for kl_coef > 0
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss to backpropagate for this micro-batch, and statistics for the run log."""
    log_ratio = torch.where(trained, logp - behaviour_logp, torch.zeros_like(logp))
    if config.level == "sequence":
        assert sequence_index is not None, "level='sequence' needs sequence_index"
        log_ratio = _sequence_mean(log_ratio, trained, sequence_index)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    if config.dual_clip is not None:
        bound = config.dual_clip * advantages
        surrogate = torch.where(advantages < 0, torch.maximum(surrogate, bound), surrogate)
    per_token = -surrogate
    kl = None
    if config.kl_coef > 0:
        assert ref_logp is not None, "kl_coef > 0 needs ref_logp"
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0
        per_token = per_token + config.kl_coef * kl
    loss = (per_token * weights * trained).sum()
    return loss, _stats(ratio, log_ratio, advantages, trained, config, kl)


def sft_loss(
    logp: torch.Tensor,  # (T,) current policy, at the trained (assistant) tokens
    weights: torch.Tensor,  # (T,) from token_weights: 1 / the step's trained tokens
) -> tuple[torch.Tensor, dict[str, float]]:
    """Supervised fine-tuning: minus the trained tokens' logprobs, weighted, so that the
    step's micro-batches sum to its token-mean cross-entropy (docs/grpo.md)."""
    loss = -(logp * weights).sum()
    with torch.no_grad():
        nll = -logp.float().mean().item() if logp.numel() else 0.0
    return loss, {"tokens": float(logp.numel()), "nll": nll}


def _sequence_mean(
    values: torch.Tensor, trained: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    sequences = int(index.max()) + 1 if index.numel() else 0
    sums = torch.zeros(sequences, dtype=values.dtype, device=values.device).index_add(
        0, index, values
    )
    counts = torch.zeros(sequences, dtype=values.dtype, device=values.device).index_add(
        0, index, trained.to(values.dtype)
    )
    return (sums / counts.clamp(min=1))[index]


@torch.no_grad()
def _stats(ratio, log_ratio, advantages, trained, config: LossConfig, kl) -> dict[str, float]:
    r, a = ratio[trained], advantages[trained]
    if r.numel() == 0:
        return {"tokens": 0.0}
    clipped = ((a > 0) & (r > 1 + config.clip_high)) | ((a < 0) & (r < 1 - config.clip_low))
    stats = {
        "tokens": float(r.numel()),
        "clipped_fraction": clipped.float().mean().item(),
        "ratio_mean": r.mean().item(),
        "ratio_min": r.min().item(),
        "ratio_max": r.max().item(),
        "ratio_std": r.std().item() if r.numel() > 1 else 0.0,
        # KL(behaviour || current), k3 estimator: how far training moved from the data.
        "behaviour_kl": (r - 1 - log_ratio[trained]).mean().item(),
    }
    if config.dual_clip is not None:
        stats["dual_clipped_fraction"] = ((a < 0) & (r > config.dual_clip)).float().mean().item()
    if kl is not None:
        stats["ref_kl"] = kl[trained].mean().item()
    return stats
