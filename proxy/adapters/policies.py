"""Several policies behind one proxy: one alias each, each with its own adapters.

A team runs several agents on one base model and one vLLM (which serves many LoRA
adapters at once); each learns from its own traffic. A policy is an alias agents ask
for in `model` (`--alias`, the default one, and each `--policy NAME`), and each has a
registry of its own (registry.py): its promotion stack and adapter lineage, its canary,
the following of other proxies, its restore after a vLLM restart. Its state is a file
of its own: the default policy's is DATA/adapters.json, as before there were policies,
so an old data directory reads as the default policy unchanged; another's is
DATA/policies/NAME/adapters.json (with a bucket, the same names in it). Files of their
own, not one file with a map: each keeps the registry's versioning, locking and
following exactly as they were, a promotion of one policy neither waits for another's
adapter loads nor makes every proxy re-read the others' states, and a one-policy
directory needs no migration.

Versioned adapter names start with the policy (`support-v3-9c1e2a`): vLLM's adapter
names are one namespace for all of them. Requests for any other model name (the base
model) pass through, untrained when there are several policies (storage/policy_scope.py).
What the replicas must serve before they are live is every policy's adapter (`Serving.siblings`). Pruning adapters is of the data
directory: a prune through any policy keeps what every policy needs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from overnight.errors import OvernightError
from overnight.proxy.forward.balancer import Balancer

from . import promotions
from .promotions import Route
from .registry import AdapterRegistry


class UnknownPolicy(OvernightError):
    status = 404
    code = "unknown_policy"


class Policies:
    """Every policy's registry, the default first; routes each request by its `model`."""

    def __init__(
        self,
        names: tuple[str, ...],
        data_dir: Path,
        balancer: Balancer,
        session_headers: dict[str, str],
        drain_timeout: float,
        base_model: str | None = None,
        check_interval: float = 10.0,
        follow_interval: float = 1.0,
    ):
        self.default = names[0]
        # Whether the default policy's nights train on what asked for no policy (the base
        # model): with one policy only, where every key limited to policies has it
        # (storage/policy_scope.py).
        self.others_trained = len(names) == 1
        self.by_name: dict[str, AdapterRegistry] = {}
        for name in names:
            path = promotions.state_path(data_dir, name, self.default)
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.by_name[name] = AdapterRegistry(
                alias=name,
                state_path=path,
                balancer=balancer,
                session_headers=session_headers,
                drain_timeout=drain_timeout,
                base_model=base_model,
                check_interval=check_interval,
                follow_interval=follow_interval,
                data_dir=Path(data_dir),
            )
        registries = list(self.by_name.values())
        for registry in registries:
            registry.siblings = registries
        # A replica that went down wakes every policy's watch (each set it to its own).
        balancer.on_down = lambda _replica: [r._wake.set() for r in registries]

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    @property
    def registries(self) -> list[AdapterRegistry]:
        return list(self.by_name.values())

    def get(self, name: str | None) -> AdapterRegistry:
        """The registry of `name` (None: the default policy's); 404 for one not served."""
        if name is None:
            return self.by_name[self.default]
        registry = self.by_name.get(name)
        if registry is None:
            raise UnknownPolicy(
                f"no policy {name!r} here; this proxy serves {', '.join(self.by_name)} "
                "(overnight serve --policy NAME adds one)"
            )
        return registry

    # -- routing (hot path) ------------------------------------------------------------

    def route(self, requested: str | None, key: str | None = None) -> Route:
        """The alias's adapter (or its canary, or the base model before a promotion); any
        other name passes through, counted in the flight of the policy whose adapter it
        names (`support-v3-9c1e2a`: its drain waits for it), else the default's."""
        return self._owner(requested).route(requested, key)

    def release(self, route: Route) -> None:
        self._owner(route.policy or route.served).release(route)

    def _owner(self, name: str | None) -> AdapterRegistry:
        registry = self.by_name.get(name) if name is not None else None
        if registry is None and name is not None and len(self.by_name) > 1:
            named = promotions.ADAPTER_NAME.fullmatch(name)
            registry = self.by_name.get(named.group(1)) if named else None
        return registry or self.by_name[self.default]

    def notice_missing(self, served: str) -> None:
        for registry in self.by_name.values():
            registry.notice_missing(served)

    # -- what the app starts, checks, describes and closes ------------------------------

    @property
    def session(self):
        return self.by_name[self.default].session

    @session.setter
    def session(self, session) -> None:
        for registry in self.by_name.values():
            registry.session = session

    async def restore(self) -> None:
        for registry in self.by_name.values():
            await registry.restore()

    async def check_upstream(self) -> bool:
        """Every policy's adapter loaded where it is missing (after a colocated night)."""
        changed = False
        for registry in self.by_name.values():
            changed = await registry.check_upstream() or changed
        return changed

    async def prune(self, keep: int, dry_run: bool):
        """Adapters none of the policies needs, deleted (retention.py)."""
        first, *others = self.registries
        return await first.prune(keep, dry_run, tuple(others))

    def describe(self, name: str | None = None) -> dict:
        """One policy's state (the default's without `name`), with the list of policies."""
        return {
            **self.get(name).describe(),
            "policies": self.names,
            "default": self.default,
            "others_trained": self.others_trained,
        }

    def describe_all(self) -> dict[str, dict]:
        return {name: registry.describe() for name, registry in self.by_name.items()}

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.by_name.values()))
