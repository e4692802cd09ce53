"""Live rewards of a new side against an old one: the watch's, the canary's and the handover's.

Each reads the live rewards of two sides (rewards.py), and compares them here the same
way: fewer than `--watch-min-rollouts` rewarded rollouts on either side compare nothing
yet; otherwise the gate's bootstrap (trainer/gate/verdict.py), unpaired (different
requests), gives the interval on mean(new) - mean(old), two-sided (the canary, the
handover: judged by the gate's bar) or its one-sided upper end (the watch: worse when it
is below 0). What each side is called, and what is done with the numbers, is the
caller's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from overnight.config import TrainConfig
from overnight.trainer.gate.verdict import CONFIDENCE, bootstrap_means, margin_for, passes


@dataclass(frozen=True)
class LiveComparison:
    new_n: int  # rewarded rollouts of each side
    old_n: int
    too_few: str | None = None  # why nothing was compared (the numbers below are None)
    new_mean: float | None = None
    old_mean: float | None = None
    diff_mean: float | None = None  # new - old
    low: float | None = None  # the two-sided interval on the difference
    high: float | None = None
    upper: float | None = None  # the one-sided interval's upper end
    bar: str = ""  # the gate's bar the low end must clear, said with how it was set
    clears: bool = False  # the two-sided interval clears it (gate.passes)
    line: str = ""  # the means, counts and interval, for the caller's reason


def compare_live(
    new: list[float],
    old: list[float],
    config: TrainConfig,
    named: tuple[str, str],
    counted: tuple[str, str],
    one_sided: bool = False,
) -> LiveComparison:
    """`new` against `old`: what the reasons call each side after its count when compared
    (`named`: "canary rollouts", "for v3") and when too few (`counted`: "served by the
    canary", "by v3 since it began"); the line states the one-sided upper end (the watch)
    or the two-sided interval. The bar: the gate's margin set on `old`'s spread unless
    --gate-margin says otherwise (0 for --gate better)."""
    least = config.watch_min_rollouts
    if min(len(new), len(old)) < least:
        return LiveComparison(len(new), len(old), too_few=(
            f"too few rewarded rollouts to compare yet ({len(new)} {counted[0]}, "
            f"{len(old)} {counted[1]}; {least} each needed)"
        ))  # fmt: skip
    draws = bootstrap_means(new, old, seed=config.seed)
    tail = (1 - CONFIDENCE) / 2
    low, high = (float(end) for end in np.quantile(draws, [tail, 1 - tail]))
    upper = float(np.quantile(draws, CONFIDENCE))
    margin, basis = margin_for(config, old)
    new_mean, old_mean = float(np.mean(new)), float(np.mean(old))
    interval = (
        f"one-sided {CONFIDENCE:.0%} upper end {upper:+.3f}"
        if one_sided
        else f"{CONFIDENCE:.0%} interval [{low:+.3f}, {high:+.3f}]"
    )
    return LiveComparison(
        len(new), len(old), None, new_mean, old_mean, new_mean - old_mean, low, high, upper,
        bar="0" if config.gate == "better" else f"{-margin:+.3g} ({basis})",
        clears=passes(low, high, config.gate, margin),
        line=f"live reward {new_mean:.3f} on {len(new)} {named[0]} against {old_mean:.3f} on "
        f"{len(old)} {named[1]}: difference {new_mean - old_mean:+.3f}, {interval}",
    )  # fmt: skip
