"""`overnight demo`: the whole story on embedded defaults, in minutes on 2 cores.

  prepare a local model -> vLLM (CPU) and the proxy -> a "day" of traffic from an
  example agent, unchanged (OpenAI SDK, rollout headers) -> the "night": score the
  day's groups, `overnight train`, gate, promote -> the next day runs on the new adapter.

Two stories, one path (`--model`):
- `smollm2` (the default): SmolLM2-135M-Instruct, a real instruct model prepared from a
  pip package (overnight/models/smollm2.py). The agent (examples/sum_agent.py) adds two
  digits and must reply with the sum alone, which the untrained model knows how to do
  but never does; nights train on its day's groups and each day also asks sixteen
  held-out sums four times each (never trained on): the table's held-out column, and the
  gate's prompts.
- `tiny`: the tiny random model of the fast tests (a minute or two): the number agent
  (examples/number_agent.py: numbers only) and the search agent (RULER's use case,
  judged only when `--judge-model` is given); eight held-out questions reworded.

Every step is a subprocess running the same command a user would type. Each night's
train is gated (trainer/gate/verdict.py) with the same reward function: the gate samples
the new adapter and the served one on the day's held-out prompts and promotes only when
the new one is not worse; the verdict is printed for every night.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from overnight.examples.number_agent import QUESTIONS
from overnight.storage import query_rows
from overnight.testing.processes import run_overnight


@dataclass(frozen=True)
class Story:
    """What a demo model needs: how it is served, its agent's day, and its night."""

    model: str  # the --model name, and the name vLLM serves the base under
    preset: str  # overnight train --preset
    reward: str  # the reward function of the agent's groups and of the gate
    trained: str  # SQL LIKE of the agent's groups, the ones nights train on
    held_out: str  # SQL LIKE of the held-out groups of one (the gate's prompts)
    gate_prompts: int
    vllm_args: tuple[str, ...]  # overnight serve flags for vLLM
    day: Callable[[dict, str, str], None]  # (agent env, proxy url, day tag)


# A day of the tiny model's number agent: 8 tasks x 8 attempts; vLLM's top_k makes the
# random tiny model's sampling peaked the way a trained model's is.
NUMBERS_DAY = ("--tasks", "8", "--group-size", "8", "--top-k", "50")


def _tiny_day(env: dict, base: str, tag: str) -> None:
    _agent("number_agent", env, *NUMBERS_DAY, "--run", tag)
    search = ("--questions", "2", "--group-size", "4", "--max-turns", "2", "--max-tokens", "48")
    _agent("search_agent", env, *search, "--run", tag)
    _tiny_held_out(base, tag)


def _smollm2_day(env: dict, base: str, tag: str) -> None:
    # 16 sums x 4 attempts at temperature 0.8 (the agent's defaults), then the 16
    # held-out sums 4 times each, as groups of one (docs/grpo.md: the smollm2-cpu preset).
    _agent("sum_agent", env, "--run", tag)
    _agent("sum_agent", env, "--held-out", "--run", tag)


# The tiny model's held-out prompts: the agent's own questions as tomorrow may word them,
# never the same conversations (so never trained on). Unrelated questions ("How many
# chairs?") measured generalisation the tiny model does not have: every night's candidate
# was measurably worse on them (-0.16 to -0.21) while better on the agent's task.
TINY_HELD_OUT = [
    wording.format(q=q[0].lower() + q[1:])
    for q in QUESTIONS
    for wording in ("Quick one: {q}", "Form field: {q}", "Please answer: {q}", "Next: {q}")
]
# The gate samples each adapter once per held-out prompt and keeps its default margin,
# half the served adapter's reward spread over those prompts. On the tiny model's 32 the
# first night is about even with the base (measured 0.02-0.05 worse over 64 replies; its
# gains on the agent's own questions come from the second night on, BENCHMARKS.md), and
# 32 single replies leave an interval of about +-0.1: inside that margin, while a
# collapse, as a sabotaged night is (tests/test_gate.py), lies wholly below zero and is
# refused.
STORIES = {
    "smollm2": Story(
        model="smollm2",
        preset="smollm2-cpu",
        reward="overnight.examples.rewards:bare_sum",
        trained="sums-%",
        held_out="heldout-%",
        gate_prompts=16,
        vllm_args=("--max-lora-rank", "8", "--vllm-arg=--max-model-len=1024"),
        day=_smollm2_day,
    ),
    "tiny": Story(
        model="tiny",
        preset="tiny-cpu",
        reward="overnight.examples.rewards:numbers_only",
        trained="numbers-%",
        held_out="heldout-%",
        gate_prompts=len(TINY_HELD_OUT),
        vllm_args=("--max-lora-rank", "8", "--vllm-arg=--max-model-len=4096"),
        day=_tiny_day,
    ),
}


