"""The canary: a candidate serves a share of live traffic before it is promoted.

`overnight train --canary 0.1`: a candidate that passed the offline gate (trainer/gate/verdict.py)
is not promoted at once; the proxy loads it on every replica and sends it that share of
the alias's rollouts, sticky per rollout (a hash of the rollout id, the same in every
proxy; proxy/alias/registry.py). Its records name it (`model_served`), so once agents post
rewards (or they are judged) each adapter's live reward is known.

The next `overnight watch` (which every `overnight train` runs first) settles it, with
the watch's statistics (trainer/live/compare.py: an unpaired bootstrap on the rollouts each
adapter served since the canary began):

  fewer than `--watch-min-rollouts` rewarded rollouts on either side -> keep it running
  the interval's low end not below the gate's bar (-margin for not-worse, as the gate
      sets it: gate.margin_for on the served adapter's live rewards; above 0 for better)
      -> promote it (the proxy makes it the alias's adapter; nothing is loaded again)
  the interval's high end below 0 (worse, as the watch rolls back) -> drop it
  neither -> keep it running; a newer candidate replaces it

Every decision says why, in the output and in the proxy's history (/ui's adapters page).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from overnight.config import TrainConfig
from overnight.errors import OvernightError
from overnight.telemetry import traced
from overnight.trainer.serving.proxy_client import admin_call, serving_state

from .compare import compare_live
from .rewards import live_rewards, policy_of, rewards_of


@dataclass
class CanaryVerdict:
    canary: str | None  # the canary's name (None: no canary runs)
    served: str | None  # what the alias serves to the rest (None: the base model)
    action: str = "none"  # none | wait | promote | drop
    canary_n: int = 0  # rewarded rollouts the canary served since it began
    served_n: int = 0  # ... and the served adapter
    canary_mean: float | None = None
    served_mean: float | None = None
    diff_mean: float | None = None  # canary - served
    low: float | None = None  # the two-sided interval on the difference
    high: float | None = None
    reason: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def check(data_dir: Path, state: dict, config: TrainConfig) -> CanaryVerdict:
    """What to do with the canary, from the live rewards since it began."""
    canary = state.get("canary")
    current = state.get("current")
    served = current["name"] if current else None
    if not canary:
        return CanaryVerdict(None, served, reason="no canary runs")
    by_name = {a["name"]: a for a in state.get("adapters") or []}
    since = by_name.get(canary["name"], {}).get("promoted_at")
    by_served = live_rewards(data_dir, config.reward_sources, since, policy_of(state))
    new = by_served.get(canary["name"], [])
    old = rewards_of(state, current["path"] if current else None, by_served)
    other = served or "the base model"
    live = compare_live(new, old, config, named=("canary rollouts", f"for {other}"),
                        counted=("served by the canary", f"by {other} since it began"))  # fmt: skip
    verdict = CanaryVerdict(canary["name"], served, "wait", live.new_n, live.old_n)
    if live.too_few:
        verdict.reason = live.too_few
        return verdict
    verdict.canary_mean, verdict.served_mean = live.new_mean, live.old_mean
    verdict.diff_mean, verdict.low, verdict.high = live.diff_mean, live.low, live.high
    if live.clears:
        verdict.action, outcome = "promote", f"low end clears {live.bar}: promote"
    elif live.high < 0:
        verdict.action, outcome = "drop", "high end below 0: worse, drop"
    else:
        outcome = f"low end short of {live.bar} and high end not below 0: keep it running"
    verdict.reason = f"{live.line}, {outcome}"
    return verdict


def settle(
    data_dir: Path, proxy_url: str, token: str | None, config: TrainConfig, say=print,
    act: bool = True,
) -> CanaryVerdict:  # fmt: skip
    """Check the canary and promote or drop it through the proxy (unless `act` is False)."""
    state = serving_state(proxy_url, token, config.policy)
    verdict = check(data_dir, state, config)
    if verdict.canary is None:
        return verdict
    if verdict.action == "wait":
        say(f"canary: {verdict.canary} keeps running: {verdict.reason}")
        return verdict
    if not act:
        done = "promoted" if verdict.action == "promote" else "dropped"
        say(f"canary: {verdict.canary} would be {done} (--dry-run): {verdict.reason}")
        return verdict
    if verdict.action == "promote":
        path = next(a["path"] for a in state["adapters"] if a["name"] == verdict.canary)
        admin_call(proxy_url, "/admin/adapters/promote", token,
                   {"path": path, "reason": f"canary: {verdict.reason}"}, config.policy)  # fmt: skip
        say(f"canary: promoted {verdict.canary}: {verdict.reason}")
    else:
        payload = {"canary": True, "reason": f"canary: {verdict.reason}"}
        admin_call(proxy_url, "/admin/adapters/rollback", token, payload, config.policy)
        say(f"canary: dropped {verdict.canary}: {verdict.reason}")
    return verdict


@traced("canary", lambda name: {"canary": name})
def start(
    proxy_url: str,
    token: str | None,
    adapter: str,
    fraction: float,
    say=print,
    policy: str | None = None,
) -> str:
    """Serve the candidate (`adapter`: its path, or its upload with a bucket) to
    `fraction` of the alias's rollouts; the canary's name. A run resumed after it started
    the canary finds it running and starts nothing."""
    if not 0 < fraction < 1:
        raise OvernightError(
            f"--canary must be between 0 and 1 (a share of traffic), got {fraction}"
        )
    path = str(adapter)
    state = serving_state(proxy_url, token, policy)
    canary = state.get("canary")
    by_name = {a["name"]: a for a in state.get("adapters") or []}
    if canary and by_name.get(canary["name"], {}).get("path") == path:
        say(f"canary: {canary['name']} runs already")
        return canary["name"]
    if canary:
        say(f"canary: {canary['name']} is replaced by the new candidate before it was settled")
    payload = {"path": path, "canary": fraction, "reason": "passed the gate"}
    name = admin_call(proxy_url, "/admin/adapters/promote", token, payload, policy)["promoted"]
    say(f"canary: {name} serves {fraction:.0%} of the alias's rollouts until the watch settles it")
    return name
