"""Trainer: GRPO on LoRA from logged records.

`train` tells the night's story top to bottom: watch, plan, resample, train, gate,
promote, record. What the night decides lives in `night/` (the plan, per-turn groups,
the gate, the canary and the watch, the proxy's admin API); how one run goes in `run/`
(the training loop, checkpoints and resuming, the run's record); the numerics in `grpo/`
(records to token sequences, vLLM's sampling redone, the loss, the policy's logprobs,
one optimizer step, one process or many). Imports point down: train -> run -> night ->
grpo; nothing here imports the proxy or the judge (the CLI hands a scorer over).
"""
