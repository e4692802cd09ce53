"""What a client can make the proxy hold or do, two versions side by side (issue 25).

    python bench/store_limits.py --base 60dba28 --head WORKTREE
    python bench/store_limits.py --base 60dba28 --head WORKTREE --rows 400000 --big 3000

1. **Chains in memory.** Each version's own `ResponseChains`, in a process of its own,
   remembers `--chains` Responses chains with 100 KB inputs (what 50,000 such requests
   leave behind); its resident memory after, and the chains it kept.
2. **Unknown `previous_response_id`s.** Each version's `overnight serve --upstream` (on
   core 0, the fake vLLM and this client on core 1) over a copy of one store of `--rows`
   Responses records (written by the head tree's storage: its compaction writes the
   index of Responses ids; the base ignores it). Ordinary chat traffic at concurrency 4
   throughout; `--unknown` Responses requests continuing nothing (the control: what any
   such requests cost the chat), then as many naming a previous response that exists
   nowhere, one after another, then `--known` for ids that are in the store but not in
   memory. Each such request's latency (the fake, like vLLM, answers an unknown id 404),
   the chat p50/p99 in each phase, and the proxy's memory before and after. Last,
   `--big` Responses requests with 100 KB inputs through the proxy (concurrency 4), each
   the start of a chain: the proxy's memory after them is what its chains hold with the
   rest of it (the store's lookups, the log's buffers).

Trees and processes as bench/versions.py (its helpers are used here): each version
runs from its own unpacked tree, and this script imports nothing from either.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import versions as v  # noqa: E402

CHAINS = """
import json, sys
from overnight.proxy.capture.conversation import ResponseChains
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
chains, start = ResponseChains(), rss()
for i in range(int(sys.argv[1])):
    text = "x" * 100_000 + str(i)
    chains.remember(f"resp_{i}", [{"role": "user", "content": text},
                                  {"role": "assistant", "content": "ok"}])
print(json.dumps({"rss_start_mb": start, "rss_end_mb": rss(), "kept": len(chains.chains),
                  "bound_mb": getattr(chains, "max_bytes", 0) / 2**20}))
"""

# Written with the head tree's storage: Responses records over four past days, compacted
# (the index with them) and merged as a long-running store would be.
STORE = """
import sys, time
from pathlib import Path
from overnight.storage import SCHEMA_VERSION, LogWriter, WriterConfig
from overnight.storage.upkeep.merge import merge_closed_days
data, rows = Path(sys.argv[1]), int(sys.argv[2])
writer = LogWriter(WriterConfig(data, commit_interval=0.5, compact_in_process=True))
writer.start()
now = time.time_ns() // 1000 - 86_400_000_000
for i in range(rows):
    at = now - (i % 4) * 86_400_000_000 - i
    reply = {"role": "assistant", "content": f"answer {i} " + "y" * 200}
    writer.append("completions", {
        "record_id": f"rec{i}", "request_id": f"req{i}", "schema_version": SCHEMA_VERSION,
        "started_at": at, "ended_at": at, "group_id": f"g{i // 8}", "rollout_id": f"r{i}",
        "turn_index": 0, "choice_index": 0, "endpoint": "responses", "logged": True,
        "http_status": 200,
        "request": {"messages": [{"role": "user", "content": f"question {i} " + "x" * 300}]},
        "response": {"id": f"resp_{i:08d}", "choices": [{"index": 0, "message": reply}]}})
