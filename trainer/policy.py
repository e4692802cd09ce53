"""The policy being trained: the base model with a LoRA adapter, and its logprobs.

Sequences are packed end to end into rows, with position ids restarting at each
sequence; transformers (5.x) turns such position ids into a block-diagonal causal
mask, so no token attends across sequences, and only row ends are padded. The vocabulary
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


def pack(samples: list[Sample], row_tokens: int = 0) -> dict[str, torch.Tensor]:
    """Samples packed into rows of `row_tokens` (at least the longest sample): (B, L).

    Attention on the CPU (and in any kernel without variable-length support) costs the
    square of a row's length, so one long row of everything would cost far more than
    padding; rows about as long as the longest sequence keep both attention and padding
    small. Rows are filled first-fit, longest sample first; padding goes at row ends,
    as a block of its own that nothing attends to and nothing is trained on.
    """
    longest = max(len(s.tokens) for s in samples)
    capacity = max(row_tokens, longest)
    rows: list[list[int]] = []  # sample indices per row
    room: list[int] = []
    for i in sorted(range(len(samples)), key=lambda i: -len(samples[i].tokens)):
        n = len(samples[i].tokens)
        slot = next((r for r, free in enumerate(room) if free >= n), None)
        if slot is None:
            rows.append([])
            room.append(capacity)
            slot = len(rows) - 1
        rows[slot].append(i)
        room[slot] -= n
    width = max(capacity - free for free in room)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    entries = []  # (sample, token position, flat index, behaviour logprob)
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            s = samples[i]
            n = len(s.tokens)
            assert not s.trained[0], "a sequence cannot start with a trained token (it is prompt)"
            ids[r, col : col + n] = torch.tensor(s.tokens)
            positions[r, col : col + n] = torch.arange(n)
            for j, (t, lp) in enumerate(zip(s.trained, s.behaviour_logprobs, strict=True)):
                if t:
                    entries.append((i, j, r * width + col + j, lp))
            col += n
        positions[r, col:] = torch.arange(width - col)  # padding: its own block
    entries.sort()  # trained tokens in sample order, whatever row they landed in
    return {
        "input_ids": ids,  # (B, L)
        "position_ids": positions,  # (B, L)
        "trained_index": torch.tensor([e[2] for e in entries], dtype=torch.long),  # (N,) flat rows
        "behaviour_logprobs": torch.tensor([e[3] for e in entries]),  # (N,)
        "sequence_index": torch.tensor([e[0] for e in entries], dtype=torch.long),  # (N,) sample
    }


def trained_logprobs(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logprob under `model` of each trained token of a packed batch: (N,)."""
    decoder, head = _parts(model)
    hidden = decoder(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
    ).last_hidden_state  # (B, L, H)
    hidden = hidden.reshape(-1, hidden.shape[-1])  # (B * L, H)
    index = batch["trained_index"]  # (N,) into the flattened rows
    logits = head(hidden[index - 1]).float()  # (N, V): the position before predicts the token
    targets = batch["input_ids"].reshape(-1)[index]  # (N,)
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
