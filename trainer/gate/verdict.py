"""The promotion gate: a night's adapter is promoted only when it is not worse than the served one.

  held-out prompts (recent conversations no run trained on, outside tonight's plan
  where the night has enough: prompts.py) -> one reply per
  prompt from each adapter, sampled here with transformers+peft, the same seed for both
  -> scored by the same scorer (the reward function, or RULER seeing both replies
  shuffled and unlabelled) -> a paired bootstrap interval on the mean difference
  (candidate - served) -> promote, or keep the candidate on disk (docs/grpo.md).

Sampled here, not through vLLM: the proxy's admin API loads an adapter only to serve it
under the alias, and vLLM's LoRA routes are for the proxy alone. The trainer has the base
model at hand, and sampling both adapters with the same code and seeds means that a
difference comes from the adapters, not from two samplers. The cost: a few dozen prompts,
generated 16 at a time, small next to a night's training. On a vision-language model a
prompt that shows images is rendered by the processor, its pictures read back from the
store (trainer/choose/images.py), and generated alone; one whose pictures are gone is a
prompt the scorer could not score.

The watch, the canary and the handover (trainer/live/compare.py) use the same bootstrap,
unpaired, on live rewards.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from overnight.config import GATE_MODES, TrainConfig
from overnight.progress import Progress, untold
from overnight.storage.read.best_adapter import Best
from overnight.storage.read.images import content_text, shows_images

from .gaming import Gaming
from .gaming import judge as judge_gaming
from .gaming import measure as measure_gaming
from .prompts import GatePrompt

CONFIDENCE = 0.95  # two-sided for the gate's interval, one-sided for the watch
RESAMPLES = 10_000  # bootstrap resamples: the interval's ends move by ~0.005 sd between seeds
MIN_PROMPTS = 8  # fewer held-out prompts decide nothing: the gate refuses
EXAMPLES = 3  # side-by-side examples kept with the verdict
_CHUNK = 2_000_000  # bootstrap indices drawn at once (memory: 16 MB)
BATCH = 16  # held-out prompts generated together

# async (messages, tools, replies) -> one score per reply, in the replies' order. The
# caller shuffles the replies; the scorer never learns which adapter wrote which.
Scorer = Callable[[list[dict], list[dict], list[dict]], Awaitable[list[float]]]


# -- the statistics ----------------------------------------------------------------------


def bootstrap_means(
    a: Sequence[float],
    b: Sequence[float] | None = None,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> np.ndarray:
    """The bootstrap distribution of mean(a) - mean(b), shape (resamples,).

    Paired (`b` None): `a` holds per-prompt differences, resampled as whole pairs, which
    cancels what the prompts share (an easy prompt is easy for both adapters). Unpaired:
    `a` and `b` are resampled independently (live traffic: different requests)."""
    rng = np.random.default_rng(seed)

    def means(values: Sequence[float]) -> np.ndarray:
        x = np.asarray(values, dtype=float)
        rows = max(1, _CHUNK // max(len(x), 1))
        parts = [
            x[rng.integers(0, len(x), (min(rows, resamples - i), len(x)))].mean(axis=1)
            for i in range(0, resamples, rows)
        ]
        return np.concatenate(parts)

    out = means(a)
    return out - means(b) if b is not None else out


def paired_interval(
    diffs: Sequence[float], confidence: float = CONFIDENCE, seed: int = 0
) -> tuple[float, float, float]:
    """(mean difference, low, high): the percentile bootstrap interval on the mean."""
    tail = (1 - confidence) / 2
    low, high = np.quantile(bootstrap_means(diffs, seed=seed), [tail, 1 - tail])
    return float(np.mean(diffs)), float(low), float(high)


def decide(diffs: Sequence[float], mode: str, margin: float, seed: int = 0) -> tuple[bool, dict]:
    """Whether to promote, and the numbers (`passes`)."""
    mean, low, high = paired_interval(diffs, seed=seed)
    bar = -margin if mode == "not-worse" else 0.0
    promote = passes(low, high, mode, margin)
    return promote, {"diff_mean": mean, "low": low, "high": high, "bar": bar}


def passes(low: float, high: float, mode: str, margin: float) -> bool:
    """Whether an interval on candidate - served clears the bar. `not-worse`: no loss
    larger than the margin is plausible (low end at or above -margin) and no loss at all
    is certain (high end not below 0: an interval wholly below zero is a measurably worse
    candidate, whatever the margin). An interval of exactly [0, 0], a candidate no
    different, is not worse. `better`: the low end above 0."""
    if mode == "better":
        return low > 0.0
    return low >= -margin and high >= 0.0


def margin_for(config, served: Sequence[float]) -> tuple[float, str]:
    """The loss `not-worse` tolerates, and how it was set: `--gate-margin` in reward
    units when given, else `--gate-margin-spread` times the spread (sample standard
    deviation) of the served adapter's rewards over the same prompts. A spread is in the
    reward's own units whatever its scale or sign, and 0 when the served adapter scores
    the same everywhere: then any loss counts (docs/grpo.md)."""
    if config.gate_margin is not None:
        return config.gate_margin, f"--gate-margin {config.gate_margin:g}"
    spread = float(np.std(served, ddof=1)) if len(served) > 1 else 0.0
    share = config.gate_margin_spread
    return share * spread, f"{share:g} x the served adapter's reward spread {spread:.3g}"


# -- the verdict -------------------------------------------------------------------------


@dataclass
class Verdict:
    mode: str
    promote: bool
    reason: str
    margin: float = 0.0  # the loss not-worse tolerated, in reward units
    margin_basis: str = ""  # how it was set (margin_for)
    prompts: int = 0
    candidate_mean: float | None = None
    served_mean: float | None = None
    diff_mean: float | None = None
    low: float | None = None
    high: float | None = None
    failed: int = 0  # prompts the scorer failed on (left out)
    held_out_from_plan: list[str] = field(default_factory=list)
    examples: list[dict] = field(default_factory=list)
    forgetting: dict | None = None  # forgetting.py's figures, when measured
    gaming: dict | None = None  # gaming.py's shapes of the replies, when sampled
    best: dict | None = None  # against the best adapter so far, when held to it
    # What was compared, as the proxies name the adapters (None: the base model): the
    # chain storage/read/best_adapter.py places adapters along.
    candidate_adapter: str | None = None
    served_adapter: str | None = None

    def refuse(self, why: str) -> None:
        """Refused for `why` whatever the task gate decided (the reason keeps what it said):
        forgetting over its budget, answers that moved as gamed ones do."""
        was = "passed" if self.promote else "refused"
        self.promote = False
        self.reason = f"{why}; the task gate {was}: {self.reason}"

    @property
    def word(self) -> str:
        return "promoted" if self.promote else "refused"

    def line(self) -> str:
        return f"gate ({self.mode}): {self.word}: {self.reason}"

    def as_dict(self) -> dict:
        return {**asdict(self), "verdict": self.word}


# -- sampling and scoring ----------------------------------------------------------------


def sample_both(
    base_model: str,
    candidate: Path,
    served: str | None,
    prompts: list[GatePrompt],
    config,
    vision=None,
    say=None,
    anchor: bool = False,
    best: Best | None = None,
) -> dict[str, list[str | None]]:
    """Each prompt's reply from the candidate and from the served adapter (None: the base
    model), one base model in memory with both adapters on it; with `anchor`, the base
    model's too (`base`) where an adapter is served: gaming's anchor across promotions;
    with `best`, the best adapter so far's (`best`: storage/read/best_adapter.py)."""
    adapters: dict[str, Path | str | None] = {"candidate": candidate, "served": served}
    if anchor and served is not None:
        adapters["base"] = None
    if best is not None and not (best.path is None and "base" in adapters):
        adapters["best"] = best.path
    sides = sample_each(base_model, adapters, prompts, config, vision, say)
    if best is not None and "best" not in sides:  # the base model, sampled once for both
        sides["best"] = sides["base"]
    return sides


