"""What a run trains on: finished, scored, untrained groups, and why the others are left out.

A group is trained once; one that holds a turn overnight sent itself through the proxy
(the demo's held-out measurement, a judge served by the same vLLM: storage/read/sent_by.py)
never is, unless a resumed run began with it. A group is taken when every rollout in it is finished, has a
reward from one of the configured sources, and the rewards differ (equal rewards give
every advantage zero: no signal). Samples come out with their advantages attached.

A night looks only at groups that changed since the last run decided them. Each plan
leaves a selection record (`Plan.selection`, stored by the run in its `metrics`;
read back and compared in selection.py): when
it looked (the watermark), the groups it found trainable but did not train (`pending`:
held out, or past --max-groups), its settle time and the options its verdicts depend
on. The next night looks at those, and at every group with a row newer than the
watermark (less the settle time, for groups still open then, and an overlap for rows
that arrive late): a new turn, finish, reward or judgment. A group skipped for equal or
missing rewards is not read again until one of those arrives; then it is decided
again, and trained if it now can be. `--rescan` looks at every untrained group (after
restoring data, or a log recovered more than the overlap late).

Per-turn groups (`turn:<record>`, turn_groups.py) are selected the same way: the changed
ones found here (a new sibling, or a reward or judgment of a member) go to the plan as
`Plan.turn_pool`, with those the last record left pending (`turn_pending`, written by
`add_turn_groups`); a record without that key (from before per-turn groups were
selected so) makes them all be looked at once.

A served turn trains once (docs/grpo.md, "Groups made from single calls"): its own
group comes first; a group one of whose turns an earlier run trained as a per-turn
group is not trained (`TRAINED_AS_TURNS`), and turn_groups.py leaves out the per-turn
groups of turns whose own group is trained or trainable.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow as pa

from overnight.config import TrainConfig
from overnight.storage import finished_groups, now_us, open_db
from overnight.storage.integrity import quarantined
from overnight.storage.read.policy_scope import PolicyScope
from overnight.storage.read.response_index import INDEX
from overnight.storage.read.sent_by import without_own
from overnight.storage.read.siblings import TURN_PREFIX
from overnight.storage.verified import left_out
from overnight.telemetry import traced
from overnight.trainer.grpo.data import GroupAdvantages, Sample, group_advantages, keep_signs
from overnight.trainer.grpo.logged_turns import Loaded, load_samples

from .inputs import Selection
from .selection import (
    TURN_HELD_KEY,
    TURN_PENDING_KEY,
    changed_groups,
    last_selection,
    selection_basis,
)

# The reward source read from what users did next: its sign means something (keep_signs).
IMPLICIT = "implicit"
# Why a served group is left out when a turn of it already trained in its per-turn group.
TRAINED_AS_TURNS = "a turn of it was trained in its per-turn group (a turn trains once)"


@dataclass
class Plan:
    groups: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    rewards: dict[str, float] = field(default_factory=dict)  # rollout -> reward
    group_stats: dict[str, dict] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)  # reason -> groups
    retokenised: int = 0
    token_count_gaps: list[int] = field(default_factory=list)
    unreproduced: dict[str, int] = field(default_factory=dict)  # see logged_turns.Loaded
    considered: list[str] = field(default_factory=list)  # the candidates looked at
    loaded_groups: list[str] = field(default_factory=list)  # those whose records were read
    looked_since: int | None = None  # the watermark it started from; None: looked at all
    # What the next night starts from (see the module's docstring); None when this plan
    # did not look at everything it should decide (a resumed run, --since).
    selection: dict | None = None
    # The per-turn groups add_turn_groups looks at: changed since the last selection or
    # left pending by it. None: all of them (no usable record, --rescan, a full look).
    turn_pool: set[str] | None = None
    # Per-turn groups an earlier night's gate held out: never trained (gate/prompts.py).
    turn_held: set[str] = field(default_factory=set)
    # Served groups trainable but perhaps not trained tonight: past --max-groups, or
    # taken (the gate may hold them out). Their turns' per-turn groups wait for them
    # (turn_groups.py), with or without a selection record (--since makes none).
    waiting: list[str] = field(default_factory=list)
    # Groups by how many promotions old their records are ("0": sampled by the adapter
    # the run starts from; "unknown" without a proxy): staleness.py.
    staleness: dict[str, int] = field(default_factory=dict)
    # An --sft night's selection (sft_plan.py): how it chose, how many rollouts it took
    # of how many, the groups it held out for the gate, the duplicates it dropped.
    sft: dict | None = None
    # Served groups too small to compare within, every rollout rewarded: decided by
    # lone_turns.py against the night's pool (with --lone-turns pool), not here.
    lone: list[str] = field(default_factory=list)
    # What lone_turns.py pooled: turns by kind and by source, the pool's mean and std.
    pooled: dict | None = None
    # Files whose rows this plan could not trust (`table/rel` -> why): damaged, found by
    # its reads or set aside before; their rows are not in the store's views, so not
    # trained on (storage/verified.py; docs/operations.md, "Damaged files").
    damaged: dict[str, str] = field(default_factory=dict)
    # The groups earlier nights trained, read once a night (plan_run) for the steps that
    # add to the plan (turn_groups.py, lone_turns.py); None: a plan not made by plan_run.
    trained_before: set[str] | None = None
    # A --hindsight distill night's (hindsight_distill.py): each sample's teacher sample
    # (by rollout id: the hint in its context, the same completion), and its figures.
    teachers: dict[str, Sample] = field(default_factory=dict)
    hindsight: dict | None = None

    @property
    def loaded(self) -> dict:
        """How much the selection read: groups looked at, and those whose records it read."""
        return {"considered": len(self.considered), "loaded": len(self.loaded_groups)}

    def lines(self) -> list[str]:
        out = [
            f"{len(self.groups)} group(s), {len(self.samples)} sequence(s), "
            f"{sum(s.trained_tokens for s in self.samples)} trained tokens"
        ]
        if self.sft is not None:
            sft = self.sft
            out.append(
                f"  sft ({sft['selection']}): imitating {sft['selected_rollouts']} of "
                f"{sft['rollouts']} rollout(s); {len(sft['held_out'])} group(s) held out for "
                f"the gate, {sft['duplicates']} duplicate sequence(s) left out"
            )
        if self.hindsight is not None:
            h = self.hindsight
            out.append(f"  hindsight ({h['mode']}): {h['turns']} of {h['corrected_turns']} "
                       f"corrected turn(s) taken: the served answers and {h['siblings']} "
                       "resampled sibling(s), each token weighed by the teacher")  # fmt: skip
        if self.looked_since is not None:
            at = dt.datetime.fromtimestamp(self.looked_since / 1e6, dt.UTC)
            out.append(
                f"  looked at {len(self.considered)} group(s) changed since the last run's "
                f"selection ({at:%Y-%m-%d %H:%M} UTC) or left pending by it (--rescan: all)"
            )
        if self.pooled is not None:
            out.append(pooled_line(self.pooled))
        if self.staleness:
            ages = ", ".join(f"{n} {_age(a)}" for a, n in sorted(self.staleness.items()))
            out.append(f"  by the adapter that sampled them: {ages}")
        out += [f"  skipped {n} group(s): {reason}" for reason, n in self.skipped.most_common()]
        if self.damaged:
            named = [f"{where} ({why})" for where, why in list(self.damaged.items())[:5]]
            more = ", ..." if len(self.damaged) > 5 else ""
            out.append(f"  left out: the rows of {len(self.damaged)} damaged file(s), set aside "
                       f"and not trained on (`overnight check`): {', '.join(named)}{more}")  # fmt: skip
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


def damaged_files(data_dir: Path) -> dict[str, str]:
    """The files a night's rows could have come from that it did not read (`table/rel`
    -> why): left out as damaged by this process's reads, or set aside before."""
    found = {n.get("file", "?"): n.get("why", "?") for n in quarantined(data_dir)}
    found.update(left_out(data_dir))
    return {where: why for where, why in found.items() if not where.startswith(INDEX + "/")}


