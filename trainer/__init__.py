"""Trainer: GRPO on LoRA from logged records.

records -> token sequences and masks (`data`, `records`), advantages, the GRPO loss
with its normalisation variants (`loss`, math in docs/grpo.md), packed policy logprobs
(`policy`), one or many processes (`parallel`), the nightly run with its checkpoints,
saving and promotion (`train`), and the HTML report (`report`).
"""
