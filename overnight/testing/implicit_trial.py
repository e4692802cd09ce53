"""Implicit rewards against posted ones: one day of scripted users, a night on each.

The proof of the source `implicit` (docs/signals.md, docs/grpo.md): does a night trained
on what users did next learn what a night trained on the true reward learns?

1. **A day.** Scripted users (scripted_user.py) talk to the base model through the proxy,
   each answer a rollout of its own; the users know their true rewards, the store does
   not.
2. **Two copies of it.** `implicit`: `overnight signals --rewards` turns the reactions
   into rewards. `posted`: the true rewards, posted as the agent's (source `agent`), and
   `overnight signals` prints how well the signals agree with them.
3. **A night on each**, the same options but the reward source: every answer is a group
   of one, so both train as lone turns against the night's pool (trainer/choose/lone_turns.py).
4. **Held-out sums** (examples/sum_agent.py's, never asked by day), sampled by vLLM from
   the base model and from each night's adapter with the same seeds, scored by the true
   reward: each night's gain over the base, and the implicit night's share of the posted
   one's.

The benchmark bench/implicit_nights.py runs it on SmolLM2 at full size; the test
tests/test_implicit_nights.py at a smaller one on the session's vLLM.

**Hindsight** (`run_hindsight_trial`, bench/implicit_nights.py --hindsight; issue 48):
the users correct a wrong answer with the right sum ("No, it's 7."); one copy of the day
trains on the implicit rewards as above, another with `overnight train --hindsight` (the
corrected answers revised by the base model shown the correction, imitated without it:
trainer/choose/hindsight.py); the held-out sums compare base, implicit and hindsight with
the same seeds, and each adapter's forgetting on the bundled reference set is measured
as a gated night measures it (trainer/gate/forgetting.py). A third night, `distill`, runs
`--hindsight --hindsight-mode distill --resample 4` on the same day: the served answers and
four resampled siblings of each corrected turn, each token's advantage the teacher's
logprob with the hint minus the student's without (trainer/grpo/distill.py). `arms` picks
the nights (HINDSIGHT_ARMS).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import statistics
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from overnight.examples.sum_agent import ASKED, HELD_OUT, SYSTEM
from overnight.storage import query_rows

from .processes import run_overnight
from .scripted_user import Conversation, converse_all, true_reward


@dataclass(frozen=True)
class TrialSize:
    conversations: int = 48  # a day's conversations, each up to `turns` answers
    turns: int = 3
    samples: int = 8  # per held-out sum, per model
    seed: int = 7
    # Every answer is a group of one: 16 a step is as many sequences as the demo's four
    # groups of four (the smollm2-cpu preset's steps).
    train: tuple[str, ...] = ("--preset", "smollm2-cpu", "--groups-per-step", "16")
    corrects: bool = False  # the users correct with the right sum (the hindsight trial)


@dataclass
class TrialResult:
    answers: int = 0  # answers the users gave a true reward to
    rewarded: int = 0  # of them, with an implicit reward
    auc: float | None = None  # implicit rewards against the true ones
    trained: dict[str, str] = field(default_factory=dict)  # arm -> the plan's lone-turn line
    held_out: dict[str, float] = field(default_factory=dict)  # base/implicit/posted -> mean

    @property
    def gains(self) -> dict[str, float]:
        return {arm: self.held_out[arm] - self.held_out["base"] for arm in ("implicit", "posted")}

    @property
    def share(self) -> float:
        gains = self.gains
        return gains["implicit"] / gains["posted"] if gains["posted"] > 0 else float("nan")

    def lines(self) -> list[str]:
        h, g = self.held_out, self.gains
        return [
            f"day: {self.answers} answers, {self.rewarded} with an implicit reward, AUC against "
            f"the true reward {self.auc:.3f}"
            if self.auc is not None
            else "day: no AUC",
            *(f"night on {arm}: {line}" for arm, line in self.trained.items()),
            f"held-out true reward: base {h['base']:.3f}, implicit {h['implicit']:.3f} "
            f"({g['implicit']:+.3f}), posted {h['posted']:.3f} ({g['posted']:+.3f}); "
            f"implicit's share of the posted gain {self.share:.2f}",
        ]


async def log_day(upstream: str, data: Path, size: TrialSize) -> Conversation:
    """The day's conversations through an in-process proxy in front of `upstream`
    (vLLM); its store closed when they are done."""
    from aiohttp.test_utils import TestClient, TestServer

    from overnight.config import ProxyConfig
    from overnight.proxy import create_app

    config = ProxyConfig(upstream=upstream, data_dir=data, commit_interval=0.0)
    async with TestClient(TestServer(create_app(config))) as proxy:

        async def chat(body: dict, headers: dict) -> dict:
            r = await proxy.post("/v1/chat/completions", json=body, headers=headers)
            if r.status != 200:
                raise RuntimeError(f"the proxy answered {r.status}: {await r.text()}")
            return await r.json()

        return await converse_all(chat, "c", ASKED, size.conversations, size.seed,
                                  turns=size.turns, corrects=size.corrects)  # fmt: skip


def run_trial(
    upstream: str, model_dir: Path, work: Path, size: TrialSize, say=print
) -> TrialResult:
    """The whole trial in `work` (see the module's docstring)."""
    result = TrialResult()
    day = work / "day"
    say(f"day: {size.conversations} scripted conversations through the proxy")
    truth = asyncio.run(log_day(upstream, day, size)).truth
    result.answers = len(truth)
    arms = {arm: work / arm for arm in ("implicit", "posted")}
    for path in arms.values():
        shutil.copytree(day, path, ignore=shutil.ignore_patterns("logs"))
    run_overnight("signals", "--data", str(arms["implicit"]), "--rewards", "--quiet", "0h")
    implicit = _implicit_rewards(arms["implicit"])
    result.rewarded = len(implicit.keys() & truth.keys())
    result.auc = auc([(v, truth[r]) for r, v in implicit.items() if r in truth])
    _post(arms["posted"], truth)
    agreement = run_overnight("signals", "--data", str(arms["posted"]), "--quiet", "0h")
    say("posted side: " + " ".join(agreement.split()))
    adapters = {}
    for arm, path in arms.items():
        source = "implicit" if arm == "implicit" else "agent"
        say(f"night on {arm}: overnight train --reward-source {source} {' '.join(size.train)}")
        out = run_overnight(
            "train", "--data", str(path), "--base-model", str(model_dir), "--proxy", "",
            "--settle", "0", "--no-watch", "--lone-turns", "pool", "--reward-source", source,
            *size.train,
        )  # fmt: skip
        result.trained[arm] = next((x.strip() for x in out.splitlines() if "lone turns" in x), "-")
        adapters[arm] = trained_adapter(path)
    say("held out: sampling the base model and both nights' adapters")
    result.held_out = held_out_means(upstream, adapters, size)
    for line in result.lines():
        say(line)
    return result


def held_out_means(upstream: str, adapters: dict[str, Path], size: TrialSize) -> dict[str, float]:
    """The mean true reward on the held-out sums of the base model and of each adapter,
    sampled by the vLLM at `upstream` (the adapters loaded under names of their own for
    the while): each sum `size.samples` times in one request, from the same seed for
    every model, so that the models differ by what they learnt, not by their draws."""
    replies = held_out_replies(upstream, adapters, size)
    return {
        model: statistics.fmean(true_reward(q, reply) for q, reply in pairs)
        for model, pairs in replies.items()
    }


def held_out_replies(
    upstream: str, adapters: dict[str, Path], size: TrialSize, temperature: float = 0.8, say=None
) -> dict[str, list[tuple[str, str]]]:
    """Each model's (held-out sum, reply) pairs, sampled as `held_out_means` samples them
    (`base` first, then each adapter), at `temperature` (0: greedy); `say` is told the
    progress, with the time left."""
    return asyncio.run(_held_out_replies(upstream, adapters, size, temperature, say))


async def _held_out_replies(upstream, adapters, size, temperature, say):
    import aiohttp

    from overnight.progress import Progress

    tag = uuid.uuid4().hex[:6]
    names = {arm: f"trial-{tag}-{arm}" for arm in adapters}
    progress = Progress(say, f"held out (temperature {temperature:g}): sampled",
                        len(HELD_OUT) * (1 + len(adapters)), "sums")  # fmt: skip
    async with aiohttp.ClientSession(upstream) as http:

        async def post(path: str, body: dict) -> str:
            async with http.post(path, json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"vLLM answered {r.status} to {path}: {await r.text()}")
                return await r.text()

        async with http.get("/v1/models") as r:
            base = next(m["id"] for m in (await r.json())["data"] if m.get("parent") is None)
        for arm, path in adapters.items():
            await post("/v1/load_lora_adapter", {"lora_name": names[arm], "lora_path": str(path)})
        try:

            async def replies(model: str) -> list[tuple[str, str]]:
                async def one(i: int, question: str) -> list[tuple[str, str]]:
                    body = {"model": model, "n": size.samples, "seed": size.seed * 1000 + i,
                            "temperature": temperature, "top_p": 1.0, "max_tokens": 24,
                            "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": question}]}  # fmt: skip
                    answer = json.loads(await post("/v1/chat/completions", body))
                    progress.advance()
                    return [(question, c["message"]["content"] or "") for c in answer["choices"]]

                each = await asyncio.gather(*(one(i, q) for i, q in enumerate(HELD_OUT)))
                return [pair for pairs in each for pair in pairs]

            out = {"base": await replies(base)}
            for arm in adapters:
                out[arm] = await replies(names[arm])
            progress.finish()
            return out
        finally:
            for name in names.values():  # whatever the answer: the names are never reused
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.post("/v1/unload_lora_adapter", json={"lora_name": name}):
                        pass


