"""The watch after promotion: roll back an adapter that live traffic shows worse than its predecessor.

`overnight watch` (from cron, as often as wanted) and the start of `overnight train` run it.
Every record names the adapter that served it (`model_served`). A rollout's reward is the
one training would take (the first of `reward_sources` it has: posted by the agent, judged,
or scored by a function), and it counts for an adapter when every turn of the rollout was
served by that adapter. A rollback loads the previous adapter again under a new name, so
adapters are compared by path: every name a path was served under counts for it.

The test (compare.py): mean(promoted) - mean(predecessor) with the gate's bootstrap
(trainer/gate/verdict.py), unpaired (different requests), one-sided: the promoted adapter is worse when the upper end
of the one-sided 95% interval is below zero, once each side has `watch_min_rollouts`
rewarded rollouts. A worse adapter is rolled back through the proxy's admin API.

Before live rewards, forgetting (forgetting.py): an adapter whose recorded drift from the
base model on the reference set is over --forgetting-budget and more than its
predecessor's is rolled back too (a budget lowered since it was promoted, or an adapter
promoted past the gate by hand or with --gate off, then measured as served).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from overnight.config import TrainConfig
from overnight.telemetry import traced
from overnight.trainer.gate.forgetting import over_budget
from overnight.trainer.serving.proxy_client import admin_call, serving_state

from .compare import compare_live
from .rewards import live_rewards, policy_of, rewards_of


@dataclass
class WatchVerdict:
    current: str | None  # the name the alias serves now (None: the base model)
    predecessor: str | None  # the path served before it (None: the base model)
    new: int = 0  # rewarded rollouts served by the current adapter
    old: int = 0  # ... by its predecessor
    new_mean: float | None = None
    old_mean: float | None = None
    diff_mean: float | None = None
    high: float | None = None  # the one-sided interval's upper end
    worse: bool = False
    rolled_back_to: str | None = None  # the name served after a rollback
    forgets: bool = False  # worse on the reference set (forgetting.py), not on live rewards
    reason: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def check(data_dir: Path, state: dict, config: TrainConfig) -> WatchVerdict:
    """Whether the adapter served now is worse than its predecessor on live rewards."""
    current = state.get("current")
    if not current:
        return WatchVerdict(None, None, reason="the alias serves the base model: nothing to watch")
    stack = state.get("stack") or []
    by_name = {a["name"]: a["path"] for a in state.get("adapters") or []}
    before = by_name.get(stack[-2]) if len(stack) >= 2 else None
    verdict = WatchVerdict(current["name"], before)
    if before == current["path"]:
        verdict.reason = "its predecessor is the same adapter"
        return verdict
    if config.reference != "off":  # the budget lowered, or an adapter promoted without it
        forgot = over_budget(data_dir, current["path"], before, config.forgetting_budget)
        if forgot is not None:
            verdict.worse, verdict.forgets, verdict.reason = True, True, forgot
            return verdict
    by_served = live_rewards(data_dir, config.reward_sources, requested=policy_of(state))
    new = rewards_of(state, current["path"], by_served)
    old = rewards_of(state, before, by_served)
    live = compare_live(
        new, old, config, named=("rollouts", f"for its predecessor ({before or 'the base model'})"),
        counted=(f"served by {current['name']}", "by its predecessor"), one_sided=True,
    )  # fmt: skip
    verdict.new, verdict.old = live.new_n, live.old_n
    if live.too_few:
        verdict.reason = live.too_few
        return verdict
    verdict.new_mean, verdict.old_mean = live.new_mean, live.old_mean
    verdict.diff_mean, verdict.high = live.diff_mean, live.upper
    verdict.worse = live.upper < 0
    verdict.reason = f"{live.line} " + ("< 0: worse" if verdict.worse else ">= 0")
    return verdict


@traced("watch", lambda v: {"served": v.current, "worse": v.worse})
def watch(
    data_dir: Path,
    proxy_url: str,
    token: str | None,
    config: TrainConfig,
    say=print,
    act: bool = True,
) -> WatchVerdict:
    """Settle a canary (trainer/live/canary.py) and move a handover's share (handover.py),
    then check the served adapter; roll it back when it is worse (unless `act` is False)."""
    from .canary import settle
    from .handover import settle as settle_handover

    settle(data_dir, proxy_url, token, config, say, act)
    settle_handover(data_dir, proxy_url, token, config, say, act)
    verdict = check(data_dir, serving_state(proxy_url, token, config.policy), config)
    if not verdict.worse:
        say(f"watch: {verdict.current or 'base model'} keeps serving: {verdict.reason}")
        return verdict
    if not act:
        say(f"watch: {verdict.current} is worse, not rolled back (--dry-run): {verdict.reason}")
        return verdict
    where = "on the reference set" if verdict.forgets else "on live traffic"
    why = f"watch: {verdict.current} worse {where}: {verdict.reason}"
    payload = {"reason": why}
    now = admin_call(proxy_url, "/admin/adapters/rollback", token, payload, config.policy)
    now = now.get("current")
    verdict.rolled_back_to = now["name"] if now else None
    say(
        f"watch: rolled back {verdict.current}: {verdict.reason}; the alias now serves "
        f"{verdict.rolled_back_to or 'the base model'}"
    )
    return verdict
