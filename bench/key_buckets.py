"""A key's rate bucket shared by the workers (proxy/routes/key_buckets.py: an mmap'd file,
an flock per update) against the per-process one it replaces, per request taken.

Microseconds per `bucket.take()` of a key, in one process (no contention), then with a second
process taking from the same bucket in a loop at the same time (both workers of a busy
key). The whole request path costs about 1 ms here (BENCHMARKS.md, proxy overhead), so
the difference is what matters, not the absolute numbers.

    python bench/key_buckets.py                 # 200,000 takes each, a few seconds
    python bench/key_buckets.py --takes 1000000
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from overnight.config import ProxyConfig  # noqa: E402
from overnight.config.keys import key_digest  # noqa: E402
from overnight.proxy.routes.key_buckets import BUCKETS_ENV, make_file  # noqa: E402
from overnight.proxy.routes.keys import KeyRing  # noqa: E402

# A rate it never reaches: every take succeeds, as on a key's ordinary day.
TABLE = (
    f'[[key]]\nname = "bench"\nsha256 = "{key_digest("sk-bench")}"\nrate = 1e9\nburst = 1000000\n'
)


def per_take_us(config: ProxyConfig, takes: int) -> float:
    key = KeyRing(config).live[0]
    start = time.perf_counter()
    for _ in range(takes):
        key.bucket.take()
    return (time.perf_counter() - start) / takes * 1e6


def _hammer(config: ProxyConfig, stop) -> None:
    key = KeyRing(config).live[0]
    while not stop.is_set():
        key.bucket.take()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--takes", type=int, default=200_000)
    args = parser.parse_args()
    config = ProxyConfig(upstream="http://x", data_dir=Path("/tmp"), keys_toml=TABLE, workers=2)
    path = make_file(config)
    try:
        local = per_take_us(dataclasses.replace(config, workers=1), args.takes)
        shared = per_take_us(config, args.takes)
        context = multiprocessing.get_context("spawn")  # as the supervisor starts workers
        stop = context.Event()
        other = context.Process(target=_hammer, args=(config, stop))
        other.start()
        time.sleep(1.0)  # the other process imported and taking
        contended = per_take_us(config, args.takes)
        stop.set()
        other.join()
    finally:
        path.unlink(missing_ok=True)
        os.environ.pop(BUCKETS_ENV, None)
    print(f"per-process bucket:           {local:6.2f} us per take")
    print(f"shared bucket (mmap + flock): {shared:6.2f} us per take")
    print(f"shared, another process too:  {contended:6.2f} us per take")


if __name__ == "__main__":
    main()