def _age(label: str) -> str:
    if label == "0":
        return "on-policy (the adapter this run starts from)"
    if label == "unknown":
        return "of unknown age (no proxy to ask what served them)"
    return f"{label} promotion(s) old"


def without(plan: Plan, groups: list[str]) -> Plan:
    """`plan` without `groups` (held out for the gate, or too stale to train)."""
    gone = set(groups)
    rollouts = {s.rollout_id for s in plan.samples if s.group_id in gone}
    return replace(
        plan,
        groups=[g for g in plan.groups if g not in gone],
        samples=[s for s in plan.samples if s.group_id not in gone],
        rewards={r: v for r, v in plan.rewards.items() if r not in rollouts},
        group_stats={g: v for g, v in plan.group_stats.items() if g not in gone},
    )


def chosen_rewards(
    con, sources: tuple[str, ...], rollouts: list[str] | None = None
) -> dict[str, float]:
    """Each rollout's reward from the first source in `sources` that has one (latest
    wins); of `rollouts` only, when given."""
    return {r: v for r, (_, v) in chosen_sourced_rewards(con, sources, rollouts).items()}


def chosen_sourced_rewards(
    con, sources: tuple[str, ...], rollouts: list[str] | None = None
) -> dict[str, tuple[str, float]]:
    """As chosen_rewards, each with the source it came from."""
    where = ""
    if rollouts is not None:
        con.register("_plan_rollouts", pa.table({"rollout_id": pa.array(rollouts, pa.string())}))
        where = "WHERE rollout_id IN (SELECT rollout_id FROM _plan_rollouts)"
    rows = con.execute(
        "SELECT rollout_id, source, arg_max(reward, created_at) FROM rewards "
        f"{where} GROUP BY rollout_id, source"
    ).fetchall()
    rank = {s: i for i, s in enumerate(sources)}
    best: dict[str, tuple[int, str, float]] = {}
    for rollout, source, reward in rows:
        if source in rank and (rollout not in best or rank[source] < best[rollout][0]):
            best[rollout] = (rank[source], source, reward)
    return {r: (source, v) for r, (_, source, v) in best.items()}


