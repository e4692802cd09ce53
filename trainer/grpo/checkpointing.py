"""Gradient checkpointing, and what bounds a run's memory (the line a night prints).

With checkpointing each decoder layer keeps only its input for the backward pass and
is run again there: about a third more compute, one layer's activations instead of
all of them. The logits' side is head.py's (a chunk of trained tokens at a time), the
attention's attention.py's; `memory_settings` records all three in the run's metrics.
"""

from __future__ import annotations

from overnight.config import TrainConfig

from .attention import kernel, sharing_path


def wants_checkpointing(mode: str) -> bool:
    """TrainConfig.gradient_checkpointing as asked: on, or not yet. `auto` is decided by
    the memory check (trainer/run/memory.py `check_fits`), which turns it on only where
    the night would not fit without it: on a CPU, a small real model (SmolLM2-135M) with
    memory to spare trains a third faster without it."""
    return mode == "on"


def enable_gradient_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward pass.

    Non-reentrant (torch.utils.checkpoint, use_reentrant=False): the frozen base's
    inputs need not require grad for the LoRA weights inside a layer to get theirs, and
    FSDP's per-layer hooks gather the shards again for the recompute. transformers
    checkpoints a layer only in training mode; the trainer runs in eval mode (no
    dropout: its logprobs must be the sampler's), so only the layers' own flags are set.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in inner.model.layers:
        layer.training = True


def memory_settings(model, config: TrainConfig) -> dict:
    """What bounds a run's memory, for its metrics: checkpointing, the logits' chunk, and
    how shared prompts are attended (micro-batches that shared them are in each step's)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {
        "gradient_checkpointing": bool(getattr(inner, "is_gradient_checkpointing", False)),
        "logit_chunk_tokens": config.logit_chunk_tokens,
        "attention": kernel(model),
        "shared_prompts": sharing_path(model, config.share_prompts),
    }


def memory_line(settings: dict) -> str:
    shared = {
        "flex": "once per row under a flex-attention block mask",
        "mask": "once per row under an explicit mask where that costs less than repeating them",
        "repeat": "repeated in every rollout",
    }[settings["shared_prompts"]]
    checkpointing = "on" if settings["gradient_checkpointing"] else "off"
    return (
        f"attention {settings['attention']}, shared prompts {shared}; gradient checkpointing "
        f"{checkpointing}; logits {settings['logit_chunk_tokens']} trained tokens at a time"
    )