def auc(scored: list[tuple[float, float]]) -> float | None:
    """How often a pair of answers with different true rewards is ordered the same way by
    the implicit rewards (ties half): 1 the same order, 0.5 chance."""
    wins = pairs = 0.0
    for i, (a, ta) in enumerate(scored):
        for b, tb in scored[i + 1 :]:
            if ta != tb:
                pairs += 1
                same = (a - b) * (ta - tb)
                wins += 1.0 if same > 0 else 0.5 if same == 0 else 0.0
    return wins / pairs if pairs else None


def _implicit_rewards(data: Path) -> dict[str, float]:
    query = "SELECT rollout_id, reward FROM rewards WHERE source = 'implicit'"
    return {row["rollout_id"]: row["reward"] for row in query_rows(data, query)}


def _post(data: Path, truth: dict[str, float]) -> None:
    """The users' true rewards as an agent posts them (source `agent`)."""
    from overnight.storage import LogWriter, WriterConfig, new_id, now_us
    from overnight.storage.schema import SCHEMA_VERSION

    writer = LogWriter(WriterConfig(data, compact_in_process=True))
    writer.start()
    try:
        for rollout, reward in truth.items():
            writer.append("rewards", {
                "reward_id": new_id(), "schema_version": SCHEMA_VERSION, "rollout_id": rollout,
                "reward": reward, "source": "agent", "created_at": now_us(),
                "proxy_id": writer.writer_id,
            })  # fmt: skip
    finally:
        writer.close()


