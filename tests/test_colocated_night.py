"""A colocated night killed at each stage leaves a serving system (issue 22).

The real `overnight serve` and `overnight train --colocate on` processes, in front of the
fake vLLM in its own process (it refuses generation while asleep, as a real vLLM cannot
answer then). SIGKILL before the sleep, asleep, mid-training, after the wake and after
the promotion; then: the proxy wakes vLLM when the killed night's lease runs out, the
next night resumes and promotes once, and traffic is served throughout, held or
answered 503 with Retry-After while asleep, never lost.

The same night on a real vLLM (CPU, its dev-mode sleep routes) is in
tests/test_colocated_vllm.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.testing.processes import spawn_fake_upstream, spawn_serve

from .helpers import rows
from .test_ops import REWARD_FILE, _get, _log_groups

pytestmark = pytest.mark.slow

LEASE = 5  # seconds: a killed night's lease runs out this fast (the minimum)


def train(data: Path, proxy_url: str, model: Path, reward: Path, kill_at: str | None):
    env = {k: v for k, v in os.environ.items() if k != "OVERNIGHT_KILL_AT"}
    if kill_at:
        env["OVERNIGHT_KILL_AT"] = kill_at
    command = [sys.executable, "-m", "overnight.cli", "train", "--data", str(data)]
    command += ["--proxy", proxy_url, "--base-model", str(model), "--preset", "tiny-cpu"]
    command += ["--epochs", "1", "--groups-per-step", "2", "--settle", "0", "--gate", "off"]
    command += ["--reward", f"{reward}:score", "--colocate", "on"]
    command += ["--maintenance-lease", str(LEASE), "--keep-adapters", "0"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def asleep(fake_url: str) -> bool:
    return _get(fake_url + "/is_sleeping")["is_sleeping"]


def chat(proxy_url: str) -> tuple[int, dict, str | None]:
    body = json.dumps({"model": "policy", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()  # fmt: skip
    request = urllib.request.Request(proxy_url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read()), None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers.get("Retry-After")


@pytest.fixture(scope="module")
def fake_process():
    with spawn_fake_upstream() as fake:
        yield fake


# Where the chain kills the night, one stage per start, in the order a night meets them.
STAGES = ("judging", "asleep", "step-1", "awake", "promoting")


def test_a_colocated_night_killed_at_each_stage_in_turn_leaves_vllm_awake_and_one_promotion(
    fake_process, tiny_model_dir, tmp_path
):
    """One night killed at each stage in turn, one per start, each start resuming what the
    one before left; after every kill the proxy wakes vLLM when the lease runs out, and
    traffic is answered (503 with Retry-After while asleep). Then a start that finishes."""
    data = tmp_path / "data"
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    # A short hold: a request during the window is answered 503 rather than held long.
    with spawn_serve(data, "--upstream", fake_process.url, "--maintenance-hold", "1") as proxy:
        _log_groups(proxy.url)
        for stage in STAGES:
            killed = train(data, proxy.url, tiny_model_dir, reward, stage)
            assert killed.returncode == -signal.SIGKILL, stage + killed.stdout + killed.stderr
            if stage in ("asleep", "step-1"):
                assert asleep(fake_process.url), f"killed asleep ({stage})"
                status, body, retry = chat(proxy.url)
                assert status == 503 and body["error"]["code"] == "maintenance" and retry, body
            deadline = time.monotonic() + LEASE + 10
            while asleep(fake_process.url) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not asleep(fake_process.url), f"the proxy woke vLLM after {stage}'s lease"
            assert chat(proxy.url)[0] == 200, stage
            served = len(_get(proxy.url + "/admin/adapters")["stack"])
            assert served == (1 if stage == "promoting" else 0), stage
        again = train(data, proxy.url, tiny_model_dir, reward, None)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "maintenance: vLLM awake after" in again.stdout, again.stdout
        assert not asleep(fake_process.url)
        (run,) = rows(data, "SELECT * FROM training_runs WHERE status = 'trained'")
        metrics = json.loads(run["metrics"])
        state = _get(proxy.url + "/admin/adapters")
        assert len(state["stack"]) == 1, state  # promoted once, however it was killed
        assert state["current"]["path"] == str((data / "adapters" / run["run_id"]).resolve())
        seconds = metrics["maintenance"]["seconds"]
        assert seconds > 0, metrics
        # The window's length, where operators look: `overnight runs` and /ui/runs.
        listing = CliRunner().invoke(main, ["runs", "--data", str(data)]).output
        assert "asleep_s" in listing and f"{seconds:.2g}" in listing, listing
        with urllib.request.urlopen(proxy.url + "/ui/runs", timeout=30) as page:
            assert "vLLM asleep (s)" in page.read().decode()
        assert chat(proxy.url)[0] == 200
        statuses = {r["http_status"] for r in rows(data, "SELECT http_status FROM completions")}
        assert statuses <= {200, 503}, statuses  # nothing else failed