def trained_groups(con) -> set[str]:
    rows = con.execute(
        "SELECT DISTINCT unnest(groups) FROM training_runs WHERE status = 'trained'"
    ).fetchall()
    return {g for (g,) in rows}


def trained_before(con, plan: Plan) -> set[str]:
    """The groups earlier nights trained, as the plan read them (or read now)."""
    return plan.trained_before if plan.trained_before is not None else trained_groups(con)


def candidate_groups(
    con,
    settle_seconds: float,
    since: dt.datetime | None,
    only: list[str] | None,
    done: set[str],
) -> list[str]:
    """Groups no earlier run trained on (`done`): finished ones, or exactly `only` (in its
    order)."""
    # A resumed run trains on exactly the groups it began with, in their order (the
    # shuffles replay from it); they were finished then, so that is not asked again.
    pool = only if only is not None else finished_groups(con, settle_seconds, None)
    candidates = [g for g in pool if g not in done]
    if since is not None:
        rows = con.execute("SELECT group_id FROM groups WHERE started_at >= ?", [since]).fetchall()
        recent = {g for (g,) in rows}
        candidates = [g for g in candidates if g in recent]
    return candidates


@traced(
    "plan",
    lambda plan: {"groups": len(plan.groups), "samples": len(plan.samples),
                  "considered": len(plan.considered), "skipped": sum(plan.skipped.values())},
)  # fmt: skip
def plan_run(selection: Selection, config: TrainConfig) -> Plan:
    """The groups to train on, in order, up to `max_groups`; `plan.skipped` says why not others.

    Only groups changed since the last run's selection are looked at (see the module's
    docstring), and token ids are read only for those whose rewards could give a
    signal: most groups a night considers are left out for their rewards alone. With
    `scope`, only the policy's own groups (storage/read/policy_scope.py), from its own
    last record."""
    data_dir, settle_seconds, since = selection.data_dir, selection.settle_seconds, selection.since
    max_groups, only, scope = selection.max_groups, selection.only, selection.scope
    tokenizer, sampling_defaults = selection.tokenizer, selection.sampling_defaults
    vision = selection.vision
    looked_at = now_us()
    # With `since`, days before it are not even listed (their groups began earlier).
    days_from = since.astimezone(dt.UTC).date() if since is not None else None
    con = open_db(data_dir, days_from=None if only is not None else days_from)
    try:
        last, candidates, rollouts, turn_pool, done = looked_at_groups(
            data_dir, con, config, settle_seconds, since, only, scope
        )
        sourced = chosen_sourced_rewards(
            con, config.reward_sources, [r for rs in rollouts.values() for r in rs]
        )
        rewards = {r: v for r, (_, v) in sourced.items()}
        signed = {r for r, (source, _) in sourced.items() if source == IMPLICIT}
        verdicts = _reward_verdicts(rollouts, rewards, config)
        if only is None:  # a resumed run trains exactly what it began with
            undecided = [g for g in candidates if g not in verdicts]
            verdicts.update(dict.fromkeys(trained_as_turns(con, undecided, done), TRAINED_AS_TURNS))
        lone = lone_groups(rollouts, rewards, config, con, done)
        wanted = [g for g in candidates if verdicts.get(g) is None]
        loaded = load_samples(con, wanted, tokenizer, sampling_defaults, vision=vision)
    finally:
        con.close()
    plan = _plan_from(loaded)
    plan.lone = [g for g in candidates if g in lone]
    plan.damaged = damaged_files(data_dir)
    plan.considered, plan.loaded_groups = candidates, wanted
    plan.looked_since = last["watermark"] if last is not None else None
    plan.turn_pool = turn_pool
    plan.turn_held = set(last.get(TURN_HELD_KEY) or []) if last is not None else set()
    plan.trained_before = done
    by_group: dict[str, list[Sample]] = {}
    for s in loaded.samples:
        by_group.setdefault(s.group_id, []).append(s)
    pending: list[str] = []  # trainable by their rewards, past the cap: not decided
    for group_id in candidates:
        samples = by_group.get(group_id, [])
        if group_id in lone:  # against the night's pool (lone_turns.py), not its own group
            continue
        if max_groups is not None and len(plan.groups) >= max_groups:
            pending += [group_id] if verdicts.get(group_id) is None else []
            continue
        verdict = verdicts.get(group_id) or _advantages_or_reason(samples, rewards, config, signed)
        if isinstance(verdict, str):
            plan.skipped[verdict] += 1
            continue
        rollouts_taken = {s.rollout_id for s in samples}
        plan.take(group_id, samples, {r: rewards[r] for r in rollouts_taken}, verdict)
    # The groups taken are pending too: the gate may hold some out of training.
    plan.waiting = plan.groups + pending
    if only is None and since is None:
        plan.selection = selection_record(plan, looked_at, settle_seconds, config, scope)
    return plan


