"""The example agents, unchanged, through the proxy in front of the real vLLM (and
without it), and the judge over what they logged."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from .helpers import rows, wait_for_rows

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

AGENT = Path(__file__).resolve().parent.parent / "examples" / "tool_agent.py"
SEARCH_AGENT = AGENT.with_name("search_agent.py")


async def run(program: list[str], env: dict) -> str:
    """Run a program to its end; returns its output, having checked it succeeded."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *program,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=240)
    assert process.returncode == 0, output.decode()
    return output.decode()


async def test_tool_agent_runs_through_the_proxy_and_is_grouped(vllm_server, make_proxy, tmp_path):
    proxy = await make_proxy(upstream=vllm_server.url)
    env = dict(os.environ, OPENAI_BASE_URL=str(proxy.make_url("/v1")), OPENAI_API_KEY="unused")
    args = ["--tasks", "2", "--group-size", "3", "--max-turns", "3", "--max-tokens", "16"]
    assert "6 rollouts in 2 groups" in await run([str(AGENT), *args], env)
    data = tmp_path / "data"
    await wait_for_rows(data, 6, table="finishes")
    groups = rows(data, "SELECT * FROM groups ORDER BY group_id")
    assert [g["rollouts"] for g in groups] == [3, 3]
    assert all(g["finished"] == 3 and g["rewarded"] == 3 for g in groups)
    # Multi-turn: each later turn's prompt extends the earlier one (the agent resends
    # its history), which is what the trainer will merge into one sequence. Except
    # after an empty reply: the model sampled it after "<|im_start|>assistant\n", but
    # the chat template renders an empty assistant message without that newline (as
    # Qwen's does for content-less messages), so there the trainer starts a new sequence.
    turns = rows(
        data,
        "SELECT rollout_id, turn_index, prompt_token_ids, response "
        "FROM completions ORDER BY rollout_id, turn_index",
    )
    by_rollout: dict[str, list[dict]] = {}
    for t in turns:
        by_rollout.setdefault(t["rollout_id"], []).append(t)
    multi = [ts for ts in by_rollout.values() if len(ts) > 1]
    assert multi, "expected at least one multi-turn rollout"
    checked = 0
    for ts in multi:
        for before, after in zip(ts, ts[1:], strict=False):
            reply = json.loads(before["response"])["choices"][0]["message"]
            if not reply.get("content") and not reply.get("tool_calls"):
                continue
            checked += 1
            assert (
                after["prompt_token_ids"][: len(before["prompt_token_ids"])]
                == before["prompt_token_ids"]
            )
    assert checked, "every earlier reply was empty: nothing to check"


async def test_search_agent_through_the_proxy_then_ruler_judges_its_groups(
    vllm_server, make_proxy, tmp_path
):
    """The RULER example: no reward code; the agent finishes its rollouts, and the judge
    (here the tiny model on vLLM, through litellm, as a self-hosted judge) scores each
    group. The tiny model is no judge: a group is either scored or its failure recorded."""
    proxy = await make_proxy(upstream=vllm_server.url)
    env = dict(os.environ, OPENAI_BASE_URL=str(proxy.make_url("/v1")), OPENAI_API_KEY="unused")
    args = ["--questions", "2", "--group-size", "3", "--max-turns", "2", "--max-tokens", "24"]
    assert "6 rollouts in 2 groups" in await run([str(SEARCH_AGENT), *args], env)
    data = tmp_path / "data"
    await wait_for_rows(data, 6, table="finishes")
    groups = rows(data, "SELECT group_id, rollouts, finished FROM groups ORDER BY group_id")
    assert [(g["rollouts"], g["finished"]) for g in groups] == [(3, 3), (3, 3)]
    # The handbook's system prompt and tools were sent, as an agent on OpenAI sends them.
    (first,) = rows(data, "SELECT request FROM completions LIMIT 1")
    assert "help desk of Acme Robotics" in first["request"] and '"search"' in first["request"]

    judge = ["-m", "overnight.cli", "judge", "--data", str(data), "--judge-model", "openai/tiny"]
    judge += [
        "--judge-base-url",
        vllm_server.url + "/v1",
        "--max-tokens",
        "160",
        "--max-fixes",
        "1",
    ]
    await run(
        judge, dict(os.environ, OVERNIGHT_JUDGE_API_KEY="unused", OVERNIGHT_JUDGE_BACKOFF="0.01")
    )
    judgments = rows(data, "SELECT group_id, scores, error FROM judgments ORDER BY group_id")
    assert [j["group_id"] for j in judgments] == [g["group_id"] for g in groups]
    for j in judgments:
        assert (len(j["scores"]) == 3) if j["error"] is None else (j["scores"] == [])


@pytest.mark.parametrize(
    "agent,args",
    [
        (AGENT, ["--tasks", "1", "--group-size", "2", "--max-turns", "2", "--no-rewards"]),
        (
            SEARCH_AGENT,
            ["--questions", "1", "--group-size", "2", "--max-turns", "2", "--no-finish"],
        ),
    ],
    ids=["tool_agent", "search_agent"],
)
async def test_examples_run_unchanged_against_a_plain_vllm(vllm_server, agent, args):
    """No proxy: the same programs, only OPENAI_BASE_URL differs (and the model name, as
    a plain server knows no alias). The rollout headers are ignored there."""
    env = dict(
        os.environ,
        OPENAI_BASE_URL=vllm_server.url + "/v1",
        OPENAI_API_KEY="unused",
        OVERNIGHT_MODEL="tiny",
    )
    assert "2 rollouts in 1 groups" in await run([str(agent), *args, "--max-tokens", "16"], env)