def trained_adapter(data: Path) -> Path:
    """The adapter of the newest night that trained in `data`."""
    query = "SELECT run_id FROM training_runs WHERE status = 'trained' ORDER BY started_at DESC"
    out = query_rows(data, query)
    if not out:
        raise RuntimeError(f"no night trained in {data}")
    return data / "adapters" / out[0]["run_id"]


@dataclass
class HindsightResult:
    answers: int = 0  # answers the users gave a true reward to
    corrected: int = 0  # of them, wrong and reacted to (corrected with the sum, or regenerated)
    trained: dict[str, list[str]] = field(default_factory=dict)  # arm -> the plan's lines
    held_out: dict[str, float] = field(default_factory=dict)  # base/implicit/hindsight
    forgetting: dict[str, float] = field(default_factory=dict)  # arm -> nats/token
    budget: float = 0.1
    seconds: dict[str, float] = field(default_factory=dict)  # step -> wall seconds

    def lines(self) -> list[str]:
        h = self.held_out
        arms = [arm for arm in h if arm != "base"]
        return [
            f"day: {self.answers} answers, {self.corrected} wrong ones reacted to (corrected "
            "with the sum, or regenerated)",
            *(f"night on {arm}: {line}" for arm, lines in self.trained.items() for line in lines),
            f"held-out share answered right: base {h['base']:.3f}, "
            + ", ".join(f"{arm} {h[arm]:.3f} ({h[arm] - h['base']:+.3f})" for arm in arms),
            "forgetting (nats/token vs the base model, budget "
            f"{self.budget:g}): "
            + ", ".join(f"{arm} {v:+.3f}" for arm, v in self.forgetting.items()),
            "seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in self.seconds.items()),
        ]