writer.close()
merge_closed_days(data, now=time.time() + 86_400)
"""


def chains_part(versions: list[v.Version], count: int) -> dict:
    out = {}
    for version in versions:
        done = subprocess.run([sys.executable, "-c", CHAINS, str(count)], cwd=version.tree,
                              env=version.env(), capture_output=True, text=True, check=True)  # fmt: skip
        out[version.label] = json.loads(done.stdout)
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def traffic(url: str, pid: int, args) -> dict:
    """Chat at concurrency 4 throughout; the previous-id requests one after another."""
    import aiohttp

    chat = {"model": "policy", "messages": v.MESSAGES, "max_tokens": 12}
    stop, phase = asyncio.Event(), ["warm"]
    lat: dict[str, list[float]] = {k: [] for k in ("warm", "before", "plain", "unknown", "known")}

    async def chatter(session):
        while not stop.is_set():
            t = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", json=chat) as r:
                await r.read()
            lat[phase[0]].append((time.perf_counter() - t) * 1e3)

    async def previous(session, ids: list[str | None]) -> list[tuple[float, int]]:
        out = []
        for rid in ids:
            body = {"model": "policy", "input": "Go on.", "previous_response_id": rid}
            if rid is None:  # the control: as many Responses requests, none continuing
                del body["previous_response_id"]
            t = time.perf_counter()
            async with session.post(url + "/v1/responses", json=body) as r:
                await r.read()
                out.append(((time.perf_counter() - t) * 1e3, r.status))
        return out

    async with aiohttp.ClientSession() as session:
        workers = [asyncio.create_task(chatter(session)) for _ in range(4)]
        await asyncio.sleep(2)
        phase[0] = "before"
        await asyncio.sleep(args.window)
        phase[0] = "plain"
        plain = await previous(session, [None] * args.unknown)
        cold = await previous(session, ["resp_nowhere_first"])  # the index read, once
        phase[0] = "unknown"
        unknown = await previous(session, [f"resp_nowhere_{k}" for k in range(args.unknown)])
        phase[0] = "known"
        known = await previous(session, [f"resp_{k * 997:08d}" for k in range(args.known)])
        stop.set()
        await asyncio.gather(*workers)
        rss = [rss_mb(pid)]
        big = await asyncio.gather(*(lane(session, url, args.big // 4) for _ in range(4)))
        rss.append(rss_mb(pid))
    return {"plain": plain, "cold": cold, "unknown": unknown, "known": known, "chat": lat,
            "rss_big_mb": rss, "big_statuses": sorted({s for b in big for s in b})}  # fmt: skip


async def lane(session, url: str, n: int) -> set[int]:
    """`n` Responses requests with 100 KB inputs, each the start of a chain."""
    statuses = set()
    for k in range(n):
        body = {"model": "policy", "input": f"{k} " + "x" * 100_000}
        async with session.post(url + "/v1/responses", json=body) as r:
            await r.read()
            statuses.add(r.status)
    return statuses


def proxy_part(versions: list[v.Version], store: Path, work: Path, args, stops: list) -> dict:
    head = next(x for x in versions if x.label == "head")
    fake_cmd = [sys.executable, "-m", "overnight.testing.fake_upstream", "--port", "{port}"]
    fake = v.start(v.pinned(1, fake_cmd), head, work / "fake.log", stops)
    out = {}
    for version in versions:
        data = work / f"data-{version.label}"
        shutil.copytree(store, data)
        cmd = [sys.executable, "-m", "overnight.cli", "serve", "--upstream", fake.url,
               "--data", str(data), "--port", "{port}", "--log-level", "WARNING"]  # fmt: skip
        proxy = v.start(v.pinned(0, cmd), version, work / f"{version.label}.log", stops)
        before = rss_mb(proxy.process.pid)
        ran = asyncio.run(traffic(proxy.url, proxy.process.pid, args))
        ran["rss_mb"] = (before, rss_mb(proxy.process.pid))
        proxy.stop()
        out[version.label] = ran
    fake.stop()
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def report(chains: dict, proxies: dict, args) -> None:
    print(f"\n1. {args.chains} Responses chains with 100 KB inputs, remembered")
    print(f"   {'':<6}{'RSS before':>12}{'RSS after':>12}{'chains kept':>13}{'bound':>9}")
    for label, r in chains.items():
        bound = f"{r['bound_mb']:>7.0f}MB" if r.get("bound_mb") else f"{'count':>9}"
        print(f"   {label:<6}{r['rss_start_mb']:>10.0f}MB{r['rss_end_mb']:>10.0f}MB{r['kept']:>13}"
              f"{bound}")  # fmt: skip
    ratio = chains["head"]["rss_end_mb"] / chains["base"]["rss_end_mb"]
    print(f"   head/base RSS after: {ratio:.3f}")
    print(f"\n2. {args.rows} Responses records; {args.unknown} unknown and {args.known} "
          "known-but-not-in-memory previous_response_ids, chat at concurrency 4")  # fmt: skip
    print(f"   {'':<6}{'previous id':<12}{'p50':>9}{'max':>9}{'<50 ms':>8}"
          f"{'chat p50':>10}{'p99':>8}")  # fmt: skip
    for label, r in proxies.items():
        c = r["chat"]
        before = f"{pct(c['before'], 0.5):>8.1f}ms{pct(c['before'], 0.99):>6.1f}ms"
        print(f"   {label:<6}{'(none)':<12}{'':>26}{before}")
        for kind in ("plain", "unknown", "known"):
            ms = [m for m, _ in r[kind]]
            under = sum(m < 50 for m in ms)
            line = f"{statistics.median(ms):>7.1f}ms{max(ms):>7.0f}ms{under:>5}/{len(ms):<3}"
            line += f"{pct(c[kind], 0.5):>7.1f}ms{pct(c[kind], 0.99):>6.1f}ms"
            print(f"   {label:<6}{kind:<12}{line}")
        statuses = sorted({s for kind in ("unknown", "known") for _, s in r[kind]})
        print(f"   {label:<6}first lookup {r['cold'][0][0]:.0f} ms; statuses {statuses}; "
              f"RSS {r['rss_mb'][0]:.0f} -> {r['rss_mb'][1]:.0f} MB")  # fmt: skip
    print(f"\n3. {args.big} Responses requests with 100 KB inputs through the proxy")
    for label, r in proxies.items():
        before, after = r["rss_big_mb"]
        print(f"   {label:<6}RSS {before:.0f} -> {after:.0f} MB; statuses {r['big_statuses']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--head", default=v.WORKTREE)
    parser.add_argument("--chains", type=int, default=50_000)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--unknown", type=int, default=40)
    parser.add_argument("--known", type=int, default=10)
    parser.add_argument("--big", type=int, default=3000, help="100 KB requests (part 3).")
    parser.add_argument("--window", type=float, default=5.0, help="Seconds of chat before.")
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    args = parser.parse_args()
    v.CACHE.mkdir(parents=True, exist_ok=True)
    v.GUARD.parent.mkdir(parents=True, exist_ok=True)
    v.GUARD.write_text(v.GUARD_CODE)
    versions = [v.materialise("base", args.base), v.materialise("head", args.head)]
    for version in versions:
        v.check_imports(version)
    work = Path(tempfile.mkdtemp(prefix="store-limits-"))
    stops: list = []
    try:
        chains = chains_part(versions, args.chains)
        store = work / "store"
        head = versions[1]
        subprocess.run([sys.executable, "-c", STORE, str(store), str(args.rows)],
                       cwd=head.tree, env=head.env(), check=True)  # fmt: skip
        proxies = proxy_part(versions, store, work, args, stops)
    finally:
        for stop in reversed(stops):
            stop()
        shutil.rmtree(work, ignore_errors=True)
    report(chains, proxies, args)
    if args.json:
        args.json.write_text(json.dumps({"chains": chains, "proxies": proxies}, indent=1))


if __name__ == "__main__":
    main()
