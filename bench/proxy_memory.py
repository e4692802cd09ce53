"""The proxy's memory over a long run under load: does it stay flat?

`overnight serve --upstream` (pinned to core 0, logging on, the log rolled and
compacted every minute so that rolling is part of the run) in front of the fake vLLM,
with wrk at concurrency 16 for `--minutes`; the proxy's resident memory (its own
process, not the compaction child) is sampled every 5 s. Flat means the last minute's
mean within 10% of the second minute's (the first is warm-up: pools, caches, the
allocator's arenas).

    python bench/proxy_memory.py --minutes 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import proxy_overhead as po  # noqa: E402

from overnight.testing.processes import spawn_fake_upstream, spawn_serve  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    fake = spawn_fake_upstream(prefix=po.pinned(1, []))
    flags = ("--upstream", fake.url, "--api-key", po.API_KEY, "--roll-seconds", "60")
    proxy = spawn_serve(work / "data", *flags, prefix=po.pinned(0, []))
    body = {"model": "policy", "messages": po.MESSAGES, "max_tokens": 12}
    seconds = args.minutes * 60
    script = po.wrk_script(work / "post.lua", body)
    load = subprocess.Popen(
        po.pinned(1, ["wrk", "-t1", "-c16", f"-d{seconds:g}s", "-s", str(script)])
        + [proxy.url + "/v1/chat/completions"],
        stdout=subprocess.PIPE,
        text=True,
    )
    samples: list[tuple[float, float]] = []
    start = time.monotonic()
    try:
        while load.poll() is None:
            samples.append((time.monotonic() - start, rss_mb(proxy.pid)))
            print(f"{samples[-1][0]:6.0f} s  proxy RSS {samples[-1][1]:7.1f} MB", flush=True)
            time.sleep(5)
        out = load.stdout.read()
    finally:
        proxy.stop()
        fake.stop()
    rps = out.split("Requests/sec:")[1].split()[0]
    second = [m for t, m in samples if 60 <= t < 120]
    last = [m for t, m in samples if t >= seconds - 60]
    growth = statistics.mean(last) / statistics.mean(second) - 1
    print(
        f"{rps} requests/s for {args.minutes:g} min; RSS min {min(m for _, m in samples):.1f} "
        f"max {max(m for _, m in samples):.1f} MB"
    )
    print(
        f"last minute vs second minute: {growth * 100:+.1f}%   target within 10%: "
        f"{'PASS' if abs(growth) <= 0.10 else 'FAIL'}"
    )


if __name__ == "__main__":
    main()
