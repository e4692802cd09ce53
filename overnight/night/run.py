"""A night, read as its steps: the signals once, then each policy's own night.

  signals   what happened next in each conversation, once for every policy
            (scoring.py; only when a policy trains on `implicit` rewards)
  for each policy, one after another, each on its own groups with its own options:
    read    the proxy's answer about the policy, once for the scoring phase
    score   --resample's siblings, then its judge and/or reward function (scoring.py)
    train   trainer/train.py's night: the watch, the plan, GRPO (or SFT), the gate
            with forgetting, the promotion and the record

Each policy's night holds the policy's cycle lease while it runs (cycles.py): never two
cycles of one policy at once, whether from cron or an `overnight learn` supervisor, on
this machine or another sharing the bucket. One policy's failure (a refused lease too)
does not stop the others' nights; the night fails at the end, naming them. The proxy's state is read once per phase: here for scoring, by the
trainer after its watch (which may roll back) and again after training, for the gate.
"""

from __future__ import annotations

from collections.abc import Callable

from overnight.errors import OvernightError

from .cycles import one_cycle, outcome, promoted_line
from .policies import NightOptions, PolicyNight
from .scoring import read_signals_once, score

Say = Callable[[str], None]


def run_night(
    night: NightOptions, policies: list[PolicyNight], say: Say = print, warn: Say | None = None
) -> list:
    """Every policy's night (`policies`; [PolicyNight(None, ...)]: every group, as before
    policies); their RunResults. `warn`: where warnings and failures go (default: `say`)."""
    warn = warn or say
    if not night.dry_run:
        read_signals_once(night.data_dir, policies, say)
    results, failed = [], []
    for policy in policies:
        if len(policies) > 1:
            say(f"policy {policy.policy}: its own groups, scoring, adapter, gate and promotion")
        try:
            results.append(policy_night(night, policy, say, warn))
        except Exception as e:  # one policy's failure does not stop the others' nights
            if len(policies) <= 1:
                raise
            failed.append(str(policy.policy))
            warn(f"policy {policy.policy}: the night failed: {type(e).__name__}: {e}")
    if failed:
        raise OvernightError(
            f"the night failed for policy {', '.join(failed)}; the other policies' nights "
            "ran (see the lines above; a run that failed while training is in `overnight runs`)"
        )
    return results


def policy_night(night: NightOptions, policy: PolicyNight, say: Say, warn: Say):
    """One policy's night, under its cycle lease (LeaseHeld, naming the holder, when
    another cycle of the policy runs); its RunResult."""
    with one_cycle(night, policy, warn) as cycle:
        result = trained_night(night, policy, say, warn, cycle)
        if cycle and result is not None:  # a dry run holds no lease, leaves no record
            cycle.update(run_id=result.run_id, outcome=outcome(result))
            if result.promoted_as:  # the loop's latency, as its run recorded it
                delay = result.metrics.get("to_serving")
                summary = {k: v for k, v in (delay or {}).items() if k != "waits"} or None
                cycle.update(to_serving=summary, outcome=cycle["outcome"] + promoted_line(delay))
    return result


def trained_night(night: NightOptions, policy: PolicyNight, say: Say, warn: Say, cycle: dict):
    """Its state read, its groups scored, then trained, gated, promoted and recorded
    (trainer/train.py), the run's record saying who ran it and why (`cycle`)."""
    from overnight.judge.scoring import pair_scorer
    from overnight.trainer.train import train

    state = policy_state(night, policy)
    scope = policy.scope(state or {})  # a dry run's may be read offline
    judged = None if night.dry_run else score(night, policy, scope, state, say, warn)
    gate_reward = policy.gate_reward or policy.reward
    return train(
        night.data_dir,
        policy.train,
        proxy_url=None if night.dry_run else night.proxy_url,
        admin_token=night.token,
        promote=night.promote,
        dry_run=night.dry_run,
        settle_seconds=night.settle_seconds,
        since=night.since,
        max_groups=night.max_groups,
        say=say,
        scorer=pair_scorer(gate_reward, policy.judge, night.data_dir),
        judge=judged,
        scope=scope,
        state=None if night.dry_run else state,
        cycle={"by": night.holder, "trigger": night.trigger} if cycle else None,
    )


def policy_state(night: NightOptions, policy: PolicyNight) -> dict | None:
    """The proxy's answer about the policy, read once for the scoring phase; None where
    it is not read: no proxy, or a policy read offline (a dry run without one), or the
    night before policies (its scope is every group; the trainer reads the state itself)."""
    from overnight.trainer.serving.proxy_client import serving_state

    if policy.offline is not None or not night.proxy_url or policy.policy is None:
        return None
    return serving_state(night.proxy_url, night.token, policy.policy)
