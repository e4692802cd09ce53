"""Which groups are a policy's: the night of one policy trains on its own traffic only.

A proxy serves several policies (proxy/adapters/policies.py), one alias each; every
record keeps the alias its request asked for (`model_requested`: a canary's records too,
served under the canary's name but asked for under the alias). A group is the policy's
whose first turn asked for its alias. The default policy (the proxy's `--alias`) also
keeps what asked for no policy at all (the base model's name, any other model): with
one policy a night trains on what it always did, and no group is ever two policies'.

A night of one policy also reads only its own selection record (selection.py): the
record says its policy, and a record from before policies (none said) is the default
policy's. Per-turn groups follow their served turn's group; the gate's held-out prompts
are the policy's own traffic (gate_prompts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa


@dataclass(frozen=True)
class PolicyScope:
    name: str
    default: bool = True  # the proxy's default policy: also what asked for no policy
    others: tuple[str, ...] = ()  # the proxy's other policies

    @classmethod
    def of(cls, name: str | None, state: dict) -> PolicyScope | None:
        """The scope of `name` among the policies the proxy's `/admin/adapters` answer
        lists (`state`); None for no name (every group, as before policies). Without a
        proxy, `name` alone: its own alias's groups."""
        if name is None:
            return None
        policies = state.get("policies")
        if not policies:
            return cls(name, default=False)
        default = state.get("default", policies[0])
        return cls(name, name == default, tuple(p for p in policies if p != name))

    def requested(self, column: str = "model_requested") -> tuple[str, list]:
        """A SQL condition on the model a record asked for, and its parameters."""
        if not self.default:
            return f"{column} = ?", [self.name]
        if not self.others:
            return "TRUE", []
        marks = ", ".join("?" for _ in self.others)
        return f"coalesce({column}, '') NOT IN ({marks})", list(self.others)

    def groups(self, con, groups: list[str]) -> set[str]:
        """Of `groups`, those whose first turn asked for this policy."""
        if not groups:
            return set()
        con.register("_scope_groups", pa.table({"group_id": pa.array(groups, pa.string())}))
        condition, params = self.requested("first_requested")
        rows = con.execute(
            "SELECT group_id FROM (SELECT group_id, arg_min(model_requested, started_at) "
            "AS first_requested FROM completions "
            "WHERE group_id IN (SELECT group_id FROM _scope_groups) GROUP BY group_id) "
            f"WHERE {condition}",
            params,
        ).fetchall()
        return {g for (g,) in rows}

    def owns(self, record: dict) -> bool:
        """Whether a selection record (or a run's metrics) is this policy's night."""
        policy = record.get("policy")
        return policy == self.name or (policy is None and self.default)
