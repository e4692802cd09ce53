"""Our GRPO loss in TRL's terms, for the two places that run TRL beside it:
tests/test_trl_loss.py (same loss and gradients) and bench/trl_compare.py (speed).

`grpo_config_options` is docs/grpo.md's mapping as code: the GRPOConfig options under
which TRL 1.16 computes the loss a LossConfig describes. `compute_loss_inputs` is a
batch of packed samples as `GRPOTrainer._compute_loss` takes it (prompts of one length,
completions right-padded). Neither imports TRL.
"""

from __future__ import annotations

import torch

from overnight.trainer.grpo.data import Sample
from overnight.trainer.grpo.loss import LossConfig


def grpo_config_options(loss: LossConfig) -> dict:
    return {
        "loss_type": loss.variant.value,
        "epsilon": loss.clip_low,
        "epsilon_high": loss.clip_high,
        "delta": loss.dual_clip,
        "max_completion_length": loss.max_tokens,
        "importance_sampling_level": loss.level,
        "beta": loss.kl_coef,
        "use_bias_correction_kl": False,  # ours is the plain k3 estimator
        # float32, as ours (TRL's default autocasts to bfloat16, also on a CPU)
        "bf16": False,
    }


def compute_loss_inputs(
    samples: list[Sample], prompt_len: int, ref_logps: list[list[float]] | None = None
) -> dict:
    """`ref_logps`: each sample's reference logprobs over its completion (for beta > 0)."""
    longest = max(len(s.tokens) - prompt_len for s in samples)
    completion = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    old = torch.zeros(len(samples), longest)
    ref = torch.zeros(len(samples), longest)
    for i, s in enumerate(samples):
        n = len(s.tokens) - prompt_len
        completion[i, :n] = torch.tensor(s.tokens[prompt_len:])
        mask[i, :n] = 1
        old[i, :n] = torch.tensor(s.behaviour_logprobs[prompt_len:])
        if ref_logps is not None:
            ref[i, :n] = torch.tensor(ref_logps[i])
    inputs = {
        "prompt_ids": torch.tensor([s.tokens[:prompt_len] for s in samples]),
        "prompt_mask": torch.ones(len(samples), prompt_len, dtype=torch.long),
        "completion_ids": completion,
        "completion_mask": mask,
        "advantages": torch.tensor([s.advantage for s in samples]),
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref
    return inputs