def looked_at_groups(
    data_dir: Path,
    con,
    config: TrainConfig,
    settle_seconds: float,
    since: dt.datetime | None,
    only: list[str] | None,
    scope: PolicyScope | None,
) -> tuple[dict | None, list[str], dict[str, list[str]], set[str] | None, set[str]]:
    """What a night looks at: (the last selection record it starts from, None for a full
    look; the candidate groups; their rollouts; the per-turn groups to look at, None:
    all; the groups earlier runs trained)."""
    full = only is not None or since is not None or config.rescan
    last = None if full else last_selection(con, config, scope)
    done = trained_groups(con)
    turn_pool = None  # per-turn groups: all
    if last is None:
        candidates = candidate_groups(con, settle_seconds, since, only, done)
        rollouts = _group_rollouts(con, candidates, settle_seconds)
    else:
        rollouts, turn_pool = _changed_since(data_dir, con, last, settle_seconds, done)
        candidates = list(rollouts)
    if scope is not None and only is None:  # another policy's groups are not looked at
        own = scope.groups(con, candidates)
        candidates = [g for g in candidates if g in own]
        rollouts = {g: rollouts[g] for g in candidates}
    return last, candidates, rollouts, turn_pool, done


def selection_record(
    plan: Plan, looked_at: int, settle_seconds: float, config: TrainConfig, scope
) -> dict:
    """Where the next night's selection starts (see the module's docstring)."""
    return {
        "watermark": looked_at,
        "pending": plan.waiting,
        "settle_seconds": settle_seconds,
        "basis": selection_basis(config),
        "policy": scope.name if scope is not None else None,
    }


