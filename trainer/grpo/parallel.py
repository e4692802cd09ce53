"""One process or many: where the model lives, and how processes agree on a step.

The training loop is the same code under `python`, `torchrun` and `accelerate launch`:
each process takes every world-th micro-batch of a step, and before the optimizer step
the gradients are summed over the processes (token weights are normalised over the
whole step, so the sum is exactly the step's gradient as one process computes it).

- data parallel (default): every process holds the whole model; gradients are summed
  with one all-reduce per parameter (the LoRA parameters are a few MB, so a bucketed
  DDP wrapper would buy nothing here).
- FSDP (`--fsdp`, or `accelerate launch --use_fsdp`): each decoder layer is sharded
  with torch's `fully_shard`, so a base model too big for one device fits across
  several; FSDP reduce-scatters the gradients itself (set to sum, not average). Every
  process must then run the same number of forward passes, so a process with fewer
  micro-batches in a step runs a zero-weighted one.

gloo on the CPU, nccl on GPUs; `torchrun`/`accelerate` set RANK, WORLD_SIZE, LOCAL_RANK.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def fsdp_requested() -> bool:
    """`accelerate launch --use_fsdp` says so in the environment."""
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")


@dataclass
class Parallel:
    rank: int = 0
    world: int = 1
    fsdp: bool = False
    device: str = "cpu"

    @classmethod
    def start(cls, fsdp: bool = False) -> Parallel:
        """Join the process group when launched as several processes."""
        import torch

        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
        if device != "cpu":
            torch.cuda.set_device(device)
        if world_size() <= 1:
            return cls(device=device)
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if device != "cpu" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), fsdp or fsdp_requested(), device)

    def finish(self) -> None:
        """Leave the process group before the interpreter exits. Without it gloo's worker
        threads are torn down at finalization, and a process can abort ("terminate called
        without an active exception", SIGABRT), failing a night that trained and saved."""
        if self.world <= 1:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def prepare(self, model):
        """The model on this process's device; sharded per decoder layer under FSDP."""
        model = model.to(self.device)
        if self.world > 1:
            self._weights_from_process_0(model)
        if not self.fsdp:
            return model
        from torch.distributed.fsdp import FSDPModule, fully_shard

        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        for layer in inner.model.layers:
            fully_shard(layer)
        # The decoder stack is the root (the trainer calls it, then the output
        # projection on the trained positions only); the frozen output projection
        # stays whole on every process: it has no gradient to reduce.
        fully_shard(inner.model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # Our token weights already divide by the whole step: sum, don't average
                # (with plain sums: gloo has no pre-multiplied reduction).
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        return model

    def _weights_from_process_0(self, model) -> None:
        """Every process starts from process 0's weights, as DDP's constructor does.

        Needed, not just tidy: under `accelerate launch --use_fsdp`, transformers loads
        the checkpoint on process 0 only (FSDP_CPU_RAM_EFFICIENT_LOADING) and leaves the
        other processes' weights empty, for the launcher to broadcast.
        """
        import itertools

        import torch.distributed as dist

        for tensor in itertools.chain(model.parameters(), model.buffers()):
            if tensor.is_meta:
                raise RuntimeError("weights on the meta device: load the model fully first")
            dist.broadcast(tensor.data, src=0)

    def micro_batch_share(self, batches: list) -> list[tuple[list, bool]]:
        """This process's micro-batches, as (batch, counts); padded to equal numbers
        under FSDP with zero-weighted repeats (counts=False), whose forward passes keep
        the processes' collectives in step."""
        mine = batches[self.rank :: self.world]
        share = [(b, True) for b in mine]
        if self.fsdp:
            most = -(-len(batches) // self.world)
            share += [(batches[0], False)] * (most - len(mine))
        return share

    def sum_gradients(self, params) -> None:
        """Data parallel: every process ends with the step's whole gradient."""
        if self.world == 1 or self.fsdp:  # FSDP has reduce-scattered already
            return
        import torch
        import torch.distributed as dist

        for p in params:
            if p.grad is None:  # a process with no micro-batch in this step
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)

    def gather_step(self, loss: float, stats: list[dict], max_gap: float):
        """The step's loss (summed), statistics (all processes') and largest logprob gap."""
        if self.world == 1:
            return loss, stats, max_gap
        import torch
        import torch.distributed as dist

        numbers = torch.tensor([loss, max_gap], dtype=torch.float64)
        dist.all_reduce(numbers[:1])
        dist.all_reduce(numbers[1:], op=dist.ReduceOp.MAX)
        gathered: list[list[dict]] = [[] for _ in range(self.world)]
        dist.all_gather_object(gathered, stats)
        return numbers[0].item(), [s for part in gathered for s in part], numbers[1].item()

    def agree(self, value):
        """Process 0's `value` on every process."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # -- state that must be whole on disk -------------------------------------------

    def adapter_state(self, model) -> dict:
        """The trainable (LoRA) parameters, whole, on the CPU: every process must call
        this under FSDP (it gathers the shards); the frozen base is never gathered."""
        state = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                state[name] = full.detach().cpu()
        return state

    def optimizer_state(self, model, optimizer) -> dict:
        if not self.fsdp:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(model, optimizer, options=options)

    def load_optimizer_state(self, model, optimizer, state: dict) -> None:
        if not self.fsdp:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        set_optimizer_state_dict(model, optimizer, state, options=options)

    def grad_norm(self, norm) -> float:
        """clip_grad_norm_'s result as a number (a DTensor under FSDP)."""
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
