"""What live traffic says about each adapter: the rewards of the rollouts it served.

The watch (roll back a promoted adapter) and the canary (promote or drop a candidate)
both compare adapters on these. A rollout's reward is the one training would take (the
first of `reward_sources` it has), and it counts for an adapter when every turn of the
rollout was served under one name. A rollback loads an adapter again under a new name, so
an adapter is known by its path: every name a path was served under counts for it.
"""

from __future__ import annotations

from pathlib import Path

from overnight.storage import open_db
from overnight.trainer.choose.plan import chosen_rewards


def names_of(state: dict, path: str | None) -> set[str]:
    """Every name `path` was served under (None: the base model's names)."""
    if path is None:
        return {n for n in (state.get("base_model"), state.get("alias")) if n}
    return {a["name"] for a in state.get("adapters") or [] if a.get("path") == path}


def rewards_of(state: dict, path: str | None, by_served: dict[str, list[float]]) -> list[float]:
    """The live rewards of `path` (None: the base model) under every name it served as."""
    return [r for name in names_of(state, path) for r in by_served.get(name, [])]


def policy_of(state: dict) -> str | None:
    """The alias whose traffic alone counts for `state`'s adapters when the proxy serves
    several policies (the base model serves them all: its rewards must be the policy's
    own), or with one when a key limited to other models could steer it (`others_trained`:
    storage/read/policy_scope.py); None with one policy otherwise, where every rollout counts,
    as before policies."""
    several = len(state.get("policies") or []) > 1
    return state.get("alias") if several or state.get("others_trained") is False else None


# Who served a turn, in SQL over `completions`: the name vLLM served it under, or, for
# a hosted API's records, that upstream's label in the notes (routes/hosted.py).
SERVED_MODEL = "model_served"
SERVED_UPSTREAM = "json_extract_string(notes, '$.upstream')"


def live_rewards(
    data_dir: Path,
    sources: tuple[str, ...],
    since: str | None = None,
    requested: str | None = None,
    served_by: str = SERVED_MODEL,
) -> dict[str, list[float]]:
    """Rewards of rollouts served by one server throughout, by that server (`served_by`:
    a model name, or a hosted upstream's label); with `since` (an ISO time), only rollouts
    that began then or later; with `requested`, only those that asked for that alias
    throughout (a policy's: policy_of; a rollout with a turn that asked for another model
    is not the policy's). The agents' rollouts only: overnight's own (the demo's held-out
    measurement, storage/read/sent_by.py) are not what the adapter serves live."""
    only = "AND bool_and(coalesce(model_requested = ?, FALSE)) " if requested is not None else ""
    only += "AND bool_and(sent_by = 'client') "
    con = open_db(data_dir)
    try:
        served = con.execute(
            f"SELECT rollout_id, min({served_by}) FROM completions "
            "WHERE logged AND error IS NULL AND rollout_id IS NOT NULL GROUP BY rollout_id "
            f"HAVING count({served_by}) = count(*) AND min({served_by}) = max({served_by}) "
            f"{only}AND min(started_at) >= CAST(? AS TIMESTAMPTZ)",
            [*([requested] if requested is not None else []),
             since or "1970-01-01T00:00:00+00:00"],
        ).fetchall()  # fmt: skip
        rewards = chosen_rewards(con, sources)
    finally:
        con.close()
    out: dict[str, list[float]] = {}
    for rollout, name in served:
        if rollout in rewards:
            out.setdefault(name, []).append(rewards[rollout])
    return out
