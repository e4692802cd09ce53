"""A policy's best adapter so far, as the gate's records place it: what a `not-worse`
candidate is held to besides the served one (trainer/gate/verdict.py), and what
retention keeps (proxy/alias/retention.py).

A not-worse gate forgives a loss up to its margin, against the adapter served now. Night
after night the forgiven losses add up: each small night a little worse than the one
before, each within the margin, a policy slides back to where it began (non-inferiority
trials call it bio-creep; measured here on reasoning-gym's number_format, four small
nights: held-out 0.125 -> 0.375 after the first, then back to 0.188 through three nights
promoted at -0.06, -0.06 and 0; BENCHMARKS.md). So the gate also samples the best adapter
of the policy so far on the same prompts, and refuses a candidate measurably worse than
it, or worse by more than the margin, as it does against the served one.

Which adapter is best comes from the gate's own records. Each verdict keeps what it
compared (`candidate_adapter`, `served_adapter`) and the mean difference on its prompts
(`diff_mean`); chained in the order the nights ran, the passed ones place each promoted
adapter at a level over the base model (the base: 0). The best is the highest level above
the served adapter's among the adapters the alias still stands on: its promotion stack
(served, and not rolled back by the watch or by hand; a canary that was dropped never
joined it), and the base model. A served adapter the records do not place (promoted by
hand, by a night with the gate off, by a resumed run whose promotion came before its
interruption, or before these records) starts a new chain: what was measured before it
is against something this chain cannot place, and is dropped. Retention keeps each
policy's best on disk whatever --keep-adapters says; one whose files are gone all the
same (deleted by hand) is passed over for the next best.

The levels are noisy sums (each step +-0.1 on 16-32 prompts); they only choose which
adapter to sample. The test itself is the paired comparison on tonight's prompts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from overnight.storage import open_db
from overnight.storage.read.policy_scope import PolicyScope

_ABOVE = 1e-9  # a level the served one's by more than rounding


@dataclass(frozen=True)
class Best:
    adapter: str | None  # as the proxies name it (None: the base model)
    path: str | None  # where this machine loads it from (None: the base model)
    above_served: float  # its level over the served adapter's, by the chained verdicts

    def describe(self) -> str:
        return f"{self.adapter or 'the base model'} ({self.above_served:+.3g} over the served)"


def levels(
    data_dir: Path, owns: Callable[[dict], bool], base_model: str | None = None
) -> dict[str | None, float]:
    """Each adapter the passed verdicts of the policy's nights (`owns(metrics)`) place, at
    its level over the base model (None: the base model, 0), along the newest chain (the
    module's docstring); with `base_model`, only its nights'. A row whose metrics cannot
    be read places nothing."""
    con = open_db(data_dir)
    try:
        rows = con.execute(
            "SELECT metrics FROM training_runs WHERE status = 'trained' "
            "AND coalesce(base_model = ?, true) AND json_valid(metrics) "
            "AND json_extract(metrics, '$.gate.diff_mean') IS NOT NULL ORDER BY started_at",
            [base_model],
        ).fetchall()
    finally:
        con.close()
    placed: dict[str | None, float] = {None: 0.0}
    for (text,) in rows:
        metrics = json.loads(text)
        gate = metrics.get("gate")
        if not isinstance(gate, dict) or not owns(metrics) or gate.get("promote") is not True:
            continue
        if "candidate_adapter" not in gate or "served_adapter" not in gate:
            continue  # recorded before verdicts named what they compared
        candidate, served, diff = (
            gate["candidate_adapter"],
            gate["served_adapter"],
            gate["diff_mean"],
        )
        if not isinstance(diff, int | float) or not math.isfinite(diff):
            continue
        if served not in placed:
            placed = {served: 0.0}  # a new chain (the module's docstring)
        placed[candidate] = placed[served] + float(diff)
    return placed


def best_so_far(
    placed: dict[str | None, float], served: str | None, standing: set[str], loadable
) -> Best | None:
    """The adapter `placed` highest above the served one, among the base model and the
    adapters the alias stands on (`standing`: its promotion stack's paths and uploads),
    whose files `loadable(adapter)` finds (its local path, or None where it cannot be
    had); None when the served one is the best placed, or is not placed at all."""
    if served not in placed:
        return None
    floor = placed[served] + _ABOVE
    ranked = sorted(placed.items(), key=lambda item: -item[1])
    for adapter, level in ranked:
        if level <= floor:
            return None
        if adapter is None:
            return Best(None, None, level - placed[served])
        path = loadable(adapter) if adapter in standing else None
        if path is not None:
            return Best(adapter, path, level - placed[served])
    return None


def standing(state: dict) -> set[str]:
    """The paths and uploads of the adapters on the alias's promotion stack, as the
    proxy's `/admin/adapters` answer (`state`) lists them."""
    by_name = {a["name"]: a for a in state.get("adapters") or []}
    stack = [by_name[name] for name in state.get("stack") or [] if name in by_name]
    return {str(a[key]) for a in stack for key in ("path", "source") if a.get(key)}


def loadable_path(data_dir: Path):
    """`best_so_far`'s `loadable` for this machine: a local adapter whose directory still
    holds its config, or a bucket upload fetched (None where either is gone)."""
    from overnight.storage import data_url, segment_store
    from overnight.storage.bucket import adapter_sync

    def find(adapter: str) -> str | None:
        try:
            path = adapter if data_url(adapter) is None else str(
                adapter_sync.fetch(segment_store(data_dir), adapter)
            )  # fmt: skip
        except OSError:  # an upload pruned from the bucket, or unreadable: the next best
            return None
        return path if (Path(path) / "adapter_config.json").is_file() else None

    return find


def kept_best(data_dir: Path, state: dict, default: str | None) -> str | None:
    """The best adapter so far of the policy whose promotion state is `state` (its
    `alias`; `default`: the default policy's name, whose nights may name no policy), for
    retention to keep; None when the served one is its best, or nothing is placed."""
    policy = state.get("alias")
    owns = PolicyScope(policy, default=policy == default).owns  # a night naming none: default's
    by_name = {a["name"]: a for a in state.get("adapters") or []}
    top = by_name.get((state.get("stack") or [None])[-1])
    served = top["path"] if top else None  # as the night's verdict names it (served_adapter)
    best = best_so_far(levels(data_dir, owns), served, standing(state), lambda a: a)
    return best.adapter if best is not None else None
