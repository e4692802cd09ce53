"""Trainer: GRPO on LoRA from logged records (see the trainer issue)."""
