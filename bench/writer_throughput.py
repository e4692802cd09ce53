"""The write-ahead log's sustained rate, side by side with the floor of any JSON-lines log.

Rows shaped like the proxy's completion records, each with 200 prompt token ids, 200
completion token ids and 200 logprobs plus the request and response text. Each side
runs for `--seconds` after a second of warm-up and counts the rows made durable:

- ours: `LogWriter.append` from the producer thread, kept at most 20,000 rows ahead
  of what is committed (as a proxy is, by its clients), while the writer thread
  encodes, writes and fsyncs in group commits, rolls the log every 64 MiB and a niced
  child process compacts each sealed log to Parquet, as in production;
- floor: the same rows encoded with orjson and written by one thread to one file,
  fsynced every 20 ms (no queue, no second thread, no rolling, no compaction).

    python bench/writer_throughput.py --seconds 10
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from overnight.storage import SCHEMA_VERSION, LogWriter, WriterConfig  # noqa: E402


def make_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    request = orjson.dumps(
        {"model": "policy", "messages": [{"role": "user", "content": "word " * 150}]}
    ).decode()
    rows = []
    for i in range(n):
        completion = [rng.randrange(50_000) for _ in range(200)]
        rows.append(
            {
                "record_id": f"r{i}",
                "request_id": f"q{i}",
                "schema_version": SCHEMA_VERSION,
                "started_at": 1_764_000_000_000_000 + i,
                "ended_at": 1_764_000_000_100_000 + i,
                "group_id": f"g{i // 8}",
                "rollout_id": f"g{i // 8}.{i % 8}",
                "turn_index": 0,
                "choice_index": 0,
                "endpoint": "chat.completions",
                "request": request,
                "response": orjson.dumps({"choices": [{"text": "x" * 800}]}).decode(),
                "prompt_token_ids": [rng.randrange(50_000) for _ in range(200)],
                "completion_token_ids": completion,
                "completion_logprobs": [-rng.random() * 3 for _ in range(200)],
                "logged": True,
                "http_status": 200,
            }
        )
    return rows


def ours(rows: list[dict], data_dir: Path, seconds: float) -> tuple[float, int]:
    """(rows/s made durable in the window, rows compacted to Parquet by the end)."""
    writer = LogWriter(WriterConfig(data_dir))
    writer.start()
    i, start = 0, None
    warm_until = time.perf_counter() + 1.0
    while True:
        now = time.perf_counter()
        if start is None and now >= warm_until:
            start, committed_before = now, writer.committed
        if start is not None and now - start >= seconds:
            break
        if writer.appended - writer.committed > 20_000:
            time.sleep(0.001)  # the clients wait for their answers
            continue
        for _ in range(100):
            writer.append("completions", rows[i % len(rows)])
            i += 1
    rate = (writer.committed - committed_before) / (time.perf_counter() - start)
    writer.close()
    return rate, writer.rows_compacted


def floor(rows: list[dict], path: Path, seconds: float) -> float:
    i, start, synced = 0, None, time.perf_counter()
    warm_until = synced + 1.0
    with open(path, "wb") as f:
        while True:
            now = time.perf_counter()
            if start is None and now >= warm_until:
                start, before = now, i
            if start is not None and now - start >= seconds:
                break
            f.write(
                orjson.dumps(
                    {"t": "completions", "r": rows[i % len(rows)]},
                    option=orjson.OPT_APPEND_NEWLINE,
                )
            )
            i += 1
            if now - synced >= 0.02:
                f.flush()
                os.fsync(f.fileno())
                synced = now
    return (i - before) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--distinct-rows", type=int, default=20_000)
    args = parser.parse_args()
    rows = make_rows(args.distinct_rows)
    with tempfile.TemporaryDirectory() as tmp:
        floor_rate = floor(rows, Path(tmp) / "floor.jsonl", args.seconds)
    with tempfile.TemporaryDirectory() as tmp:
        our_rate, compacted = ours(rows, Path(tmp), args.seconds)
    print(f"rows of 200 token ids + 200 logprobs each, {args.seconds:g} s per side")
    print(f"floor (one thread, fsync every 20 ms): {floor_rate:9.0f} rows/s")
    print(
        f"LogWriter (group commit, rolling, compaction): {our_rate:9.0f} rows/s   "
        f"ratio to floor {our_rate / floor_rate:.2f}   ({compacted} rows compacted in all)"
    )
    verdict = "PASS" if our_rate >= 20_000 else "FAIL"
    print(f"target: LogWriter sustains >= 20000 rows/s: {verdict}")


if __name__ == "__main__":
    main()