def _changed_since(
    data_dir: Path, con, last: dict, settle_seconds: float, done: set[str]
) -> tuple[dict[str, list[str]], set[str] | None]:
    """What a night after `last` (a selection record) looks at: the finished served
    groups that changed since or were left pending, with their rollouts; and the
    per-turn groups likewise (None: all of them, for a record from before per-turn
    groups were selected so)."""
    # A group open then (by the settle time it used) was not decided: look back by the
    # longer of the two.
    settle = max(settle_seconds, float(last.get("settle_seconds") or 0))
    changed = changed_groups(data_dir, con, last["watermark"], settle)
    turns = {g for g in changed if g.startswith(TURN_PREFIX)}
    turn_pool = None
    if isinstance(last.get(TURN_PENDING_KEY), list):
        turn_pool = turns | set(last[TURN_PENDING_KEY])
    pool = [g for g in (changed - turns) | set(last.get("pending", [])) if g not in done]
    # Overnight's own traffic never trains (finished_groups leaves it out of a full look).
    pool = without_own(con, pool)
    return _group_rollouts(con, pool, settle_seconds, finished_only=True), turn_pool


def trained_as_turns(con, groups: list[str], done: set[str]) -> set[str]:
    """Of the served `groups`, those one of whose turns a run trained (`done`) as a
    per-turn group: training the group would train that turn a second time."""
    records = [g[len(TURN_PREFIX) :] for g in done if g.startswith(TURN_PREFIX)]
    if not groups or not records:
        return set()
    con.register("_plan_undecided", pa.table({"group_id": pa.array(groups, pa.string())}))
    con.register("_plan_turns", pa.table({"record_id": pa.array(records, pa.string())}))
    rows = con.execute(
        "SELECT DISTINCT group_id FROM completions "
        "WHERE group_id IN (SELECT group_id FROM _plan_undecided) "
        "AND record_id IN (SELECT record_id FROM _plan_turns)"
    ).fetchall()
    return {g for (g,) in rows}


def _group_rollouts(
    con, groups: list[str], settle_seconds: float, finished_only: bool = False
) -> dict[str, list[str]]:
    """Each group's rollouts, in the order of `groups`; with `finished_only`, only the
    groups finished now (as `finished_groups` says), ordered by when they began."""
    if not groups:
        return {}
    con.register("_plan_groups", pa.table({"group_id": pa.array(groups, pa.string())}))
    rows = con.execute(
        """
        WITH c AS (
            SELECT group_id, rollout_id, min(started_at) AS started_at, max(ended_at) AS ended_at
            FROM completions WHERE group_id IN (SELECT group_id FROM _plan_groups)
            GROUP BY group_id, rollout_id),
        f AS (SELECT DISTINCT rollout_id FROM finishes
              WHERE rollout_id IN (SELECT rollout_id FROM c))
        SELECT c.group_id, list(c.rollout_id ORDER BY c.rollout_id),
               bool_and(f.rollout_id IS NOT NULL
                        OR c.ended_at < now() - to_microseconds(CAST($settle * 1e6 AS BIGINT)))
        FROM c LEFT JOIN f USING (rollout_id)
        GROUP BY c.group_id ORDER BY min(c.started_at), c.group_id
        """,
        {"settle": settle_seconds},
    ).fetchall()
    if finished_only:
        return {g: rollouts for g, rollouts, finished in rows if finished}
    found = {g: rollouts for g, rollouts, _ in rows}
    return {g: found.get(g, []) for g in groups}


