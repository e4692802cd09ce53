"""`overnight demo`, the README's first command, end to end on the shared vLLM server.

The demo normally starts its own vLLM; here it fronts the session's (`--upstream`), so
the suite runs one vLLM. Everything else is as a user runs it: the example agents as
subprocesses through the proxy, `overnight judge` and `overnight train` each night.
Learning by a stated margin is test_learning's job; this checks the story holds
together: nights promote new adapters with no failed request, and the reward rises.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from overnight.proxy.launcher import free_port

from .helpers import rows, version_of

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
DAY_ROW = re.compile(r"^\s+(\d)\s+([\d.]+)\s+(\S+)\s+\d+s\s+\d+s\s+\d+s$", re.M)


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


def test_demo_runs_the_whole_story(vllm_server, tmp_path):
    data = tmp_path / "demo-data"
    out = demo(vllm_server, data, 4)
    table = DAY_ROW.findall(out)
    assert [int(day) for day, _, _ in table] == [1, 2, 3, 4], out
    rewards = [float(r) for _, r, _ in table]
    served = [version_of(s) for _, _, s in table]
    assert served == ["tiny", "policy-v1", "policy-v2", "policy-v3"], out
    print(f"demo rewards by day: {rewards}")
    assert rewards[-1] > rewards[0], rewards
    assert "failed requests: 0" in out
    for night in (1, 2, 3):
        assert f"night {night}: overnight train --preset tiny-cpu" in out
    assert "night 4: overnight train" not in out  # the last day is only scored
    report = data / "reports" / "training.html"
    assert report.exists() and f"The training report: {report}" in out
    runs = rows(data, "SELECT status, promoted_as FROM training_runs ORDER BY started_at")
    assert [(r["status"], version_of(r["promoted_as"])) for r in runs] == [
        ("trained", "policy-v1"),
        ("trained", "policy-v2"),
        ("trained", "policy-v3"),
    ]
    # The search agent's groups were logged and, with no judge given, left unscored.
    (handbook,) = rows(
        data,
        "SELECT count(*) AS n, sum(rewarded) AS scored FROM groups WHERE group_id LIKE 'handbook-%'",
    )
    assert handbook["n"] == 8 and handbook["scored"] == 0


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
    assert run["status"] == "trained" and version_of(run["promoted_as"]) == "policy-v1"
