"""An agent for tasks others wrote: reasoning-gym's questions, scored by reasoning-gym.

Each of `--size` questions of a reasoning-gym task (`reasoning_gym.create_dataset(--task,
size, seed, **difficulty)`) is asked `--group-size` times: one GRPO group per question, one
rollout per attempt, each question after `--shots` worked examples of the task (questions
of a fixed other seed with their answers, as earlier turns: they show the answer's form).
The reply (its text, stripped of surrounding whitespace) is scored by
the dataset's own `score_answer`, and that score is posted as the attempt's reward (metrics:
the task, the answer given, the answer expected); then the rollout is finished. Written with
the plain `openai` SDK: it runs unchanged against OpenAI or a plain vLLM, where the rollout
headers are ignored; `--no-rewards` skips the reward and finish posts, and a server without
those routes (404) is noticed once and not asked again.

`--held-out` is a measurement, not traffic to train on: the questions come from another
seed (`--seed` + HELD_OUT_SEED, so they are not the training questions of the same seed),
each attempt is a group of its own (`heldout-...`, nothing for GRPO to compare), no reward
is posted, and the requests carry `X-Rollout-Origin: eval` (with `X-Rollout-Origin-Token`
from OVERNIGHT_ADMIN_TOKEN where one is set), which the proxy honours from the operator
only (docs/wire.md): its nights never train such groups. The score is printed, and with
`--summary-json PATH` written as JSON, for bench code.

    pip install -e ".[tasks]"
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python examples/reasoning_gym_agent.py \\
        --task basic_arithmetic --size 16 --group-size 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import uuid

import httpx
import openai

# A small model answers in sentences, and often with its instructions' own words ("No
# working, no explanation." was SmolLM2's greedy answer to three tasks): worked examples
# of the task's own (`--shots`, another seed's questions with their answers) show the form
# the verifier wants, where an instruction alone does not.
SYSTEM = "Reply with the final answer only."
HELD_OUT_SEED = 1_000_003  # added to --seed in --held-out mode: other questions
EXAMPLES_SEED = 2_000_003  # the worked examples' questions: the same for every --seed
HELD_OUT_DRAWS = 1_000  # held-out sampling seeds: question * HELD_OUT_DRAWS + attempt


def difficulty(values: list[str]) -> dict:
    """`key=value` pairs; a value is read as JSON where it parses (3, 0.5, [1, 2], true),
    else kept as text."""
    out = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--difficulty wants key=value, got {item!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def eval_headers() -> dict[str, str]:
    """The mark of a measurement (docs/wire.md, X-Rollout-Origin), honoured from the
    operator only: with the admin token, or from loopback where none is set."""
    token = os.environ.get("OVERNIGHT_ADMIN_TOKEN")
    mark = {"X-Rollout-Origin": "eval"}
    return {**mark, "X-Rollout-Origin-Token": token} if token else mark


class Rewards:
    """The proxy's reward and finish routes; a server without them is asked once."""

    def __init__(self, http: httpx.AsyncClient, enabled: bool) -> None:
        self.http, self.enabled = http, enabled

    async def post(self, rollout: str, reward: float | None, metrics: dict) -> None:
        if not self.enabled:
            return
        calls = [(f"/rollouts/{rollout}/reward", {"reward": reward, "metrics": metrics})]
        calls = (calls if reward is not None else []) + [(f"/rollouts/{rollout}/finish", None)]
        for path, body in calls:
            r = await self.http.post(path, json=body)
            if r.status_code in (404, 405):  # OpenAI, a plain vLLM: no such routes
                print(f"the server has no {path.split('/')[-1]} route: rewards not posted")
                self.enabled = False
                return
            r.raise_for_status()


def worked_examples(task: str, options: dict, shots: int) -> list[dict]:
    """`shots` questions of the task with their answers, as earlier turns of the
    conversation: the same for every --seed, and never one of the asked questions."""
    if shots <= 0:
        return []
    import reasoning_gym

    ds = reasoning_gym.create_dataset(task, size=shots, seed=EXAMPLES_SEED, **options)
    turns = []
    for i in range(shots):
        turns += [{"role": "user", "content": ds[i]["question"]},
                  {"role": "assistant", "content": str(ds[i]["answer"])}]  # fmt: skip
    return turns


def task_messages(question: str, examples: list[dict]) -> list[dict]:
    """What the agent sends: its instruction, the worked examples, the question."""
    return [{"role": "system", "content": SYSTEM}, *examples,
            {"role": "user", "content": question}]  # fmt: skip


