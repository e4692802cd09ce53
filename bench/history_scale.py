"""Read paths against history size: `overnight sql` count(*) over groups, `overnight ls`,
the nightly selection (`overnight train --dry-run`'s plan, with and without `--since`),
at 10k/100k/1M completion rows, before (a git ref, default f5b20ae) and after (this tree).

History is shaped like production: groups of 8 rollouts of 1-3 turns, 1.6 KB requests,
~300 prompt token ids and ~50 completion ids with logprobs per turn, a reward and a
finish per rollout (most groups' rewards all equal or one missing: 8% trainable), one
training run a day, and the default 5-minute roll: ~65 logs a day, each leaving one
segment per table (~195 files a day). Days are filled back from today, 2,740 rows a day
(1M rows: a year). The Parquet is written directly with pyarrow in the storage schema
(version 1 rows, as the old code wrote them; no fsync), which is much faster than the
writer's own log and compaction and gives the same files.

Each path runs in a fresh process; time is the call's wall clock, memory the process's
peak RSS. "before" reads the un-merged history with the old code; "after" reads it
with this tree's code after closed days are merged (storage/merge.py), which is what the
writer does after each roll. The growth exponent is log(t2/t1)/log(n2/n1) between sizes.

    python bench/history_scale.py --sizes 10000 100000 [1000000] [--before f5b20ae]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
ROWS_PER_DAY = 2740
LOGS_PER_DAY = 65
DAY_US = 86_400_000_000

# One measured path: Python run in a fresh process; it prints {"seconds": s}.
PATHS = {
    "count_groups": """
from overnight.storage import open_db
t = time.perf_counter()
con = open_db(DATA)
con.execute("SELECT count(*) FROM groups").fetchall()
""",
    "ls": """
from overnight.storage import open_db
from overnight.view.display import list_groups
t = time.perf_counter()
list_groups(open_db(DATA), None, 20)
""",
    "plan": """
from overnight.config import TrainConfig
from overnight.trainer.plan import plan_run
t = time.perf_counter()
plan = plan_run(Path(DATA), TrainConfig(), 600)
info = {"groups": len(plan.groups), "skipped": sum(plan.skipped.values())}
""",
    "plan_since_yesterday": """
import datetime as dt
from overnight.config import TrainConfig
from overnight.trainer.plan import plan_run
t = time.perf_counter()
since = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
plan = plan_run(Path(DATA), TrainConfig(), 600, since=since)
info = {"groups": len(plan.groups)}
""",
}
RUNNER = """
import json, resource, sys, time
from pathlib import Path
DATA = sys.argv[1]
info = {}
{body}
seconds = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"seconds": seconds, "rss_mb": rss, **info}}))
"""


def generate(data: Path, rows: int, seed: int = 0) -> None:
    """Write `rows` completion rows (and their rewards, finishes, training runs)."""
    from overnight.storage.schema import TABLES

    rng = np.random.default_rng(seed)
    words = np.array([f"w{i}" for i in range(2000)])
    pool = [" ".join(rng.choice(words, 300)) for _ in range(4000)]  # ~1.6 KB each
    days = max(1, math.ceil(rows / ROWS_PER_DAY))
    today0 = (time.time_ns() // 1000) // DAY_US * DAY_US
    left, n_group = rows, 0
    for d in range(days):
        day0 = today0 - (days - 1 - d) * DAY_US
        want = min(ROWS_PER_DAY, left)
        comp, rew, fin, varied = [], [], [], []
        while sum(len(c["record_id"]) for c in comp) < want:
            n_group += 1
            comp_g, rew_g, fin_g, trainable = one_group(rng, pool, n_group, day0, d == days - 1)
            comp.append(comp_g)
            rew += rew_g
            fin += fin_g
            if trainable:
                varied.append(f"g{n_group}")
        table = pa.concat_tables(pa.table(c) for c in comp)
        left -= table.num_rows
        write_day(data, "completions", table, TABLES["completions"])
        write_day(data, "rewards", pa.Table.from_pylist(rew), TABLES["rewards"])
        write_day(data, "finishes", pa.Table.from_pylist(fin), TABLES["finishes"])
        if d < days - 1:  # each night trained that day's varied groups
            run = {
                "run_id": f"run{d}",
                "schema_version": 1,
                "status": "trained",
                "started_at": day0 + DAY_US - 3_600_000_000,
                "groups": varied,
            }
            write_day(
                data, "training_runs", pa.Table.from_pylist([run]), TABLES["training_runs"], 1
            )


def one_group(rng, pool, n: int, day0: int, today: bool):
    # One piece on purpose: the shape of a production group (rollouts, turns, rewards,
    # judgments) reads best as one sequence of draws.
    group = f"g{n}"
    start = day0 + int(rng.integers(0, DAY_US // 2 if today else DAY_US - 7_200_000_000))
    kind = rng.random()  # 80% all equal, 12% one missing, 8% varied
    base = float(rng.integers(0, 2))
    cols: dict[str, list] = {
        k: []
        for k in (
            "record_id",
            "request_id",
            "started_at",
            "ended_at",
            "group_id",
            "rollout_id",
            "turn_index",
            "request",
            "response",
            "prompt_token_ids",
            "completion_token_ids",
            "completion_logprobs",
            "prompt_tokens",
            "completion_tokens",
        )
    }
    rewards, finishes = [], []
    for r in range(8):
        rollout = f"{group}.{r}"
        t = start + r * 1000
        prompt = list(rng.integers(0, 30000, 300))
        for turn in range(int(rng.integers(1, 4))):
            completion = list(rng.integers(0, 30000, 50))
            rid = f"{rollout}.{turn}"
            cols["record_id"].append(rid)
            cols["request_id"].append(rid)
            cols["started_at"].append(t)
            cols["ended_at"].append(t + 2_000_000)
            cols["group_id"].append(group)
            cols["rollout_id"].append(rollout)
            cols["turn_index"].append(turn)
            cols["request"].append(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": pool[int(rng.integers(0, len(pool)))]}
                        ]
                    }
                )
            )
            cols["response"].append(
                json.dumps({"choices": [{"message": {"role": "assistant", "content": "ok " * 60}}]})
            )
            cols["prompt_token_ids"].append(prompt)
            cols["completion_token_ids"].append(completion)
            cols["completion_logprobs"].append(list(-rng.random(50)))
            cols["prompt_tokens"].append(len(prompt))
            cols["completion_tokens"].append(50)
            prompt = prompt + completion + list(rng.integers(0, 30000, 20))
            t += 3_000_000
        finishes.append({"rollout_id": rollout, "schema_version": 1, "finished_at": t})
        if kind < 0.12 and r == 7:
            continue
        value = float(rng.random()) if kind > 0.92 else base
        rewards.append(
            {
                "reward_id": rollout,
                "schema_version": 1,
                "rollout_id": rollout,
                "reward": value,
                "source": "agent",
                "created_at": t + 1,
            }
        )
    k = len(cols["record_id"])
    cols.update(
        schema_version=[1] * k,
        attribution=["header"] * k,
        choice_index=[0] * k,
        endpoint=["chat.completions"] * k,
        model_requested=["policy"] * k,
        model_served=["base"] * k,
        finish_reason=["stop"] * k,
        http_status=[200] * k,
        partial=[False] * k,
        latency_ms=[2000.0] * k,
        stream=[False] * k,
        logged=[True] * k,
    )
    return cols, rewards, finishes, kind > 0.92


def write_day(
    data: Path, table: str, rows: pa.Table, schema: pa.Schema, logs: int = LOGS_PER_DAY
) -> None:
    """The day's rows as the default roll leaves them: one segment per log."""
    cols = [
        rows.column(f.name).cast(f.type)
        if f.name in rows.column_names
        else pa.nulls(rows.num_rows, f.type)
        for f in schema
    ]
    full = pa.Table.from_arrays(cols, schema=schema)
    time_col = {
        "completions": "started_at",
        "rewards": "created_at",
        "finishes": "finished_at",
        "training_runs": "started_at",
    }[table]
    full = full.sort_by(time_col)
    day = time.strftime("%Y-%m-%d", time.gmtime(full.column(time_col)[0].value / 1e6))
    folder = data / table / f"date={day}"
    folder.mkdir(parents=True, exist_ok=True)
    meta = {b"overnight.schema_version": b"1"}
    for i, chunk in enumerate(np.array_split(np.arange(full.num_rows), min(logs, full.num_rows))):
        if len(chunk):
            piece = full.slice(int(chunk[0]), len(chunk)).replace_schema_metadata(meta)
            pq.write_table(piece, folder / f"bench-{i:06d}.parquet", compression="zstd")


