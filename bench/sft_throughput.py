"""The --sft step beside the GRPO step on the same packed tokens, and beside TRL's
SFTTrainer on the same batch, in one run.

- ours, sft: the trainer's micro-batch loss with the SFT objective (the assistant
  tokens' cross-entropy through the same packing, shared prompts and chunked head).
- ours, grpo: the same call with the GRPO objective (advantages, logged logprobs).
- TRL SFTTrainer 1.16 `compute_loss`, on the same sequences with the same labels
  (-100 outside the assistant tokens), padded to the longest (its default collator)
  and padding-free (`padding_free=True`: one row, position ids restarting).

Every side is `loss + backward` on one batch with the same fresh LoRA (r8 on the
attention projections, B = 0: all four start from the base model, so the three SFT
losses printed must agree), float32 on the CPU.
The sides take turns, one repeat each per round, so a neighbour's load on a shared
machine falls on all of them alike; each side's time is its median. Throughput is the
batch's assistant (trained) tokens per second.

Workload: bench/grpo_step.py's (8 prompts x 8 completions, 64-token prompts, completion
lengths log-normal up to 251) on the tiny model.

    python bench/sft_throughput.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from grpo_step import workload  # noqa: E402

from overnight.config import TrainConfig  # noqa: E402
from overnight.models.tiny import build_tiny_model  # noqa: E402
from overnight.trainer.grpo.loss import LossConfig, token_weights  # noqa: E402
from overnight.trainer.grpo.policy import load_policy  # noqa: E402
from overnight.trainer.grpo.step import fresh_adapter, micro_batch_loss  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def ours(model, samples, objective: str):
    """Our micro-batch loss + backward, the whole batch as one micro-batch."""
    config = TrainConfig(sft=objective == "sft")
    loss_config = LossConfig.from_train_config(config)
    weights = token_weights([s.trained_tokens for s in samples], loss_config)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss, _, _ = micro_batch_loss(model, samples, weights, loss_config, config.share_prompts)
        loss.backward()
        return loss.item()

    return step


def trl_side(model_dir: Path, samples, padding_free: bool):
    """TRL's SFTTrainer.compute_loss + backward on the same sequences and labels."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    examples = [
        {
            "input_ids": s.tokens,
            "labels": [t if m else -100 for t, m in zip(s.tokens, s.trained, strict=True)],
        }
        for s in samples
    ]
    args = SFTConfig(
        output_dir=str(ROOT / ".cache" / "trl-sft-out"),
        per_device_train_batch_size=len(samples),
        report_to=[],
        use_cpu=True,
        bf16=False,  # float32, as ours (its default autocasts to bfloat16, also on a CPU)
        padding_free=padding_free,
        max_length=None,  # the workload's sequences are whole (at most 315 tokens)
        logging_steps=1000,
    )
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        args=args,
        train_dataset=Dataset.from_list(examples),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(
            r=8, lora_alpha=16, target_modules=list(TARGETS), task_type="CAUSAL_LM"
        ),  # fmt: skip
    )
    batch = trainer.data_collator(examples)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop we bypass

    def step() -> float:
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, dict(batch))
        loss.backward()
        return loss.item()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-dir", type=Path, default=ROOT / ".cache" / "tiny-model")
    args = parser.parse_args()
    torch.manual_seed(0)
    model_dir = build_tiny_model(args.model_dir)
    config = TrainConfig(lora_rank=8, lora_alpha=16, target_modules=TARGETS)
    model = fresh_adapter(load_policy(model_dir, trainable=True), config)
    model.train()
    samples = workload(model.config.vocab_size)
    trained = sum(s.trained_tokens for s in samples)
    sides = {
        "ours, sft": ours(model, samples, "sft"),
        "ours, grpo": ours(model, samples, "grpo"),
        "TRL SFTTrainer, padded": trl_side(model_dir, samples, padding_free=False),
        "TRL SFTTrainer, padding-free": trl_side(model_dir, samples, padding_free=True),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    losses = {name: step() for name, step in sides.items()}  # warm-up, and the losses
    for _ in range(args.repeats):
        for name, step in sides.items():
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    print(f"{len(samples)} sequences, {sum(len(s.tokens) for s in samples)} tokens, "
          f"{trained} trained (assistant) tokens; median of {args.repeats}, loss + backward")  # fmt: skip
    sft = statistics.median(times["ours, sft"])
    for name in sides:
        median = statistics.median(times[name])
        print(f"{name:30s} {median * 1000:8.1f} ms  {trained / median:7.0f} tokens/s  "
              f"loss {losses[name]:8.5f}  time / ours-sft {median / sft:5.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
