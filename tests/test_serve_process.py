"""A real `overnight serve` process, stopped with SIGTERM and killed with SIGKILL.

The upstream is the fake vLLM in its own process: what is under test is the proxy
process's durability, not the model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from overnight.proxy.launcher import free_port, wait_healthy
from overnight.storage.segments import log_files, segment_files

from .helpers import rows

pytestmark = pytest.mark.slow

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def wait_http(url: str, timeout: float = 30.0) -> None:
    assert wait_healthy(url, timeout), f"{url} did not come up"


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return r.status, r.read()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture
def fake_process():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "overnight.testing.fake_upstream", "--port", str(port), "--delay", "0.3"]
    )
    wait_http(f"http://127.0.0.1:{port}/health")
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def start_serve(upstream: str, data_dir) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "overnight.cli",
            "serve",
            "--upstream",
            upstream,
            "--port",
            str(port),
            "--data",
            str(data_dir),
            "--log-level",
            "WARNING",
        ],
    )
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/health")
    return proc, base


def send_traffic(base: str, n: int) -> None:
    def one(i: int):
        body = {**CHAT, "stream": i % 2 == 1}
        status, _ = post(
            base + "/v1/chat/completions", body, {"X-Rollout-Group": "g", "X-Rollout-Id": f"r{i}"}
        )
        assert status == 200

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(n)))


def test_sigterm_with_requests_in_flight_loses_nothing(fake_process, tmp_path):
    proc, base = start_serve(fake_process, tmp_path)
    with ThreadPoolExecutor(8) as pool:
        # Eight requests still waiting on the (0.3 s) upstream when SIGTERM arrives.
        futures = [
            pool.submit(post, base + "/v1/chat/completions", CHAT, {"X-Rollout-Id": f"f{i}"})
            for i in range(8)
        ]
        time.sleep(0.15)
        proc.send_signal(signal.SIGTERM)
        statuses = [f.result()[0] for f in futures]
    assert proc.wait(timeout=30) == 0
    assert statuses == [200] * 8
    assert log_files(tmp_path) == []  # everything compacted on the way out
    assert segment_files(tmp_path, "completions")
    found = rows(tmp_path, "SELECT rollout_id FROM completions ORDER BY rollout_id")
    assert [r["rollout_id"] for r in found] == sorted(f"f{i}" for i in range(8))


def test_sigkill_loses_nothing_that_was_committed(fake_process, tmp_path):
    proc, base = start_serve(fake_process, tmp_path)
    send_traffic(base, 12)
    status, _ = post(base + "/v1/rollouts/r3/reward", {"reward": 1.0})
    assert status == 200  # a reward is answered only once it is on disk
    deadline = time.monotonic() + 10
    while get_json(base + "/admin/stats")["rows_committed"] < 13 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(log_files(tmp_path)) == 1 and segment_files(tmp_path, "completions") == []
    # Readers see the orphaned log at once ...
    assert len(rows(tmp_path, "SELECT * FROM completions")) == 12
    # ... and the next start recovers it into Parquet.
    proc, base = start_serve(fake_process, tmp_path)
    deadline = time.monotonic() + 10
    while log_files(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log_files(tmp_path) == []
    found = rows(
        tmp_path, "SELECT rollout_id, completion_token_ids FROM completions ORDER BY rollout_id"
    )
    assert sorted(r["rollout_id"] for r in found) == sorted(f"r{i}" for i in range(12))
    assert all(r["completion_token_ids"] == [100, 101, 102] for r in found)
    assert rows(tmp_path, "SELECT rollout_id, reward FROM rewards") == [
        {"rollout_id": "r3", "reward": 1.0}
    ]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
