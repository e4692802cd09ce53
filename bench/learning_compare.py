"""Does training on the sampled distribution change learning? Two versions, same demo.

    python bench/learning_compare.py --old 1a75e0a --new HEAD --runs 2
    python bench/learning_compare.py --what learning --runs 1   # tests/test_learning.py

"Old" is a commit from before the GRPO-fidelity work (vLLM logs raw logprobs, the
trainer uses the raw log-softmax); "new" logs vLLM's processed logprobs and computes the
same temperature/top-k/top-p distribution in the trainer. Each ref is laid out as an
importable tree by bench/versions.py (its processes import that tree's code only), and
each run is the unchanged command a user types, run from that tree:

    demo:     python -m overnight.cli demo --data D --model-dir M --port P
    learning: python -m pytest -q -s tests/test_learning.py

Runs alternate between the versions (old, new; new, old; ...) so that drift of the
shared machine hits both, one at a time (each starts its own vLLM). Every run's output
goes to .cache/learning-compare/<label>-<n>.log; the day-by-day mean rewards (the demo's
closing table, or the test's "mean reward by night" line) are printed side by side and,
with --json, written there.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import versions  # noqa: E402 -- bench/versions.py: the trees and their import guard

ROOT = versions.ROOT
WORK = ROOT / ".cache" / "learning-compare"
DAY_ROW = re.compile(r"^\s*(\d+)\s+(-?\d+\.\d+)\s+\S")
NIGHTS_LINE = re.compile(r"mean reward by night: (\[.*\])")
TIMEOUT_S = 3600


def demo_cmd(data: Path, model_dir: Path) -> list[str]:
    port = str(versions.free_port())
    cmd = ["-m", "overnight.cli", "demo", "--data", str(data), "--model-dir", str(model_dir)]
    return [sys.executable, *cmd, "--port", port]


def learning_cmd() -> list[str]:
    test = ["tests/test_learning.py", "-p", "no:cacheprovider", "-o", "timeout=3000"]
    return [sys.executable, "-m", "pytest", "-q", "-s", *test]


def rewards_of(what: str, output: str) -> list[float]:
    """The mean rewards by day (demo: its closing table; learning: the printed list)."""
    if what == "learning":
        found = NIGHTS_LINE.search(output)
        return list(ast.literal_eval(found.group(1))) if found else []
    table = output.split("day  mean reward", 1)[-1] if "day  mean reward" in output else ""
    return [float(m.group(2)) for line in table.splitlines() if (m := DAY_ROW.match(line))]


def gaps_of(output: str) -> list[float]:
    """The logprob_gap column of `overnight runs` (newest first), oldest night first."""
    lines = output.split("run_id ", 1)[-1].splitlines() if "run_id " in output else []
    header = ("run_id " + lines[0]).split() if lines else []
    if "logprob_gap" not in header:
        return []
    at = header.index("logprob_gap")
    rows = [line.split() for line in lines[1:] if line[:1].isdigit()]
    return [float(row[at]) for row in reversed(rows) if len(row) > at and row[at] != "-"]


def run_once(what: str, version: versions.Version, n: int, model_dir: Path) -> dict:
    name = f"{what}-{version.label}-{n}"
    data = WORK / name / "data"
    shutil.rmtree(data.parent, ignore_errors=True)
    data.parent.mkdir(parents=True)
    cmd = demo_cmd(data, model_dir) if what == "demo" else learning_cmd()
    # The tests find the tiny model through OVERNIGHT_TEST_CACHE; the demo is told.
    env = dict(version.env(), OVERNIGHT_TEST_CACHE=str(model_dir.parent))
    started = time.monotonic()
    log = WORK / f"{name}.log"
    with log.open("w") as out:
        done = subprocess.run(
            cmd,
            cwd=version.tree,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=TIMEOUT_S,
        )
    if what == "demo":  # each night's largest |policy - logged| logprob, as `overnight runs`
        runs = [sys.executable, "-m", "overnight.cli", "runs", "--data", str(data)]
        with log.open("a") as out:
            subprocess.run(runs, cwd=version.tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    output = log.read_text(errors="replace")
    result = {
        "version": version.label,
        "sha": version.sha,
        "run": n,
        "rc": done.returncode,
        "seconds": round(time.monotonic() - started),
        "rewards": rewards_of(what, output),
        "logprob_gaps": gaps_of(output),
        "log": str(log),
    }
    print(json.dumps(result), flush=True)
    return result


def table(results: list[dict]) -> str:
    """Markdown: one column per run, old runs first, then per-day means of each side."""
    runs = sorted(results, key=lambda r: (r["version"] != "old", r["run"]))
    days = max((len(r["rewards"]) for r in runs), default=0)
    head = "| day | " + " | ".join(f"{r['version']} #{r['run']}" for r in runs)
    head += " | old mean | new mean | new - old |"
    lines = [head, "|" + "---|" * (len(runs) + 4)]
    for d in range(days):
        cells = [f"{r['rewards'][d]:.3f}" if d < len(r["rewards"]) else "-" for r in runs]
        side = {}
        for label in ("old", "new"):
            got = [r["rewards"][d] for r in runs if r["version"] == label and d < len(r["rewards"])]
            side[label] = sum(got) / len(got) if got else None
        both = side["old"] is not None and side["new"] is not None
        diff = f"{side['new'] - side['old']:+.3f}" if both else "-"
        means = [f"{side[k]:.3f}" if side[k] is not None else "-" for k in ("old", "new")]
        lines.append(f"| {d + 1} | " + " | ".join(cells + means + [diff]) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="1a75e0a", help="git ref before the change")
    parser.add_argument("--new", default="HEAD", help=f"git ref or {versions.WORKTREE}")
    parser.add_argument("--what", choices=("demo", "learning"), default="demo")
    parser.add_argument("--runs", type=int, default=2, help="runs per version (alternating)")
    parser.add_argument("--only", choices=("old", "new"), help="run this version alone")
    parser.add_argument("--start", type=int, default=1, help="number of the first run")
    parser.add_argument("--model-dir", type=Path, default=ROOT / ".cache" / "tiny-model")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    versions.GUARD.parent.mkdir(parents=True, exist_ok=True)
    versions.GUARD.write_text(versions.GUARD_CODE)
    pair = [versions.materialise("old", args.old), versions.materialise("new", args.new)]
    for v in pair:
        print(f"{v.label}: {v.ref} = {v.sha}; {versions.check_imports(v)}", flush=True)
    WORK.mkdir(parents=True, exist_ok=True)
    # Built once, by the new tree (the recipe is the same in both); reused by every run.
    subprocess.run(
        [sys.executable, "-m", "overnight.cli", "tiny-model", str(args.model_dir)],
        cwd=pair[1].tree,
        env=pair[1].env(),
        check=True,
        stdout=subprocess.DEVNULL,
    )
    results = []
    for n in range(args.start, args.start + args.runs):
        for v in pair if n % 2 else pair[::-1]:
            if args.only and v.label != args.only:
                continue
            results.append(run_once(args.what, v, n, args.model_dir))
    print(table(results))
    if args.json:
        shas = {v.label: v.sha for v in pair}
        args.json.write_text(json.dumps({"what": args.what, "shas": shas, "runs": results}))


if __name__ == "__main__":
    main()
