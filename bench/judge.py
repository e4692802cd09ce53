"""Judge benchmarks, each comparing side by side in one run.

1. Prompt size: RULER's shared-prefix packing (shared messages once as context) vs
   sending every trajectory whole, in tokens of the served model's tokenizer, on
   groups of 8 multi-turn rollouts logged through the proxy. The rollouts come from
   the example agent (examples/tool_agent.py) run against the tiny model on vLLM (CPU),
   unless --data names a data directory that already holds logged groups.
2. Throughput: judging 200 groups through real litellm against a judge that answers in
   200 ms (the fake upstream in its own process), vs the ideal 200 x 0.2 s / concurrency.
3. Compacted histories: groups of the compacting agent (examples/compacting_agent.py,
   its own loop driven by a scripted model, no LLM) as the judge saw them before (the
   last turn only), every turn's conversation sent whole, and every turn rendered once
   with what the turns share (now), with and without a token budget.
4. A realistic night, three nights running: 200 groups a night, 5% whose rollouts are
   all identical, 2% over the judge's 8,192-token window; judge calls made now (real
   litellm, a scripted judge that refuses prompts over its window) vs the calls the
   judge before this change made by its rules (every group of two or more rollouts not
   yet judged successfully, so a refused group is sent again every night).

    python bench/judge.py                    # all four, about 4 minutes
    python bench/judge.py --parts 3,4        # no vLLM needed, about 30 s
    python bench/judge.py --data DIR         # part 1 on your own logged groups
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.compacting_agent import SUMMARISER  # noqa: E402
from overnight.config import JudgeConfig  # noqa: E402
from overnight.judge.budget import Counter, estimate  # noqa: E402
from overnight.judge.ruler import (  # noqa: E402
    DEFAULT_RUBRIC,
    build_prompt,
    import_litellm,
    render_message,
)
from overnight.judge.run import load_groups, run_judge  # noqa: E402
from overnight.judge.trajectories import (  # noqa: E402
    Group,
    rollout_from_turns,
    trajectory_from_turn,
    turn_messages,
)
from overnight.storage import LogWriter, WriterConfig, finished_groups, open_db  # noqa: E402
from overnight.testing.processes import serve_tiny, spawn_fake_upstream  # noqa: E402
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


# -- 3. compacted histories -------------------------------------------------------------


class ScriptedPolicy:
    """Stands in for the policy model behind the compacting agent's own loop: each
    attempt searches and reads a few handbook pages (how many varies), then answers;
    asked for notes, it writes them. Every call is kept as (request, response)."""

    def __init__(self, seed: int) -> None:
        import random

        self.rng = random.Random(seed)
        self.calls: dict[str, int] = {}
        self.steps: dict[str, int] = {}
        self.turns: dict[str, list[tuple[dict, dict]]] = {}
        self.chat = self
        self.completions = self

    async def create(self, *, model: str, messages: list[dict], extra_headers: dict, **kw):
        import copy

        from openai.types.chat import ChatCompletion

        from examples.compacting_agent import SUMMARISER
        from examples.search_agent import HANDBOOK

        rollout = extra_headers["X-Rollout-Id"]
        n = self.calls[rollout] = self.calls.get(rollout, 0) + 1
        steps = self.steps.setdefault(rollout, self.rng.randint(4, 9))
        if messages[0]["content"] == SUMMARISER:
            pages = sorted({p["id"] for p in HANDBOOK if p["id"] in str(messages)})[:3]
            message = {"role": "assistant", "content": f"Read {', '.join(pages) or 'nothing'}; "
                       "leave policy found, the approver is still unknown."}  # fmt: skip
        elif n >= steps:
            message = {
                "role": "assistant",
                "content": f"New employees get 25 days ({rollout[-4:]}).",
            }
        else:
            page = self.rng.choice(HANDBOOK)["id"]
            name, args = ("read", {"page": page}) if n % 2 == 0 else ("search", {"query": page})
            call = {"id": f"{rollout}-{n}", "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)}}  # fmt: skip
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        response = {
            "id": f"r{n}", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        }  # fmt: skip
        request = {"model": model, "messages": copy.deepcopy(messages), **kw}
        self.turns.setdefault(rollout, []).append((request, response))
        return ChatCompletion.model_validate(response)


def compacting_groups(groups: int, size: int) -> list[tuple[Group, Group, list]]:
    """(the group as rendered now, as the judge saw it before, every turn) per group."""
    from examples.compacting_agent import run_rollout
    from examples.search_agent import QUESTIONS

    policy = ScriptedPolicy(seed=7)

    async def attempts() -> None:
        for g in range(groups):
            await asyncio.gather(
                *(
                    run_rollout(
                        policy, "policy", QUESTIONS[g % len(QUESTIONS)], f"g{g}", 12, 200, 3
                    )
                    for _ in range(size)
                )
            )

    asyncio.run(attempts())
    out = []
    for g in range(groups):
        mine = {r: t for r, t in policy.turns.items() if r.startswith(f"g{g}.")}
        now = Group(f"g{g}", [rollout_from_turns(r, t) for r, t in mine.items()])
        before = Group(f"g{g}", [trajectory_from_turn(r, *t[-1]) for r, t in mine.items()])
        out.append((now, before, list(mine.values())))
    return out


def compaction_sizes(groups: int, size: int, budget: int) -> None:
    litellm = import_litellm()
    count = Counter("litellm", lambda m: litellm.token_counter(model="gpt-4o", messages=m))
    totals = dict(before=0, every=0, now=0, budgeted=0)
    seen_before = seen_now = replies = turns = compactions = 0
    cut_groups = unfit = largest = 0
    for now, before, rollouts in compacting_groups(groups, size):
        p_before = build_prompt(before, DEFAULT_RUBRIC, 2000)
        p_now = build_prompt(now, DEFAULT_RUBRIC, 2000)
        p_budget = build_prompt(now, DEFAULT_RUBRIC, 2000, budget=budget, counter=count)
        totals["before"] += count.count(p_before.messages)
        totals["now"] += count.count(p_now.messages)
        totals["budgeted"] += count.count(p_budget.messages)
        cut_groups += p_budget.cut is not None
        unfit += p_budget.cut is not None and not p_budget.cut.fits
        largest = max(largest, count.count(p_now.messages))
        for turns_of in rollouts:  # every turn's conversation whole, one after another
            text = "\n".join(
                render_message(m) for req, resp in turns_of for m in turn_messages(req, resp)[0]
            )
            totals["every"] += count.count([{"role": "user", "content": text}])
            for _req, resp in turns_of:
                reply = render_message(resp["choices"][0]["message"])
                replies += 1
                seen_before += reply in p_before.messages[1]["content"]
                seen_now += reply in p_now.messages[1]["content"]
            turns += len(turns_of)
            compactions += sum(req["messages"][0]["content"] == SUMMARISER for req, _ in turns_of)
    rollouts_n = groups * size
    print(
        f"\n3. compacted histories: {groups} groups of {size} rollouts of the compacting agent, "
        f"{turns / rollouts_n:.1f} turns and {compactions / rollouts_n:.1f} compactions per rollout "
        f"(tokens: litellm's counter for gpt-4o); the largest group {largest} tokens"
    )
    rows = [
        ("before: the last turn only", totals["before"], seen_before),
        ("every turn's conversation whole", totals["every"], replies),
        ("now: every turn, shared once", totals["now"], seen_now),
        (f"now, budget {budget} tokens", totals["budgeted"], None),
    ]
    for name, tokens, seen in rows:
        shown = (
            f"{seen / replies:6.1%} of the replies shown"
            if seen is not None
            else f"{cut_groups}/{groups} groups shortened, {unfit} could not fit"
        )
        print(f"   {name:<34} {tokens:>8} tokens ({tokens / groups:6.0f} per group)  {shown}")


# -- 4. a realistic night ---------------------------------------------------------------


WINDOW = 8192  # the judge's context window, in its own count (chars / 4 here)


def night_groups(data: Path, night: int, n: int, identical: float, over: float) -> None:
    writer = LogWriter(WriterConfig(data, commit_interval=0.0))
    writer.start()
    now = time.time_ns() // 1000
    system = {"role": "system", "content": "Answer from the attached document."}
    n_same, n_over = round(n * identical), round(n * over)
    for g in range(n):
        group = f"n{night}.g{g}"
        task = f"Question {g} of night {night}: what is the capital?"
        if g < n_over:  # a pasted document: over the window once rendered
            task += " Document: " + "lorem ipsum " * 3000
        for r in range(4):
            answer = "Same answer" if n_over <= g < n_over + n_same else f"City {r} of {g}"
            request = {"messages": [system, {"role": "user", "content": task}]}
            writer.append(
                "completions",
                completion_row(
                    f"{group}.r{r}", group, request=request, response=chat_response(answer)
                ),
            )
            writer.append(
                "finishes", {"rollout_id": f"{group}.r{r}", "schema_version": 1, "finished_at": now}
            )
    writer.close()


def windowed_judge(body: dict):
    """The scripted judge with a context window: over it, the 400 vLLM answers."""
    from tests.judge_server import context_overflow, good

    if estimate(body["messages"]) > WINDOW:
        return context_overflow()(body)
    return good()(body)


async def a_night(data: Path, config: JudgeConfig, seen: list) -> tuple[int, object]:
    before = len(seen)
    summary = await run_judge(data, config, progress=False)
    return len(seen) - before, summary


def night_calls(work: Path, nights: int, n: int, identical: float, over: float) -> None:
    from aiohttp import web

    from tests.judge_server import SEEN, create_judge_server

    async def run() -> list[tuple]:
        app = create_judge_server([windowed_judge])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001
        url = f"http://127.0.0.1:{port}/v1"
        results = []
        try:
            for budget in (None, WINDOW - 512):
                data = work / f"night-data-{budget}"
                config = JudgeConfig(
                    model="openai/judge", base_url=url, api_key="x", max_prompt_tokens=budget
                )
                for night in range(1, nights + 1):
                    night_groups(data, night, n, identical, over)
                    calls, summary = await a_night(data, config, app[SEEN])
                    results.append((budget, night, calls, summary))
        finally:
            await runner.cleanup()
        return results

    import_litellm()
    results = asyncio.run(run())
    n_over, n_same = round(n * over), round(n * identical)
    print(
        f"\n4. {nights} nights of {n} groups of 4 rollouts: {n_same} a night all identical, "
        f"{n_over} over the judge's {WINDOW}-token window"
    )
    total_before = total_now = 0
    for budget, night, calls, summary in results:
        # Before: every group of 2+ rollouts without a successful judgment was sent: the
        # night's groups, and every refused group of the nights before, again.
        before = n + n_over * (night - 1)
        label = "no budget" if budget is None else f"budget {budget}"
        print(
            f"   night {night}, {label:<12} calls before {before:>4}, now {calls:>4} "
            f"(judged {summary.judged}, failed {summary.failed}, shortened {summary.shortened}; "
            f"skipped: {dict(summary.skipped)})"
        )
        if budget is None:
            total_before, total_now = total_before + before, total_now + calls
    print(
        f"   over {nights} nights without a budget: {total_before} calls before, {total_now} now "
        f"({total_before - total_now} saved, {1 - total_now / total_before:.1%})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="1,2,3,4", help="which parts to run, e.g. 3,4")
    parser.add_argument(
        "--data", type=Path, help="logged groups to size prompts on (default: log new ones)"
    )
    parser.add_argument("--model-dir", type=Path, default=ROOT / ".cache" / "tiny-model")
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--budget", type=int, default=3500, help="part 3's token budget")
    parser.add_argument("--nights", type=int, default=3)
    args = parser.parse_args()
    parts = {int(p) for p in args.parts.split(",")}
    work = Path(tempfile.mkdtemp(prefix="overnight-judge-bench-"))
    if 1 in parts:
        data = args.data
        if data is None:
            data = work / "agent-data"
            print(
                f"logging {args.tasks} groups of {args.group_size} with the example agent "
                "(vLLM on CPU) ...",
                flush=True,
            )
            log_agent_groups(data, args.model_dir, args.tasks, args.group_size)
        prompt_sizes(data, args.model_dir)
    if 2 in parts:
        judge_throughput(work, args.groups, args.delay, args.concurrency)
    if 3 in parts:
        compaction_sizes(8, 4, args.budget)
    if 4 in parts:
        night_calls(work, args.nights, args.groups, identical=0.05, over=0.02)


if __name__ == "__main__":
    main()
