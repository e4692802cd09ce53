"""The trained tokens' logprobs from their hidden states, a chunk of tokens at a time.

The vocabulary projection of N trained tokens is an (N, V) tensor: 8192 tokens of a
152k vocabulary are 5 GB in float32, and autograd keeps several of them (the tempered
logits, the log-softmax, their gradients). Here the projection, vLLM's processing of
the logits (sampling.py) and the log-softmax run over `chunk` tokens at a time, in the
forward pass and again in the backward (recomputed from the (N, H) hidden states), so
what they take is a few (chunk, V) tensors whatever N is.

A plain linear head (every causal LM's, unless an adapter targets it) is written out
(`_ChunkedHead`): a chunk's processed logits become their softmax and then their
gradient (the target's one-hot minus the softmax, what autograd's log-softmax backward
computes) in place, one (chunk, V) float32 tensor at a time (4 bytes per token and
vocabulary entry; top-k, top-p and min-p add a few hundred MB: sampling.py sorts 128
rows at a time). Any other head (an adapted lm_head) runs each chunk under
torch.utils.checkpoint, which recomputes it the same way with autograd's own copies.
The values are the unchunked ones: the same float32 operations on the same rows.
"""

from __future__ import annotations

import torch

from .sampling import GREEDY_BELOW, processed_logits, processed_logprobs

Params = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # temperature, k, p, min-p


def chunked_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,  # (N, H) the hidden states that predict the trained tokens
    targets: torch.Tensor,  # (N,)
    params: Params,  # (N,) each
    chunk: int,
) -> torch.Tensor:
    """Logprob of each target under the processed distribution of `head(hidden)`: (N,)."""
    if type(head) is torch.nn.Linear:
        return _ChunkedHead.apply(hidden, head.weight, head.bias, targets, chunk, *params)
    parts = []
    for rows in _chunks(len(targets), chunk):
        args = (head, hidden[rows], targets[rows], *(p[rows] for p in params))
        if torch.is_grad_enabled():
            parts.append(torch.utils.checkpoint.checkpoint(_head_chunk, *args, use_reentrant=False))
        else:
            parts.append(_head_chunk(*args))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def _chunks(n: int, chunk: int) -> list[slice]:
    return [slice(start, min(start + chunk, n)) for start in range(0, n, chunk)]


def _head_chunk(head, hidden, targets, temperature, top_k, top_p, min_p) -> torch.Tensor:
    return processed_logprobs(head(hidden), targets, temperature, top_k, top_p, min_p)


def _logits(hidden, weight, bias, targets, params: Params) -> torch.Tensor:
    """A chunk's processed logits, float32 (chunk, V), as `processed_logprobs` makes them."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    return processed_logits(logits, targets, *params, in_place=True)


class _ChunkedHead(torch.autograd.Function):
    """A linear head's processed logprobs, a chunk of tokens at a time.

    A trained token's logprob depends on its own hidden state only, and with the head
    frozen (LoRA leaves it so) its gradient there, d logp / d h = (onehot - softmax) / T
    @ W, does not depend on the loss: the forward computes it while a chunk's logits
    exist, an (N, H) tensor like the hidden states it replaces, and the backward scales
    it by the loss's gradient, without projecting onto the vocabulary a second time. A
    trained head (its gradient sums over tokens with the loss's weights) recomputes each
    chunk in the backward instead.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, *params):
        head_trained = weight.requires_grad or (bias is not None and bias.requires_grad)
        ctx.local = hidden.requires_grad and not head_trained
        ctx.chunk, ctx.params = chunk, len(params)
        out = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)
        local = torch.empty_like(hidden) if ctx.local else None  # (N, H): d logp / d h
        for rows in _chunks(len(targets), chunk):
            ones = torch.ones(rows.stop - rows.start, device=hidden.device) if ctx.local else None
            logp, grad = _chunk(hidden[rows], weight, bias, targets[rows], params, rows, ones)
            out[rows] = logp
            if local is not None:
                local[rows] = grad @ weight
            del grad  # before the next chunk's logits: one (chunk, V) tensor at a time
        if ctx.local:
            ctx.save_for_backward(local)
        else:
            ctx.save_for_backward(hidden, weight, bias, targets, *params)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        none = (None,) * (2 + ctx.params)  # targets, chunk, the sampling parameters
        if ctx.local:
            (local,) = ctx.saved_tensors
            return (local * grad_out[:, None].to(local.dtype), None, None) + none
        hidden, weight, bias, targets, *params = ctx.saved_tensors
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        # Accumulated over the chunks in float32 (only when the head itself is trained).
        grad_weight = _zeros_like_f32(weight) if wants_weight else None
        grad_bias = _zeros_like_f32(bias) if wants_bias else None
        for rows in _chunks(len(targets), ctx.chunk):
            _, grad = _chunk(
                hidden[rows], weight, bias, targets[rows], params, rows, grad_out[rows]
            )
            if grad_hidden is not None:
                grad_hidden[rows] = grad @ weight
            if grad_weight is not None:
                grad_weight += grad.float().t() @ hidden[rows].float()
            if grad_bias is not None:
                grad_bias += grad.float().sum(0)
            del grad
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return (grad_hidden, grad_weight, grad_bias) + none


def _chunk(hidden, weight, bias, targets, params, rows: slice, grad_out):
    """One chunk: (its logprobs, and with `grad_out` the gradient of grad_out . logp with
    respect to the logits, in the weight's dtype, else None).

    The log-softmax is computed in place in the chunk's one (chunk, V) tensor: z - max,
    then its exponential, whose sum normalises it (what torch.log_softmax computes,
    without a second tensor).
    """
    chunk_params = tuple(p[rows] for p in params)
    z = _logits(hidden, weight, bias, targets, chunk_params)  # (chunk, V) float32
    target = z.gather(1, targets[:, None]).squeeze(1)
    top = z.amax(dim=-1, keepdim=True)
    z.sub_(top).exp_()  # dropped tokens: exp(-inf) = 0
    total = z.sum(dim=-1)
    out = target - top.squeeze(1) - total.log()
    if grad_out is None:
        return out, None
    # d logp_t / d z = onehot(t) - softmax(z), what log-softmax's backward computes.
    g = grad_out.float()
    grad = z.mul_((-g / total)[:, None])
    grad.scatter_add_(1, targets[:, None], g[:, None])
    grad.div_(chunk_params[0].clamp(min=GREEDY_BELOW)[:, None])  # z = logits / T
    return out, grad.to(weight.dtype)


def _zeros_like_f32(tensor: torch.Tensor) -> torch.Tensor:
    return torch.zeros(tensor.shape, dtype=torch.float32, device=tensor.device)
