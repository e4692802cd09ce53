"""The night across policies (overnight/night/): its steps in order, the signals read once,
the proxy's state read once per policy for scoring, one policy's failure not stopping the
others. The steps themselves (scoring, training) are stood in for: their own tests run
them; this checks what the orchestrator does with them. No servers, no models."""

from __future__ import annotations

from pathlib import Path

import pytest

from overnight.config import TrainConfig
from overnight.errors import OvernightError
from overnight.night import run as night_run
from overnight.night import scoring
from overnight.night.policies import NightOptions, PolicyNight


class _Summary:
    def lines(self) -> list[str]:
        return ["read"]


@pytest.fixture
def signals_read(monkeypatch) -> list[Path]:
    import overnight.judge.implicit

    read: list[Path] = []

    def run_signals(data_dir, rewards=False):
        assert rewards  # a night reads them with the rewards they make
        read.append(data_dir)
        return _Summary()

    monkeypatch.setattr(overnight.judge.implicit, "run_signals", run_signals)
    return read


@pytest.mark.parametrize(
    ("options", "reads"),
    [
        ({}, False),
        ({"reward_sources": ("agent", "implicit")}, True),
        ({"hindsight": True}, True),  # it learns from the corrections the signals find
    ],
)
def test_the_signals_are_read_once_when_a_policy_needs_them(tmp_path, signals_read, options, reads):
    policies = [PolicyNight("a", TrainConfig(**options)), PolicyNight("b", TrainConfig())]
    said: list[str] = []
    scoring.read_signals_once(tmp_path, policies, said.append)
    assert signals_read == ([tmp_path] if reads else [])
    assert said == (["signals: read"] if reads else [])


def test_each_policy_runs_in_turn_and_a_failure_is_named_at_the_end(
    tmp_path, signals_read, monkeypatch
):
    ran: list[str | None] = []

    def policy_night(night, policy, say, warn):
        ran.append(policy.policy)
        if policy.policy == "broken":
            raise RuntimeError("no adapter")
        return policy.policy

    monkeypatch.setattr(night_run, "policy_night", policy_night)
    policies = [PolicyNight(name, TrainConfig()) for name in ("a", "broken", "c")]
    said, warned = [], []
    with pytest.raises(OvernightError, match="the night failed for policy broken"):
        night_run.run_night(NightOptions(tmp_path), policies, said.append, warned.append)
    assert ran == ["a", "broken", "c"]  # the one after the failure still ran
    assert warned == ["policy broken: the night failed: RuntimeError: no adapter"]
    assert said[0] == "policy a: its own groups, scoring, adapter, gate and promotion"


def test_a_single_policy_failure_is_raised_as_it_is(tmp_path, signals_read, monkeypatch):
    def policy_night(night, policy, say, warn):
        raise RuntimeError("no adapter")

    monkeypatch.setattr(night_run, "policy_night", policy_night)
    with pytest.raises(RuntimeError, match="no adapter"):
        night_run.run_night(NightOptions(tmp_path), [PolicyNight(None, TrainConfig())])


def test_a_dry_run_reads_no_signals(tmp_path, signals_read, monkeypatch):
    monkeypatch.setattr(night_run, "policy_night", lambda *a: None)
    implicit = PolicyNight("a", TrainConfig(reward_sources=("implicit",)))
    night_run.run_night(NightOptions(tmp_path, dry_run=True), [implicit])
    assert signals_read == []


def test_the_state_is_read_once_for_scoring_and_handed_to_the_trainer(tmp_path, monkeypatch):
    """One answer about the policy serves its scope, the scoring and the trainer's open
    (which reads again only when its watch ran); none where there is nothing to ask."""
    import overnight.judge.scoring
    import overnight.trainer.serving.proxy_client as proxy_client
    import overnight.trainer.train

    asked: list[str | None] = []
    state = {"alias": "a", "policies": ["a"], "default": "a", "current": None}

    def serving_state(proxy_url, token, policy=None):
        asked.append(policy)
        return state

    trained: list[dict] = []
    scored: list[tuple] = []
    monkeypatch.setattr(proxy_client, "serving_state", serving_state)
    monkeypatch.setattr(overnight.judge.scoring, "pair_scorer", lambda *a: None)
    monkeypatch.setattr(night_run, "score", lambda *a: scored.append(a) or None)
    monkeypatch.setattr(overnight.trainer.train, "train", lambda *a, **k: trained.append(k))
    night = NightOptions(tmp_path, proxy_url="http://127.0.0.1:9", token="t")
    night_run.policy_night(night, PolicyNight("a", TrainConfig()), print, print)
    assert asked == ["a"]
    (kwargs,) = trained
    assert kwargs["state"] is state and kwargs["scope"].name == "a"
    assert scored[0][3] is state  # the scoring phase's state: --resample's upstream

    asked.clear()
    night_run.policy_night(NightOptions(tmp_path), PolicyNight(None, TrainConfig()), print, print)
    assert asked == [] and trained[-1]["state"] is None and trained[-1]["scope"] is None
