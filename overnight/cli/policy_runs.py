"""Which policies a batch command runs for, and each one's groups and options: for
`overnight train` (resample, score and train, one policy after another) and
`overnight judge --policy`.

A policy's night resamples, scores and trains its own groups only (storage/read/policy_scope.py),
each step with the policy's own options: the command line's, then the config file's
`[policies.NAME]` table (options.py), its judge, rubric and reward function included.

Which policies: `--policy`'s, else every policy the proxy serves, asked as the night asks
it (trainer/serving/proxy_client.py). Where no proxy answers and nothing will be promoted
(a dry run, a judge run), they are read offline instead: the promotion states and the
runs in the data directory, and what the config file names (serve's `alias` and
`--policy`, the `[policies.NAME]` tables), the default policy first. Nothing at all:
one run over every group, as before policies (policy None).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from overnight.config import JudgeConfig, TrainConfig

from .data import admin_token_option, data_option, proxy_option, settle_option
from .options import POLICY_TABLES, config_options, policy_options

# A night's options, declared once: `overnight train` takes them, and `overnight learn`
# passes them to each cycle (cli/learn.py). Listed top first, as `--help` shows them.
_NIGHT_OPTIONS = [
    data_option,
    proxy_option,
    admin_token_option,
    config_options(TrainConfig),
    click.option("--max-groups", type=int, help="Train on at most this many groups."),
    click.option(
        "--since", type=click.DateTime(), help="Only groups started at or after this time."
    ),
    settle_option,
    click.option("--judge-model", help="Score unscored groups with this judge first."),
    config_options(JudgeConfig, only=["base_url", "tool_call_parser", "tool_parser_tokenizer"]),
    click.option("--reward", help="Score unscored groups with this function first."),
    click.option(
        "--gate-reward",
        help="Score the gate's held-out replies with this function (default: --reward), "
        "without scoring any group with it.",
    ),
    click.option(
        "--no-promote", is_flag=True, help="Save the adapter but keep serving the old one."
    ),
    click.option("--dry-run", is_flag=True, help="Show what would be trained, and stop."),
    click.option(
        "--preset",
        type=click.Choice(["smollm2-cpu", "tiny-cpu"]),
        help="Defaults for SmolLM2-135M or the tiny test model on a CPU (options given "
        "explicitly still win; docs/grpo.md).",
    ),
]


def night_options(command: Callable) -> Callable:
    """A night's options on `command` (its callback gets `data_dir`, `reward` and the rest)."""
    for option in reversed(_NIGHT_OPTIONS):  # click lists the last decorator applied first
        command = option(command)
    return command


def night_of(ctx: click.Context, data_dir: Path, reward: str | None, values: dict[str, Any],
             **shared: Any):  # fmt: skip
    """A night's values from its options: what every policy shares (NightOptions, with
    `shared`'s fields: `overnight learn`'s holder) and each policy's (`policy_nights`)."""
    import datetime as dt

    from overnight.night.policies import NightOptions

    from .data import proxy_of

    if values["preset"]:
        from overnight.config import PRESETS

        for name, value in PRESETS[values["preset"]].items():
            if ctx.get_parameter_source(name) is click.core.ParameterSource.DEFAULT:
                values[name] = value
    since = values["since"]
    night = NightOptions(
        data_dir, proxy_of(data_dir, values["proxy_url"]), values["admin_token"],
        promote=not values["no_promote"], dry_run=values["dry_run"],
        settle_seconds=values["settle"], since=since.replace(tzinfo=dt.UTC) if since else None,
        max_groups=values["max_groups"], **shared,
    )  # fmt: skip
    return night, policy_nights(ctx, night, values, reward)


@dataclass(frozen=True)
class PolicyRun:
    policy: str | None  # None: every group, as before policies
    values: dict[str, Any]  # the command's values, the policy's table's options over them
    # With no proxy to ask: the keys of its answer that a scope reads, read offline.
    offline: dict | None = None

    def scope(self, proxy_url: str | None, token: str | None):
        """Its groups (storage/read/policy_scope.py), from the proxy's answer about the policy
        (asked now, as its night asks it) or the offline one; None: every group."""
        from overnight.storage.read.policy_scope import PolicyScope
        from overnight.trainer.serving.proxy_client import serving_state

        if self.policy is None:
            return None
        state = self.offline
        if state is None:
            state = serving_state(proxy_url, token, self.policy)
        return PolicyScope.of(self.policy, state)

    def option(self, name: str, given: Any) -> Any:
        """An option the command takes apart from `values` (`reward`): the policy's table's
        unless the command line gave it (policy_options leaves those out)."""
        return self.values.get(name, given)


