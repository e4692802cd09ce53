"""Read paths against history size: `overnight sql` count(*) over groups, `overnight ls`,
the web view's first page (/ui) and a group's page, and the nightly selection
(`overnight train --dry-run`'s plan: from the last run's watermark, with `--rescan`, and
with `--since` yesterday), at 10k/100k/1M completion rows; optionally before (a git
ref, `--before f5b20ae`) beside after (this tree).

History is shaped like production: groups of 8 rollouts of 1-3 turns, 1.6 KB requests,
~300 prompt token ids and ~50 completion ids with logprobs per turn, a reward and a
finish per rollout (most groups' rewards all equal or one missing: 8% trainable), one
training run a night (with the selection record its plan leaves), and the default
5-minute roll: ~65 logs a day, each leaving one segment per table (~195 files a day).
Days are filled back from today, 2,740 rows a day (1M rows: a year). The Parquet is
written directly with pyarrow in the storage schema (version 1 rows, as the old code
wrote them; no fsync), which is much faster than the writer's own log and compaction
and gives the same files. The history stays in `--work` (default /tmp): `--reuse`
measures it again without writing it (1M rows: ~15 minutes to write, ~25 to merge its
days and ~2 more its months on one busy core).

Each path runs in a fresh process, `--repeat` times (the fastest kept: a shared
machine slows a run, never speeds it up): its wall time, its CPU time (every thread: on
a shared machine wall time waits for cores) and the process's peak memory. "before" is
the old code (`--before REF`) on the history as it is found (fresh: not merged; with
`--reuse`: as an earlier run's merge left it); "after" is this tree's code once its
merge ran as the writer runs it after each roll (storage/upkeep/merge.py: today's segments in
batches, closed days, closed months), replayed over today's rolls. The growth exponent
is log(t2/t1)/log(n2/n1) between sizes.

    python bench/history_scale.py --sizes 10000 100000 1000000 [--reuse] [--before REF]
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
# Today's rows so far, the same at every size: a night's new data stays constant while
# the history behind it grows, which is what the growth exponents are about.
TODAY_ROWS = 1070
LOGS_PER_DAY = 65
ROLL_SECONDS = 300
DAY_US = 86_400_000_000

# The web view in a test server, for the /ui paths; `timed` measures one request alone,
# not the server's start or stop.
WEB_VIEW = """
import asyncio, re
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from overnight.view.web import DATA_DIR, create_web_view

def web_view():
    app = web.Application()
    app[DATA_DIR] = Path(DATA)
    app.add_subapp("/ui", create_web_view())
    return TestClient(TestServer(app))

async def timed(client, path):
    start = start_clock()
    response = await client.get(path)
    page = await response.text()
    assert response.status == 200, page[:300]
    return time.perf_counter() - start, page
"""

# One measured path: Python run in a fresh process; it prints {"seconds": s}.
PATHS = {
    "count_groups": """
from overnight.storage import open_db
t = start_clock()
con = open_db(DATA)
con.execute("SELECT count(*) FROM groups").fetchall()
""",
    "ls": """
from overnight.storage import open_db
from overnight.view.display import list_groups
t = start_clock()
list_groups(open_db(DATA), None, 20)
""",
    # The nightly selection as `overnight train --dry-run` makes it: from the last
    # run's watermark (the generated nights recorded one), and with --rescan.
    "plan": """
from overnight.config import TrainConfig
from overnight.trainer.choose.plan import plan_run
t = start_clock()
plan = plan_run(Path(DATA), TrainConfig(), 600)
info = {"groups": len(plan.groups), "skipped": sum(plan.skipped.values()), **plan.loaded}
""",
    "plan_rescan": """
from overnight.config import TrainConfig
from overnight.trainer.choose.plan import plan_run
t = start_clock()
plan = plan_run(Path(DATA), TrainConfig(rescan=True), 600)
info = {"groups": len(plan.groups), "skipped": sum(plan.skipped.values()), **plan.loaded}
""",
    "plan_since_yesterday": """
import datetime as dt
from overnight.config import TrainConfig
from overnight.trainer.choose.plan import plan_run
t = start_clock()
since = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
plan = plan_run(Path(DATA), TrainConfig(), 600, since=since)
info = {"groups": len(plan.groups)}
""",
    # The web view in-process (what the proxy mounts at /ui): its first page, the groups
    # newest first, then the newest group's page.
    "ui": WEB_VIEW
    + """
async def main():
    global t, page
    async with web_view() as client:
        t, page = await timed(client, "/ui")

asyncio.run(main())
t = time.perf_counter() - t  # so that the runner's `seconds` is the request's alone
info = {"bytes": len(page)}
""",
    "ui_group": WEB_VIEW
    + """
