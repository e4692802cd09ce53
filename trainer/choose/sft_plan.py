"""What an --sft night trains on: the logged conversations worth imitating, once each.

  finished groups no run trained on, found as a GRPO night finds them (plan.py: changed
  since the last selection, or left pending by it) -> a stable share held out for the
  gate (`held_out`) -> of each other group, the rollouts to imitate (`select_rollouts`)
  -> each rendered with the local model's chat template (grpo/render.py) -> identical
  sequences once.

Which rollouts (`--sft-selection`, docs/operations.md):

    auto        a group whose rollouts all have rewards: those at or above
                --sft-min-reward when it is given, else its best (rejection-sampling
                fine-tuning); a group without any reward (a hosted model's traffic that
                nobody scored): all of it
    best        each rewarded group's best rollout (and only if it reaches
                --sft-min-reward, when given)
    min-reward  every rollout whose reward reaches --sft-min-reward
    all         every finished rollout, rewards ignored

A group some of whose rollouts have rewards and some not waits for the rest (a late
reward makes it change, so the next night decides it). The groups a night trains on are
recorded as a GRPO night's are (`training_runs.groups`): no later night, SFT or GRPO,
trains them again. A group whose every sequence duplicates one trained tonight is
recorded too: its conversation was trained, and the gate must never take it as unseen.

The held-out share is chosen by a hash of the group id, not drawn: a group held out once
is held out every night, so the gate's prompts never leak into a later night's training.
Held-out groups are never trained or recorded; the gate finds their prompts among the
recent traffic no run trained on (gate/prompts.py), and takes none from the plan.
"""

from __future__ import annotations

import datetime as dt
import hashlib

from overnight.config import TrainConfig
from overnight.storage import now_us, open_db
from overnight.storage.read.siblings import TURN_PREFIX
from overnight.telemetry import traced
from overnight.trainer.grpo.data import Sample
from overnight.trainer.grpo.render import load_conversations

from .inputs import Selection
from .plan import (
    Plan,
    chosen_rewards,
    damaged_files,
    looked_at_groups,
    selection_record,
)

HELD_OUT = "held out for the gate by --sft-held-out (the same groups every night; never trained)"
PARTLY_SCORED = (
    "a rollout has no reward yet while others have (run overnight judge, or post rewards)"
)


def held_out(group_id: str, share: float) -> bool:
    """Whether the group is one of the `share` kept for the gate: the same answer on
    every night and machine (a hash of its id, not a draw)."""
    digest = hashlib.sha256(group_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") < share * 2**64


def select_rollouts(
    rollouts: list[str], rewards: dict[str, float], config: TrainConfig
) -> list[str] | str:
    """The group's rollouts to imitate (see the module's docstring), or why none."""
    mode, floor = config.sft_selection, config.sft_min_reward
    scored = {r: rewards[r] for r in rollouts if r in rewards}
    if mode == "all" or (mode == "auto" and not scored):
        return list(rollouts)
    if not scored:
        return f"no rollout has a reward (--sft-selection {mode} needs them)"
    if len(scored) < len(rollouts):
        return PARTLY_SCORED
    if mode == "min-reward" or (mode == "auto" and floor is not None):
        chosen = [r for r in rollouts if scored[r] >= floor]
    else:  # the best: the first of the highest, in the rollouts' order
        best = max(rollouts, key=lambda r: scored[r])
        chosen = [best] if floor is None or scored[best] >= floor else []
    return chosen or f"no rollout's reward reaches --sft-min-reward {floor:g}"


@traced(
    "plan",
    lambda plan: {"groups": len(plan.groups), "samples": len(plan.samples), "sft": True},
)
def plan_sft(selection: Selection, config: TrainConfig) -> Plan:
    """The groups an --sft night trains on, their samples, and why other groups wait.
    `only`: a resumed run's groups, selected again exactly (none held out: they were
    not). `tokenizer`: the local base model's, whose chat template renders them; `vision`:
    a vision-language model's reader, whose processor renders turns that show images."""
    data_dir, settle_seconds, since = selection.data_dir, selection.settle_seconds, selection.since
    max_groups, only, scope = selection.max_groups, selection.only, selection.scope
    tokenizer, vision = selection.tokenizer, selection.vision
    if tokenizer is None:
        raise ValueError(
            "an --sft night renders conversations: it needs the base model's tokenizer"
        )
    looked_at = now_us()
    days_from = since.astimezone(dt.UTC).date() if since is not None else None
    con = open_db(data_dir, days_from=None if only is not None else days_from)
    try:
        last, candidates, rollouts, _, _ = looked_at_groups(
            data_dir, con, config, settle_seconds, since, only, scope
        )
        # Per-turn groups are GRPO's (a served turn and its resampled siblings).
        candidates = [g for g in candidates if not g.startswith(TURN_PREFIX)]
        everyone = [r for g in candidates for r in rollouts[g]]
        rewards = chosen_rewards(con, config.reward_sources, everyone)
        plan = Plan(considered=candidates, looked_since=last["watermark"] if last else None)
        chosen: dict[str, list[str]] = {}
        pending: list[str] = []  # selectable, past --max-groups: not decided
        kept_out: list[str] = []
        for group_id in candidates:
            if only is None and held_out(group_id, config.sft_held_out):
                kept_out.append(group_id)
                plan.skipped[HELD_OUT] += 1
                continue
            picked = select_rollouts(rollouts[group_id], rewards, config)
            if isinstance(picked, str):
                plan.skipped[picked] += 1
            elif max_groups is not None and len(chosen) >= max_groups:
                pending.append(group_id)
            else:
                chosen[group_id] = picked
        imitated = [r for rs in chosen.values() for r in rs]
        loaded = load_conversations(con, imitated, tokenizer, vision)
    finally:
        con.close()
    for reason, n in loaded.skipped.items():
        plan.skipped[f"turns skipped: {reason}"] += n
    plan.loaded_groups = list(chosen)
    samples, duplicates = _unique(loaded.samples)
    trained = {s.group_id for s in loaded.samples}  # rendered: trained, or a duplicate
    for group_id, picked in chosen.items():
        if group_id not in trained:
            plan.skipped["nothing of it could be rendered (its turns' reasons above)"] += 1
            continue
        plan.groups.append(group_id)
        plan.rewards.update({r: rewards[r] for r in picked if r in rewards})
        plan.group_stats[group_id] = {"rollouts": len(rollouts[group_id]), "imitated": len(picked)}
    plan.samples = samples
    plan.sft = {
        "selection": config.sft_selection,
        "min_reward": config.sft_min_reward,
        "rollouts": sum(len(rollouts[g]) for g in plan.groups),
        "selected_rollouts": sum(len(chosen[g]) for g in plan.groups),
        "held_out": kept_out,
        "duplicates": duplicates,
    }
    plan.waiting = plan.groups + pending
    plan.damaged = damaged_files(data_dir)
    if only is None and since is None:
        plan.selection = selection_record(plan, looked_at, settle_seconds, config, scope)
    return plan


def _unique(samples: list[Sample]) -> tuple[list[Sample], int]:
    """Each sequence once (the first, in the records' order), and how many were repeats:
    an agent that asks the same thing the same way must not weigh it twice."""
    seen: set[tuple] = set()
    out = []
    for s in samples:
        # The same ids with other pictures are another sequence.
        key = (tuple(s.tokens), tuple(s.trained), s.vision.digests if s.vision else ())
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out, len(samples) - len(out)
