"""A real `overnight serve` process, stopped with SIGTERM and killed with SIGKILL.

The upstream is the fake vLLM in its own process: what is under test is the proxy
process's durability, not the model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from overnight.storage.manifest import segment_files
from overnight.storage.write.segments import log_files
from overnight.testing.processes import spawn_fake_upstream, spawn_serve

from .helpers import rows, wait_until
from .vllm_fixtures import _require_vllm

pytestmark = pytest.mark.slow

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


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
    with spawn_fake_upstream("--delay", "0.3") as fake:
        yield fake.url


def send_traffic(base: str, n: int) -> None:
    def one(i: int):
        body = {**CHAT, "stream": i % 2 == 1}
        status, _ = post(
            base + "/v1/chat/completions", body, {"X-Rollout-Group": "g", "X-Rollout-Id": f"r{i}"}
        )
        assert status == 200

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(n)))


def in_flight(base: str) -> int:
    return sum(get_json(base + "/admin/adapters")["in_flight"].values())


def test_sigterm_with_requests_in_flight_loses_nothing(tmp_path):
    # An upstream slow enough (3 s) that all eight overlap however the machine's load
    # spreads their starts (at 0.3 s a loaded run once never saw the eight at once).
    with (
        spawn_fake_upstream("--delay", "3") as fake,
        spawn_serve(tmp_path, "--upstream", fake.url) as serve,
        ThreadPoolExecutor(8) as pool,
    ):
        futures = [
            pool.submit(post, serve.url + "/v1/chat/completions", CHAT, {"X-Rollout-Id": f"f{i}"})
            for i in range(8)
        ]
        # SIGTERM once all eight are waiting on the upstream.
        wait_until(lambda: in_flight(serve.url) == 8, timeout=10, what="8 requests in flight")
        serve.process.send_signal(signal.SIGTERM)
        statuses = [f.result()[0] for f in futures]
        assert serve.process.wait(timeout=30) == 0
    assert statuses == [200] * 8
    assert log_files(tmp_path) == []  # everything compacted on the way out
    assert segment_files(tmp_path, "completions")
    found = rows(tmp_path, "SELECT rollout_id FROM completions ORDER BY rollout_id")
    assert [r["rollout_id"] for r in found] == sorted(f"f{i}" for i in range(8))


def test_sigkill_loses_nothing_that_was_committed(fake_process, tmp_path):
    with spawn_serve(tmp_path, "--upstream", fake_process) as serve:
        send_traffic(serve.url, 12)
        status, _ = post(serve.url + "/v1/rollouts/r3/reward", {"reward": 1.0})
        assert status == 200  # a reward is answered only once it is on disk
        stats = serve.url + "/admin/stats"
        wait_until(lambda: get_json(stats)["rows_committed"] >= 13, 10, "13 rows committed")
        os.kill(serve.pid, signal.SIGKILL)
        serve.process.wait()
    assert len(log_files(tmp_path)) == 1 and segment_files(tmp_path, "completions") == []
    # Readers see the orphaned log at once ...
    assert len(rows(tmp_path, "SELECT * FROM completions")) == 12
    # ... and the next start recovers it into Parquet.
    with spawn_serve(tmp_path, "--upstream", fake_process) as serve:
        wait_until(lambda: log_files(tmp_path) == [], 10, "the orphaned log recovered")
        found = rows(
            tmp_path, "SELECT rollout_id, completion_token_ids FROM completions ORDER BY rollout_id"
        )
        assert sorted(r["rollout_id"] for r in found) == sorted(f"r{i}" for i in range(12))
        assert all(r["completion_token_ids"] == [100, 101, 102] for r in found)
        assert rows(tmp_path, "SELECT rollout_id, reward FROM rewards") == [
            {"rollout_id": "r3", "reward": 1.0}
        ]
        assert serve.stop(timeout=30) == 0


def served_requests(vllm_url: str) -> float:
    """Requests a vLLM server finished, from its Prometheus metrics."""
    with urllib.request.urlopen(vllm_url + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith("vllm:request_success_total"))


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.vllm
def test_serve_starts_two_local_vllm_replicas_balances_and_sigterm_stops_all(
    tiny_model_dir, tmp_path
):
    """`overnight serve --model` with two vLLM replicas as its children: each gets a
    rollout of its own, and SIGTERM stops the proxy and both vLLMs, the log compacted and
    each vLLM's output kept. (One server start for all of it: each costs a minute or more.)"""
    _require_vllm()
    from overnight.proxy.forward.balancer import Balancer

    args = ["--model", str(tiny_model_dir), "--served-model-name", "tiny", "--vllm-replicas", "2"]
    args += ["--vllm-arg=--max-model-len=2048", "--vllm-arg=--max-num-seqs=4"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with spawn_serve(tmp_path, *args, env=env, startup_timeout=1500) as serve:
        replicas = get_json(serve.url + "/admin/adapters")["replicas"]
        urls = [r["url"] for r in replicas]
        assert len(urls) == 2 and all(r["healthy"] for r in replicas)
        # One rollout the balancer sends to each replica (its own hashing, same URLs).
        balancer = Balancer(urls, 1, 1)
        ids = {balancer.pick(f"v{i}").url: f"v{i}" for i in range(20)}
        assert set(ids) == set(urls)
        for rollout in ids.values():
            status, _ = post(
                serve.url + "/v1/chat/completions",
                {**CHAT, "model": "tiny"},
                {"X-Rollout-Id": rollout},
            )
            assert status == 200
        assert [served_requests(url) for url in urls] == [1.0, 1.0]
        vllm_pids = children(serve.pid)
        assert len(vllm_pids) == 2
        assert serve.stop(timeout=60) == 0
    assert not [pid for pid in vllm_pids if Path(f"/proc/{pid}").exists()]  # vLLMs stopped too
    assert log_files(tmp_path) == []  # committed and compacted on the way out
    for n in (0, 1):  # each vLLM's own output, kept
        assert (tmp_path / "logs" / f"vllm-{n}.log").stat().st_size > 0
    records = rows(
        tmp_path, "SELECT rollout_id, model_served, completion_token_ids FROM completions"
    )
    assert sorted(r["rollout_id"] for r in records) == sorted(ids.values())
    assert all(
        r["model_served"] == "tiny" and 0 < len(r["completion_token_ids"]) <= 3 for r in records
    )
