"""Soak: mixed traffic through `overnight serve` for `--minutes`, clients leaving mid-stream.

`overnight serve --upstream` in front of the fake vLLM, both as processes; a closed loop
of `--concurrency` clients, each sending as fast as its last answer came (the highest
rate the machine sustains), a mix of
  45%  non-streaming chat completions
  35%  streams read to the end
  12%  streams the client leaves after the first chunk
   8%  streams whose client sends the request and closes without reading a byte
every request with its own `X-Rollout-Group` (its rollout id one of 500: the proxy's
turn counter keeps 100,000 rollouts by design, which would read as growth here). Every 5 s the proxy's open file descriptors
and resident memory are sampled. At the end the proxy is stopped (SIGTERM: it commits and
compacts) and the ids stored are compared with the ids sent.

Pass: 0 sent ids missing from the store, file descriptors flat (the last minute's max
within 10 of the first minute after warm-up), memory growth under 1 MiB/min after
warm-up (least-squares slope of RSS over time, warm-up the first quarter, at most 60 s).

    python bench/soak.py --minutes 10
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
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from overnight.storage import open_db  # noqa: E402
from overnight.testing.processes import spawn_fake_upstream, spawn_serve  # noqa: E402

MESSAGES = [{"role": "user", "content": "Count to ten, slowly."}]
MIX = (("whole", 0.45), ("stream", 0.35), ("leave", 0.12), ("never_read", 0.08))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Load:
    def __init__(self, url: str):
        self.url = url
        self.sent: set[str] = set()
        self.counts = {kind: 0 for kind, _ in MIX}
        self.failed = 0
        self.n = 0

    def next_id(self, kind: str) -> str:
        self.n += 1
        return f"soak-{kind}-{self.n}"

    async def one(self, session: aiohttp.ClientSession, kind: str) -> None:
        rollout = self.next_id(kind)
        body = {"model": "policy", "messages": MESSAGES, "max_tokens": 16}
        headers = {"X-Rollout-Group": rollout, "X-Rollout-Id": f"r{self.n % 500}"}
        if kind == "never_read":
            await self.never_read(rollout, body)
        else:
            if kind != "whole":
                body["stream"] = True
            if kind == "leave":  # still streaming when the client goes
                body["max_tokens"] = 64
                headers["X-Fake"] = "slow-chunks-0.005"
            async with session.post(
                f"{self.url}/v1/chat/completions", json=body, headers=headers
            ) as r:
                self.sent.add(rollout)
                if kind == "leave":
                    await r.content.readany()
                    r.close()  # hang up mid-stream
                else:
                    await r.read()
                    self.failed += r.status != 200
        self.counts[kind] += 1

    async def never_read(self, rollout: str, body: dict) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        data = json.dumps({**body, "stream": True}).encode()
        writer.write(
            (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nX-Rollout-Group: {rollout}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
            ).encode()
            + data
        )
        await writer.drain()
        self.sent.add(rollout)
        writer.close()

    async def worker(self, session: aiohttp.ClientSession, until: float) -> None:
        kinds, weights = zip(*MIX, strict=True)
        while time.monotonic() < until:
            try:
                await self.one(session, random.choices(kinds, weights)[0])
            except (aiohttp.ClientError, OSError):
                self.failed += 1


async def drive(url: str, seconds: float, concurrency: int, proxy_pid: int) -> tuple[Load, list]:
    load = Load(url)
    samples: list[tuple[float, int, float]] = []  # (seconds, fds, RSS MiB)
    start = time.monotonic()

    async def sample() -> None:
        while True:
            samples.append((time.monotonic() - start, open_fds(proxy_pid), rss_mib(proxy_pid)))
            t, fds, rss = samples[-1]
            print(
                f"{t:6.0f} s  {sum(load.counts.values()):8d} requests  fds {fds:4d}  RSS {rss:7.1f} MiB",
                flush=True,
            )
            await asyncio.sleep(5)

    sampler = asyncio.create_task(sample())
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(load.worker(session, start + seconds) for _ in range(concurrency)))
    await asyncio.sleep(2)  # the proxy notices the last hang-ups
    samples.append((time.monotonic() - start, open_fds(proxy_pid), rss_mib(proxy_pid)))
    sampler.cancel()
    return load, samples


def slope_mib_per_min(points: list[tuple[float, float]]) -> float:
    ts, ms = [t for t, _ in points], [m for _, m in points]
    mt, mm = statistics.mean(ts), statistics.mean(ms)
    var = sum((t - mt) ** 2 for t in ts)
    return 60 * sum((t - mt) * (m - mm) for t, m in zip(ts, ms, strict=True)) / var


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    seconds = args.minutes * 60
    work = Path(tempfile.mkdtemp())
    data_dir = work / "data"
    fake = spawn_fake_upstream("--tokens", "16")
    proxy = spawn_serve(data_dir, "--upstream", fake.url, "--roll-seconds", "60")
    try:
        load, samples = asyncio.run(drive(proxy.url, seconds, args.concurrency, proxy.pid))
    finally:
        code = proxy.stop()
        fake.stop()
    con = open_db(data_dir)
    try:
        stored = {r for (r,) in con.execute("SELECT DISTINCT group_id FROM completions").fetchall()}
        errors = dict(
            con.execute(
                "SELECT coalesce(error, 'none'), count(*) FROM completions GROUP BY 1 ORDER BY 2 DESC"
            ).fetchall()
        )
    finally:
        con.close()
    missing = load.sent - stored
    total = sum(load.counts.values())
    warm = min(60.0, seconds / 4)
    after = [(t, m) for t, _, m in samples if t >= warm]
    growth = slope_mib_per_min(after) if len(after) >= 3 else float("nan")
    fds_after = [f for t, f, _ in samples if t >= warm]
    first = max(fds_after[: max(1, len(fds_after) // 4)])
    last = max(fds_after[-max(1, len(fds_after) // 4) :])
    print(
        f"\n{total} requests in {args.minutes:g} min ({total / seconds:.0f}/s), concurrency {args.concurrency}"
    )
    print("  by kind: " + ", ".join(f"{k} {n}" for k, n in load.counts.items()))
    print(f"  client-side failures: {load.failed}; proxy exit code {code}")
    print(f"  sent {len(load.sent)}, stored {len(stored & load.sent)}, lost {len(missing)}")
    print(f"  recorded errors: {errors}")
    print(f"  fds after warm-up: first quarter max {first}, last quarter max {last}")
    print(
        f"  RSS {after[0][1]:.1f} -> {after[-1][1]:.1f} MiB after {warm:.0f} s warm-up; "
        f"slope {growth:+.2f} MiB/min"
    )
    ok = not missing and last - first <= 10 and growth < 1.0
    print(f"  {'PASS' if ok else 'FAIL'}: 0 lost, fds flat (within 10), growth < 1 MiB/min")
    if missing:
        print(f"  missing (first 10): {sorted(missing)[:10]}")


if __name__ == "__main__":
    main()
