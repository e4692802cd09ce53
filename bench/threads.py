"""Torch threads when processes share the cores: why the suite gives each pytest-xdist
worker its share of the cores (tests/conftest.py) rather than torch's default of all.

    python bench/threads.py                 # a LoRA-sized matmul + backward loop
    python bench/threads.py --steps 6000

Three arrangements side by side, in one run: one process alone with torch's default
threads; as many processes as cores, each with the default (every process's OpenMP pool
as wide as the machine: the suite before); as many processes as cores, each with one
thread (the suite now). It prints each arrangement's wall time and its ratio to the
process alone; the work of the last two is the same, `cores` times the first's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

WORK = """
import sys, time, torch
steps = int(sys.argv[1])
torch.manual_seed(0)
x = torch.randn(64, 576)
w = torch.randn(576, 1536, requires_grad=True)
for _ in range(steps):
    (x @ w).relu().sum().backward()
"""


def run(processes: int, threads: int | None, steps: int) -> float:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    started = time.monotonic()
    running = [
        subprocess.Popen([sys.executable, "-c", WORK, str(steps)], env=env)
        for _ in range(processes)
    ]
    for p in running:
        if p.wait() != 0:
            raise SystemExit(f"a worker failed with {p.returncode}")
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    alone = run(1, None, args.steps)
    print(f"{cores} cores; {args.steps} steps of a 64x576 @ 576x1536 matmul and its backward")
    print(f"one process, default threads:        {alone:6.1f} s  1.00x")
    for label, threads in (("default threads", None), ("one thread each", 1)):
        took = run(cores, threads, args.steps)
        print(f"{cores} processes, {label + ':':<20} {took:6.1f} s  {took / alone:.2f}x "
              f"(the same work run one after another: {cores:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
