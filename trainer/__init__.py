"""Trainer: GRPO on LoRA from logged records.

`train` tells the night's story top to bottom: watch, plan, resample, train, gate,
promote, record. What to train on lives in `choose/` (the plan, per-turn groups, lone
turns, staleness); judging the candidate in `gate/` (held-out prompts, forgetting); live
traffic in `live/` (the watch, the canary, the handover); the proxy's admin API in
`serving/`; how one run goes in `run/` (the training loop, checkpoints and resuming, the
run's record); the numerics in `grpo/` (records to token sequences, vLLM's sampling
redone, the loss, the policy's logprobs, one optimizer step, one process or many).
Imports point down: train -> run -> live -> gate -> choose -> grpo, serving; nothing
here imports the proxy or the judge (the CLI hands a scorer over).
"""