async def main():
    global t, page
    async with web_view() as client:
        first = await (await client.get("/ui?limit=1")).text()
        group = re.search(r'href="/ui/groups/([^"]+)"', first).group(1)
        t, page = await timed(client, f"/ui/groups/{group}")

asyncio.run(main())
t = time.perf_counter() - t
info = {"bytes": len(page)}
""",
}
# Paths the old code cannot run (options it did not have).
AFTER_ONLY = {"plan_rescan", "ui", "ui_group"}
RUNNER = """
import json, resource, sys, time
from pathlib import Path
DATA = sys.argv[1]
info = {}
cpu = [0.0]

def start_clock():
    cpu[0] = time.process_time()  # all threads' CPU: DuckDB's too
    return time.perf_counter()

{body}
seconds = time.perf_counter() - t
cpu_s = time.process_time() - cpu[0]
# The peak of this process's own memory (VmHWM starts afresh at exec; ru_maxrss keeps
# the parent's, which the merge run before it had grown).
status = Path("/proc/self/status")
hwm = [line for line in status.read_text().splitlines() if line.startswith("VmHWM")]
rss = int(hwm[0].split()[1]) / 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"seconds": seconds, "cpu_s": cpu_s, "rss_mb": rss, **info}}))
"""


def generate(data: Path, rows: int, seed: int = 0) -> None:
    """Write `rows` completion rows (and their rewards, finishes, training runs)."""
    from overnight.storage.schema import TABLES

    rng = np.random.default_rng(seed)
    words = np.array([f"w{i}" for i in range(2000)])
    pool = [" ".join(rng.choice(words, 300)) for _ in range(4000)]  # ~1.6 KB each
    days = max(0, math.ceil((rows - TODAY_ROWS) / ROWS_PER_DAY)) + 1
    today0 = (time.time_ns() // 1000) // DAY_US * DAY_US
    left, n_group, runs = rows, 0, []
    for d in range(days):
        day0 = today0 - (days - 1 - d) * DAY_US
        past = max(min(ROWS_PER_DAY, left - TODAY_ROWS), 1)
        want = TODAY_ROWS if d == days - 1 else past
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
            runs.append(night_run(f"run{d}", day0 + DAY_US - 3_600_000_000, varied))
        if d % 30 == 29:
            print(f"    {d + 1} of {days} days written", flush=True)
    for run in runs:
        write_day(data, "training_runs", pa.Table.from_pylist([run]), TABLES["training_runs"], 1)


def night_run(run_id: str, at_us: int, groups: list[str]) -> dict:
    """A night's `training_runs` row (its selection record is added by `stamp_runs`)."""
    return {
        "run_id": run_id,
        "schema_version": 1,
        "status": "trained",
        "started_at": at_us,
        "groups": groups,
    }


def stamp_runs(data: Path) -> None:
    """Give each night's run the selection record its plan left (trainer/choose/plan.py's
    `Plan.selection`, which record_run stores in `metrics`): looked at its start, every
    group finished by then decided, none left pending."""
    from overnight.config import TrainConfig
    from overnight.trainer.choose.selection import SELECTION_KEY, selection_basis

    record = {"pending": [], "settle_seconds": 600, "basis": selection_basis(TrainConfig())}
    for path in data.glob("training_runs/date=*/*.parquet"):
        table = pq.read_table(path)
        records = [
            json.dumps({SELECTION_KEY: {**record, "watermark": at.value}})
            for at in table.column("started_at")
        ]
        i = table.schema.get_field_index("metrics")
        table = table.set_column(i, "metrics", pa.array(records, pa.string()))
        pq.write_table(table, path, compression="zstd")


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
        prompt = rng.integers(0, 30000, 300, dtype=np.int32)
        for turn in range(int(rng.integers(1, 4))):
            completion = rng.integers(0, 30000, 50, dtype=np.int32)
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
            cols["completion_logprobs"].append(-rng.random(50, dtype=np.float32))
            cols["prompt_tokens"].append(len(prompt))
            cols["completion_tokens"].append(50)
            prompt = np.concatenate(
                [prompt, completion, rng.integers(0, 30000, 20, dtype=np.int32)]
            )
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


def measure(path: str, data: Path, version, repeat: int = 1) -> dict:
    """The fastest of `repeat` runs (CPU and wall time each their own minimum: on a
    shared machine a run is slowed by others, never sped up), with the last run's rest."""
    runs = [_measure_once(path, data, version) for _ in range(repeat)]
    if any("error" in r for r in runs):
        return next(r for r in runs if "error" in r)
    best = dict(runs[-1])
    for key in ("seconds", "cpu_s", "rss_mb"):
        best[key] = min(r[key] for r in runs)
    return best


def _measure_once(path: str, data: Path, version) -> dict:
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


