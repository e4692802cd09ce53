"""vLLM's LoRA arithmetic on a CPU, made right and fast: a vLLM plugin, on only where our
launcher starts vLLM on a CPU.

vLLM 0.32 on a CPU applies LoRA with pure-PyTorch ops (vllm/lora/ops/torch_ops) that
gather one adapter matrix per token and multiply token by token:

- **Wrong for base-model requests batched beside an adapter's.** A token of no adapter
  has index -1, which the GPU kernels skip; the gather reads `weights[-1]`, the last
  adapter slot, so a base-model request that shares a batch with adapter requests gets
  that slot's adapter applied (vLLM pull request 48421, open). Here that is any client
  of the base model while an adapter serves, and a measurement that samples the base
  model through vLLM beside adapters (the gate samples in the trainer: not affected).
- **Slow.** The gather copies rank x width floats per token (47 MB an op for a
  2,560-token prefill of SmolLM2) and the per-token products run one by one: serving an
  adapter took twice the time of the base model (BENCHMARKS.md, "LoRA on vLLM's CPU").

The ops here do the same sums adapter by adapter: the rows of each adapter in the batch
times its matrix, in one matrix product (most batches hold one adapter), and rows of no
adapter get nothing. Same results up to the order of float sums.

vLLM loads `vllm.general_plugins` entry points in each of its processes; `register`
patches the CPU punica wrapper's names only when `ENV` is set (the launcher sets it for
the vLLM it starts on a CPU: a vLLM someone else starts is left alone) and only when the
ops are the ones it was written against (else it says why and leaves vLLM as it is).
"""

from __future__ import annotations

import inspect
import logging
import os

import torch

from .vllm_cpu import CPU_LORA_ENV as ENV

log = logging.getLogger("overnight.vllm_cpu_lora")


def per_adapter(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Row t of `inputs` times adapter `indices[t]`'s matrix in `weights` ([slots, (1,)
    out, in]); rows of index -1 (no adapter) are zero."""
    matrices = weights.squeeze(1) if weights.dim() == 4 else weights
    x = inputs.to(dtype)
    adapters = torch.unique(indices).tolist() if x.shape[0] else []
    if len(adapters) == 1 and adapters[0] >= 0:  # the usual batch: one adapter throughout
        return x @ matrices[adapters[0]].to(dtype).T
    out = x.new_zeros((x.shape[0], matrices.shape[1]))
    for adapter in adapters:
        if adapter < 0:
            continue
        rows = (indices == adapter).nonzero(as_tuple=True)[0]
        out.index_copy_(0, rows, x.index_select(0, rows) @ matrices[adapter].to(dtype).T)
    return out


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling=1.0):
    outputs = per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
    outputs = per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    # As vLLM's op: one row of output broadcast over a batch, and adapter and model may
    # pad their widths differently.
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    width = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :width] += outputs[:limit, :width]
    else:
        output_tensor[:, :width] = outputs[:limit, :width]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset,
                      slice_size, add_inputs=True):  # fmt: skip
    outputs = per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


def _each_token(lora_indices_tensor, seq_len_tensor):
    """A prefill's per-sequence adapter indices, one per token."""
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                lora_indices_tensor, batches, max_seq_length, token_nums, scaling):  # fmt: skip
    indices = _each_token(lora_indices_tensor, seq_len_tensor)
    bgmv_shrink(inputs, lora_a_weights, output_tensor, indices, scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                lora_indices_tensor, batches, max_seq_length, token_nums, add_inputs=False):  # fmt: skip
    indices = _each_token(lora_indices_tensor, seq_len_tensor)
    bgmv_expand(inputs, lora_b_weights, output_tensor, indices, add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                      lora_indices_tensor, batches, max_seq_length, token_nums, slice_offset,
                      slice_size, add_inputs=False):  # fmt: skip
    indices = _each_token(lora_indices_tensor, seq_len_tensor)
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, indices, slice_offset, slice_size,
                      add_inputs)  # fmt: skip


OPS = {f.__name__: f for f in (bgmv_shrink, bgmv_expand, bgmv_expand_slice, sgmv_shrink,
                                sgmv_expand, sgmv_expand_slice)}  # fmt: skip


def mismatches(module) -> list[str]:
    """The ops of `module` (vLLM's torch_ops) whose parameters are not those of ours that
    replace them (ours take vLLM 0.32's, name for name)."""
    return [name for name, ours in OPS.items() if getattr(module, name, None) is None
            or inspect.signature(getattr(module, name)).parameters.keys()
            != inspect.signature(ours).parameters.keys()]  # fmt: skip


def register() -> None:
    """vLLM's plugin hook (each of its processes calls it once or more)."""
    if os.environ.get(ENV) != "1":
        return
    try:
        from vllm.lora.ops import torch_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError as e:  # a vLLM without them has nothing to mend
        log.warning("%s: vLLM's CPU LoRA ops are not where expected (%s): left as they are",
                    ENV, e)  # fmt: skip
        return
    wrong = mismatches(torch_ops)
    if wrong:
        log.warning("%s: this vLLM's CPU LoRA ops differ from 0.32's (%s): left as they are",
                    ENV, ", ".join(wrong))  # fmt: skip
        return
    for name, op in OPS.items():
        setattr(punica_cpu, name, op)