def sample_each(
    base_model: str,
    adapters: dict[str, Path | str | None],
    prompts: list[GatePrompt],
    config,
    vision=None,
    say=None,
) -> dict[str, list[str | None]]:
    """Each prompt's reply from each named adapter (None: the base model), in the order
    given, one base model in memory with every adapter on it, each from the same seeds.
    `vision`: a vision-language model's reader, for the prompts that show images; `say`:
    where progress lines go (None: nowhere)."""
    model, tokenizer, device = load_named(base_model, adapters, config)
    shown = rendered_images(prompts, vision)  # once, for every adapter
    progress = Progress(say, "gate: sampled", len(adapters) * len(prompts), "replies")
    out = {}
    for name, path in adapters.items():
        if path is not None:
            model.set_adapter(name)
        off = path is None and hasattr(model, "disable_adapter")
        with model.disable_adapter() if off else nullcontext():
            out[name] = generate_replies(
                model, tokenizer, prompts, config.seed, device, shown, progress.advance
            )
    progress.finish()
    return out


def rendered_images(prompts: list[GatePrompt], vision) -> dict[int, tuple | None]:
    """For each prompt that shows images (`vision`: a vision-language model's reader), its
    token ids, made once, and its pictures, made again for each adapter (held for all the
    prompts at once, a real model's screenshot tiles would take gigabytes); None where a
    picture cannot be read back (pruned since, say)."""
    from overnight.trainer.grpo.data import DataError
    from overnight.trainer.grpo.images import Rendering

    out: dict[int, tuple | None] = {}
    for i, p in enumerate(prompts):
        if vision is None or not shows_images(p.messages):
            continue
        try:
            out[i] = vision.rendered(Rendering(p.messages, p.tools))
        except DataError:
            out[i] = None
    return out


