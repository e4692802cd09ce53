"""Attention at length: which mask a packed row gets, and when a shared prompt pays.

Three ways a group's rollouts can share their prompt in a row (policy.py packs them):

- `flex`: with `attn_implementation="flex_attention"`, a block mask
  (torch.nn.attention.flex_attention) made from each token's block and the block of the
  prompt it hangs off; it is never an (L x L) tensor, and the kernel skips the blocks
  nobody attends to, so a whole group fits one row. torch 2.13 runs flex attention's
  backward on CUDA only: on a CPU it serves passes without gradient.
- `mask`: sdpa or eager with an explicit (B, 1, L, L) mask. Its memory and its
  attention cost are the square of the row (the kernels compute masked pairs too), so
  it is used only where it costs less than `repeat` (`sharing_pays`).
- `repeat`: every rollout carries its own copy of the prompt.

Rows without a shared prompt need no mask of ours: transformers reads the packed
sequences from the position ids (a block mask under flex, an (L x L) mask under sdpa).
Under flash attention (`VARLEN`: flash-attn's variable-length kernel, CUDA only) it does
so for a row of batch size one with no mask at all, and the kernel's cost is each
sequence's own square, not the row's: a micro-batch is then packed into one row, its
shared prompts repeated (the kernel takes no mask).
A long row runs in a forward pass of its own, without its padding (`row_passes`): one
sequence alone is then plain causal attention, with no mask at all.
"""

from __future__ import annotations

import torch

# A row at least this long is forwarded alone: a (B, L, L) mask over rows this long
# costs more than a pass per row (below it, one pass for all rows is faster).
LONG_ROW = 1024

# Kernels that read packed sequences from the position ids of a one-row batch, with no
# mask (transformers' flash-attention integration: cu_seqlens from the position resets).
VARLEN = ("flash_attention_2", "flash_attention_3")


def kernel(model) -> str:
    """The model's attention implementation (sdpa, eager, flex_attention, ...)."""
    return getattr(model.config, "_attn_implementation", None) or "sdpa"


def sharing_path(model, share_prompts: bool) -> str:
    """How this model can share prompts: flex, mask (decided per micro-batch), or repeat."""
    if not share_prompts:
        return "repeat"
    name = kernel(model)
    if name == "flex_attention":
        return "flex"
    return "mask" if name in ("sdpa", "eager") else "repeat"


def explicit_mask(block: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """(B, 1, L, L) bool: a token sees the earlier tokens of its own block, and the
    whole block of the prompt it hangs off."""
    width = block.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=block.device).tril()
    same = block[:, :, None] == block[:, None, :]  # (B, L, L): query, key
    into_prompt = parent[:, :, None] == block[:, None, :]
    return ((same & causal) | into_prompt)[:, None]


def flex_mask(block: torch.Tensor, parent: torch.Tensor):
    """The same mask as a flex-attention BlockMask, built block by block (compiled), so
    no (L x L) tensor is made."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, width = block.shape

    def mask_mod(b, h, q, kv):
        same = (block[b, q] == block[b, kv]) & (kv <= q)
        return same | (parent[b, q] == block[b, kv])

    return create_block_mask(mask_mod, rows, None, width, width, device=block.device, _compile=True)


def row_passes(lengths: list[int], flex: bool) -> list[tuple[int, int, int]]:
    """The forward passes over a packed batch's rows: (first row, end row, width).

    Under flex attention one pass (its block masks skip padding and other sequences);
    otherwise a row of `LONG_ROW` tokens or more runs alone, cut to its length, and the
    shorter rows run together, cut to the longest of them. Rows come longest first.
    """
    width = max(lengths)
    if flex or width < LONG_ROW:
        return [(0, len(lengths), width)]
    passes = [(r, r + 1, n) for r, n in enumerate(lengths) if n >= LONG_ROW]
    short = [r for r, n in enumerate(lengths) if n < LONG_ROW]
    if short:
        passes.append((short[0], len(lengths), max(lengths[r] for r in short)))
    return passes


def sharing_pays(model, shared_rows, repeated_rows) -> bool:
    """Whether a micro-batch costs less with its prompts shared under an explicit mask
    than with them repeated, in the model's floating-point operations.

    `shared_rows` and `repeated_rows`: each packing's rows as (tokens, sequences, masked)
    triples. A row's linear layers cost its tokens; its attention costs the pairs the
    kernel computes: every pair of a masked row (a shared prompt, or several sequences
    under sdpa), half of them for one sequence alone (causal).
    """
    return _cost(model, shared_rows) < _cost(model, repeated_rows)


def _cost(model, rows) -> float:
    config = model.config
    if hasattr(config, "get_text_config"):  # a vision-language model's: its language model
        config = config.get_text_config()
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", heads) * head_dim
    inner = getattr(config, "intermediate_size", 4 * hidden)
    linear = 2 * (2 * hidden * heads * head_dim + 2 * hidden * kv + 3 * hidden * inner)
    pair = 4 * heads * head_dim  # q.k and the weighted sum of v, per (query, key)
    total = 0.0
    for tokens, sequences, masked in rows:
        pairs = tokens * tokens if masked or sequences > 1 else tokens * (tokens + 1) / 2
        total += tokens * linear + pairs * pair
    return total
