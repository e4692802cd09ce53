"""The gate's held-out prompts: recent conversations the candidate did not train on.

The gate needs prompts like tomorrow's traffic that tonight's candidate never saw. They
are taken once the plan is whole (served groups and per-turn groups alike), in this order:

  1. recent first turns with no group in tonight's plan and no per-turn group of their
     own: traffic nobody selected by its outcome (single calls not resampled, one-off
     questions), newest first;
  2. if too few, the night's other conversations in the proportion the night has them:
     those whose per-turn group was left out for its rewards (all equal, say), newest
     first, and those of tonight's plan in an order drawn afresh each night, giving up
     at most a quarter of the plan's groups. A plan group whose conversation the gate takes
     waits for a later night (pending), listed in the plan's skipped reasons; if an
     adapter is promoted meanwhile it is then a promotion stale (staleness.py).

Why not the newest conversations whatever they are: with single calls every recent
conversation has a per-turn group, so the newest were tonight's own training data, and
holding them out left most of tonight's per-turn groups for the next night, one
promotion stale (issue 21). Why not only conversations that cannot train: those are
selected by their outcome (all of their samples scored the same), and a gate that sees
only prompts where every reply scores 0 cannot tell a broken candidate from the served one.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from overnight.storage import open_db
from overnight.storage.read.images import image_parts, shows_images
from overnight.storage.read.policy_scope import PolicyScope
from overnight.storage.read.siblings import add_turn_views
from overnight.trainer.choose.plan import Plan, trained_groups, without
from overnight.trainer.choose.selection import TURN_HELD_KEY, TURN_PENDING_KEY
from overnight.trainer.choose.turn_groups import (
    conversation_key,
    is_turn_group,
    trained_turn_sources,
)

# Whose first turns may be the gate's prompts (storage/read/sent_by.py): like tomorrow's
# traffic, or asked to measure it.
GATE_SENDERS = "('client', 'eval', 'gate')"
MAX_NEW_TOKENS = 512  # a reply's cap when its logged request set none
# A rollout's first logged turn: turn 0 for most agents, but the proxy counts the assistant
# turns a request carries (proxy/capture/records.py), and an agent that shows the model
# worked examples as earlier turns (few-shot, examples/reasoning_gym_agent.py) or resumes a
# conversation held elsewhere starts its rollout at turn 2 or 7.
FIRST_TURN = "turn_index = min(turn_index) OVER (PARTITION BY rollout_id)"
# Why a plan group is not trained tonight when the gate takes its conversation.
GIVEN_TO_THE_GATE = (
    "held out as one of the gate's prompts tonight: waits for a later night "
    "(--gate-prompts sets how many; the gate takes the plan's only when the night has too few others)"
)
TURNS_GIVEN_TO_THE_GATE = (
    "per-turn groups: held out as one of the gate's prompts tonight, not trained later "
    "(--gate-prompts sets how many; the gate takes the plan's only when the night has too few others)"
)


@dataclass(frozen=True)
class GatePrompt:
    group_id: str
    messages: list[dict]
    tools: list[dict]
    temperature: float
    top_p: float
    max_tokens: int
    top_k: int = 0  # vLLM's extension, as the logged request asked (0: off)

    @property
    def key(self) -> str:
        return conversation_key(self.messages, self.tools)


def prompt_of(group_id: str, request_text: str | None, images: bool = False) -> GatePrompt | None:
    """The prompt a logged request makes, or None where the gate cannot sample it: not
    a conversation, or one that shows images where the model cannot see (`images`: a
    vision-language base model, whose processor samples it: verdict.py)."""
    request = json.loads(request_text) if request_text else {}
    if not isinstance(request, dict):
        return None
    messages = request.get("messages")
    if not messages or not isinstance(messages, list):
        return None  # text completions and redacted bodies: nothing to sample from
    if shows_images(messages) and (not images or _by_url(messages)):
        # A text model's gate samples through the tokenizer: no pixels. A picture given
        # by URL was never stored, and the gate does not fetch it.
        return None
    cap = request.get("max_completion_tokens") or request.get("max_tokens") or MAX_NEW_TOKENS
    temperature = request.get("temperature")
    return GatePrompt(
        group_id,
        messages,
        list(request.get("tools") or []),
        1.0 if temperature is None else float(temperature),
        float(request.get("top_p") or 1.0),
        min(int(cap), MAX_NEW_TOKENS),
        max(int(request.get("top_k") or 0), 0),
    )


def _by_url(messages: list) -> bool:
    return any(p is not None and p.kind == "url" for m in messages for p in image_parts(m))


def held_out_prompts(
    data_dir: Path,
    plan: Plan,
    count: int,
    take_from_plan: bool = True,
    scope: PolicyScope | None = None,
    images: bool = False,
) -> tuple[list[GatePrompt], Plan]:
    """Up to `count` distinct recent prompts the candidate does not train on (see the
    module's docstring), and the plan to train on: `plan` less the groups it gave. With
    `scope`, only the policy's own traffic: another agent's prompts say nothing of it.
    `images`: prompts that show images may be taken (a vision-language base model)."""
    con = open_db(data_dir)
    try:
        add_turn_views(con)
        # Served groups trained on as a whole or through one of their turns (per-turn
        # groups of their siblings) are not held out: the candidate has seen them.
        done = trained_groups(con) | trained_turn_sources(con)
        conversations = _plan_conversations(con, plan.groups, images)
        recent = _first_turns(con, 50 * count, scope)
        resampled = _resampled(con, [record for record, _, _ in recent])
    finally:
        con.close()
    in_plan = {key for keys in conversations.values() for key in keys}
    blind, selected, seen = [], [], set()
    for record, group_id, request in recent:
        prompt = prompt_of(group_id, request, images)
        if prompt is None or group_id in done or group_id in conversations or prompt.key in seen:
            continue
        seen.add(prompt.key)
        if prompt.key in in_plan:
            continue  # offered below as one of the plan's, if the gate needs it
        (selected if record in resampled else blind).append(prompt)
    prompts = blind[:count]
    given: list[str] = []
    if len(prompts) < count:
        costly = _plan_prompts(plan, conversations, images) if take_from_plan else []
        needed = count - len(prompts)
        total = len(costly) + len(selected)
        share = round(needed * len(costly) / total) if total else 0
        budget = len(plan.groups) // 4  # groups, not prompts: a conversation may be several
        taken = 0
        for prompt in costly:
            if taken >= share:
                break
            groups = [g for g, keys in conversations.items() if prompt.key in keys]
            if len(given) + len(set(groups) - set(given)) > budget:
                continue
            prompts.append(prompt)
            given += [g for g in groups if g not in given]
            taken += 1
        prompts += selected[: count - len(prompts)]
    if given:
        plan = _give(plan, given)
    return prompts, plan


def _give(plan: Plan, given: list[str]) -> Plan:
    """`plan` without the groups whose conversations the gate took. A served group waits
    for a later night (pending, as the plan recorded it); a per-turn group is decided:
    recorded as held out, never trained. A night later it would train a promotion stale
    (on the tiny model its first-step ratios then spread from 0.01 to 1.7), while the
    agent's next turns are resampled fresh."""
    turns = [g for g in given if is_turn_group(g)]
    plan = without(plan, given)
    if len(given) > len(turns):
        plan.skipped[GIVEN_TO_THE_GATE] += len(given) - len(turns)
    if turns:
        plan.skipped[TURNS_GIVEN_TO_THE_GATE] += len(turns)
    if plan.selection is not None and TURN_PENDING_KEY in plan.selection:
        gone = set(turns)
        pending = [g for g in plan.selection[TURN_PENDING_KEY] if g not in gone]
        held = sorted(set(plan.selection.get(TURN_HELD_KEY) or []) | gone)
        plan.selection = {**plan.selection, TURN_PENDING_KEY: pending, TURN_HELD_KEY: held}
    return plan


def _first_turns(con, limit: int, scope: PolicyScope | None = None) -> list[tuple[str, str, str]]:
    """(record, group, request) of recent first turns (of `scope`'s policy), newest first:
    the agents' and the held-out measurement's (sent by `eval` or `gate`: what the gate is
    for, as the demo asks them), never a judge's or a classifier's prompts through the proxy.
    A first turn is its rollout's first logged one (FIRST_TURN), not turn 0."""
    condition, params = scope.requested() if scope is not None else ("TRUE", [])
    return con.execute(
        "SELECT record_id, group_id, request FROM completions "
        f"WHERE logged AND error IS NULL AND request IS NOT NULL AND {condition} "
        f"AND sent_by IN {GATE_SENDERS} QUALIFY {FIRST_TURN} "
        "ORDER BY started_at DESC, record_id LIMIT ?",
        [*params, limit],
    ).fetchall()


def _resampled(con, records: list[str]) -> set[str]:
    """Of `records`, those with siblings: their per-turn group was decided by its outcome."""
    if not records:
        return set()
    con.register("_gate_records", pa.table({"record_id": pa.array(records, pa.string())}))
    rows = con.execute(
        "SELECT DISTINCT sibling_of FROM siblings "
        "WHERE error IS NULL AND sibling_of IN (SELECT record_id FROM _gate_records)"
    ).fetchall()
    return {r for (r,) in rows}


def _plan_conversations(con, groups: list[str], images: bool) -> dict[str, dict[str, str]]:
    """Each plan group's conversations (key -> the logged request): the first turns of a
    served group, the served turn's context of a per-turn group."""
    served = [g for g in groups if not is_turn_group(g)]
    turns = [g for g in groups if is_turn_group(g)]
    out: dict[str, dict[str, str]] = {g: {} for g in groups}
    con.register("_gate_served", pa.table({"group_id": pa.array(served, pa.string())}))
    con.register("_gate_turns", pa.table({"group_id": pa.array(turns, pa.string())}))
    rows = con.execute(
        "(SELECT group_id, request FROM completions WHERE request IS NOT NULL "
        f"AND group_id IN (SELECT group_id FROM _gate_served) QUALIFY {FIRST_TURN}) "
        "UNION ALL SELECT group_id, request FROM turn_completions WHERE origin = 'served' "
        "AND request IS NOT NULL AND group_id IN (SELECT group_id FROM _gate_turns)"
    ).fetchall()
    for group_id, text in rows:
        prompt = prompt_of(group_id, text, images)
        if prompt is not None:
            out[group_id].setdefault(prompt.key, text)
    return out


def _plan_prompts(
    plan: Plan, conversations: dict[str, dict[str, str]], images: bool
) -> list[GatePrompt]:
    """One prompt per conversation of the plan's groups, in an order drawn afresh each
    night (from its watermark): taking the same ones first every night would keep the
    same conversations out of training for good when an agent's traffic repeats."""
    out, seen = [], set()
    order = list(plan.groups)
    random.Random((plan.selection or {}).get("watermark", 0)).shuffle(order)
    for group_id in order:
        for key, text in conversations.get(group_id, {}).items():
            prompt = prompt_of(group_id, text, images)
            if prompt is not None and key not in seen:
                seen.add(key)
                out.append(prompt)
    return out
