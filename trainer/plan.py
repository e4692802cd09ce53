"""What a run trains on: finished, scored, untrained groups, and why the others are left out.

A group is trained once. It is taken when every rollout in it is finished, has a
reward from one of the configured sources, and the rewards differ (equal rewards give
every advantage zero: no signal). Samples come out with their advantages attached.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow as pa

from overnight.config import TrainConfig
from overnight.storage import finished_groups, open_db

from .data import GroupAdvantages, Sample, group_advantages
from .records import Loaded, load_samples


@dataclass
class Plan:
    groups: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    rewards: dict[str, float] = field(default_factory=dict)  # rollout -> reward
    group_stats: dict[str, dict] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)  # reason -> groups
    retokenised: int = 0
    token_count_gaps: list[int] = field(default_factory=list)
    unreproduced: dict[str, int] = field(default_factory=dict)  # see records.Loaded

    def lines(self) -> list[str]:
        out = [
            f"{len(self.groups)} group(s), {len(self.samples)} sequence(s), "
            f"{sum(s.trained_tokens for s in self.samples)} trained tokens"
        ]
        out += [f"  skipped {n} group(s): {reason}" for reason, n in self.skipped.most_common()]
        if self.retokenised:
            gaps = self.token_count_gaps
            worst = max((abs(g) for g in gaps), default=0)
            out.append(
                f"  {self.retokenised} turn(s) had no token ids and were re-tokenised from text (less "
                f"exact; starting policy used as behaviour): token counts differ from the upstream's "
                f"in {sum(g != 0 for g in gaps)} of {len(gaps)}, by up to {worst}"
            )
        if self.unreproduced:
            what = ", ".join(f"{name} ({n})" for name, n in sorted(self.unreproduced.items()))
            out.append(
                f"  turns sampled with logit processing the trainer does not redo: {what}; "
                "their logprobs will not match the logged ones (see the run's logprob gap)"
            )
        return out

    def take(
        self, group_id: str, samples: list[Sample], rewards: dict[str, float], adv: GroupAdvantages
    ) -> None:
        """A group to train on; its samples carry their rollouts' advantages."""
        self.groups.append(group_id)
        self.samples += [replace(s, advantage=adv.advantages[s.rollout_id]) for s in samples]
        self.rewards.update(rewards)
        self.group_stats[group_id] = {"mean": adv.mean, "std": adv.std, "rollouts": len(rewards)}


def chosen_rewards(con, sources: tuple[str, ...]) -> dict[str, float]:
    """Each rollout's reward from the first source in `sources` that has one (latest wins)."""
    rows = con.execute(
        "SELECT rollout_id, source, arg_max(reward, created_at) FROM rewards GROUP BY rollout_id, source"
    ).fetchall()
    rank = {s: i for i, s in enumerate(sources)}
    best: dict[str, tuple[int, float]] = {}
    for rollout, source, reward in rows:
        if source in rank and (rollout not in best or rank[source] < best[rollout][0]):
            best[rollout] = (rank[source], reward)
    return {r: v for r, (_, v) in best.items()}


def trained_groups(con) -> set[str]:
    rows = con.execute(
        "SELECT DISTINCT unnest(groups) FROM training_runs WHERE status = 'trained'"
    ).fetchall()
    return {g for (g,) in rows}


def candidate_groups(
    con, settle_seconds: float, since: dt.datetime | None, only: list[str] | None
) -> list[str]:
    """Groups no earlier run trained on: finished ones, or exactly `only` (in its order)."""
    done = trained_groups(con)
    # A resumed run trains on exactly the groups it began with, in their order (the
    # shuffles replay from it); they were finished then, so that is not asked again.
    pool = only if only is not None else finished_groups(con, settle_seconds, None)
    candidates = [g for g in pool if g not in done]
    if since is not None:
        rows = con.execute("SELECT group_id FROM groups WHERE started_at >= ?", [since]).fetchall()
        recent = {g for (g,) in rows}
        candidates = [g for g in candidates if g in recent]
    return candidates


