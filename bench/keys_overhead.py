"""Scoped keys' cost, side by side in one run: one policy and one plain key, against three
policies and scoped keys (issue 27: goal within 5%).

Both proxies front the same fake vLLM in its own process and take the same traffic in
turn each round: a plain agent's whole chat completion (bench/proxy_overhead.py's common
path and machinery: wrk, the proxy pinned to core 0, wrk and the fake on core 1). The
scoped proxy serves `policy`, `research` and `eval` from a keys file of three hashed keys,
one per policy, and per-policy admin tokens; the agent's key is limited to `policy` and
the group prefix `bench`, with a rate and a concurrency cap it never reaches, so every
request pays for the hash, the scope checks, the bucket and the rollout's memory. A third
proxy, one policy with a scoped key, splits the keys' cost from the policies'.

    python bench/keys_overhead.py                        # 5 rounds of 3 s, about 2 minutes
    python bench/keys_overhead.py --rounds 9 --duration 5
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from proxy_overhead import API_KEY, MESSAGES, median, pinned, start, stop, wrk  # noqa: E402

from overnight.config.keys import key_digest  # noqa: E402
from overnight.proxy.launch.launcher import free_port  # noqa: E402
from overnight.testing.processes import spawn_serve  # noqa: E402

POLICIES = ("policy", "research", "eval")


def keys_file(path: Path, policies: tuple[str, ...]) -> Path:
    """A scoped key per policy (the agent's is the benchmark's API_KEY) and an admin token
    each."""
    tables = []
    for i, policy in enumerate(policies):
        key = API_KEY if policy == "policy" else f"sk-bench-{policy}-{i:032d}"
        tables.append(
            f'[[key]]\nname = "{policy}-agent"\nsha256 = "{key_digest(key)}"\n'
            f'policies = ["{policy}"]\ngroup_prefixes = ["bench"]\n'
            "rate = 1000000.0\nburst = 1000000\nconcurrency = 1024\n"
        )
        admin = key_digest(f"adm-bench-{policy}")
        tables.append(
            f'[[admin]]\nname = "{policy}-ops"\npolicy = "{policy}"\nsha256 = "{admin}"\n'
        )
    path.write_text("\n".join(tables))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    stops = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-keys-") as tmp:
            results = run(args, Path(tmp), stops)
    finally:
        for stopper in reversed(stops):
            stopper()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def run(args, work: Path, stops: list) -> dict:
    port = free_port()
    fake = [sys.executable, "-m", "overnight.testing.fake_upstream", "--port", str(port)]
    upstream = f"http://127.0.0.1:{port}"
    proc = start(pinned(1, [*fake, "--tokens", str(args.tokens)]), upstream + "/health")
    stops.append(lambda: stop(proc))
    others = [flag for p in POLICIES[1:] for flag in ("--policy", p)]
    one, three = (
        keys_file(work / "one.toml", POLICIES[:1]),
        keys_file(work / "three.toml", POLICIES),
    )
    variants = {  # the first is the baseline; the second splits the keys' cost from the policies'
        "one policy, one key": ("--api-key", API_KEY),
        "one policy, scoped key": ("--keys-file", str(one)),
        "3 policies, scoped keys": (*others, "--keys-file", str(three)),
    }
    targets = {}
    for i, (name, flags) in enumerate(variants.items()):
        proxy = spawn_serve(work / f"v{i}", "--upstream", upstream, *flags, prefix=pinned(0, []))
        stops.append(proxy.stop)
        targets[name] = proxy.url
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": args.tokens}
    for url in targets.values():  # warm up
        wrk(f"{url}/v1/chat/completions", body, 16, 2, work)
    base = next(iter(variants))
    rounds = []
    for i in range(args.rounds):
        row = {
            f"c{c}/{name}": wrk(f"{url}/v1/chat/completions", body, c, args.duration, work)
            for c in (1, 16)
            for name, url in targets.items()
        }
        rounds.append(row)
        ratios = ", ".join(
            f"{name} {row[f'c16/{name}'].rps / row[f'c16/{base}'].rps:.3f}x" for name in variants
        )
        line = ", ".join(f"{k} {r.rps:.0f} req/s p50 {r.p50_ms:.3f} ms" for k, r in row.items())
        print(f"round {i + 1}: {line}; c16 against {base}: {ratios}", flush=True)
    summary = {}
    for name in targets:
        summary[f"c16 req/s {name}"] = median([r[f"c16/{name}"].rps for r in rounds])
        summary[f"c1 p50 {name} (ms)"] = median([r[f"c1/{name}"].p50_ms for r in rounds])
    for name in list(variants)[1:]:
        summary[f"c16 {name} / one key (per round, median)"] = median(
            [r[f"c16/{name}"].rps / r[f"c16/{base}"].rps for r in rounds]
        )
        summary[f"c1 p50 {name} - one key (median, ms)"] = median(
            [r[f"c1/{name}"].p50_ms - r[f"c1/{base}"].p50_ms for r in rounds]
        )
    print()
    for name, value in summary.items():
        print(f"{name:<56}{value:>10.3f}")
    errors = sum(r.errors for row in rounds for r in row.values())
    print(f"{'failed requests':<56}{errors:>10}")
    return {
        "rounds": [{k: v.__dict__ for k, v in row.items()} for row in rounds],
        "summary": summary,
        "errors": errors,
    }


if __name__ == "__main__":
    main()
