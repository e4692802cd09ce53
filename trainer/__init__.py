"""Trainer: GRPO on LoRA from logged records.

So far: records -> token sequences and masks (`data`), advantages, and the GRPO loss
with its normalisation variants (`loss`, math in docs/grpo.md). The training loop,
adapter saving and promotion come next (see the trainer issue).
"""
