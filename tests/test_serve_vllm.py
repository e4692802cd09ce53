"""`overnight serve --model`: vLLM as a child process, and SIGTERM stopping both."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from overnight.proxy.launcher import free_port
from overnight.storage.segments import log_files

from .helpers import rows
from .test_serve_process import CHAT, post, wait_http
from .vllm_fixtures import _require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_serve_model_starts_vllm_and_sigterm_stops_both(tiny_model_dir, tmp_path):
    _require_vllm()
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "overnight.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--served-model-name",
            "tiny",
            "--port",
            str(port),
            "--data",
            str(tmp_path),
            "--max-lora-rank",
            "8",
            "--vllm-arg=--dtype=float32",
            "--vllm-arg=--max-model-len=2048",
        ],
        env=env,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=600)
        (vllm_pid,) = children(proc.pid)
        status, _ = post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            {**CHAT, "max_tokens": 4},
            {"X-Rollout-Id": "via-serve"},
        )
        assert status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not Path(f"/proc/{vllm_pid}").exists()  # vLLM stopped too
    assert log_files(tmp_path) == []
    (row,) = rows(
        tmp_path, "SELECT rollout_id, model_served, completion_token_ids FROM completions"
    )
    assert row["rollout_id"] == "via-serve" and row["model_served"] == "tiny"
    assert len(row["completion_token_ids"]) == 4
    assert (tmp_path / "logs" / "vllm.log").stat().st_size > 0  # vLLM's output, kept
