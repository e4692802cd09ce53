"""Trainer: GRPO on LoRA from logged records.

`train` tells the night's story top to bottom: plan, score, resample, train, gate,
promote, watch. What it decides lives in `night/` (the plan, per-turn groups, the gate,
the canary and the watch, checkpoints, the proxy's admin API); the numerics in `grpo/`
(records to token sequences, vLLM's sampling redone, the loss, the policy's logprobs,
one optimizer step, one process or many). `night` imports `grpo`, never the reverse;
nothing here imports the proxy or the judge (the CLI hands a scorer over).
"""
