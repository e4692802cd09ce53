"""`overnight demo`, the README's first command, end to end on the shared vLLM server.

The demo normally starts its own vLLM; here it fronts the session's (`--upstream`), so
the suite runs one vLLM. Everything else is as a user runs it: the example agents as
subprocesses through the proxy, `overnight judge` and `overnight train` each night.
Learning by a stated margin is test_learning's job; this checks the story holds
together: nights promote new adapters with no failed request, and the reward rises.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from overnight.proxy.launch.launcher import free_port

from .helpers import rows, version_of

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
DAY_ROW = re.compile(r"^\s+(\d)\s+([\d.]+)\s+(\S+)\s+\d+s\s+\d+s\s+\d+s$", re.M)
VERDICT = re.compile(r"^night (\d) gate \(not-worse\): (promoted|refused): (.+)$", re.M)


def demo(vllm_server, data, days: int, *extra: str, env: dict | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "overnight.cli", "demo", "--upstream", vllm_server.url]
        + ["--data", str(data), "--port", str(free_port()), "--days", str(days), *extra],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(900)  # four days and three gated nights on 2 shared cores
def test_demo_runs_the_whole_story(vllm_server, tmp_path):
    data = tmp_path / "demo-data"
    out = demo(vllm_server, data, 4)
    table = DAY_ROW.findall(out)
    assert [int(day) for day, _, _ in table] == [1, 2, 3, 4], out
    rewards = [float(r) for _, r, _ in table]
    served = [version_of(s) for _, _, s in table]
    # Every night is gated on the held-out questions and says its verdict; the next day
    # is served by what the verdict left serving.
    verdicts = VERDICT.findall(out)
    assert [int(n) for n, _, _ in verdicts] == [1, 2, 3], out
    promoted = [word == "promoted" for _, word, _ in verdicts]
    for _, _, reason in verdicts:
        assert "held-out prompts" in reason, reason  # sampled and scored, not skipped
    expected = ["tiny"] + [f"policy-v{sum(promoted[:n])}" for n in (1, 2, 3)]
    expected = [e if e != "policy-v0" else "tiny" for e in expected]
    print(f"demo rewards by day: {rewards}; gate verdicts: {[w for _, w, _ in verdicts]}")
    assert served == expected, out
    assert rewards[-1] > rewards[0], (rewards, verdicts)
    assert "failed requests: 0" in out
    for night in (1, 2, 3):
        assert f"night {night}: overnight train --preset tiny-cpu" in out
    assert "night 4: overnight train" not in out  # the last day is only scored
    report = data / "reports" / "training.html"
    assert report.exists() and f"The training report: {report}" in out
    runs = rows(data, "SELECT status, promoted_as, metrics FROM training_runs ORDER BY started_at")
    assert [r["status"] for r in runs] == ["trained"] * 3
    assert [r["promoted_as"] is not None for r in runs] == promoted
    for run, (_, word, _) in zip(runs, verdicts, strict=True):
        assert json.loads(run["metrics"])["gate"]["verdict"] == word
    # The search agent's groups were logged and, with no judge given, left unscored.
    (handbook,) = rows(
        data,
        "SELECT count(*) AS n, sum(rewarded) AS scored FROM groups WHERE group_id LIKE 'handbook-%'",
    )
    assert handbook["n"] == 8 and handbook["scored"] == 0


@pytest.mark.timeout(600)
def test_demo_with_a_judge_has_it_rank_the_search_agents_groups(vllm_server, tmp_path):
    """RULER on the search agent's groups, with the tiny model as its own judge (through
    litellm, as a self-hosted judge). It is no judge: each group gets scores or a
    recorded failure, and the story goes on either way (whether the policy improves
    when trained on its scores is not asked). Its answers are capped through the judge
    command's environment variable, which the demo's subprocesses inherit."""
    data = tmp_path / "demo-data"
    env = dict(os.environ, OVERNIGHT_JUDGE_MAX_TOKENS="160", OVERNIGHT_JUDGE_API_KEY="unused")
    judge = ["--judge-model", "openai/tiny", "--judge-base-url", vllm_server.url + "/v1"]
    out = demo(vllm_server, data, 2, *judge, env=env)
    assert out.count("overnight judge --judge-model openai/tiny") == 2
    assert "failed requests: 0" in out
    (handbook,) = rows(data, "SELECT count(*) AS n FROM groups WHERE group_id LIKE 'handbook-%'")
    judged = rows(data, "SELECT DISTINCT group_id FROM judgments WHERE judge_model = 'openai/tiny'")
    assert handbook["n"] == 4 and len(judged) == 4
    (run,) = rows(data, "SELECT status, promoted_as FROM training_runs")
    ((_, word, _),) = VERDICT.findall(out)
    assert run["status"] == "trained"
    assert version_of(run["promoted_as"]) == ("policy-v1" if word == "promoted" else None)
