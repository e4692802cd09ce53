"""A policy's groups scored before its night: the signals of what happened next (once
for every policy), resampled siblings, the judge and the reward function.

The trainer never calls the judge: whatever scores does so here, with its own batch,
and the night trains on the rewards it wrote.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from overnight.storage.read.policy_scope import PolicyScope

from .policies import NightOptions, PolicyNight

Say = Callable[[str], None]


def read_signals_once(data_dir: Path, policies: list[PolicyNight], say: Say) -> None:
    """When a night's reward sources name `implicit`, or it learns from the corrections
    themselves (--hindsight): the signals of what happened next and the rewards they make
    (judge/implicit.py), once for all of tonight's policies (a turn's signals are its own,
    whichever policy trains on it)."""
    if any("implicit" in p.train.reward_sources or p.train.hindsight for p in policies):
        from overnight.judge.implicit import run_signals

        for line in run_signals(data_dir, rewards=True).lines():
            say(f"signals: {line}")


def score(
    night: NightOptions,
    policy: PolicyNight,
    scope: PolicyScope | None,
    state: dict | None,
    say: Say,
    warn: Say,
):
    """A policy's scoring, of its own groups (`scope`): --resample's siblings of its
    single calls, then its judge and/or reward function. The judge's summary (its cost
    goes to the night's W&B run), or None when nothing scores. `state`: the proxy's answer
    about the policy, read once for this phase."""
    judge = marked_through_proxy(policy.judge, night.data_dir, night.token)
    tool_calls = {
        "tool_call_parser": policy.tool_call_parser,
        "tool_parser_tokenizer": policy.tool_parser_tokenizer or policy.train.base_model,
    }
    if policy.train.resample:
        _resample(night, policy, scope, state, tool_calls, say, warn)
    if not policy.scores:
        return None
    # Scored first, with the judge's own batch (the trainer never calls the judge).
    from overnight.judge.run import judge_step

    return judge_step(night.data_dir, judge, policy.reward, say=say,
                      settle_seconds=night.settle_seconds, scope=scope, **tool_calls)  # fmt: skip


def _resample(night, policy, scope, state, tool_calls: dict, say: Say, warn: Say) -> None:
    """Siblings of single calls first (trainer/choose/resample.py): the judge scores them
    next, and the plan takes the per-turn groups they form."""
    from overnight.trainer.choose.inputs import Selection
    from overnight.trainer.choose.resample import imported_tokenizer, resample_turns
    from overnight.trainer.serving.proxy_client import base_model_of

    if not policy.scores:
        warn("warning: --resample without --reward or --judge-model: the siblings stay "
             "unscored until a judge run scores them")  # fmt: skip
    else:  # a parser that cannot be built stops the night before any sampling
        from overnight.judge.tool_calls import sibling_parser

        sibling_parser(*tool_calls.values())
    # Imported turns have no token ids: their messages are rendered with the base model's
    # chat template (loaded only where the store holds some).
    base = None if (state or {}).get("upstream") else (
        policy.train.base_model or base_model_of(state or {}))  # fmt: skip
    selection = Selection(night.data_dir, night.settle_seconds, night.since, scope=scope,
                          tokenizer=imported_tokenizer(night.data_dir, base))  # fmt: skip
    resample_turns(selection, policy.train, proxy_url=night.proxy_url, admin_token=night.token,
                   say=say, state=state)  # fmt: skip


def marked_through_proxy(judge, data_dir: Path, token: str | None, kind: str = "judge"):
    """`judge` (a JudgeConfig or None: the judge, or the signals' classifier with `kind`
    "signals") marking its calls as overnight's own (`X-Rollout-Origin: judge`, with the
    admin token where one is given) when its --judge-base-url is the proxy serving
    `data_dir` (DATA/proxy.json): a local judge served by the same vLLM through the proxy
    is not an agent's traffic, and its calls are then never listed, trained or read for
    signals as one (docs/operations.md). Any other server gets no mark, and never the
    token; a judge given its own `extra_headers` keeps them as they are."""
    if judge is None or not judge.base_url:
        return judge
    if any(arg.partition("=")[0].strip() == "extra_headers" for arg in judge.args):
        return judge
    from overnight.proxy.address import find_proxy
    from overnight.proxy.capture.attribution import ORIGIN_HEADER, ORIGIN_TOKEN_HEADER

    found = find_proxy(data_dir)
    if found is None or _server(found["url"]) != _server(judge.base_url):
        return judge
    headers = {ORIGIN_HEADER: kind, **({ORIGIN_TOKEN_HEADER: token} if token else {})}
    return dataclasses.replace(judge, args=(*judge.args, f"extra_headers={json.dumps(headers)}"))


def _server(url: str) -> tuple[str, int | None]:
    """A URL's host and port, every loopback name as one (the proxy advertises 127.0.0.1)."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    return ("loopback" if host in ("localhost", "127.0.0.1", "::1") else host), parts.port