def measure(path: str, data: Path, version) -> dict:
    code = RUNNER.replace("{body}", PATHS[path]).replace("{{", "{").replace("}}", "}")
    env, cwd = (version.env(), version.tree) if version is not None else (None, ROOT)
    done = subprocess.run(
        [sys.executable, "-c", code, str(data.resolve())],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=1800,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--before", default="f5b20ae", help="git ref of the old code; '' skips it")
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "history-scale")
    args = parser.parse_args()
    before_env = None
    if args.before:
        sys.path.insert(0, str(ROOT))
        from bench.versions import materialise

        before_env = materialise("before", args.before)
    from overnight.storage.merge import GRACE_SECONDS, MERGE_AFTER, merge_closed_days

    results: dict[str, dict[int, dict]] = {}
    for size in args.sizes:
        data = args.work / str(size)
        shutil.rmtree(data, ignore_errors=True)
        t = time.perf_counter()
        generate(data, size)
        files = sum(1 for _ in data.glob("*/date=*/*.parquet"))
        print(f"{size} rows: {files} files written in {time.perf_counter() - t:.0f} s", flush=True)
        if before_env is not None:
            for path in PATHS:
                results.setdefault(f"before {path}", {})[size] = r = measure(path, data, before_env)
                print(f"  before {path}: {r}", flush=True)
        t = time.perf_counter()
        later = time.time() + MERGE_AFTER + 1
        merge_closed_days(data, now=later)
        merge_closed_days(data, now=later + GRACE_SECONDS + 1)  # replaced files deleted
        files = sum(1 for _ in data.glob("*/date=*/*.parquet"))
        print(f"  merged closed days in {time.perf_counter() - t:.0f} s: {files} files", flush=True)
        for path in PATHS:
            results.setdefault(f"after {path}", {})[size] = r = measure(path, data, None)
            print(f"  after {path}: {r}", flush=True)
    print("\ngrowth exponents (time):")
    for name, by_size in results.items():
        sizes = [s for s in args.sizes if "seconds" in by_size.get(s, {})]
        for a, b in zip(sizes, sizes[1:], strict=False):
            ta, tb = by_size[a]["seconds"], by_size[b]["seconds"]
            print(f"  {name}: {a} -> {b}: {math.log(tb / ta) / math.log(b / a):.2f}")


if __name__ == "__main__":
    main()
