"""Per-turn groups in the night's plan: a served turn and its siblings, trained one step deep.

The stage in resample.py (or the proxy's shadow sampler) stores siblings of served
turns; the judge scores each per-turn group (`turn:<record id>`) like any group.
`add_turn_groups` puts the scored ones into the plan: each member is one sequence, the
served prompt plus one alternative, trained against the logprobs it was sampled with
(docs/grpo.md, "Groups made from single calls").

A night decides per-turn groups as plan.py decides served ones: only those changed since
the last run's selection, or left pending by it (`Plan.turn_pool`), are read, and the
ones left undecided go into the selection record (`turn_pending`).

A served turn trains once. With `--resample-all-turns` a turn of a group of two or more
rollouts has a per-turn group too; when its own group is trained (tonight or by an
earlier run) the per-turn group is left out for good, and while its own group is
trainable but left for a later night (held out for the gate, past --max-groups) it waits
(pending). The own group comes first: its reward is the task's outcome, credited to
every turn, which a per-turn group cannot see. The reverse order (a per-turn group
trained first, its own group trainable only later) is plan.py's `TRAINED_AS_TURNS`.

A per-turn group of an imported turn (docs/import.md; resample.py renders its prompt)
trains its siblings only: each is the prompt rendered for it (kept in its notes) and
what vLLM sampled, with its logprobs. The imported answer is scored with them (the judge
compares the group) but never trained: no logprobs, not the policy's sample (the plan's
`turns skipped: imported: no token ids (off-policy)`); the advantages are the siblings'.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable

import pyarrow as pa

from overnight.config import TrainConfig
from overnight.storage import open_db
from overnight.storage.read.siblings import TURN_PREFIX, add_turn_views
from overnight.trainer.grpo.data import DataError, Turn, group_advantages, merge_turns
from overnight.trainer.grpo.logged_turns import IMPORTED_SKIP, Loaded, load_samples
from overnight.trainer.grpo.sampling import from_request

from .inputs import Selection
from .plan import (
    Plan,
    _advantages_or_reason,
    chosen_rewards,
    trained_before,
)
from .selection import HINDSIGHT_PREFIX, TURN_HELD_KEY, TURN_PENDING_KEY

# Rewards a per-turn group trains on: only those the judge writes. A reward an agent
# posts names a rollout of its own; one posted for a member id would be a client
# writing into a group it never sampled.
TURN_SOURCES = ("combined", "function", "ruler")
# Why a per-turn group is left out, or waits, because of its turn's own group.
OWN_GROUP_TRAINED = (
    "its turn is trained in its own group, tonight, before, or (held out for the gate) later: "
    "a turn trains once"
)
OWN_GROUP_WAITS = "its turn's own group is trainable, left for a later night (a turn trains once)"
# Why a per-turn group an earlier night's gate took is not trained now (gate/prompts.py).
HELD_BY_A_GATE = (
    "held out by an earlier night's gate: not trained later (a promotion stale by now; the "
    "agent's next turns are resampled fresh)"
)


def is_turn_group(group_id: str) -> bool:
    return group_id.startswith(TURN_PREFIX)


def add_turn_groups(selection: Selection, plan: Plan, config: TrainConfig) -> Plan:
    """`plan` plus the per-turn groups no run trained on whose members all have a reward
    from the judge and whose rewards differ; exactly the turn groups in `only` for a
    resumed run. The gate's prompts are chosen afterwards, from outside the whole plan
    (gate/prompts.py), so tonight's per-turn groups train tonight.

    Only `plan.turn_pool` is looked at, when set (see the module's docstring), and
    a turn whose own group `plan` trains or leaves pending is not trained here."""
    data_dir, since, max_groups = selection.data_dir, selection.since, selection.max_groups
    only, scope = selection.only, selection.scope
    sampling_defaults, vision = selection.sampling_defaults, selection.vision
    full = only is not None or since is not None or config.rescan
    con = open_db(data_dir)
    try:
        add_turn_views(con)
        members = _members(con, since, only, None if full else plan.turn_pool)
        if scope is not None and only is None:  # a turn is its own group's policy's
            own = scope.groups(con, sorted({group for _, group in members.values()}))
            members = {g: m for g, m in members.items() if m[1] in own}
        done = trained_before(con, plan)
        candidates = [g for g in members if g not in done]
        plan.considered += candidates
        sources = tuple(s for s in config.reward_sources if s in TURN_SOURCES)
        member_ids = [r for g in candidates for r in members[g][0]]
        rewards = chosen_rewards(con, sources, member_ids) if sources and member_ids else {}
        own = _own_group_verdict(plan, done, only)
        wanted, pending = [], []
        held = plan.turn_held if only is None else set()
        for group_id in candidates:
            ids, own_group = members[group_id]
            why = (HELD_BY_A_GATE if group_id in held else None) or _verdict(ids, rewards, config)
            why = why or own(own_group)
            pending += [group_id] if why == OWN_GROUP_WAITS else []
            if why:
                plan.skipped[f"per-turn groups: {why}"] += 1
            else:
                wanted.append(group_id)
        room = None if max_groups is None else max(max_groups - len(plan.groups), 0)
        pending += wanted[room:] if room is not None else []
        wanted = wanted[:room] if room is not None else wanted
        plan.loaded_groups += wanted
        imported = _imported_turns(con, wanted)
        loaded = load_samples(
            con, [g for g in wanted if g not in imported], None, sampling_defaults,
            view="turn_completions", vision=vision,
        )  # fmt: skip
        if imported:
            _add(loaded, _imported_samples(con, sorted(imported), sampling_defaults))
    finally:
        con.close()
    _take(plan, wanted, loaded, rewards, config)
    if plan.selection is not None and only is None and since is None:
        # Taken ones too, as plan.py records its own: a failed run's record is not used.
        taken = [g for g in plan.groups if is_turn_group(g)]
        still = sorted(plan.turn_held & set(candidates))  # found again: still decided
        plan.selection = {**plan.selection, TURN_PENDING_KEY: taken + pending, TURN_HELD_KEY: still}
    return plan


def _own_group_verdict(
    plan: Plan, done: set[str], only: list[str] | None
) -> Callable[[str], str | None]:
    """served group -> why its turns' per-turn groups are not trained tonight (it is
    trained, tonight or before, or trainable and waiting), or None. A resumed run
    (`only`) trains exactly the groups it began with, chosen by this rule then."""
    trained = done | set(plan.groups)
    waiting = set(plan.waiting)

    def why(own_group: str) -> str | None:
        if only is not None:
            return None
        if own_group in trained:
            return OWN_GROUP_TRAINED
        return OWN_GROUP_WAITS if own_group in waiting else None

    return why


def _take(plan: Plan, wanted: list[str], loaded, rewards: dict[str, float], config) -> None:
    """The `wanted` groups whose records still give a signal, into `plan`."""
    for reason, n in loaded.skipped.items():
        plan.skipped[f"per-turn groups: turns skipped: {reason}"] += n
    by_group: dict[str, list] = {}
    for sample in loaded.samples:
        by_group.setdefault(sample.group_id, []).append(sample)
    for group_id in wanted:
        samples = by_group.get(group_id, [])
        verdict = _advantages_or_reason(samples, rewards, config)
        if isinstance(verdict, str):
            plan.skipped[f"per-turn groups: {verdict}"] += 1
        else:
            plan.take(group_id, samples, {s.rollout_id: rewards[s.rollout_id] for s in samples},
                      verdict)  # fmt: skip


# The notes key resample.py keeps an imported turn's rendered prompt under (a sibling's).
IMPORTED_PROMPT = "imported_prompt_token_ids"


def _imported_turns(con, groups: list[str]) -> set[str]:
    """Of `groups`, the per-turn groups of imported turns (their notes' upstream)."""
    if not groups:
        return set()
    con.register("_turn_imported", pa.table({"group_id": pa.array(groups, pa.string())}))
    rows = con.execute(
        "SELECT 'turn:' || record_id FROM completions WHERE 'turn:' || record_id IN "
        "(SELECT group_id FROM _turn_imported) AND "
        "starts_with(json_extract_string(notes, '$.upstream'), 'imported:')"
    ).fetchall()
    return {g for (g,) in rows}


def _imported_samples(con, groups: list[str], sampling_defaults: dict | None) -> Loaded:
    """The trainable members of imported turns' per-turn groups: the siblings, each its
    rendered prompt (notes) and what vLLM sampled, as the body sent asked it sampled.
    The imported answer is counted as skipped, never a sample."""
    out = Loaded()
    con.register("_turn_imported", pa.table({"group_id": pa.array(groups, pa.string())}))
    served = con.execute(
        "SELECT count(*) FROM turn_completions WHERE origin = 'served' "
        "AND group_id IN (SELECT group_id FROM _turn_imported)"
    ).fetchone()[0]
    if served:
        out.skipped[IMPORTED_SKIP] += served
    rows = con.execute(
        f"""
        SELECT group_id, rollout_id, model_served, request, completion_token_ids,
               completion_logprobs, json_extract(notes, '$.{IMPORTED_PROMPT}')
        FROM siblings WHERE error IS NULL AND group_id IN (SELECT group_id FROM _turn_imported)
        ORDER BY group_id, rollout_id
        """
    ).fetchall()
    for group_id, rollout_id, model, sent, completion, logprobs, prompt in rows:
        prompt = json.loads(prompt) if isinstance(prompt, str) else prompt
        if not prompt or not completion or not logprobs:
            out.skipped["imported: a sibling without its rendered prompt or its logprobs"] += 1
            continue
        try:
            sampling = from_request(json.loads(sent) if sent else {}, sampling_defaults or {})
            turn = Turn(list(prompt), list(completion), list(logprobs), sampling, model)
        except DataError as e:
            out.skipped[str(e)] += 1
            continue
        out.samples += merge_turns(rollout_id, group_id, [turn])
    return out


def _add(loaded: Loaded, more: Loaded) -> None:
    loaded.samples += more.samples
    for reason, n in more.skipped.items():
        loaded.skipped[reason] += n


def trained_turn_sources(con) -> set[str]:
    """Served groups one of whose turns a run trained on as a per-turn group, or as a
    --hindsight revision (`hindsight:<record>`, the turn's prompt trained with the
    teacher's answer): their prompts are not held out (the gate's prompts must be ones
    nothing trained on)."""
    rows = con.execute(
        """
        WITH trained AS (
            SELECT unnest(groups) AS id FROM training_runs WHERE status = 'trained')
        SELECT DISTINCT group_id FROM completions
        WHERE 'turn:' || record_id IN (SELECT id FROM trained)
           OR ? || record_id IN (SELECT id FROM trained)
        """,
        [HINDSIGHT_PREFIX],
    ).fetchall()
    return {g for (g,) in rows}


def _members(
    con, since: dt.datetime | None, only: list[str] | None, pool: set[str] | None
) -> dict[str, tuple[list[str], str]]:
    """Each per-turn group's (member ids, the served turn's own group), oldest served
    turn first (a resumed run: `only`'s); of `pool` only, when given."""
    # Turns overnight sent itself never train (storage/read/sent_by.py), siblings or not.
    where, params = ["c.sent_by = 'client'"], []
    if since is not None:
        where, params = [*where, "c.started_at >= ?"], [since]
    if only is not None or pool is not None:
        chosen = [g for g in (only if only is not None else pool) if is_turn_group(g)]
        con.register("_turn_pool", pa.table({"group_id": pa.array(chosen, pa.string())}))
        where.append("t.group_id IN (SELECT group_id FROM _turn_pool)")
    rows = con.execute(
        f"""
        SELECT t.group_id, list(t.rollout_id ORDER BY t.rollout_id), any_value(c.group_id)
        FROM turn_completions t JOIN completions c ON c.record_id = t.sibling_of
        WHERE {" AND ".join(where)}
        GROUP BY t.group_id ORDER BY min(c.started_at), t.group_id
        """,
        params,
    ).fetchall()
    members = {g: (ids, own) for g, ids, own in rows}
    if only is not None:
        return {g: members[g] for g in only if g in members}
    return members


def _verdict(members: list[str], rewards: dict[str, float], config: TrainConfig) -> str | None:
    """Why a per-turn group is not trained on, from its members' rewards; or None."""
    if len(members) < config.min_group_size:
        return f"fewer than {config.min_group_size} members"
    if any(m not in rewards for m in members):
        return "a member has no reward from the judge or the reward function"
    try:
        if group_advantages({m: rewards[m] for m in members}, config.scale_by_std) is None:
            return "all rewards equal: no signal"
    except DataError as e:
        return str(e)
    return None


def conversation_key(messages, tools) -> str:
    """What makes two conversations the same, as the gate compares its prompts."""
    return json.dumps([messages, tools or []], sort_keys=True)
