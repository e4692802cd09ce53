"""The handover's watch: move the share of a policy's rollouts the local model serves.

A proxy with a hosted model beside vLLM (`overnight serve --hosted-upstream`,
proxy/routes/handover.py) serves a sticky share of each policy's rollouts locally and the
rest by the hosted model. `overnight watch` (which every `overnight train` runs first)
compares the live rewards of the two sides since the share last changed, with the
canary's statistics (compare.py: an unpaired bootstrap, the gate's bar):

  fewer than `--watch-min-rollouts` rewarded rollouts on either side -> keep the share
  the local side not worse (the interval clears the gate's bar: -margin for not-worse)
      -> double the share (capped at 1: the handover is complete, the hosted model
      serves nothing of the alias)
  the interval's high end below 0 (the local side worse) -> stop: share 0, the hosted
      model serves all again
  neither -> keep the share

The local side is the adapter the alias serves (every name its path served under,
rewards.py); the hosted side is every rollout all of whose turns the hosted upstream
answered (their records' `notes.upstream`). Every decision says why, in the output and
in the proxy's history.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from overnight.config import TrainConfig
from overnight.trainer.serving.proxy_client import admin_call, serving_state

from .compare import compare_live
from .rewards import SERVED_UPSTREAM, live_rewards, policy_of, rewards_of


@dataclass
class HandoverVerdict:
    share: float | None  # the share served locally now (None: no handover here)
    action: str = "none"  # none | wait | raise | stop
    new_share: float | None = None  # after a raise or a stop
    local_n: int = 0  # rewarded rollouts the local model served since the share was set
    hosted_n: int = 0  # ... and the hosted model
    local_mean: float | None = None
    hosted_mean: float | None = None
    diff_mean: float | None = None  # local - hosted
    low: float | None = None  # the two-sided interval on the difference
    high: float | None = None
    reason: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def check(data_dir: Path, state: dict, config: TrainConfig) -> HandoverVerdict:
    """What to do with the policy's handover share, from the live rewards since it was set."""
    handover = state.get("handover") or {}
    # `upstream`: the proxy serves a hosted model beside vLLM now (a state written by an
    # earlier one that did is not a handover of this proxy's).
    share, upstream = handover.get("share"), handover.get("upstream")
    if share is None or upstream is None:
        return HandoverVerdict(None, reason="no hosted model beside vLLM here")
    if not 0 < share < 1:
        return HandoverVerdict(share, reason=f"the handover is at {share:.0%}")
    since = handover.get("since")
    current = state.get("current")
    served = current["name"] if current else "the base model"
    by_served = live_rewards(data_dir, config.reward_sources, since, policy_of(state))
    local = rewards_of(state, current["path"] if current else None, by_served)
    by_upstream = live_rewards(
        data_dir, config.reward_sources, since, policy_of(state), served_by=SERVED_UPSTREAM
    )
    hosted = by_upstream.get(upstream, [])
    live = compare_live(
        local, hosted, config, named=(f"local rollouts ({served})", "hosted ones"),
        counted=(f"served locally by {served}", f"by the hosted model since {since}"),
    )  # fmt: skip
    verdict = HandoverVerdict(share, "wait", local_n=live.new_n, hosted_n=live.old_n)
    if live.too_few:
        verdict.reason = live.too_few
        return verdict
    verdict.local_mean, verdict.hosted_mean = live.new_mean, live.old_mean
    verdict.diff_mean, verdict.low, verdict.high = live.diff_mean, live.low, live.high
    if live.clears:
        verdict.action, verdict.new_share = "raise", min(1.0, 2 * share)
        outcome = f"low end clears {live.bar}: the local share goes to {verdict.new_share:.0%}"
    elif live.high < 0:
        verdict.action, verdict.new_share = "stop", 0.0
        outcome = "high end below 0: the local model is worse, the hosted model serves all"
    else:
        outcome = f"low end short of {live.bar} and high end not below 0: the share stays"
    verdict.reason = f"{live.line}, {outcome}"
    return verdict


def settle(
    data_dir: Path, proxy_url: str, token: str | None, config: TrainConfig, say=print,
    act: bool = True,
) -> HandoverVerdict:  # fmt: skip
    """Check the policy's handover and move its share through the proxy (unless `act` is
    False)."""
    verdict = check(data_dir, serving_state(proxy_url, token, config.policy), config)
    if verdict.share is None or verdict.action == "none":
        return verdict
    now = f"{verdict.share:.0%} served locally"
    if verdict.action == "wait":
        say(f"handover: stays at {now}: {verdict.reason}")
        return verdict
    if not act:
        say(f"handover: would {verdict.action} ({now}, --dry-run): {verdict.reason}")
        return verdict
    payload = {"share": verdict.new_share, "reason": f"watch: {verdict.reason}"}
    admin_call(proxy_url, "/admin/handover", token, payload, config.policy)
    done = "stopped" if verdict.action == "stop" else f"moved to {verdict.new_share:.0%}"
    say(f"handover: {done} (was {now}): {verdict.reason}")
    return verdict
