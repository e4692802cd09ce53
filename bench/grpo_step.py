"""A GRPO step on packed logged data, side by side with two references, in one run.

- plain: a forward and backward over the same packed tokens with the same adapter
  (cross-entropy over every position): the cost of touching those tokens at all.
- padded: the same GRPO step with each sequence padded to the longest in its batch,
  full logits at every position (what a padding trainer does).

Our step runs twice: with each group's prompt once per row (`share_prompts`, the
trainer's default) and with every rollout carrying its own copy.

Workload (the one the architecture notes measured TRL on): 8 prompts x 8 completions,
64-token prompts, completion lengths log-normal up to 251, LoRA r8 on the tiny model.

    python bench/grpo_step.py --repeats 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from overnight.config import TrainConfig  # noqa: E402
from overnight.models.tiny import build_tiny_model  # noqa: E402
from overnight.trainer.grpo.data import Sample, Turn, merge_turns  # noqa: E402
from overnight.trainer.grpo.loss import LossConfig, policy_loss, token_weights  # noqa: E402
from overnight.trainer.grpo.policy import load_policy, pack  # noqa: E402
from overnight.trainer.grpo.step import fresh_adapter, micro_batch_loss  # noqa: E402

# The shapes benchmarked: the architecture notes' TRL workload, and a night of the demo's
# agent on SmolLM2 (examples/sum_agent.py: 16 sums x 4 attempts, 36-token prompts,
# replies of 3-24 tokens, about 12 on average).
SHAPES = {
    "default": {"groups": 8, "size": 8, "prompt_len": 64, "mu": 3.8, "sigma": 0.8, "longest": 251},
    "night": {"groups": 16, "size": 4, "prompt_len": 36, "mu": 2.5, "sigma": 0.5, "longest": 24},
}


def workload(vocab: int, seed: int = 0, shape: str = "default") -> list[Sample]:
    rng = random.Random(seed)
    sh = SHAPES[shape]
    samples = []
    for g in range(sh["groups"]):
        prompt = [rng.randrange(3, vocab) for _ in range(sh["prompt_len"])]
        for k in range(sh["size"]):
            length = min(sh["longest"], max(3, int(rng.lognormvariate(sh["mu"], sh["sigma"]))))
            completion = [rng.randrange(3, vocab) for _ in range(length)]
            (s,) = merge_turns(f"{g}.{k}", str(g), [Turn(prompt, completion, [-5.0] * length)])
            samples.append(replace(s, advantage=rng.uniform(-1, 1)))
    return samples


def grpo_step(model, samples, config, share_prompts: bool = False) -> None:
    """The trainer's own micro-batch loss, the whole batch as one micro-batch."""
    loss_config = LossConfig.from_train_config(config)
    weights = token_weights([s.trained_tokens for s in samples], loss_config)
    loss, _, _ = micro_batch_loss(model, samples, weights, loss_config, share_prompts)
    loss.backward()


def shared_step(model, samples, config) -> None:
    grpo_step(model, samples, config, share_prompts=True)


def plain_step(model, samples, config) -> None:
    batch = pack(samples)
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    logits = out.logits[:, :-1].float()  # (B, L-1, V): every position of every row
    torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1)
    ).backward()


def padded_step(model, samples, config) -> None:
    loss_config = LossConfig.from_train_config(config)
    longest = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    attention = torch.zeros(len(samples), longest, dtype=torch.long)
    trained = torch.zeros(len(samples), longest, dtype=torch.bool)
    behaviour = torch.zeros(len(samples), longest)
    for i, s in enumerate(samples):
        ids[i, : len(s.tokens)] = torch.tensor(s.tokens)
        attention[i, : len(s.tokens)] = 1
        trained[i, : len(s.tokens)] = torch.tensor(s.trained)
        behaviour[i, : len(s.tokens)] = torch.tensor(s.behaviour_logprobs)
    logits = model(
        input_ids=ids, attention_mask=attention, use_cache=False
    ).logits.float()  # (B, L, V)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)  # (B, L-1)
    mask = trained[:, 1:]
    per_sequence = torch.tensor(token_weights([s.trained_tokens for s in samples], loss_config))
    weights = per_sequence[:, None].expand_as(mask)
    advantages = torch.tensor([s.advantage for s in samples])[:, None].expand_as(mask)
    loss, _ = policy_loss(
        logp[mask],
        behaviour[:, 1:][mask],
        advantages[mask],
        weights[mask],
        torch.ones(int(mask.sum()), dtype=torch.bool),
        loss_config,
    )
    loss.backward()


def timed(step, model, samples, config, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        step(model, samples, config)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-dir", type=Path, default=ROOT / ".cache" / "tiny-model")
    args = parser.parse_args()
    build_tiny_model(args.model_dir)
    config = TrainConfig(
        lora_rank=8, lora_alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")
    )
    model = fresh_adapter(load_policy(args.model_dir, trainable=True), config)
    samples = workload(model.config.vocab_size)
    tokens = sum(len(s.tokens) for s in samples)
    trained = sum(s.trained_tokens for s in samples)
    longest = max(len(s.tokens) for s in samples)
    print(
        f"{len(samples)} sequences, {tokens} tokens packed, {trained} trained, "
        f"{len(samples) * longest} when padded to {longest}; torch threads {torch.get_num_threads()}"
    )
    shared_tokens = pack(samples, share_prompts=True)["input_ids"].numel()
    print(f"with prompts shared: {shared_tokens} tokens in rows (padding included)")
    ours = timed(grpo_step, model, samples, config, args.repeats)
    shared = timed(shared_step, model, samples, config, args.repeats)
    plain = timed(plain_step, model, samples, config, args.repeats)
    padded = timed(padded_step, model, samples, config, args.repeats)
    print(f"GRPO step, packed:            {ours * 1000:8.1f} ms")
    print(f"GRPO step, prompts shared:    {shared * 1000:8.1f} ms")
    print(f"plain forward+backward:       {plain * 1000:8.1f} ms")
    print(f"GRPO step, padded:            {padded * 1000:8.1f} ms")
    print(f"shared / packed GRPO: {shared / ours:.3f}")
    print(
        f"packed GRPO / plain:  {ours / plain:.3f}   target <= 1.15: {'PASS' if ours / plain <= 1.15 else 'FAIL'}"
    )
    print(
        f"padded / packed GRPO: {padded / ours:.3f}   target >= 1.5:  {'PASS' if padded / ours >= 1.5 else 'FAIL'}"
    )


if __name__ == "__main__":
    main()