# What a night's output says of its plan, kept for the result.
_PLAN_LINES = ("lone turns", "hindsight", "sft (hindsight)", "skipped", "sequence(s)", "resampled")
# The hindsight trial's nights, beside the base model: the implicit rewards; --hindsight's
# revisions imitated; --hindsight-mode distill on the served answers and SIBLINGS
# resampled siblings of each (`overnight train --resample`, no judge: they need no reward).
HINDSIGHT_ARMS = ("implicit", "hindsight", "distill")
SIBLINGS = 4


def arm_options(arm: str, upstream: str) -> list[str]:
    """`overnight train`'s options for one arm of the hindsight trial."""
    if arm == "implicit":
        return ["--lone-turns", "pool", "--reward-source", "implicit"]
    hindsight = ["--hindsight", "--resample-upstream", upstream, "--sft-held-out", "0"]
    if arm == "hindsight":
        return hindsight
    if arm == "distill":
        return [*hindsight, "--hindsight-mode", "distill", "--resample", str(SIBLINGS)]
    raise ValueError(f"no arm {arm!r}: one of {', '.join(HINDSIGHT_ARMS)}")


def run_hindsight_trial(
    upstream: str,
    model_dir: Path,
    work: Path,
    size: TrialSize,
    say=print,
    references: Path | None = None,
    arms: tuple[str, ...] = HINDSIGHT_ARMS,
) -> HindsightResult:
    """A day of users who correct with the right sum; a night on its implicit rewards and
    a --hindsight night on the same day; the held-out share answered right of the base
    model and both adapters, and their forgetting (see the module's docstring).
    `references`: where the base model's reference answers are cached (default: in
    `work`, generated every run). `arms`: the nights, of HINDSIGHT_ARMS."""
    import time
    from dataclasses import replace

    result = HindsightResult()
    size = replace(size, corrects=True)
    day = work / "day"
    began = time.monotonic()
    say(f"day: {size.conversations} scripted conversations through the proxy (users correct)")
    conversation = asyncio.run(log_day(upstream, day, size))
    result.answers = len(conversation.truth)
    result.corrected = sum(1 for r in conversation.reacted if conversation.truth[r] == 0.0)
    result.seconds["day"] = time.monotonic() - began
    adapters = {}
    for arm, path in {arm: work / arm for arm in arms}.items():
        shutil.copytree(day, path, ignore=shutil.ignore_patterns("logs"))
        run_overnight("signals", "--data", str(path), "--rewards", "--quiet", "0h")
        options = arm_options(arm, upstream)
        say(f"night on {arm}: overnight train {' '.join(options)} {' '.join(size.train)}")
        began = time.monotonic()
        out = run_overnight(
            "train", "--data", str(path), "--base-model", str(model_dir), "--proxy", "",
            "--settle", "0", "--no-watch", *options, *size.train,
        )  # fmt: skip
        result.seconds[f"{arm} night"] = time.monotonic() - began
        result.trained[arm] = [
            x.strip() for x in out.splitlines() if any(k in x for k in _PLAN_LINES)
        ][:8]
        for line in result.trained[arm]:
            say(f"  {line}")
        adapters[arm] = trained_adapter(path)
    say("held out: sampling the base model and each night's adapter")
    began = time.monotonic()
    result.held_out = held_out_means(upstream, adapters, size)
    result.seconds["held-out sampling"] = time.monotonic() - began
    began = time.monotonic()
    result.forgetting, result.budget = forgetting(model_dir, adapters, references or work, say)
    result.seconds["forgetting"] = time.monotonic() - began
    for line in result.lines():
        say(line)
    return result


def forgetting(
    model_dir: Path, adapters: dict[str, Path], cache: Path, say=print
) -> tuple[dict[str, float], float]:
    """Each adapter's forgetting on the bundled reference set against the base model, as
    a gated night measures it (the base model's answers generated once, in `cache`); the
    budget a night's gate holds it to."""
    from overnight.config import TrainConfig
    from overnight.trainer.gate.forgetting import measure

    config = TrainConfig(dtype="float32")
    out = {}
    for arm, path in adapters.items():
        measured = measure(config, cache, str(model_dir), path, None, "bundled", say=say)
        say(f"{arm}: {measured.line()}")
        out[arm] = measured.candidate
    return out, config.forgetting_budget
