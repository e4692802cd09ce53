"""Who sent a completion: an agent (a client), or overnight itself through its own proxy.

Every completion row says so in `sent_by` (storage/schema.py): `client` for an agent's
request, else one of `KINDS`, what of overnight's own made it. The proxy sets it from
the `X-Rollout-Origin` header only for a request the operator made (proxy/routes/auth.py:
the admin token, or loopback where no admin token is set); a client that sends the
header is recorded as `client`, so no client can hide its traffic or change what trains.

The readers' rules, here because the proxy, the judge, the trainer and the view all
follow them and none may import another (docs/operations.md, "Overnight's own traffic"):
- What people see by default (`overnight ls`, /ui, the proxy's counters) is the agents'
  traffic: a group or rollout is shown as a client's when any of its turns was one, so
  a product's row never hides a client's.
- What a night trains, judges or reads signals from never holds a turn of overnight's
  own (`own_turns` > 0 leaves the group out) unless a step names the group itself
  (`overnight judge --group`, as the demo scores its held-out measurement). Resampled
  and shadow siblings are the `siblings` table's, not these: they train as before.
"""

from __future__ import annotations

CLIENT = "client"
# What overnight sends through its own proxy, by what made it (X-Rollout-Origin's values).
KINDS = {
    "eval": "a measurement on held-out prompts (the demo's held-out questions)",
    "gate": "the promotion gate's samples of the candidate and the served adapter",
    "canary": "a canary's or the watch's own probes of an adapter",
    "resample": "siblings of logged turns asked through the proxy",
    "judge": "an LLM judge served by the same vLLM (--judge-base-url at the proxy)",
    "signals": "the implicit-reward classifier, where it runs on the local model",
}
SENT_BY = frozenset({CLIENT, *KINDS})

# The `rollouts` and `groups` views' columns (reader.py), over rows whose `sent_by` is
# never null there: `sent_by` is `client` when any turn was a client's (what the views
# show), else the product's kind; `own_turns` counts overnight's own turns (what trains).
AGGREGATE_SENT_BY = "CASE WHEN bool_or({column} = 'client') THEN 'client' ELSE min({column}) END"
# The condition on the `groups` or `rollouts` view for the agents' traffic, and for the rest.
AGENTS = "sent_by = 'client'"
OWN = "sent_by <> 'client'"


def shown(column: str = "sent_by", which: str | None = CLIENT) -> tuple[str, list]:
    """A SQL condition on `column` of the `groups` or `rollouts` view for what a listing
    shows (`which`: `client`, the default; a kind of `KINDS`; `own`: every kind; None:
    everything), and its parameters. Raises ValueError for anything else."""
    if which is None or which == "all":
        return "TRUE", []
    if which == "own":
        return f"{column} <> 'client'", []
    if which not in SENT_BY:
        raise ValueError(f"sent by must be all, own or one of {sorted(SENT_BY)}, got {which!r}")
    return f"{column} = ?", [which]


def without_own(con, groups: list[str]) -> list[str]:
    """`groups` less those that hold a turn overnight sent itself, in their order: what
    a night may train, judge or resample when no step named them."""
    if not groups:
        return []
    own = {
        g
        for (g,) in con.execute(
            f"SELECT DISTINCT group_id FROM completions WHERE {OWN} "
            "AND group_id IN (SELECT unnest(?))",
            [groups],
        ).fetchall()
    }
    return [g for g in groups if g not in own]