@dataclass
class Day:
    number: int
    reward: float  # the agent's groups (the ones the night trains on)
    held_out: float  # the held-out groups of one, never trained on
    served: str
    traffic_s: float
    scoring_s: float
    training_s: float
    judged: str = "-"
    gate: str = "-"  # the night's gate verdict line ("-": no training that night)


def _agent(module: str, env: dict, *args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", f"overnight.examples.{module}", *args],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def run_demo(
    data: str,
    port: int,
    model: str = "smollm2",
    model_dir: str | None = None,
    days: int = 4,
    upstream: str | None = None,
    judge_model: str | None = None,
    judge_base_url: str | None = None,
    say=print,
) -> list[Day]:
    """The story of `model` (a STORIES name) over `days` days, the last one only scored:
    about two minutes for the tiny model, ten for SmolLM2 on two cores (BENCHMARKS.md)."""
    from overnight.testing.processes import spawn_serve

    story = STORIES[model]
    started = time.monotonic()
    if upstream:
        say(f"starting the proxy in front of {upstream} (serving {story.model})")
        serve = spawn_serve(data, "--upstream", upstream, port=port)
    else:
        say(f"preparing the {story.model} model (reused when present)")
        model_dir = run_overnight("prepare-model", story.model,
                               *(["--out", model_dir] if model_dir else [])).strip()  # fmt: skip
        say(f"starting vLLM (CPU) on {model_dir} and the proxy; their logs go to {data}/logs/")
        serve = _serve(story, model_dir, data, port)
    say(f"proxy ready at {serve.url}/v1 after {time.monotonic() - started:.0f} s")
    results: list[Day] = []
    try:
        for day in range(1, days + 1):
            # The last day is only scored, to see where the policy ended.
            night = _Night(story, data, serve.url, judge_model, judge_base_url, say)
            results.append(night.run(day, train=day < days))
    finally:
        say("stopping the server (it commits and compacts its log first)")
        serve.stop()
    _summary(data, results)
    report = Path(data) / "reports" / "training.html"
    say(f"done in {time.monotonic() - started:.0f} s. The training report: {report}")
    say(f"next: overnight runs --data {data}; overnight ls --data {data}")
    fronts = (f"--upstream {upstream}" if upstream else f"--model {model_dir} --served-model-name "
              f"{story.model} --vllm-arg=--dtype=float32")  # fmt: skip
    say(f"      the web view: overnight serve {fronts} --data {data}, then open "
        "http://127.0.0.1:8000/ui")  # fmt: skip
    return results


def _serve(story: Story, model_dir: str, data: str, port: int):
    """`overnight serve --model` for the demo's model, started and healthy."""
    from overnight.testing.processes import serve_local_model

    return serve_local_model(data, model_dir, story.model, *story.vllm_args, port=port)


# The lines of a night the demo passes on as they come.
PROGRESS = ("step ", "memory:", "on-policy:", "stale data:", "warning:", "gate (")