def load_named(base_model: str, adapters: dict[str, Path | str | None], config):
    """(model, tokenizer, device): the base model in eval mode with each named adapter
    that is not None on it, the first one active; `disable_adapter()` is the base model."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from overnight.trainer.grpo.policy import load_base, torch_dtype

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    model = load_base(base_model, torch_dtype(config.dtype))
    for name, path in adapters.items():
        if path is None:
            continue
        if isinstance(model, PeftModel):
            model.load_adapter(str(path), adapter_name=name)
        else:
            model = PeftModel.from_pretrained(model, str(path), adapter_name=name)
    model.eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    return model, tokenizer, device


def generate_replies(
    model, tokenizer, prompts: list[GatePrompt], seed: int, device: str,
    shown: dict[int, tuple | None] | None = None, advance: Callable[[int], None] = untold,
) -> list[str | None]:  # fmt: skip
    """One reply per prompt; prompts with the same sampling settings are generated together
    (left-padded, BATCH at a time: one generate call costs about what one prompt did), each
    batch from a seed of its own, so both adapters see the same random stream. A prompt
    that shows images (in `shown`: `rendered_images`) is generated alone with them; None
    where its pictures could not be read back. `advance`: told how many replies each
    generate call made (overnight/progress.py)."""
    import torch

    out: list[str | None] = [""] * len(prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    alike: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        if shown and i in shown:
            rendered = shown[i]
            out[i] = rendered and _reply_to_images(
                model, tokenizer, p, *rendered, seed * 100_003 + i, device, pad
            )
            advance(1)
            continue
        alike.setdefault((p.temperature, p.top_p, p.top_k, p.max_tokens), []).append(i)
    for (_, _, _, max_tokens), members in alike.items():
        sampling = _sampling(prompts[members[0]])
        for start in range(0, len(members), BATCH):
            batch = members[start : start + BATCH]
            ids = [prompt_ids(tokenizer, prompts[i]) for i in batch]
            width = max(map(len, ids))
            input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
            torch.manual_seed(seed * 100_003 + members[start])
            with torch.no_grad():
                generated = model.generate(
                    input_ids=input_ids, attention_mask=mask, **sampling,
                    max_new_tokens=max_tokens, pad_token_id=pad,
                )  # fmt: skip
            for row, i in enumerate(batch):
                out[i] = tokenizer.decode(generated[row, width:], skip_special_tokens=True)
            advance(len(batch))
    return out


def _sampling(p: GatePrompt) -> dict:
    """generate()'s sampling arguments for a prompt, as its logged request asked."""
    if p.temperature <= 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k}


def _reply_to_images(model, tokenizer, p: GatePrompt, ids: list[int], images, seed: int,
                     device: str, pad: int) -> str:  # fmt: skip
    """One reply to a prompt that shows images: its ids and pictures (`rendered_images`)."""
    import torch

    input_ids = torch.tensor([ids], device=device)
    pixels = {k: v.to(device) for k, v in images.tensors().items()}
    torch.manual_seed(seed)
    with torch.no_grad():
        generated = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **pixels,
            **_sampling(p), max_new_tokens=p.max_tokens, pad_token_id=pad,
        )  # fmt: skip
    return tokenizer.decode(generated[0, len(ids) :], skip_special_tokens=True)


def prompt_ids(tokenizer, p: GatePrompt) -> list[int]:
    encoded = tokenizer.apply_chat_template(
        p.messages, tools=p.tools or None, add_generation_prompt=True, return_dict=True
    )
    ids = encoded["input_ids"]
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


