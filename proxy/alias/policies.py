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
model) pass through, untrained when there are several policies
(storage/read/policy_scope.py). What the replicas must serve before they are live is
every policy's adapter (`AdapterRegistry.siblings`). Pruning adapters is of the data
directory: a prune through any policy keeps what every policy needs.

No policy may be named as the base model vLLM serves (with several policies): base-model
traffic would look like that policy's. The config refuses a `--base-model` that is one;
the name vLLM reports at start is checked too (a start refused), and one learned later,
when vLLM was not up at the start, is said loudly in the log.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from overnight.errors import ConfigError, OvernightError
from overnight.proxy.forward.balancer import Balancer

from . import promotions
from .promotions import Route
from .registry import AdapterRegistry

log = logging.getLogger("overnight.proxy")


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
        hosted: str | None = None,
        hosted_model: str | None = None,
        beside: str | None = None,
    ):
        self.default = names[0]
        # A hosted model beside vLLM (`beside`: how records name it): each policy's
        # rollouts outside its handover share go to it as `hosted_model` (a Route marked
        # hosted, proxy/routes/handover.py); all of them before a handover starts.
        self.beside = beside
        # A hosted upstream (`hosted`: how records name it, routes/hosted.py) serves no
        # adapter: every policy's alias is sent as `hosted_model`, whatever an earlier
        # promotion state says.
        self.hosted, self.hosted_model = hosted, hosted_model
        # Whether the default policy's nights train on what asked for no policy (the base
        # model): with one policy only, where every key limited to policies has it
        # (storage/read/policy_scope.py).
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
        self._clash_said = False
        for registry in registries:
            registry.siblings = registries
            registry.on_base_model = self.notice_base_model
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
        if self.hosted:
            return self._hosted_route(requested)
        if self.beside is not None and requested in self.by_name:
            handover = self.by_name[requested].handover or {}
            if not promotions.served_locally(key, handover.get("share", 0.0)):
                return Route(self.hosted_model or "", None, requested, hosted=True)
        return self._owner(requested).route(requested, key)

    def release(self, route: Route) -> None:
        if not self.hosted and not route.hosted:
            self._owner(route.policy or route.served).release(route)

    def _hosted_route(self, requested: str | None) -> Route:
        """A policy's alias as the hosted model; any other name unchanged (nothing drains)."""
        if requested not in self.by_name:
            return Route(requested or "", None)
        if self.hosted_model is None:
            raise OvernightError(
                f"the alias {requested!r} names no hosted model here: start the proxy with "
                "--upstream-model NAME, or ask for the hosted model by its name",
                status=404,
                code="model_not_found",
            )
        return Route(self.hosted_model, None, requested)

    def _owner(self, name: str | None) -> AdapterRegistry:
        registry = self.by_name.get(name) if name is not None else None
        if registry is None and name is not None and len(self.by_name) > 1:
            named = promotions.ADAPTER_NAME.fullmatch(name)
            registry = self.by_name.get(named.group(1)) if named else None
        return registry or self.by_name[self.default]

    def notice_missing(self, served: str) -> None:
        if self.hosted:  # no adapter to miss
            return
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
        self._clash_said = True  # at the start a clash refuses it, below, instead
        for registry in self.by_name.values():
            await registry.restore()
        clash = self.base_model_clash()
        if clash:
            await self.close()
            raise ConfigError(clash)
        self._clash_said = False

    def base_model_clash(self) -> str | None:
        """What is wrong when vLLM's base model has a policy's name (several policies)."""
        base = next((r.base_model for r in self.by_name.values() if r.base_model), None)
        if len(self.by_name) < 2 or base not in self.by_name:
            return None
        return (f"vLLM serves its base model as {base!r}, a policy's name here: requests "
                "for the base model would be that policy's traffic (and train it); serve "
                "vLLM under another name (--served-model-name) or name the policy otherwise")  # fmt: skip

    async def check_upstream(self) -> bool:
        """Every policy's adapter loaded where it is missing (after a colocated night)."""
        changed = False
        for registry in self.by_name.values():
            changed = await registry.check_upstream() or changed
        return changed

    def notice_base_model(self) -> None:
        """Said once, in the log, where vLLM's base model turns out to have a policy's
        name after the start (vLLM was not up then): the start could not refuse it."""
        clash = None if self._clash_said else self.base_model_clash()
        if clash:
            self._clash_said = True
            log.error("%s", clash)

    async def prune(self, keep: int, dry_run: bool):
        """Adapters none of the policies needs, deleted (retention.py)."""
        first, *others = self.registries
        return await first.prune(keep, dry_run, tuple(others))

    def describe(self, name: str | None = None) -> dict:
        """One policy's state (the default's without `name`), with the list of policies."""
        state = {
            **self.get(name).describe(),
            "policies": self.names,
            "default": self.default,
            "others_trained": self.others_trained,
        }
        if self.beside is not None:  # the share served locally; the rest is the hosted's
            handover = {"share": 0.0, "since": None, **(state.get("handover") or {})}
            state["handover"] = {**handover, "upstream": self.beside,
                                 "hosted_model": self.hosted_model}  # fmt: skip
        if self.hosted:  # what serves is the hosted model, whatever a promotion said
            hosted = {"upstream": self.hosted, "base_model": self.hosted_model}
            state |= {**hosted, "current": None, "canary": None}
        return state

    def describe_all(self) -> dict[str, dict]:
        return {name: registry.describe() for name, registry in self.by_name.items()}

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.by_name.values()))
