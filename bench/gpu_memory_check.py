"""The memory check's estimate against the measured peak of a training step (issue 22).

    python bench/gpu_memory_check.py                 # on a CUDA GPU: under ten minutes
    python bench/gpu_memory_check.py --device cpu --layers 2 --tokens 512   # a smoke run

A model with Qwen2.5-0.5B's shapes (vocabulary 151,936, hidden 896, 24 layers, 14 heads,
2 KV heads, MLP 4,864) is built with random weights on the device (nothing downloaded).
With `--hold F` a block of F of the GPU's memory is held first, as a sleeping-or-not
vLLM would hold it. Then, for each micro-batch size: the check's estimate
(trainer/run/memory.py), one GRPO optimizer step on packed random sequences of that
many tokens (a group of 4 with a shared prompt), and torch's peak allocation, side by
side with their ratio. The check is meant to be a little above the measured peak
(ratio 1.0-1.5): below it a night could pass the check and still fail.
Needs torch, transformers and peft; no vLLM.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

QWEN_05B = dict(vocab_size=151_936, hidden_size=896, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                tie_word_embeddings=True, max_position_embeddings=32768)  # fmt: skip


def build(directory: Path, layers: int, dtype):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**{**QWEN_05B, "num_hidden_layers": layers})
    config.save_pretrained(directory)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype), config


def samples(tokens: int, vocab: int):
    """A group of 4: one shared prompt of a quarter, four branches of the rest."""
    import random

    from overnight.trainer.grpo.data import Sample

    rng = random.Random(0)
    prompt_len = tokens // 8
    branch = (tokens - prompt_len) // 4
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    out = []
    for i in range(4):
        reply = [rng.randrange(vocab) for _ in range(branch)]
        out.append(Sample(f"r{i}", "g", prompt + reply, [False] * prompt_len + [True] * branch,
                          [0.0] * prompt_len + [-5.0] * branch, 1, advantage=(-1) ** i))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--hold", type=float, default=0.0, help="share of GPU memory held")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    from overnight.config import TrainConfig
    from overnight.trainer.grpo.loss import LossConfig
    from overnight.trainer.grpo.parallel import Parallel
    from overnight.trainer.grpo.step import fresh_adapter, optimizer_step
    from overnight.trainer.run.memory import GIB, estimate, free_memory

    on_gpu = args.device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    held = None
    if on_gpu and args.hold:
        free = free_memory(args.device)
        held = torch.empty(int(free * args.hold), dtype=torch.uint8, device=args.device)
        print(f"holding {held.numel() / GIB:.1f} GiB, as vLLM would")
    directory = Path(tempfile.mkdtemp(prefix="gpu-memory-"))
    model, model_config = build(directory, args.layers, dtype)
    rows = []
    for tokens in args.tokens:
        config = TrainConfig(micro_batch_tokens=tokens, lora_rank=16, groups_per_step=1)
        need = estimate(model_config, config, torch.finfo(dtype).bits // 8)
        policy = fresh_adapter(model, config).to(args.device)
        optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        started = time.perf_counter()
        optimizer_step(policy, optimizer, Parallel(device=args.device), samples(tokens, 151_936),
                       LossConfig.from_train_config(config), config)  # fmt: skip
        seconds = time.perf_counter() - started
        peak = (torch.cuda.max_memory_allocated() - before + need.weights) if on_gpu else None
        rows.append({"tokens": tokens, "estimate_gib": need.total / GIB,
                     "measured_gib": peak / GIB if peak else None, "seconds": seconds,
                     "parts": need.parts()})  # fmt: skip
        model = policy.unload()  # the base again, for the next size
        del policy, optimizer
        if on_gpu:
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if on_gpu else "cpu"
    print(f"\n{name}, Qwen2.5-0.5B shapes, {args.layers} layers, {dtype}")
    print("tokens  estimate GiB  measured peak GiB  estimate/measured  step s")
    for r in rows:
        measured = f"{r['measured_gib']:.2f}" if r["measured_gib"] else "-"
        ratio = f"{r['estimate_gib'] / r['measured_gib']:.2f}" if r["measured_gib"] else "-"
        print(f"{r['tokens']:6}  {r['estimate_gib']:12.2f}  {measured:>17}  {ratio:>17}  "
              f"{r['seconds']:6.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    del held


if __name__ == "__main__":
    main()