async def attempt(
    client: openai.AsyncOpenAI,
    rewards: Rewards,
    args: argparse.Namespace,
    task: dict,
    score,
    group: str,
    marked: dict[str, str],
    examples: list[dict],
    seed: int | None = None,
) -> dict:
    rollout = f"{group}.{uuid.uuid4().hex[:8]}"
    reply = await client.chat.completions.create(
        model=args.model,
        messages=task_messages(task["question"], examples),
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=openai.NOT_GIVEN if seed is None else seed,
        extra_headers={"X-Rollout-Group": group, "X-Rollout-Id": rollout, **marked},
    )
    answer = (reply.choices[0].message.content or "").strip()
    reward = float(score(answer, task))
    metrics = {"task": args.task, "answer": answer, "expected": task["answer"]}
    await rewards.post(rollout, None if args.held_out else reward, metrics)
    return {"rollout_id": rollout, "group": group, "answer": answer, "reward": reward}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="basic_arithmetic", help="a reasoning-gym dataset")
    parser.add_argument("--difficulty", nargs="*", default=[], metavar="KEY=VALUE",
                        help="the dataset's options, e.g. min_terms=2 max_digits=3")  # fmt: skip
    parser.add_argument("--size", type=int, default=8, help="questions (groups)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=4, help="attempts per question")
    parser.add_argument("--shots", type=int, default=2,
                        help="worked examples of the task before each question (0: none)")  # fmt: skip
    parser.add_argument("--model", default=os.environ.get("OVERNIGHT_MODEL", "policy"))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8, help="requests at once")
    parser.add_argument("--run", default=uuid.uuid4().hex[:6], help="tag in the group ids")
    parser.add_argument("--held-out", action="store_true",
                        help="measure on held-out questions: marked eval, no rewards")  # fmt: skip
    parser.add_argument("--no-rewards", action="store_true",
                        help="post no rewards or finishes (plain servers)")  # fmt: skip
    parser.add_argument("--summary-json", help="also write the summary here, as JSON")
    args = parser.parse_args(argv)
    args.options = difficulty(args.difficulty)
    return args


async def run(args: argparse.Namespace) -> dict:
    import reasoning_gym  # the `tasks` extra: pip install -e ".[tasks]"

    seed = args.seed + (HELD_OUT_SEED if args.held_out else 0)
    dataset = reasoning_gym.create_dataset(args.task, size=args.size, seed=seed, **args.options)
    examples = worked_examples(args.task, args.options, args.shots)
    base_url = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    api_key = os.environ.get("OPENAI_API_KEY", "unused")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=300)
    prefix = "heldout" if args.held_out else "rg"
    marked = eval_headers() if args.held_out else {}
    limit = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
    ) as http:
        rewards = Rewards(http, enabled=not args.no_rewards)

        async def one(i: int, k: int) -> dict:
            # held out: each attempt a group of its own; else one group per question
            group = f"{prefix}-{args.task}-{args.run}-{i}" + (f"-{k}" if args.held_out else "")
            # Held out: each question's k-th answer drawn with the same seed whatever
            # model answers, so that two models' scores differ by what they learnt more
            # than by their draws (common random numbers); the days' answers are unseeded.
            seed = i * HELD_OUT_DRAWS + k if args.held_out else None
            async with limit:
                result = await attempt(
                    client, rewards, args, dataset[i], dataset.score_answer, group, marked,
                    examples, seed,
                )  # fmt: skip
            return {**result, "question": i}

        jobs = [one(i, k) for i in range(len(dataset)) for k in range(args.group_size)]
        results = await asyncio.gather(*jobs)
    return summarise(args, results)


def summarise(args: argparse.Namespace, results: list[dict]) -> dict:
    per_question: dict[int, list[float]] = {}
    for r in results:
        per_question.setdefault(r["question"], []).append(r["reward"])
    mean = sum(r["reward"] for r in results) / max(len(results), 1)
    for i, scores in sorted(per_question.items()):
        print(f"question {i}: mean score {sum(scores) / len(scores):.2f} over {len(scores)}")
    kind = "held-out" if args.held_out else "training"
    print(f"{len(results)} attempts at {len(per_question)} {args.task} question(s) ({kind}): "
          f"mean score {mean:.3f}")  # fmt: skip
    summary = {"task": args.task, "held_out": args.held_out, "attempts": len(results),
               "questions": len(per_question), "mean_score": mean,
               "per_question": {str(i): s for i, s in sorted(per_question.items())}}  # fmt: skip
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def main(argv: list[str] | None = None) -> dict:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    main()
