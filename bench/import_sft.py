"""A team's logs of a stronger model, imported: does an --sft night from them raise a
held-out score on the real model (issue 50)?

    flock -s /tmp/overnight-heavy.lock python bench/import_sft.py --seed 7
    python bench/import_sft.py --conversations 96 --wrong 0.3 --samples 16

1. **A day of the team's logs, as they already have them.** Scripted users
   (overnight/testing/scripted_user.py: the sum task of examples/sum_agent.py, its asked
   sums only) talk to a stronger model, written by this script since no hosted model is
   reachable here: the bare right sum, the form the task wants ("7"), except a share
   `--wrong` of answers that are a wrong number, which the users complain about, ask again
   or regenerate (as they do to the base model in bench/implicit_nights.py). Each call is
   written as a logging middleware around the OpenAI SDK writes it, one OpenAI
   chat-completions JSONL line (docs/import.md: request, response, times; the model
   `gpt-4o-mini`), the conversations of yesterday's day a few minutes apart.
2. **The product's path, as a user runs it:** `overnight import --format openai-jsonl`,
   `overnight signals --rewards` (the users' reactions made implicit rewards), `overnight
   train --sft --dry-run` (the plan: what the night takes from the import and why), then
   the night: `--sft-selection min-reward --sft-min-reward 0.5 --reward-source implicit`
   (the answers the users' reactions rate well; docs/import.md), `--preset smollm2-cpu`,
   on SmolLM2-135M-Instruct.
3. **Measured:** the implicit rewards against what the script knows (AUC; how many wrong
   answers the selection kept); the 16 held-out sums (never in the day) sampled from the
   base model and the adapter with the same seeds (8 each at temperature 0.8) and
   greedily, scored right (the reply's last number is the sum) and bare (the sum alone:
   the task's form); the adapter's forgetting on the bundled reference answers, as a
   gated night measures it (the base model's answers cached in .cache/references/).

The pieces are bench/implicit_nights.py's: the scripted user, the held-out sampling, the
forgetting pass (overnight/testing/implicit_trial.py) and vLLM (bench/smollm2_vllm.py).
Results: BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import random
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

TEAM_MODEL = "gpt-4o-mini"  # what the team's agent asked for, and the service answered as
SERVED = "gpt-4o-mini-2024-07-18"
SUM = re.compile(r"What is (\d+) plus (\d+)\?")
PREFIX = "c"  # the scripted conversations' ids: c0, c1, ... (rollouts c0-0, c0-1, ...)
GAP_S = 300.0  # the mean time between two conversations' starts: a few an hour
TURN_S = 30.0  # between a user's messages in one conversation


@dataclass
class TeamDay:
    """The stronger model the team's agent called, and the log its middleware wrote."""

    start_us: int
    conversations: int
    seed: int
    wrong: float  # the share of answers that are a wrong number
    lines: list[dict] = field(default_factory=list)  # the log, in the order the calls came
    starts: list[float] = field(default_factory=list)  # each conversation's first call (us)

    def __post_init__(self) -> None:
        rng = random.Random(f"{self.seed}:arrivals")
        at = float(self.start_us)
        for _ in range(self.conversations):
            self.starts.append(at)
            at += rng.expovariate(1 / GAP_S) * 1e6

    async def chat(self, body: dict, headers: dict) -> dict:
        """scripted_user's Chat: the stronger model's answer, logged as the team logs it."""
        rollout = headers["X-Rollout-Id"]
        conversation, turn = rollout.rsplit("-", 1)
        rng = random.Random(f"{self.seed}:answer:{rollout}")
        started = self.starts[int(conversation[len(PREFIX) :])] + int(turn) * TURN_S * 1e6
        started += rng.uniform(0, 5e6)
        latency = rng.uniform(0.3, 1.2)
        text = self.answer(body["messages"], rng)
        response = {
            "id": f"chatcmpl-{rollout}", "object": "chat.completion",
            "created": int(started / 1e6), "model": SERVED,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 12 * len(body["messages"]), "completion_tokens": 1,
                      "total_tokens": 12 * len(body["messages"]) + 1},
        }  # fmt: skip
        self.lines.append({
            "id": rollout, "request": {**body, "model": TEAM_MODEL}, "response": response,
            "started_at": _iso(started), "ended_at": _iso(started + latency * 1e6),
            "latency_ms": round(latency * 1000, 1),
        })  # fmt: skip
        return response

    def answer(self, messages: list[dict], rng: random.Random) -> str:
        """The bare sum the last user message asks (else the last one asked), or a wrong
        number with probability `wrong`."""
        asked = [m for u in messages if u["role"] == "user" for m in SUM.finditer(u["content"])]
        if not asked:
            return "Which sum do you mean?"
        right = int(asked[-1].group(1)) + int(asked[-1].group(2))
        if rng.random() < self.wrong:
            return str(right + rng.choice([-2, -1, 1, 2, 10]))
        return str(right)

    def write(self, folder: Path) -> Path:
        """The day's log, one call a line in the order they ended, as a middleware appends."""
        folder.mkdir(parents=True, exist_ok=True)
        day = _iso(self.start_us)[:10]
        path = folder / f"openai-calls-{day}.jsonl"
        ordered = sorted(self.lines, key=lambda line: line["ended_at"])
        path.write_text("".join(json.dumps(line) + "\n" for line in ordered))
        return path