@dataclass
class _Night:
    """One day of agent traffic through the proxy at `base`, then that night's scoring
    and (when it trains) training, gate and promotion, in the order the demo prints them."""

    story: Story
    data: str
    base: str
    judge_model: str | None
    judge_base_url: str | None
    say: Callable[[str], None]

    def run(self, day: int, train: bool) -> Day:
        tag = f"{uuid.uuid4().hex[:4]}d{day}"
        t0 = time.monotonic()
        self.say(f"day {day}: the example agents run through the proxy")
        env = dict(os.environ, OPENAI_BASE_URL=self.base + "/v1", OPENAI_API_KEY="unused")
        self.story.day(env, self.base, tag)
        traffic = time.monotonic() - t0

        t0 = time.monotonic()
        groups, held_out = self.score(day)
        judged = self.judge(day, tag) if self.judge_model else "-"
        scoring = time.monotonic() - t0

        t0 = time.monotonic()
        gate = self.train(day) if train else "-"
        training = time.monotonic() - t0

        reward, served = self.mean(groups)
        held, _ = self.mean(held_out)
        self.say(
            f"day {day}: mean reward {reward:.3f}, held-out {held:.3f}, served by {served}; "
            f"traffic {traffic:.0f} s, scoring {scoring:.0f} s, training {training:.0f} s"
        )
        return Day(day, reward, held, served, traffic, scoring, training, judged, gate)

    def score(self, day: int) -> tuple[list[str], list[str]]:
        """Score the day's agent and held-out groups with the story's reward function."""
        story = self.story
        rows = query_rows(
            self.data,
            "SELECT group_id, group_id LIKE '" + story.held_out + "' AS held FROM groups "
            f"WHERE (group_id LIKE '{story.trained}' OR group_id LIKE '{story.held_out}') "
            "AND rewarded = 0",
        )
        groups = [r["group_id"] for r in rows if not r["held"]]
        held_out = [r["group_id"] for r in rows if r["held"]]
        group_args = [a for r in rows for a in ("--group", r["group_id"])]
        self.say(f"night {day}: overnight judge --reward {story.reward} ({len(rows)} groups)")
        run_overnight("judge", "--data", self.data, "--settle", "0", "--reward", story.reward,
                   *group_args)  # fmt: skip
        return groups, held_out

    def judge(self, day: int, tag: str) -> str:
        """RULER on the search agent's groups (the tiny story's), with --judge-model."""
        self.say(f"night {day}: overnight judge --judge-model {self.judge_model} (search groups)")
        judge = ["judge", "--data", self.data, "--settle", "0", "--judge-model", self.judge_model]
        judge += ["--judge-base-url", self.judge_base_url] if self.judge_base_url else []
        judge += [a for q in range(2) for a in ("--group", f"handbook-{tag}-{q}")]
        out = run_overnight(*judge)
        return out.splitlines()[0] if out else "-"

    def train(self, day: int) -> str:
        """The night's `overnight train`, gated on the held-out prompts; its verdict line."""
        story = self.story
        self.say(f"night {day}: overnight train --preset {story.preset} --no-watch "
                 "(gated, then promote)")  # fmt: skip
        # Without the watch: the demo shows what training alone does day by day. With it,
        # a night whose adapter dipped on a small model's noisy rewards would be rolled
        # back (as it should be in production: `overnight watch`, docs/operations.md).

        def progress(line: str) -> None:
            # The steps (rate, time left), the memory check's choice, and what the first
            # step saw: the day's own records, sampled by the starting adapter.
            if line.startswith(PROGRESS):
                self.say(f"night {day}: {line}")

        out = run_overnight(
            "train", "--data", self.data, "--proxy", self.base, "--preset", story.preset,
            "--settle", "0", "--no-watch", "--gate-reward", story.reward,
            "--gate-prompts", str(story.gate_prompts), show=progress,
        )  # fmt: skip
        return next((line for line in out.splitlines() if line.startswith("gate (")), "-")

    def mean(self, groups: list[str]) -> tuple[float, str]:
        """The mean reward of `groups`' rollouts, and what served them."""
        if not groups:
            return float("nan"), "-"
        (row,) = query_rows(
            self.data,
            "SELECT avg(reward) AS reward, string_agg(DISTINCT models_served, ',') AS served "
            "FROM rollouts WHERE list_contains(?, group_id)",  # ids as data, never as SQL
            [groups],
        )
        return row["reward"], row["served"]


def _tiny_held_out(base: str, tag: str) -> None:
    """Each of TINY_HELD_OUT once, as the number agent asks (a rollout, then finished);
    groups of one, which no night trains on: the gate's held-out prompts, sent as
    overnight's own (`eval`), so that `overnight ls` and /ui list the agents' first."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from overnight.examples.number_agent import SYSTEM
    from overnight.examples.sum_agent import measurement_headers

    marked = measurement_headers()  # the demo's measurement, not the agent's traffic

    def ask(http: httpx.Client, i: int, question: str) -> None:
        rollout = f"heldout-{tag}-{i}.0"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        body = {"model": "policy", "messages": messages, "max_tokens": 12, "temperature": 1.0}
        headers = {"X-Rollout-Group": f"heldout-{tag}-{i}", "X-Rollout-Id": rollout, **marked}
        answer = http.post("/v1/chat/completions", json={**body, "top_k": 50}, headers=headers)
        answer.raise_for_status()
        http.post(f"/v1/rollouts/{rollout}/finish").raise_for_status()

    with httpx.Client(base_url=base, timeout=120) as http, ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: ask(http, *item), enumerate(TINY_HELD_OUT)))


def _summary(data: str, results: list[Day]) -> None:
    """The table test_demo reads, each night's gate verdict, and the count of failed
    requests (the groups themselves are one `overnight ls` away)."""
    (failures,) = query_rows(
        data,
        "SELECT count(*) AS n FROM completions WHERE error IS NOT NULL OR http_status <> 200",
    )
    print("\nday  mean reward  held-out  served by                   traffic  scoring  training")
    for d in results:
        print(
            f"{d.number:>3}  {d.reward:11.3f}  {d.held_out:8.3f}  {d.served:<26} "
            f"{d.traffic_s:6.0f}s {d.scoring_s:7.0f}s {d.training_s:8.0f}s"
        )
    for d in results[:-1]:
        print(f"night {d.number} {d.gate}")
    print(f"failed requests: {failures['n']}")