def _reward_verdicts(
    rollouts: dict[str, list[str]], rewards: dict[str, float], config: TrainConfig
) -> dict[str, str]:
    """Why each group that surely cannot be trained on is left out, from its rollouts'
    rewards alone (no token ids read). The trainable rollouts are a subset of all of
    them, so a group with too few rollouts, or fewer than two distinct rewards, is out
    whatever its records hold."""
    out = {}
    for group_id, group_rollouts in rollouts.items():
        scored = {rewards[r] for r in group_rollouts if r in rewards}
        if len(group_rollouts) < config.min_group_size:
            out[group_id] = f"fewer than {config.min_group_size} trainable rollouts"
        elif len(scored) < 2:
            missing = any(r not in rewards for r in group_rollouts)
            out[group_id] = (
                "a rollout has no reward (run overnight judge, or post rewards)"
                if missing
                else "all rewards equal: no signal"
            )
    return out


def pools_lone_turns(config: TrainConfig) -> bool:
    """Whether a night trains turns with nothing to compare with (lone_turns.py)."""
    if config.lone_turns == "auto":
        return "implicit" in config.reward_sources
    return config.lone_turns == "pool"


def lone_groups(
    rollouts: dict[str, list[str]], rewards: dict[str, float], config: TrainConfig, con, done
) -> set[str]:
    """The served groups too small to compare within (fewer rollouts than
    --min-group-size: a single call is a group of one) whose every rollout has a reward,
    when the night pools them (lone_turns.py); not one a turn of which an earlier run
    trained as a per-turn group (a turn trains once)."""
    if not pools_lone_turns(config):
        return set()
    small = [
        g
        for g, rs in rollouts.items()
        if 0 < len(rs) < config.min_group_size and all(r in rewards for r in rs)
    ]
    return set(small) - trained_as_turns(con, small, done)


def pooled_line(pooled: dict) -> str:
    """The plan's line for what lone_turns.py pooled."""
    if not pooled["turns"]:
        return f"  lone turns: none trained ({pooled['why']})"
    sources = ", ".join(f"{s} {n}" for s, n in sorted(pooled["sources"].items()))
    return (
        f"  lone turns: {pooled['turns']} trained against the night's pool (mean reward "
        f"{pooled['mean']:.3g}, std {pooled['std']:.3g}): {pooled['rollouts']} rollout(s) of "
        f"groups too small to compare within, {pooled['conversation_turns']} conversation "
        f"turn(s) rewarded on their own; by source: {sources}"
    )


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
    samples: list[Sample], rewards: dict[str, float], config: TrainConfig, signed=frozenset()
) -> GroupAdvantages | str:
    """The group's advantages, or why it is not trained on. `signed`: rollouts whose
    reward's sign means something (implicit): never trained the other way (keep_signs)."""
    rollouts = {s.rollout_id for s in samples}
    if len(rollouts) < config.min_group_size:
        return f"fewer than {config.min_group_size} trainable rollouts"
    if any(r not in rewards for r in rollouts):
        return "a rollout has no reward (run overnight judge, or post rewards)"
    adv = group_advantages({r: rewards[r] for r in rollouts}, config.scale_by_std)
    if adv is None:
        return "all rewards equal: no signal"
    return keep_signs(adv, rewards, signed & rollouts) if signed else adv
