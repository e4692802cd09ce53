"""Adapter swaps under load: 32 streaming clients through the proxy while it promotes.

`overnight serve --model` runs the tiny model on vLLM (CPU) behind the proxy. Every
client streams chat completions for the alias in a loop. First a steady phase, then
a phase with a promotion every few seconds (alternating two peft adapters, each
loaded under a new versioned name, the old one drained and unloaded). Compared in
one run: failed requests, p50/p99 latency steady vs during swaps, and whether every
record names an adapter that was being served.

    python bench/adapter_swap.py --clients 32 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from overnight.models.tiny import build_tiny_model  # noqa: E402
from overnight.storage import open_db  # noqa: E402
from overnight.testing.processes import serve_tiny  # noqa: E402

BODY = {
    "model": "policy",
    "stream": True,
    "max_tokens": 16,
    "temperature": 1.0,
    "messages": [{"role": "user", "content": "Tell me about the weather."}],
}


def make_adapters(model_dir: Path, out: Path, n: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(n):
        torch.manual_seed(100 + i)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft = get_peft_model(
            model,
            LoraConfig(
                r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
            ),
        )
        peft.save_pretrained(out / f"adapter-{i}")
        paths.append(out / f"adapter-{i}")
    return paths


async def client(session, url: str, stop: asyncio.Event, log: list) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        ok, why = False, ""
        try:
            async with session.post(url + "/v1/chat/completions", json=BODY) as r:
                text = await r.text()
                ok = (
                    r.status == 200
                    and text.rstrip().endswith("data: [DONE]")
                    and '"error"' not in text
                )
                why = "" if ok else f"HTTP {r.status}: {text[-200:]}"
        except (aiohttp.ClientError, TimeoutError) as e:
            why = repr(e)
        log.append((started, time.perf_counter() - started, ok, why))


async def load(
    url: str,
    clients: int,
    steady: float,
    swapping: float,
    adapters: list[Path],
    every: float,
    warmup: float = 10.0,
) -> dict:
    log: list = []
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        tasks = [asyncio.create_task(client(session, url, stop, log)) for _ in range(clients)]
        await asyncio.sleep(warmup)  # vLLM's first batches compile kernels: not steady state
        t0 = time.perf_counter()
        await asyncio.sleep(steady)
        swaps, t_swap = [], time.perf_counter()
        while time.perf_counter() - t_swap < swapping:
            path = adapters[len(swaps) % len(adapters)]
            async with session.post(url + "/admin/adapters/promote", json={"path": str(path)}) as r:
                swaps.append((time.perf_counter() - t0, r.status, (await r.json()).get("promoted")))
            await asyncio.sleep(every)
        stop.set()
        await asyncio.gather(*tasks)
    return {"log": log, "t0": t0, "t_swap": t_swap, "swaps": swaps}


def summarise(result: dict, data: Path) -> None:
    log, t_swap = result["log"], result["t_swap"]
    steady = [d for s, d, ok, _ in log if result["t0"] <= s < t_swap and ok]
    during = [d for s, d, ok, _ in log if s >= t_swap and ok]
    failures = [why for *_, ok, why in log if not ok]

    def p(values, q):
        return (
            statistics.quantiles(values, n=100)[q - 1] * 1000 if len(values) > 2 else float("nan")
        )

    print(
        f"\nswaps: {len(result['swaps'])}, all answered 200: {all(s[1] == 200 for s in result['swaps'])}"
    )
    print(
        f"requests: {len(log)} ({len(steady)} steady, {len(during)} during swaps); failed: {len(failures)}"
    )
    for why in failures[:5]:
        print(f"  failure: {why}")
    print(f"steady       p50 {p(steady, 50):7.1f} ms  p99 {p(steady, 99):7.1f} ms")
    print(f"during swaps p50 {p(during, 50):7.1f} ms  p99 {p(during, 99):7.1f} ms")
    ratio = p(during, 99) / p(steady, 99)
    print(f"p99 during / steady: {ratio:.3f}   target <= 1.2: {'PASS' if ratio <= 1.2 else 'FAIL'}")
    print(f"failed requests: {len(failures)}   target 0: {'PASS' if not failures else 'FAIL'}")
    con = open_db(data)
    served = con.execute(
        "SELECT model_served, count(*) FROM completions GROUP BY 1 ORDER BY 1"
    ).fetchall()
    unnamed = con.execute("SELECT count(*) FROM completions WHERE model_served IS NULL").fetchone()[
        0
    ]
    con.close()
    promoted = {s[2] for s in result["swaps"]}
    ok = unnamed == 0 and all(m == "tiny" or m in promoted for m, _ in served)
    print(f"records by adapter: {dict(served)}")
    print(f"every record names a served adapter: {'PASS' if ok else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--every", type=float, default=3.0, help="seconds between promotions")
    parser.add_argument("--model-dir", type=Path, default=ROOT / ".cache" / "tiny-model")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="overnight-swap-"))
    build_tiny_model(args.model_dir)
    adapters = make_adapters(args.model_dir, work, 2)
    with serve_tiny(args.model_dir, work / "data") as serve:
        result = asyncio.run(
            load(serve.url, args.clients, args.seconds, args.seconds, adapters, args.every)
        )
    summarise(result, work / "data")
    (work / "swaps.json").write_text(json.dumps(result["swaps"]))


if __name__ == "__main__":
    main()
