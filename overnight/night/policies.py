"""A night's values, typed: what the whole night shares, and each policy's own options.

The command line resolves them (its options, the config file's `[policies.NAME]`
tables: overnight/cli/policy_runs.py) and builds these; the night reads fields, never a
dictionary of option names.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from overnight.config import SETTLE_SECONDS, JudgeConfig, TrainConfig
from overnight.storage.lease import LEASE_SECONDS
from overnight.storage.read.policy_scope import PolicyScope


@dataclass(frozen=True)
class NightOptions:
    """What every policy's night shares."""

    data_dir: Path
    proxy_url: str | None = None  # None: no proxy (nothing promoted; the policies offline)
    token: str | None = None  # the proxy's admin token
    promote: bool = True  # False (--no-promote): save the adapter, keep serving the old one
    dry_run: bool = False  # say what would be trained, and stop
    settle_seconds: float = SETTLE_SECONDS  # idle this long, an unfinished rollout is done
    since: dt.datetime | None = None  # only groups started at or after it (UTC)
    max_groups: int | None = None  # at most this many groups a policy
    # Who runs it, for the cycle's lease (cycles.py) and its run's record: a refused night
    # names its holder. `trigger`: why this cycle runs (`overnight learn`'s; None: by hand
    # or cron). `lease_seconds`: how long a holder that stopped renewing blocks the next.
    holder: str = "overnight train"
    trigger: str | None = None
    lease_seconds: float = LEASE_SECONDS


@dataclass(frozen=True)
class PolicyNight:
    """One policy's night: its training options, its judge and its reward function."""

    policy: str | None  # None: every group, as before policies
    train: TrainConfig
    judge: JudgeConfig | None = None  # --judge-model's judge; None: no judge
    reward: str | None = None  # --reward: the function that scores its groups
    gate_reward: str | None = None  # --gate-reward: the gate's function (default: reward)
    # How siblings' tool calls are read (judge/tool_calls.py): the server's parser.
    tool_call_parser: str | None = None
    tool_parser_tokenizer: str | None = None
    # No proxy to ask (a dry run): the keys of its answer that a scope reads, offline.
    offline: dict | None = None

    def scope(self, state: dict) -> PolicyScope | None:
        """Its groups (storage/read/policy_scope.py) by the proxy's answer about it
        (`state`), or the offline one; None: every group."""
        if self.policy is None:
            return None
        return PolicyScope.of(self.policy, self.offline if self.offline is not None else state)

    @property
    def scores(self) -> bool:
        """Whether anything scores its groups before training (a judge, a function)."""
        return self.judge is not None or self.reward is not None
