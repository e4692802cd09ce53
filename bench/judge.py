"""Judge benchmarks, each comparing side by side in one run.

1. Prompt size: RULER's shared-prefix packing (shared messages once as context) vs
   sending every trajectory whole, in tokens of the served model's tokenizer, on
   groups of 8 multi-turn rollouts logged through the proxy. The rollouts come from
   the example agent (examples/tool_agent.py) run against the tiny model on vLLM (CPU),
   unless --data names a data directory that already holds logged groups.
2. Throughput: judging 200 groups through real litellm against a judge that answers in
   200 ms (the fake upstream in its own process), vs the ideal 200 x 0.2 s / concurrency.

    python bench/judge.py                # both, about 3 minutes
    python bench/judge.py --data DIR     # part 1 on your own logged groups
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from overnight.config import JudgeConfig  # noqa: E402
from overnight.judge.ruler import DEFAULT_RUBRIC, build_prompt, import_litellm  # noqa: E402
from overnight.judge.run import load_groups, run_judge  # noqa: E402
from overnight.storage import LogWriter, WriterConfig, finished_groups, open_db  # noqa: E402
from overnight.testing.processes import spawn_fake_upstream  # noqa: E402
from overnight.testing.tiny_model import serve_tiny  # noqa: E402
from tests.helpers import chat_response, completion_row  # noqa: E402


def log_agent_groups(data: Path, model_dir: Path, tasks: int, group_size: int) -> None:
    """Serve the tiny model behind the proxy and run the example agent through it."""
    with serve_tiny(model_dir, data) as serve:
        agent_env = dict(os.environ, OPENAI_BASE_URL=serve.url + "/v1", OPENAI_API_KEY="unused")
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "tool_agent.py"),
                "--tasks",
                str(tasks),
                "--group-size",
                str(group_size),
                "--max-turns",
                "3",
                "--max-tokens",
                "48",
            ],
            env=agent_env,
            check=True,
            stdout=subprocess.DEVNULL,
        )


def prompt_sizes(data: Path, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    con = open_db(data)
    groups = [
        g for g in load_groups(con, finished_groups(con, 0.0, None)) if len(g.trajectories) >= 2
    ]
    con.close()
    packed = whole = turns = 0
    for group in groups:
        count = lambda p: sum(len(tokenizer(m["content"]).input_ids) for m in p.messages)  # noqa: E731
        packed += count(build_prompt(group, DEFAULT_RUBRIC, 2000))
        whole += count(build_prompt(group, DEFAULT_RUBRIC, 2000, share_prefix=False))
        turns += sum(
            sum(m.get("role") == "assistant" for m in t.messages) for t in group.trajectories
        )
    rollouts = sum(len(g.trajectories) for g in groups)
    print(
        f"\n1. prompt tokens on {len(groups)} logged group(s), {rollouts} rollouts, "
        f"{turns / max(rollouts, 1):.1f} assistant turns per rollout"
    )
    print(
        f"   every trajectory whole:  {whole:>8} tokens ({whole / max(len(groups), 1):.0f} per group)"
    )
    print(
        f"   shared prefix packed:    {packed:>8} tokens ({packed / max(len(groups), 1):.0f} per group)"
    )
    ratio = packed / max(whole, 1)
    print(
        f"   ratio packed / whole:    {ratio:.3f}   target <= 0.6: {'PASS' if ratio <= 0.6 else 'FAIL'}"
    )


def synthetic_groups(data: Path, n: int) -> None:
    writer = LogWriter(WriterConfig(data, commit_interval=0.0))
    writer.start()
    now = time.time_ns() // 1000
    system = {"role": "system", "content": "Answer with the capital city."}
    for g in range(n):
        for r in range(4):
            rollout = f"g{g}.r{r}"
            request = {
                "messages": [system, {"role": "user", "content": f"Capital of country {g}?"}]
            }
            writer.append(
                "completions",
                completion_row(
                    rollout, f"g{g}", request=request, response=chat_response(f"City {r}")
                ),
            )
            writer.append(
                "finishes", {"rollout_id": rollout, "schema_version": 1, "finished_at": now}
            )
    writer.close()


def judge_throughput(work: Path, groups: int, delay: float, concurrency: int) -> None:
    data = work / "judge-data"
    synthetic_groups(data, groups)
    with spawn_fake_upstream("--delay", str(delay)) as fake:
        config = JudgeConfig(
            model="openai/fake-judge",
            base_url=fake.url + "/v1",
            api_key="x",
            concurrency=concurrency,
        )
        t0 = time.perf_counter()
        import_litellm()  # a one-time cost of any process that judges, shown apart
        imported = time.perf_counter() - t0
        started = time.perf_counter()
        summary = asyncio.run(run_judge(data, config, progress=False))
        wall = time.perf_counter() - started
    ideal = groups * delay / concurrency
    print(
        f"\n2. judging {groups} groups, judge answering in {delay * 1000:.0f} ms, concurrency {concurrency}"
    )
    print(
        f"   judged {summary.judged}, failed {summary.failed}; wall {wall:.2f} s (reading the groups, "
        f"writing and compaction included), ideal {ideal:.2f} s; importing litellm took {imported:.1f} s"
    )
    ratio = wall / ideal
    print(
        f"   ratio wall / ideal:      {ratio:.3f}   target <= 1.3: {'PASS' if ratio <= 1.3 else 'FAIL'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, help="logged groups to size prompts on (default: log new ones)"
    )
    parser.add_argument("--model-dir", type=Path, default=ROOT / ".cache" / "tiny-model")
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="overnight-judge-bench-"))
    data = args.data
    if data is None:
        data = work / "agent-data"
        print(
            f"logging {args.tasks} groups of {args.group_size} with the example agent (vLLM on CPU) ...",
            flush=True,
        )
        log_agent_groups(data, args.model_dir, args.tasks, args.group_size)
    prompt_sizes(data, args.model_dir)
    judge_throughput(work, args.groups, args.delay, args.concurrency)


if __name__ == "__main__":
    main()