def plan_run(
    data_dir: Path,
    config: TrainConfig,
    settle_seconds: float,
    since: dt.datetime | None = None,
    max_groups: int | None = None,
    only: list[str] | None = None,
    tokenizer=None,
    sampling_defaults: dict | None = None,
) -> Plan:
    """The groups to train on, in order, up to `max_groups`; `plan.skipped` says why not others.

    Token ids are read only for groups whose rewards could give a signal: most groups a
    night considers are left out for their rewards alone (all equal, or missing), and
    reading their records was most of a night's selection time."""
    # With `since`, days before it are not even listed (their groups began earlier).
    days_from = since.astimezone(dt.UTC).date() if since is not None else None
    con = open_db(data_dir, days_from=None if only is not None else days_from)
    try:
        candidates = candidate_groups(con, settle_seconds, since, only)
        rewards = chosen_rewards(con, config.reward_sources)
        verdicts = _reward_verdicts(con, candidates, rewards, config)
        wanted = [g for g in candidates if verdicts.get(g) is None]
        loaded = load_samples(con, wanted, tokenizer, sampling_defaults)
    finally:
        con.close()
    plan = _plan_from(loaded)
    by_group: dict[str, list[Sample]] = {}
    for s in loaded.samples:
        by_group.setdefault(s.group_id, []).append(s)
    for group_id in candidates:
        samples = by_group.get(group_id, [])
        verdict = verdicts.get(group_id) or _advantages_or_reason(samples, rewards, config)
        if isinstance(verdict, str):
            plan.skipped[verdict] += 1
            continue
        rollouts = {s.rollout_id for s in samples}
        plan.take(group_id, samples, {r: rewards[r] for r in rollouts}, verdict)
        if max_groups is not None and len(plan.groups) >= max_groups:
            break
    return plan


def _reward_verdicts(
    con, groups: list[str], rewards: dict[str, float], config: TrainConfig
) -> dict[str, str]:
    """Why each group that surely cannot be trained on is left out, from its rollouts'
    rewards alone (no token ids read). The trainable rollouts are a subset of all of
    them, so a group with too few rollouts, or fewer than two distinct rewards, is out
    whatever its records hold."""
    if not groups:
        return {}
    con.register("_plan_groups", pa.table({"group_id": groups}))
    rows = con.execute(
        "SELECT group_id, list(DISTINCT rollout_id) FROM completions "
        "WHERE group_id IN (SELECT group_id FROM _plan_groups) GROUP BY group_id"
    ).fetchall()
    out = {}
    for group_id, rollouts in rows:
        scored = {rewards[r] for r in rollouts if r in rewards}
        if len(rollouts) < config.min_group_size:
            out[group_id] = f"fewer than {config.min_group_size} trainable rollouts"
        elif len(scored) < 2:
            missing = any(r not in rewards for r in rollouts)
            out[group_id] = (
                "a rollout has no reward (run overnight judge, or post rewards)"
                if missing
                else "all rewards equal: no signal"
            )
    return out


def _plan_from(loaded: Loaded) -> Plan:
    """An empty plan that reports what loading the records left out."""
    plan = Plan(
        retokenised=loaded.retokenised,
        token_count_gaps=loaded.token_count_gaps,
        unreproduced=dict(loaded.unreproduced),
    )
    for reason, n in loaded.skipped.items():
        plan.skipped[f"turns skipped: {reason}"] += n
    return plan


def _advantages_or_reason(
    samples: list[Sample], rewards: dict[str, float], config: TrainConfig
) -> GroupAdvantages | str:
    """The group's advantages, or why it is not trained on."""
    rollouts = {s.rollout_id for s in samples}
    if len(rollouts) < config.min_group_size:
        return f"fewer than {config.min_group_size} trainable rollouts"
    if any(r not in rewards for r in rollouts):
        return "a rollout has no reward (run overnight judge, or post rewards)"
    adv = group_advantages({r: rewards[r] for r in rollouts}, config.scale_by_std)
    if adv is None:
        return "all rewards equal: no signal"
    return adv
