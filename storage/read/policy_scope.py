"""Which groups are a policy's, in SQL over the `completions` view: one definition, read by
the nights that train a policy on its own traffic (trainer/night/) and by the views that
show it (view/: `overnight ls --policy`, the web view's `?policy=`).

A proxy serves several policies, one alias each; every record keeps the alias its request
asked for (`model_requested`: a canary's records too, served under the canary's name but
asked for under the alias). A group is the policy's whose first turn asked for its alias
(what the views show); a night trains on it only when every record in it asked for the
policy (`groups`): a rollout that asked for another model is not the policy's, whatever
its group, and a group mixing two policies is nobody's (GRPO compares a group's samples
with each other; the proxy refuses a scoped key's completion into a group first served
under a model the key may not use, so such a group is made only by an unscoped key, or
across workers or a restart, where the proxy's memory of groups does not reach).

What asked for no policy at all (the base model's name, any other model) is untrained
traffic whenever the proxy serves several policies (`others_trained` false in the proxy's
`/admin/adapters` answer): a key of one policy may be let ask for the base model, and a
key must never steer the training of a policy it may not use. With one policy the
default trains on it, as it always did: every key limited to policies has that one (the
keys file names served policies only, and at least one), so none steers what it may not
use.

Here, in the leaf, because both the trainer and the view read it and neither may import
the other; it needs nothing but DuckDB's SQL and pyarrow.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

# Each group's first turn's model (its policy's alias), from the `completions` view.
FIRST_REQUESTED = (
    "SELECT group_id, arg_min(model_requested, started_at) AS first_requested "
    "FROM completions{where} GROUP BY group_id"
)


@dataclass(frozen=True)
class PolicyScope:
    name: str
    default: bool = True  # the proxy's default policy: also what asked for no policy
    others: tuple[str, ...] = ()  # the proxy's other policies
    others_trained: bool = True  # the default policy trains on what asked for no policy

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
        others = tuple(p for p in policies if p != name)
        # An older proxy does not say: the base model trained the default of one policy.
        trained = len(policies) == 1 and state.get("others_trained", True) is not False
        return cls(name, name == default, others, trained)

    def requested(self, column: str = "model_requested") -> tuple[str, list]:
        """A SQL condition on the model a record asked for, and its parameters."""
        if self.default and self.others_trained and not self.others:
            return "TRUE", []  # the only policy, and no key that could steer it
        return f"coalesce({column} = ?, FALSE)", [self.name]

    def group_condition(self, column: str = "group_id") -> tuple[str, list]:
        """A SQL condition that `column` is one of this policy's groups (any table or
        view with group ids: `groups`, `rollouts`), and its parameters."""
        condition, params = self.requested("first_requested")
        if condition == "TRUE":  # the only policy: every group is its
            return "TRUE", []
        inner = FIRST_REQUESTED.format(where="")
        return (
            f"{column} IN (SELECT group_id FROM ({inner}) WHERE {condition})",
            params,
        )

    def groups(self, con, groups: list[str]) -> set[str]:
        """Of `groups`, those a night of this policy trains on: every record of the group
        asked for the policy (a mixed group is nobody's; the module's docstring)."""
        if not groups:
            return set()
        con.register("_scope_groups", pa.table({"group_id": pa.array(groups, pa.string())}))
        condition, params = self.requested()
        rows = con.execute(
            "SELECT group_id FROM completions "
            "WHERE group_id IN (SELECT group_id FROM _scope_groups) "
            f"GROUP BY group_id HAVING bool_and({condition})",
            params,
        ).fetchall()
        return {g for (g,) in rows}

    def turn_groups(self, con, turn_groups: list[str]) -> set[str]:
        """Of per-turn groups (`turn:<record id>`), those whose served turn's own group is
        this policy's (`groups`), as its night trains them. Needs the `turn_groups` view
        on `con` (storage/read/siblings.py: add_turn_views)."""
        if not turn_groups:
            return set()
        con.register("_scope_turns", pa.table({"group_id": pa.array(turn_groups, pa.string())}))
        served = dict(
            con.execute(
                "SELECT group_id, served_group_id FROM turn_groups "
                "WHERE group_id IN (SELECT group_id FROM _scope_turns)"
            ).fetchall()
        )
        own = self.groups(con, sorted(set(served.values())))
        return {turn for turn, group in served.items() if group in own}

    def owns(self, record: dict) -> bool:
        """Whether a selection record (or a run's metrics) is this policy's night."""
        policy = record.get("policy")
        return policy == self.name or (policy is None and self.default)
