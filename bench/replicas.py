"""Proxy throughput with 1 and 2 worker processes, and with 1, 2 and 4 upstream replicas,
side by side in one run.

Each scenario starts `overnight serve --upstream URL [--upstream URL ...] [--workers N]`
with logging on, in front of fake vLLMs (overnight.testing.fake_upstream, each its own
process, a fixed delay per answer), and drives it with wrk: JSON (non-streamed) chat
completions, each request its own rollout id, so the replicas share the load by hash.
The proxy's workers are pinned to core 0 (one worker) or cores 0-1 (two); wrk and the
fakes to core 1, as in bench/proxy_overhead.py. On a 2-core machine the second worker
shares its core with the load generator: the figure says what a second process buys
when the first is saturated, not what it buys on a bigger machine.

    python bench/replicas.py                       # about a minute
    python bench/replicas.py --duration 10 --connections 16 --delay 0.02
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from proxy_overhead import API_KEY, MESSAGES, Result, _ms  # noqa: E402

from overnight.testing.processes import spawn_fake_upstream, spawn_serve  # noqa: E402

SCENARIOS = [(1, 1), (2, 1), (1, 2), (1, 4)]  # (workers, replicas)

# wrk's request: a fresh rollout id each time (a counter per connection's thread).
SCRIPT = """
wrk.method = "POST"
wrk.body = [[{body}]]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
counter = 0
request = function()
  counter = counter + 1
  wrk.headers["X-Rollout-Id"] = "bench-" .. counter
  return wrk.format()
end
"""


def pinned(cores: str, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", cores, *cmd] if shutil.which("taskset") else cmd


def scenario(
    workers: int, replicas: int, args: argparse.Namespace, work: Path
) -> tuple[Result, int]:
    """Throughput of one shape, and the rows it recorded (every answered request)."""
    fakes = [
        spawn_fake_upstream("--delay", str(args.delay), "--tokens", "16", prefix=pinned("1", []))
        for _ in range(replicas)
    ]
    data = work / f"data-w{workers}-r{replicas}"
    flags = [f for fake in fakes for f in ("--upstream", fake.url)]
    flags += ["--workers", str(workers), "--api-key", API_KEY]
    try:
        with spawn_serve(data, *flags, prefix=pinned("0" if workers == 1 else "0-1", [])) as serve:
            body = {"model": "policy", "messages": MESSAGES, "max_tokens": 16}
            url = serve.url + "/v1/chat/completions"
            script = _script(work, body)
            run_wrk(url, script, 4, 1.0)  # warm up
            result = run_wrk(url, script, args.connections, args.duration)
    finally:
        for fake in fakes:
            fake.stop()
    return result, _count_rows(data)


def run_wrk(url: str, script: Path, connections: int, duration: float) -> Result:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--latency", "-s", str(script)]
    out = subprocess.run(pinned("1", [*cmd, url]), capture_output=True, text=True, check=True)
    text = out.stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", text, re.M).group(1))
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", text, re.M).group(1))
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    sockets = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text
    )
    errors = (int(bad.group(1)) if bad else 0) + (sum(map(int, sockets.groups())) if sockets else 0)
    return Result(rps, p50, p99, errors)


def _script(work: Path, body: dict) -> Path:
    path = work / "rollouts.lua"
    path.write_text(SCRIPT.format(body=json.dumps(body), key=API_KEY))
    return path


def _count_rows(data: Path) -> int:
    from overnight.storage import open_db

    con = open_db(data)
    try:
        return con.execute("SELECT count(*) FROM completions").fetchone()[0]
    finally:
        con.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per scenario")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--delay", type=float, default=0.0, help="fake vLLM's seconds per answer")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        for workers, replicas in SCENARIOS:
            result, recorded = scenario(workers, replicas, args, Path(tmp))
            rows.append((workers, replicas, result, recorded))
            print(f"workers={workers} replicas={replicas}: {result.rps:.0f} req/s", flush=True)
    print(f"\njson c{args.connections}, {args.duration:g} s each, fake delay {args.delay:g} s\n")
    print("| workers | replicas | req/s | p50 ms | p99 ms | errors | rows recorded |")
    print("|---|---|---|---|---|---|---|")
    for workers, replicas, r, recorded in rows:
        print(
            f"| {workers} | {replicas} | {r.rps:.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} "
            f"| {r.errors} | {recorded} |"
        )


if __name__ == "__main__":
    main()
