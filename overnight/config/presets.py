"""`overnight train --preset NAME`: the settings measured to work for a model on a machine,
as defaults that an option given explicitly still overrides (overnight/cli/policy_runs.py).
"""

from __future__ import annotations

# The tiny local model (tests, the demo) on a CPU: its random weights need far bigger
# steps than a real model (measured: a numbers-only reward went 0.56 -> 0.84 in three
# nights of 64 rollouts at 6e-2; at 2e-2 it took eight). Alpha follows the rank.
TINY_CPU_PRESET = {
    "learning_rate": 6e-2,
    "epochs": 4,
    "lora_rank": 8,
    "groups_per_step": 8,
}
# SmolLM2-135M-Instruct, a real small model, on a CPU (the demo, tests/test_smollm2.py):
# a LoRA of rank 8 moves a pretrained model far less per step than the tiny random one,
# so 1e-3 (not 1e-5 as on a 7B GPU run) and two epochs of four-group steps; argued from
# measurements in docs/grpo.md ("A small real model on a CPU").
SMOLLM2_CPU_PRESET = {
    "learning_rate": 1e-3,
    "epochs": 2,
    "lora_rank": 8,
    "groups_per_step": 4,
    # A quarter of the default: activations about 3 GiB, not 12, beside vLLM on a
    # 24 GiB machine (the night's own tokens are ~1,500 an epoch: nothing slower).
    "micro_batch_tokens": 2048,
}
# `overnight train --preset NAME`: defaults an option given explicitly still overrides.
PRESETS = {"tiny-cpu": TINY_CPU_PRESET, "smollm2-cpu": SMOLLM2_CPU_PRESET}