async def score_pairs(
    prompts: list[GatePrompt], candidate: list[str], served: list[str], scorer: Scorer, seed: int,
    advance: Callable[[int], None] = untold,
) -> list[tuple[float, float] | None]:  # fmt: skip
    """(candidate score, served score) per prompt, None where the scorer failed. The two
    replies go to the scorer in a random order, unlabelled. `advance`: told of each prompt
    scored (or failed)."""
    rng = random.Random(seed)
    flips = [rng.random() < 0.5 for _ in prompts]
    limit = asyncio.Semaphore(8)

    async def counted(p: GatePrompt, c, s, flip: bool) -> tuple[float, float] | None:
        pair = await one(p, c, s, flip)
        advance(1)
        return pair

    async def one(p: GatePrompt, c, s, flip: bool) -> tuple[float, float] | None:
        if c is None or s is None:
            return None  # not sampled (its pictures could not be read back)
        replies = [{"role": "assistant", "content": x} for x in ((s, c) if flip else (c, s))]
        try:
            async with limit:
                first, second = await scorer(p.messages, p.tools, replies)
        except Exception:  # one prompt the scorer cannot score is left out, not the night
            return None
        return (second, first) if flip else (first, second)

    return await asyncio.gather(*map(counted, prompts, candidate, served, flips))


# -- the gate ----------------------------------------------------------------------------


def run_gate(
    config: TrainConfig,
    base_model: str,
    candidate: Path,
    served: str | None,
    prompts: list[GatePrompt],
    scorer: Scorer,
    held_out_from_plan: list[str] = (),  # type: ignore[assignment]
    vision=None,
    say=print,
    best: Best | None = None,
) -> Verdict:
    """Sample, score and decide; the verdict says why in one line (`reason`). `say`: the
    progress lines of sampling and scoring, now and then (overnight/progress.py). `best`:
    the best adapter so far, which a not-worse candidate must not be worse than either."""
    mode = config.gate
    assert mode in GATE_MODES and mode != "off"
    verdict = Verdict(mode, False, "", held_out_from_plan=list(held_out_from_plan))
    if len(prompts) < MIN_PROMPTS:
        verdict.reason = (
            f"only {len(prompts)} held-out prompt(s), fewer than {MIN_PROMPTS}: nothing shows "
            "the candidate is not worse (--gate off promotes without evidence)"
        )
        return verdict
    limits = config.gaming_limits  # the answers' shapes, gaming.py (None: not checked)
    best = best if mode == "not-worse" else None  # `better` cannot slide: each step a gain
    sides = sample_both(base_model, candidate, served, prompts, config, vision, say,
                        anchor=limits != (None, None), best=best)  # fmt: skip
    cand, served_replies = sides["candidate"], sides["served"]
    gaming = measure_gaming(sides, *limits)
    scoring = Progress(say, "gate: scored", len(prompts), "pairs of replies")
    scored = asyncio.run(
        score_pairs(prompts, cand, served_replies, scorer, config.seed, scoring.advance)
    )
    scoring.finish()
    kept = [(i, pair) for i, pair in enumerate(scored) if pair is not None]
    verdict.failed = len(prompts) - len(kept)
    verdict.prompts = len(kept)
    if len(kept) < MIN_PROMPTS:
        verdict.reason = f"the scorer failed on {verdict.failed} of {len(prompts)} prompts"
        judge_gaming(verdict, gaming)
        return verdict
    diffs = [c - s for _, (c, s) in kept]
    verdict.margin, verdict.margin_basis = margin_for(config, [s for _, (_, s) in kept])
    verdict.promote, numbers = decide(diffs, mode, verdict.margin, seed=config.seed)
    verdict.candidate_mean = float(np.mean([c for _, (c, _) in kept]))
    verdict.served_mean = float(np.mean([s for _, (_, s) in kept]))
    verdict.diff_mean, verdict.low, verdict.high = (
        numbers["diff_mean"],
        numbers["low"],
        numbers["high"],
    )
    verdict.reason = (
        f"candidate - served = {numbers['diff_mean']:+.3g} on {len(kept)} held-out prompts "
        f"({verdict.candidate_mean:.3g} vs {verdict.served_mean:.3g}), "
        f"{CONFIDENCE:.0%} interval [{numbers['low']:+.3g}, {numbers['high']:+.3g}], "
        + _why(numbers, mode, verdict)
    )
    worst_first = sorted(kept, key=lambda item: -abs(item[1][0] - item[1][1]))[:EXAMPLES]
    verdict.examples = [
        _example(prompts[i], cand[i], served_replies[i], pair) for i, pair in worst_first
    ]
    if best is not None and verdict.promote:  # a refused one needs no second opinion
        held_to_best(verdict, best, prompts, cand, sides["best"], scorer, config, say)
    judge_gaming(verdict, gaming)  # refused, whatever the reward, if it moved as gaming does
    return verdict


