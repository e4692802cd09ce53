"""How many promotions old a record is, and what a run does with stale ones.

A record names the adapter that sampled it (`model_served`); a run starts from the
adapter the proxy serves now. A record is on-policy (0) when it was sampled by that
adapter's weights (the same path, under any name: a rollback loads an adapter again
under a new one), else as old as the number of times the alias changed between its
adapter's load and the start adapter's, and at least 1. Its importance ratios then
compare the starting policy with one a promotion or more away: trained as they are
(GRPO's clipping bounds them), or left out with `--max-staleness N`.

Per-turn groups take their served turn's adapter (siblings are sampled with it,
trainer/choose/resample.py); a group is as old as its oldest sample.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from .plan import Plan, without

# Why a group is left out when its records are older than --max-staleness allows.
TOO_STALE = (
    "sampled {age} promotion(s) before the adapter this run starts from (--max-staleness {limit})"
)


def staleness_of(state: dict, start: str | None) -> Callable[[tuple[str, ...]], int | None]:
    """served_by (a sample's model names) -> promotions between them and `start` (the
    starting adapter's path as the proxy's state names it; None: the base model). None
    when the state says nothing (no proxy): age unknown."""
    adapters = state.get("adapters") or []
    if not state:
        return lambda _names: None
    by_name = {a["name"]: a for a in adapters}
    # Loads that changed what the alias serves, in order; a canary serves only a share.
    loads = sorted(a["version"] for a in adapters if a.get("reason") != "canary")
    start_version = max(
        (a["version"] for a in adapters if a.get("path") == start and start is not None),
        default=0,
    )

    def age(name: str) -> int:
        adapter = by_name.get(name)
        path = adapter["path"] if adapter else None  # not one of ours: the base model
        if path == start:
            return 0
        version = adapter["version"] if adapter else 0
        return max(1, sum(version < v <= start_version for v in loads))

    return lambda names: max((age(n) for n in names), default=0)


def weigh_staleness(plan: Plan, age_of, max_staleness: int | None) -> Plan:
    """`plan` with every sample's age (`Sample.staleness`), its groups counted by age in
    `plan.staleness`, and the groups older than `max_staleness` left out."""
    aged = [replace(s, staleness=age_of(s.served_by)) for s in plan.samples]
    group_age: dict[str, int | None] = {}
    for s in aged:
        old = group_age.get(s.group_id)
        group_age[s.group_id] = s.staleness if old is None else max(old, s.staleness or 0)
    too_old = [
        g
        for g, age in group_age.items()
        if max_staleness is not None and age is not None and age > max_staleness
    ]
    plan = replace(plan, samples=aged)
    if too_old:
        plan = without(plan, too_old)
        for g in too_old:
            plan.skipped[TOO_STALE.format(age=group_age[g], limit=max_staleness)] += 1
    plan.staleness = dict(Counter(_label(group_age[g]) for g in plan.groups))
    return plan


def _label(age: int | None) -> str:
    return "unknown" if age is None else str(age)
