"""The policy being trained: the base model with a LoRA adapter, and its logprobs.

Sequences are packed end to end in one row, with position ids restarting at each
sequence; transformers (5.x) turns such position ids into a block-diagonal causal
mask, so no token attends across sequences and nothing is padded. The vocabulary
projection is applied only where a sampled token is predicted: context positions
(system, user, tool output) never materialise their logits, which for a real
vocabulary are most of the memory of a step.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .data import Sample


def load_policy(
    base_model: str | Path,
    adapter: str | Path | None = None,
    *,
    trainable: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """The base model, with `adapter` (a peft directory) applied if given."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=trainable)
    return model


def _parts(model):
    """(decoder stack, output projection) of a causal LM, peft-wrapped or not."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model, inner.get_output_embeddings()


def pack(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """One packed row: input ids and positions (1, T), and where the trained tokens are."""
    tokens, positions, trained, behaviour, sequence = [], [], [], [], []
    for i, s in enumerate(samples):
        tokens += s.tokens
        positions += range(len(s.tokens))
        trained += s.trained
        behaviour += s.behaviour_logprobs
        sequence += [i] * len(s.tokens)
    trained_t = torch.tensor(trained, dtype=torch.bool)
    # A sequence's first token has nothing before it; it is never trained (it is prompt).
    assert not any(s.trained[0] for s in samples if s.tokens), (
        "a sequence cannot start with a trained token"
    )
    return {
        "input_ids": torch.tensor([tokens]),  # (1, T)
        "position_ids": torch.tensor([positions]),  # (1, T)
        "trained_index": trained_t.nonzero().squeeze(1),  # (N,) positions of trained tokens
        "behaviour_logprobs": torch.tensor(behaviour)[trained_t],  # (N,)
        "sequence_index": torch.tensor(sequence)[trained_t],  # (N,)
    }


def trained_logprobs(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logprob under `model` of each trained token of a packed batch: (N,)."""
    decoder, head = _parts(model)
    hidden = decoder(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
    ).last_hidden_state[0]  # (T, H)
    index = batch["trained_index"]  # (N,)
    logits = head(hidden[index - 1]).float()  # (N, V): the position before predicts the token
    targets = batch["input_ids"][0, index]  # (N,)
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
