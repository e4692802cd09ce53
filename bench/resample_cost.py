"""The cost of resampling a turn against serving it, on vLLM (CPU) with the tiny model.

`overnight serve --model` runs the tiny model on vLLM behind the proxy. For each K, a
fresh batch of single-call turns is served through the proxy (distinct prompts, no
rollout headers, `--concurrency` at a time), then the nightly stage
(`trainer/choose/resample.py`: one /v1/completions call per turn with the logged prompt token
ids and n=K) asks for K siblings of each. Reported per K: wall seconds per turn served
and per turn resampled, their ratio, and generated tokens per second of each. A
sibling call prefills the context once for its K samples and decodes them in one batch,
so it costs less than K served turns.

    python bench/resample_cost.py --turns 32 --ks 1 4 8
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from overnight.config import TrainConfig  # noqa: E402
from overnight.storage import open_db  # noqa: E402
from overnight.testing.processes import serve_tiny  # noqa: E402
from overnight.trainer.choose.inputs import Selection  # noqa: E402
from overnight.trainer.choose.resample import resample_turns  # noqa: E402

SYSTEM = "You fill in numeric form fields. Reply with numbers only."


async def serve_batch(url: str, tag: str, turns: int, concurrency: int, max_tokens: int) -> float:
    """Serve `turns` distinct single calls through the proxy; their wall seconds."""
    limit = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        body = {
            "model": "policy",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Form {tag}-{i}: how many items?"},
            ],
            "max_tokens": max_tokens,
            "temperature": 1.0,
        }
        async with limit, session.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()

    async with aiohttp.ClientSession() as session:
        started = time.perf_counter()
        await asyncio.gather(*(one(session, i) for i in range(turns)))
        return time.perf_counter() - started


def served_tokens(data: Path, since: dt.datetime) -> int:
    con = open_db(data)
    try:
        row = con.execute(
            "SELECT sum(len(completion_token_ids)) FROM completions WHERE started_at >= ?",
            [since],
        ).fetchone()
    finally:
        con.close()
    return int(row[0] or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=32, help="turns served, then resampled, per K")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--concurrency", type=int, default=8, help="served turns in flight")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model-dir", type=Path, default=ROOT / ".cache" / "tiny-model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        server = serve_tiny(args.model_dir, data)
        try:
            asyncio.run(serve_batch(server.url, "warm", 8, args.concurrency, args.max_tokens))
            print(f"{args.turns} single-call turns per K, {args.max_tokens} max tokens, "
                  f"served {args.concurrency} at a time; resampled with n=K, 8 calls at a time")  # fmt: skip
            print(f"{'K':>3} {'served s/turn':>14} {'resampled s/turn':>17} {'ratio':>6} "
                  f"{'served tok/s':>13} {'resampled tok/s':>16}")  # fmt: skip
            for k in args.ks:
                since = dt.datetime.now(dt.UTC)
                serve_s = asyncio.run(
                    serve_batch(server.url, f"k{k}", args.turns, args.concurrency, args.max_tokens)
                )
                tokens = served_tokens(data, since)
                config = TrainConfig(resample=k, resample_max_turns=args.turns)
                done = resample_turns(Selection(data, settle_seconds=0.0, since=since), config,
                                      proxy_url=server.url, say=lambda _line: None)  # fmt: skip
                assert done.turns == args.turns and done.failed == done.unreached == 0, done.lines()
                per_served, per_resampled = serve_s / args.turns, done.seconds / args.turns
                print(
                    f"{k:>3} {per_served:>14.3f} {per_resampled:>17.3f} "
                    f"{per_resampled / per_served:>6.2f} {tokens / serve_s:>13.0f} "
                    f"{done.completion_tokens / done.seconds:>16.0f}"
                )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