def policy_runs(
    ctx: click.Context,
    data_dir: Path,
    values: dict[str, Any],
    policy: str | None,
    proxy_url: str | None,
    token: str | None,
    offline: bool = False,
) -> list[PolicyRun]:
    """One run per policy, each with its options: `policy`, else the proxy's policies.
    With `offline` (a dry run, a judge run), a proxy that does not answer is done without:
    the policies come from the data directory and the config file (`offline_policies`).
    Otherwise a proxy that cannot be asked gives one run of policy None, every group (the
    night then fails on it, or runs without one, as before policies)."""
    from overnight.trainer.serving.proxy_client import proxy_policies

    names = [policy] if policy else proxy_policies(proxy_url, token)
    state = None
    if offline and not (_answers(proxy_url, token, policy) if policy else names):
        listed = offline_policies(ctx, data_dir)
        names, state = [policy] if policy else listed, _offline_state(listed)
    return [
        PolicyRun(name, {**values, **policy_options(ctx, name)} if name else values, state)
        for name in names or [None]
    ]


def _answers(proxy_url: str | None, token: str | None, policy: str) -> bool:
    from overnight.trainer.serving.proxy_client import ProxyError, serving_state

    if not proxy_url:
        return False
    try:
        return bool(serving_state(proxy_url, token, policy))
    except ProxyError:
        return False


def offline_policies(ctx: click.Context, data_dir: Path) -> list[str]:
    """The policies the data directory and the config file name, the default first: the
    alias of DATA/adapters.json (else serve's `alias`, else `policy`), then the others."""
    from overnight.config import ProxyConfig
    from overnight.proxy.alias.promotions import policy_state_paths
    from overnight.proxy.alias.retention import night_run

    root = ctx.find_root()
    serve = (root.default_map or {}).get("serve", {})
    on_disk = [_alias_in(path) for path in policy_state_paths(data_dir)]
    default_state, others = on_disk[0], [a for a in on_disk[1:] if a]
    runs = sorted(Path(data_dir).glob("runs/*/run.json"))
    trained = [(night_run(data_dir, run.parent.name) or {}).get("policy") for run in runs]
    named = [*serve.get("policies", []), *root.meta.get(POLICY_TABLES, {})]
    found = [*others, *(p for p in trained if isinstance(p, str)), *named]
    if not (default_state or found or "alias" in serve):
        return []  # nothing says there are policies: every group, as before them
    default = default_state or serve.get("alias") or ProxyConfig.alias
    return list(dict.fromkeys([default, *found]))


def _offline_state(names: list[str]) -> dict:
    """The keys of the proxy's answer a night's scope reads, for `names` (default first);
    none known: {} (a policy's own alias's groups only: PolicyScope.of)."""
    if not names:
        return {}
    return {"policies": names, "default": names[0], "others_trained": len(names) == 1}


def _alias_in(path: Path) -> str | None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        alias = json.loads(path.read_text()).get("alias")
        return alias if isinstance(alias, str) else None
    return None


def judge_config(values: dict[str, Any], *, own_max_tokens: bool = True):
    """The judge a policy's groups are scored with (None: no --judge-model). `overnight
    train`'s --max-tokens is the night's, not the judge's (`own_max_tokens` False)."""
    from .options import build

    if not values.get("judge_model"):
        return None
    return build(JudgeConfig, {k: v for k, v in values.items()
                               if own_max_tokens or k != "max_tokens"})  # fmt: skip


def policy_nights(ctx: click.Context, night, values: dict[str, Any], reward: str | None):
    """`overnight train`'s policies, typed (overnight/night/policies.py): `--policy`'s, else
    every policy the proxy serves (offline for a dry run), each with its table's options."""
    from overnight.night.policies import PolicyNight

    from .options import build

    runs = policy_runs(ctx, night.data_dir, values, values["policy"], night.proxy_url,
                       night.token, night.dry_run)  # fmt: skip
    return [
        PolicyNight(
            run.policy,
            build(TrainConfig, run.values, policy=run.policy),
            judge=judge_config(run.values, own_max_tokens=False),
            reward=run.option("reward", reward),
            gate_reward=run.values["gate_reward"],
            tool_call_parser=run.values["tool_call_parser"],
            tool_parser_tokenizer=run.values["tool_parser_tokenizer"],
            offline=run.offline,
        )
        for run in runs
    ]


def judge_run(ctx: click.Context, data_dir: Path, values: dict[str, Any]):
    """`overnight judge`'s run and its scope: every group, or with --policy that policy's
    groups with its table's options (its `max_tokens` is the night's, not the judge's);
    the proxy is asked where one runs (--proxy, or the live one of DATA/proxy.json)."""
    from .data import proxy_of

    policy = values["policy"]
    if policy is None:
        return PolicyRun(None, values), None
    proxy_url, token = proxy_of(data_dir, values["proxy_url"], None), values["admin_token"]
    (run,) = policy_runs(ctx, data_dir, values, policy, proxy_url, token, offline=True)
    run = PolicyRun(policy, {**run.values, "max_tokens": values["max_tokens"]}, run.offline)
    return run, run.scope(proxy_url, token)
