"""`overnight import` of a large OpenAI JSONL file: rows per second, peak memory, and a
second import that adds nothing (issue 50; docs/import.md).

The file is made here, production-shaped: multi-turn conversations with a system prompt
(a few KB a line), most answers whole, a fifth streamed (the chunks a stream sent), a
tenth tool calls, and a bad line every 10,000. Each import runs as `overnight import` in
a process of its own; its peak RSS is the kernel's (wait4's ru_maxrss).

    python bench/import_throughput.py --mb 100
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEM = {"role": "system", "content": "You are a careful assistant for a logistics team. " * 12}
TOOLS = [{"type": "function", "function": {"name": "lookup_order", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "string"}}}}}]  # fmt: skip


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(("order", "ship", "late", "box", "the", "when", "route", "eta",
                                "customer", "refund", "is", "a", "to")) for _ in range(n))  # fmt: skip


def _line(i: int, rng: random.Random) -> str:
    if i % 10_000 == 9_999:
        return '{"request": {"model": "gpt-4o-mini"}, "response": truncated'
    turns = rng.randint(1, 4)
    messages = [SYSTEM]
    for _ in range(turns):
        messages.append({"role": "user", "content": _words(rng, rng.randint(20, 120))})
        messages.append({"role": "assistant", "content": _words(rng, rng.randint(20, 150))})
    messages.append({"role": "user", "content": _words(rng, 40)})
    request = {"model": "gpt-4o-mini", "messages": messages, "temperature": 0.7}
    created = 1_733_000_000 + i
    base = {"id": f"chatcmpl-{i}", "created": created, "model": "gpt-4o-mini-2024-07-18"}
    usage = {"prompt_tokens": 300, "completion_tokens": 80, "total_tokens": 380}
    kind = i % 10
    if kind == 0:  # a tool call
        request["tools"] = TOOLS
        message = {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}",
                   "type": "function", "function": {"name": "lookup_order",
                   "arguments": json.dumps({"order_id": str(i)})}}]}  # fmt: skip
        response = {**base, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls"}]}  # fmt: skip
    elif kind in (1, 2):  # streamed: the chunks as sent
        request["stream"] = True
        pieces = _words(rng, 60).split(" ")
        response = [{**base, "object": "chat.completion.chunk", "choices": [{"index": 0,
                     "delta": {"content": p + " "}, "finish_reason": None}]} for p in pieces]  # fmt: skip
        response[-1]["choices"][0]["finish_reason"] = "stop"
        response.append({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
    else:
        response = {**base, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": _words(rng, 90)},
             "finish_reason": "stop"}]}  # fmt: skip
    return json.dumps({"request": request, "response": response})


def make_file(path: Path, mb: float) -> int:
    rng = random.Random(0)
    target = int(mb * 1e6)
    lines = 0
    with open(path, "w") as f:
        while f.tell() < target:
            f.write(_line(lines, rng) + "\n")
            lines += 1
    return lines


def run_import(data: Path, source: Path) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes), the command's output."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        child = subprocess.Popen(
            [sys.executable, "-m", "overnight.cli", "import", "--data", str(data), str(source),
             "--format", "openai-jsonl"], stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - start
        out.seek(0)
        text = out.read().decode()
    if child.returncode != 0:
        raise SystemExit(f"import failed ({child.returncode}):\n{text}")
    return seconds, usage.ru_maxrss * 1024, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="Size of the file made.")
    parser.add_argument("--dir", type=Path, help="Work here (default: a temporary folder).")
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="import-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    source = work / "calls.jsonl"
    lines = make_file(source, args.mb)
    size = source.stat().st_size
    print(f"made {source}: {size / 1e6:.0f} MB, {lines} lines")
    data = work / "data"
    seconds, rss, text = run_import(data, source)
    summary = [line for line in text.splitlines() if line.startswith("openai-jsonl: read")]
    rows = lines - lines // 10_000
    print(f"first import: {seconds:.1f} s, {rows / seconds:.0f} rows/s, "
          f"{size / 1e6 / seconds:.1f} MB/s, peak RSS {rss / 2**20:.0f} MiB")  # fmt: skip
    print("  " + (summary[0] if summary else text[-500:]))
    seconds, rss2, text = run_import(data, source)
    again = [line for line in text.splitlines() if line.startswith("openai-jsonl: read")]
    print(f"second import: {seconds:.1f} s, peak RSS {rss2 / 2**20:.0f} MiB")
    print("  " + (again[0] if again else text[-500:]))


if __name__ == "__main__":
    main()