def held_to_best(
    verdict: Verdict, best: Best, prompts: list[GatePrompt], candidate: list, replies: list,
    scorer: Scorer, config: TrainConfig, say=print,
) -> None:  # fmt: skip
    """The candidate against the best adapter so far on the same prompts, by the same
    not-worse test (its margin from the best one's spread): refused if it fails
    (storage/read/best_adapter.py).
    Scored as its own pairs, so a judge ranks the two replies it compares, unlabelled."""
    scoring = Progress(say, "gate, against the best so far: scored", len(prompts), "pairs")
    scored = asyncio.run(
        score_pairs(prompts, candidate, replies, scorer, config.seed + 1, scoring.advance)
    )
    scoring.finish()
    kept = [pair for pair in scored if pair is not None]
    if len(kept) < MIN_PROMPTS:
        verdict.best = {"adapter": best.adapter, "above_served": best.above_served,
                        "prompts": len(kept), "passes": None}  # fmt: skip
        verdict.refuse(f"the scorer failed on {len(prompts) - len(kept)} of {len(prompts)} "
                       f"prompts against the best adapter so far, {best.describe()}")  # fmt: skip
        return
    margin, basis = margin_for(config, [b for _, b in kept])
    ok, numbers = decide([c - b for c, b in kept], "not-worse", margin, seed=config.seed)
    verdict.best = {"adapter": best.adapter, "above_served": best.above_served,
                    "prompts": len(kept), "best_mean": float(np.mean([b for _, b in kept])),
                    "margin": margin, "margin_basis": basis, "passes": ok,
                    **{k: numbers[k] for k in ("diff_mean", "low", "high")}}  # fmt: skip
    said = (f"candidate - best so far = {numbers['diff_mean']:+.3g}, interval "
            f"[{numbers['low']:+.3g}, {numbers['high']:+.3g}] against {best.describe()}")  # fmt: skip
    if ok:
        verdict.reason += f"; not worse than the best so far: {said}"
    else:
        verdict.refuse(f"worse than the best adapter so far: {said}, margin {margin:.3g}")


def _why(numbers: dict, mode: str, verdict: Verdict) -> str:
    """The clause of the reason that says which end of the interval decided."""
    low, high, bar = numbers["low"], numbers["high"], numbers["bar"]
    if mode == "better":
        return f"low end {'above' if low > 0 else 'not above'} 0"
    margin = f"{bar:+.3g} (margin {verdict.margin_basis})"
    if high < 0:
        return "high end below 0: measurably worse"
    return f"low end {'not below' if low >= bar else 'below'} {margin}"


def _example(p: GatePrompt, candidate: str, served: str, scores: tuple[float, float]) -> dict:
    last = p.messages[-1].get("content") if p.messages else ""
    return {
        "group_id": p.group_id,
        "prompt": content_text(last)[:500],  # an image as its label, as the judge reads it
        "candidate": candidate[:500],
        "served": served[:500],
        "candidate_score": scores[0],
        "served_score": scores[1],
    }


def gaming_alone(config: TrainConfig, scorer: Scorer | None) -> bool:
    """Whether the gate samples for the gaming check alone (gaming.py): no scorer to judge
    the replies with, on a night that trains on rewards read from reactions (`implicit`),
    the rewards gaming wins."""
    return (
        scorer is None
        and config.gate != "off"
        and "implicit" in config.reward_sources
        and config.gaming_limits != (None, None)
    )


def shapes_alone(
    config: TrainConfig, base_model: str, candidate: Path, served: str | None,
    prompts: list[GatePrompt], vision=None, say=print,
) -> Gaming | None:  # fmt: skip
    """The gaming check without a scorer: the three sides' replies sampled and measured
    (None: fewer than MIN_PROMPTS prompts, nothing to tell by)."""
    if len(prompts) < MIN_PROMPTS:
        return None
    sides = sample_both(base_model, candidate, served, prompts, config, vision, say, anchor=True)
    return measure_gaming(sides, *config.gaming_limits)


def skipped(config: TrainConfig, scorer: Scorer | None) -> Verdict | None:
    """The verdict when the gate does not sample at all (off, or nothing to score with)."""
    if config.gate == "off":
        return Verdict("off", True, "the gate is off (--gate off)")
    if scorer is None:
        return Verdict(
            config.gate,
            True,
            "not gated: no scorer for fresh replies (give --reward or --judge-model); "
            "`overnight watch` compares live rewards after the promotion",
        )
    return None