def _iso(us: float) -> str:
    at = dt.datetime.fromtimestamp(us / 1e6, dt.UTC)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def yesterday_morning() -> int:
    """09:00 UTC yesterday, in microseconds: a whole day settled, inside every window."""
    today = dt.datetime.now(dt.UTC).replace(hour=9, minute=0, second=0, microsecond=0)
    return int((today - dt.timedelta(days=1)).timestamp() * 1e6)


def scores(pairs: list[tuple[str, str]]) -> dict[str, float]:
    """The share of replies right (their last number is the sum) and bare (the sum alone)."""
    from overnight.examples.rewards import bare_sum
    from overnight.testing.scripted_user import true_reward

    def bare(question: str, reply: str) -> bool:
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        return bare_sum({"messages": messages}) == 1.0

    return {
        "right": statistics.fmean(true_reward(q, r) for q, r in pairs),
        "bare": statistics.fmean(bare(q, r) for q, r in pairs),
    }


def noise(a: float, b: float, n: int) -> float:
    """Two standard errors of a difference of two shares of `n` (unpaired: an upper
    bound, since both models are sampled with the same seeds)."""
    return 2 * math.sqrt((a * (1 - a) + b * (1 - b)) / n)


def agreement(data: Path, truth: dict[str, float], floor: float) -> dict:
    """The implicit rewards against what the script knows: AUC, and the answers at or
    above `floor` (what the night imitates), right and wrong."""
    from overnight.storage import query_rows
    from overnight.testing.implicit_trial import auc

    query = (
        "SELECT json_extract_string(c.notes, '$.imported.id') AS source, r.reward "
        "FROM rewards r JOIN completions c ON c.rollout_id = r.rollout_id "
        "WHERE r.source = 'implicit'"
    )
    rated = {row["source"]: row["reward"] for row in query_rows(data, query)}
    known = {s: v for s, v in rated.items() if s in truth}
    kept = [s for s, v in known.items() if v >= floor]
    kinds = query_rows(
        data, "SELECT kind, count(*) AS n FROM signals GROUP BY kind ORDER BY n DESC"
    )
    return {
        "rated": len(known),
        "auc": auc([(v, truth[s]) for s, v in known.items()]),
        "kept": len(kept),
        "kept_wrong": sum(1 for s in kept if truth[s] == 0.0),
        "signals": ", ".join(f"{k['kind']} {k['n']}" for k in kinds),
    }


def plan_lines(out: str) -> list[str]:
    """What `overnight train --dry-run` says the night would take, and why not the rest."""
    keep = ("group(s)", "sft (", "skipped", "looked at")
    return [line.strip() for line in out.splitlines() if any(k in line for k in keep)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8, help="per held-out sum, per model")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--wrong", type=float, default=0.2, help="share of wrong answers")
    parser.add_argument("--min-reward", type=float, default=0.5, help="--sft-min-reward")
    args = parser.parse_args()

    from smollm2_vllm import CACHE, clock, prepared_model

    from overnight.testing.implicit_trial import TrialSize

    say = clock()
    model = prepared_model(say)
    size = TrialSize(args.conversations, args.turns, args.samples, args.seed)
    with tempfile.TemporaryDirectory(prefix="import-sft-") as work:
        result = run(Path(work), model, size, args, say, CACHE)
    for line in table(result, size, args):
        print(line)


