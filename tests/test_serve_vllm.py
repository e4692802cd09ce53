"""`overnight serve --model`: vLLM as a child process, and SIGTERM stopping both."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from overnight.storage.segments import log_files
from overnight.testing.tiny_model import serve_tiny

from .helpers import rows
from .test_serve_process import CHAT, post
from .vllm_fixtures import _require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_serve_model_starts_vllm_and_sigterm_stops_both(tiny_model_dir, tmp_path):
    _require_vllm()
    with serve_tiny(tiny_model_dir, tmp_path, max_model_len=2048) as serve:
        (vllm_pid,) = children(serve.pid)
        status, _ = post(
            serve.url + "/v1/chat/completions",
            {**CHAT, "max_tokens": 4},
            {"X-Rollout-Id": "via-serve"},
        )
        assert status == 200
        assert serve.stop() == 0
    assert not Path(f"/proc/{vllm_pid}").exists()  # vLLM stopped too
    assert log_files(tmp_path) == []
    (row,) = rows(
        tmp_path, "SELECT rollout_id, model_served, completion_token_ids FROM completions"
    )
    assert row["rollout_id"] == "via-serve" and row["model_served"] == "tiny"
    assert len(row["completion_token_ids"]) == 4
    assert (tmp_path / "logs" / "vllm.log").stat().st_size > 0  # vLLM's output, kept
