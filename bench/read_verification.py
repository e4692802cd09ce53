"""What verifying every file a reader reads costs (storage/verified.py, issue 41), side by
side with verification off, in one run.

History as bench/history_scale.py makes it (production-shaped rows, its merge: closed
days, weeks and months merged as the writer does), at `--size` completion rows (2,740 a
day: 1M is a year). Each path runs in a fresh process, as `overnight sql` does, with
`verified.ENABLED` set on or off in that process:

- `first sql`: `SELECT count(*), sum(length(request)) FROM completions` (every row, every
  file) with no remembered verification (`verified/` removed): every byte hashed once.
- `later sql`: the same query in a new process, `verified/` as the first left it: one
  stat per file.
- `record read, first` and `later`: the Responses store's read of one record
  (response_index.py `_from_files`: `covering(day)` of a day in a merged month, then the
  row), in one process, as the proxy does: its first lookup, and the mean of 20 after it.

Wall and CPU seconds (every thread), the fastest of `--repeat`; ratios on/off.

    python bench/read_verification.py --size 100000 [--reuse] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.history_scale import merge, prepare  # noqa: E402

SQL = """
import json, resource, time
from overnight.storage import open_db, verified
verified.ENABLED = {on}
start = time.perf_counter(); cpu = time.process_time()
con = open_db({data!r})
n, chars = con.execute("SELECT count(*), sum(length(request)) FROM completions").fetchone()
print(json.dumps({{"seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu,
                  "rows": n}}))
"""

RECORD = """
import json, time
import duckdb
from overnight.storage import verified
from overnight.storage.manifest import list_segments
verified.ENABLED = {on}
con = duckdb.connect(":memory:")
con.execute("SET threads = 1")  # as the proxy's lookup does

def once():
    start = time.perf_counter()
    files = [str(p) for p in list_segments({data!r}, "completions").covering({day!r})]
    row = con.execute("SELECT request FROM read_parquet(?, union_by_name = true) "
                      "WHERE record_id = ? LIMIT 1", [files, {record!r}]).fetchone()
    assert row is not None
    return time.perf_counter() - start

first = once()
later = sorted(once() for _ in range(20))
print(json.dumps({{"seconds": first, "later_s": sum(later) / len(later)}}))
"""


def run(code: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=ROOT
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.splitlines()[-1])


def fastest(code: str, data: Path, cold: bool, repeat: int) -> dict:
    best: dict = {}
    for _ in range(repeat):
        if cold:
            shutil.rmtree(data / "verified", ignore_errors=True)
        got = run(code)
        if not best or got["seconds"] < best["seconds"]:
            best = got
    return best


def a_month_record(data: Path) -> tuple[str, str]:
    """A day inside the oldest merged month, and a record of it."""
    import pyarrow.parquet as pq

    from overnight.storage.manifest import list_segments

    found = list_segments(data, "completions")
    month = next(r for r in found.rels if found.entries.get(r, {}).get("from", "") < r[5:15])
    day = found.entries[month]["from"]
    path = data / "completions" / month
    record = pq.read_table(path, columns=["record_id"]).column(0)[0].as_py()
    return day, record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--work", type=Path, default=Path("/tmp/overnight-read-verification"))
    parser.add_argument("--reuse", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    data = args.work / str(args.size)
    prepare(data, args.size, args.reuse)
    if not (data / "bench-complete").exists():
        merge(data)
    stored = sum(p.stat().st_size for p in data.glob("*/date=*/*.parquet"))
    files = sum(1 for _ in data.glob("*/date=*/*.parquet"))
    print(f"{args.size:,} completion rows: {files} Parquet files, {stored / 1e6:.0f} MB")
    day, record = a_month_record(data)
    rows = []
    for name, code, cold in (
        ("first sql (nothing remembered)", SQL, True),
        ("later sql (a new process)", SQL, False),
    ):
        on = fastest(code.format(on=True, data=str(data)), data, cold, args.repeat)
        off = fastest(code.format(on=False, data=str(data)), data, cold, args.repeat)
        rows.append((name, on, off))
    shutil.rmtree(data / "verified", ignore_errors=True)
    lookup = {"on": True, "off": False}
    got = {
        k: run(RECORD.format(on=v, data=str(data), day=day, record=record))
        for k, v in lookup.items()
    }
    print(f"\n{'path':34s}{'on: wall (CPU) s':>20s}{'off: wall (CPU) s':>20s}{'on/off':>9s}")
    for name, on, off in rows:
        cells = [f"{r['seconds']:8.3f} ({r['cpu_s']:7.3f})" for r in (on, off)]
        print(f"{name:34s}{cells[0]:>20s}{cells[1]:>20s}{on['seconds'] / off['seconds']:8.2f}x")
    for label, key in (("record read, first lookup", "seconds"), ("record read, later", "later_s")):
        on, off = got["on"][key], got["off"][key]
        print(f"{label:34s}{on * 1e3:17.1f} ms{off * 1e3:17.1f} ms{on / off:8.2f}x")
    print(f"\nhashed on the first read: {stored / 1e6:.0f} MB; "
          f"{stored / 1e6 / max(rows[0][1]['seconds'] - rows[0][2]['seconds'], 1e-9):.0f} MB/s "
          "of extra wall time")  # fmt: skip


if __name__ == "__main__":
    main()
