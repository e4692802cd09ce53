"""vLLM's LoRA on a CPU, its own ops against ours (proxy/launch/vllm_cpu_lora.py), side by
side in one run on SmolLM2-135M-Instruct: how long a batch takes on the base model and on
an adapter, and whether a base-model request batched beside two adapters' answers as it
does alone.

    python bench/vllm_cpu_lora.py [--requests 64] [--tokens 48] [--rounds 2]

Each side starts its own vLLM (float32, LoRA rank 8, two adapters at a time, as the demo
serves), the plugin off (`OVERNIGHT_VLLM_CPU_LORA=0`) or on; the two adapters are rank-8
LoRA on q/k/v/o with random weights (the speed does not depend on what they learned).
Run it alone: two cores are all the machine has.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smollm2_vllm import clock, prepared_model  # noqa: E402

from overnight.proxy.launch.vllm_cpu import CPU_LORA_ENV  # noqa: E402

PROMPT = "What is {a} + {b}? Reply with the sum alone."


def random_adapter(model: Path, seed: int, out: Path) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    get_peft_model(base, config).save_pretrained(out)
    return out


async def ask(client: httpx.AsyncClient, url: str, model: str, i: int, tokens: int, greedy=False):
    body = {"model": model, "max_tokens": tokens, "seed": i, "ignore_eos": not greedy,
            "temperature": 0 if greedy else 0.8, "logprobs": greedy,
            "messages": [{"role": "user", "content": PROMPT.format(a=i % 9, b=i * 7 % 9)}]}  # fmt: skip
    r = await client.post(url + "/v1/chat/completions", json=body, timeout=900)
    r.raise_for_status()
    return r.json()["choices"][0]


async def timed(url: str, model: str, n: int, tokens: int) -> float:
    async with httpx.AsyncClient() as client:
        started = time.perf_counter()
        await asyncio.gather(*(ask(client, url, model, i, tokens) for i in range(n)))
        return time.perf_counter() - started


async def mixed(url: str) -> bool:
    """A greedy base-model answer alone, then batched beside both adapters': the same?"""
    async with httpx.AsyncClient() as client:
        alone = await ask(client, url, "smollm2", 3, 24, greedy=True)
        batch = await asyncio.gather(*(ask(client, url, m, 3, 24, greedy=True)
                                       for m in ("a", "b", "smollm2", "a")))  # fmt: skip
    return batch[2]["message"]["content"] == alone["message"]["content"]


def side(model: Path, adapters: dict[str, Path], plugin: bool, args, work: Path, say) -> dict:
    from overnight.proxy.launch.launcher import VLLMConfig, VLLMProcess

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env = {CPU_LORA_ENV: "1" if plugin else "0"}
    vllm = VLLMProcess(VLLMConfig(model=str(model), served_model_name="smollm2", max_lora_rank=8,
                                  max_loras=2, log_path=work / f"vllm-{int(plugin)}.log",
                                  extra_args=("--dtype", "float32", "--max-model-len", "1024")),
                       env=env)  # fmt: skip
    say(f"{'ours' if plugin else 'vLLM'}: starting vLLM")
    vllm.start()
    try:
        vllm.wait_healthy()
        for name, path in adapters.items():
            httpx.post(vllm.url + "/v1/load_lora_adapter", timeout=120,
                       json={"lora_name": name, "lora_path": str(path)}).raise_for_status()  # fmt: skip
        asyncio.run(timed(vllm.url, "a", 4, 4))  # warm both paths once
        out: dict[str, list[float]] = {}
        for r in range(args.rounds):
            for model_name in ("smollm2", "a"):
                for n in (1, args.requests):
                    t = asyncio.run(timed(vllm.url, model_name, n, args.tokens))
                    out.setdefault(f"{model_name} n={n}", []).append(t)
                    say(
                        f"{'ours' if plugin else 'vLLM'} round {r + 1}: {model_name} x{n}: {t:.1f} s"
                    )
        same = asyncio.run(mixed(vllm.url))
        return {"times": {k: statistics.median(v) for k, v in out.items()}, "same": same}
    finally:
        vllm.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    say = clock()
    model = prepared_model(say)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        adapters = {n: random_adapter(model, seed, work / n) for n, seed in (("a", 1), ("b", 2))}
        theirs = side(model, adapters, False, args, work, say)
        ours = side(model, adapters, True, args, work, say)
    n = args.requests
    print(f"\n{n} chat requests of {args.tokens} tokens at once (and 1), medians of "
          f"{args.rounds} rounds, seconds:\n")  # fmt: skip
    print("| | vLLM's ops | ours | ours/vLLM's |\n|---|---|---|---|")
    for key in theirs["times"]:
        a, b = theirs["times"][key], ours["times"][key]
        model_name, count = key.split()
        what = "base model" if model_name == "smollm2" else "an adapter"
        print(f"| {what}, {count} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    for label, result in (("vLLM's ops", theirs), ("ours", ours)):
        t = result["times"]
        print(f"{label}: an adapter's batch of {n} takes {t[f'a n={n}'] / t[f'smollm2 n={n}']:.2f}x "
              f"the base model's; a base-model request beside two adapters answers as alone: "
              f"{'yes' if result['same'] else 'NO'}")  # fmt: skip


if __name__ == "__main__":
    main()