def run(work: Path, model: Path, size, args, say, cache: Path) -> dict:
    """The steps of the module's docstring, in `work`; what the table reads."""
    from smollm2_vllm import smollm2_vllm

    from overnight.examples.sum_agent import ASKED
    from overnight.testing.implicit_trial import forgetting, held_out_replies, trained_adapter
    from overnight.testing.processes import run_overnight
    from overnight.testing.scripted_user import converse_all

    seconds, data = {}, work / "data"
    began = time.monotonic()
    team = TeamDay(yesterday_morning(), size.conversations, size.seed, args.wrong)
    said = asyncio.run(converse_all(team.chat, PREFIX, ASKED, size.conversations, size.seed,
                                    turns=size.turns))  # fmt: skip
    source = team.write(work / "exports")
    say(f"day: {len(team.lines)} calls of {size.conversations} conversations -> {source.name}")
    imported = run_overnight("import", "--data", str(data), str(source), "--format", "openai-jsonl")
    signals = run_overnight("signals", "--data", str(data), "--rewards")
    for line in (imported + signals).splitlines():
        say(f"  {line.strip()}")
    found = agreement(data, said.truth, args.min_reward)
    night = ["--data", str(data), "--base-model", str(model), "--proxy", "", "--no-watch",
             "--sft", "--sft-selection", "min-reward", "--sft-min-reward", str(args.min_reward),
             "--reward-source", "implicit", "--sft-held-out", "0", *size.train]  # fmt: skip
    plan = plan_lines(run_overnight("train", *night, "--dry-run"))
    seconds["day, import, signals, plan"] = time.monotonic() - began
    say("night: overnight train " + " ".join(night[6:]))
    began = time.monotonic()
    out = run_overnight("train", *night, show=lambda line: say(f"  night | {line}"))
    seconds["night"] = time.monotonic() - began
    adapter = trained_adapter(data)
    began = time.monotonic()
    with smollm2_vllm(model, work, say) as url:
        sampled = held_out_replies(url, {"sft": adapter}, size, 0.8, say)
        greedy = held_out_replies(url, {"sft": adapter}, replace(size, samples=1), 0.0, say)
    seconds["vLLM and held-out sampling"] = time.monotonic() - began
    for how, replies in (("sampled", sampled), ("greedy", greedy)):
        said_scores = {m: scores(p) for m, p in replies.items()}
        say(f"held out, {how}: " + ", ".join(
            f"{m} right {v['right']:.3f} bare {v['bare']:.3f}" for m, v in said_scores.items()))  # fmt: skip
    began = time.monotonic()
    forgot, budget = forgetting(model, {"sft": adapter}, cache, say)
    seconds["forgetting"] = time.monotonic() - began
    return {
        "calls": len(team.lines), "answers": len(said.truth),
        "wrong": sum(1 for v in said.truth.values() if v == 0.0), "found": found,
        "plan": plan, "trained": [x.strip() for x in out.splitlines() if "group(s), " in x],
        "sampled": {m: scores(p) for m, p in sampled.items()},
        "greedy": {m: scores(p) for m, p in greedy.items()},
        "examples": list(zip(greedy["base"][:4], greedy["sft"][:4], strict=True)),
        "forgetting": forgot["sft"], "budget": budget, "seconds": seconds,
    }  # fmt: skip


def table(r: dict, size, args) -> list[str]:
    """The result as the benchmark prints it (and BENCHMARKS.md records it)."""
    f = r["found"]
    n_sampled, n_greedy = 16 * size.samples, 16
    out = [
        f"day: {r['calls']} calls (openai-jsonl), {r['answers']} answers the users read, "
        f"{r['wrong']} of them wrong (--wrong {args.wrong:g})",
        f"signals: {f['signals']}",
        f"implicit rewards: {f['rated']} answers rated, AUC against the truth "
        + (f"{f['auc']:.3f}" if f["auc"] is not None else "-")
        + f"; at or above {args.min_reward:g}: {f['kept']}, of them wrong {f['kept_wrong']}",
        "the night's plan (overnight train --sft --dry-run):",
        *(f"  {line}" for line in r["plan"]),
        *(f"night: {line}" for line in r["trained"]),
        "",
        f"{'held out: 16 sums never in the day':50} {'base':>6} {'sft':>6} {'change':>7} {'2 SE':>6}",
    ]
    for how, n in (("sampled", n_sampled), ("greedy", n_greedy)):
        for what in ("right", "bare"):
            b, s = r[how]["base"][what], r[how]["sft"][what]
            name = f"{what} ({how}, {n} replies" + (", T 0.8, fixed seeds)" if n > 16 else ")")
            out.append(f"{name:50} {b:6.3f} {s:6.3f} {s - b:+7.3f} {noise(b, s, n):6.3f}")
    out += [
        f"forgetting on the bundled references: {r['forgetting']:+.3f} nats/token vs the base "
        f"model (a gated night's budget {r['budget']:g})",
        "greedy, base -> sft: "
        + "; ".join(
            f"{q.removeprefix('What is ')} {b!r} -> {s!r}" for (q, b), (_, s) in r["examples"]
        ),
        "seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in r["seconds"].items()),
    ]
    return out


if __name__ == "__main__":
    main()