def prepare(data: Path, size: int, reuse: bool) -> bool:
    """The history of `size` rows in `data`; False when it was already there (`reuse`)."""
    done = data / "bench-complete"
    if reuse and done.exists():
        print(f"{size} rows: reusing {data}", flush=True)
        return False
    shutil.rmtree(data, ignore_errors=True)
    t = time.perf_counter()
    generate(data, size)
    files = sum(1 for _ in data.glob("*/date=*/*.parquet"))
    print(f"{size} rows: {files} files written in {time.perf_counter() - t:.0f} s", flush=True)
    return True


def merge(data: Path) -> None:
    """Merge as the writer does after each roll, replayed: today's segments were written
    one per roll (5 minutes apart, the last just now), every earlier day's long ago, and
    the merge runs after each of today's rolls. Today is then left as a live proxy leaves
    it (merged batches and the segments since), not as one file."""
    from overnight.storage.manifest import MERGED_PREFIX
    from overnight.storage.upkeep.merge import merge_closed_days

    t = time.perf_counter()
    now = time.time()
    today = time.strftime("%Y-%m-%d", time.gmtime(now))
    todays: dict[str, list[Path]] = {}
    for path in sorted(data.glob("*/date=*/*.parquet")):
        if path.name.startswith(MERGED_PREFIX):
            continue
        if path.parent.name == f"date={today}":
            todays.setdefault(path.parent.parent.name, []).append(path)
        else:
            os.utime(path, (now - 2 * 86_400, now - 2 * 86_400))
    rolls = max((len(paths) for paths in todays.values()), default=1)
    for paths in todays.values():
        for i, path in enumerate(paths):
            at = now - (len(paths) - 1 - i) * ROLL_SECONDS
            os.utime(path, (at, at))
    for k in range(rolls):
        merge_closed_days(data, now=now - (rolls - 1 - k) * ROLL_SECONDS + 1)
    files = {t.name: sum(1 for _ in t.glob("date=*/*.parquet")) for t in sorted(data.glob("*/"))}
    took = time.perf_counter() - t
    print(f"  merged in {took:.0f} s: files {files} (replaced ones within grace included)")
    (data / "bench-complete").write_text("merged\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--before", default="", help="git ref of the old code (e.g. f5b20ae)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/overnight-history-scale"))
    parser.add_argument(
        "--reuse", action="store_true", help="measure a history generated by an earlier run"
    )
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    parser.add_argument("--generate-only", action="store_true")
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs of each path; the fastest is reported"
    )
    args = parser.parse_args()
    before_env = None
    if args.before:
        sys.path.insert(0, str(ROOT))
        from bench.versions import materialise

        before_env = materialise("before", args.before)
    results: dict[str, dict[int, dict]] = {}
    for size in args.sizes:
        data = args.work / str(size)
        prepare(data, size, args.reuse)
        stamp_runs(data)
        # "before": the old code on the history as it is (fresh: not merged; reused: as an
        # earlier run's merge left it); "after": this tree's code once its merge ran.
        for path in args.paths if before_env is not None else []:
            if path not in AFTER_ONLY:
                results.setdefault(f"before {path}", {})[size] = r = measure(
                    path, data, before_env, args.repeat
                )
                print(f"  before {path}: {r}", flush=True)
        merge(data)
        for path in [] if args.generate_only else args.paths:
            results.setdefault(f"after {path}", {})[size] = r = measure(
                path, data, None, args.repeat
            )
            print(f"  after {path}: {r}", flush=True)
    report(results, args.sizes)


def report(results: dict[str, dict[int, dict]], sizes: list[int]) -> None:
    """CPU seconds (every thread's; wall time on a busy machine waits for cores) by size,
    before beside after, and the growth exponents log(t2/t1)/log(n2/n1)."""
    print("\nCPU seconds (wall seconds), by completion rows:")
    print(f"  {'path':34s}" + "".join(f"{n:>18,}" for n in sizes) + "   exponents (CPU)")
    for name, by_size in sorted(results.items(), key=lambda kv: (kv[0].split()[1], kv[0])):
        cells, cpu = [], []
        for n in sizes:
            r = by_size.get(n, {})
            cells.append(f"{r['cpu_s']:7.2f} ({r['seconds']:6.2f})" if "cpu_s" in r else "-")
            cpu.append(r.get("cpu_s"))
        pairs = list(zip(sizes, cpu, strict=True))
        grow = [
            f"{math.log(b / a) / math.log(nb / na):.2f}"
            for (na, a), (nb, b) in zip(pairs, pairs[1:], strict=False)
            if a and b
        ]
        print(f"  {name:34s}" + "".join(f"{c:>18s}" for c in cells) + "   " + ", ".join(grow))


if __name__ == "__main__":
    main()
