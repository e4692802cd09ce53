"""`overnight train` end to end: real vLLM, the proxy, peft, and the adapter swap."""

from __future__ import annotations

import asyncio
import json

import pytest

from overnight.config import TrainConfig
from overnight.trainer.train import train

from .helpers import TINY_NIGHT, log_digit_group, rows, version_of, wait_for_rows

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name a colour."},
]


async def log_group(proxy, group: str, size: int = 4) -> None:
    await log_digit_group(proxy, group, MESSAGES, size)


async def test_train_promotes_an_adapter_and_continues_from_it(
    vllm_server, tiny_model_dir, make_proxy, tmp_path
):
    proxy = await make_proxy(upstream=vllm_server.url)
    data = tmp_path / "data"
    for g in ("a", "b", "c"):
        await log_group(proxy, g)
    config = TrainConfig(**TINY_NIGHT)
    lines: list[str] = []
    url = str(proxy.make_url(""))
    first = await asyncio.to_thread(train, data, config, proxy_url=url, say=lines.append)
    assert first.plan.groups == ["a", "b", "c"] and version_of(first.promoted_as) == "policy-v1"
    assert (first.adapter_path / "adapter_config.json").exists()
    assert any(line.startswith("step 2/2: loss") for line in lines), lines
    (run,) = rows(data, "SELECT * FROM training_runs")
    assert run["status"] == "trained" and run["steps"] == 2 and run["rollouts"] == 12
    assert run["base_model"] == str(tiny_model_dir) and run["start_adapter"] is None
    # A fresh LoRA starts as the base model: its logprobs are vLLM's, as logged.
    assert run["max_logprob_gap"] < 1e-4
    metrics = json.loads(run["metrics"])
    assert [s["step"] for s in metrics["steps"]] == [1, 2] and set(metrics["groups"]) == {
        "a",
        "b",
        "c",
    }

    # Nothing new: nothing to train on.
    again = await asyncio.to_thread(train, data, config, proxy_url=url, say=lines.append)
    assert again.plan.groups == [] and lines[-1] == "nothing to train on"

    # New traffic is served by the new adapter, and the next run starts from it.
    await log_group(proxy, "d")
    served = rows(data, "SELECT DISTINCT model_served FROM completions WHERE group_id = 'd'")
    assert served == [{"model_served": first.promoted_as}]
    second = await asyncio.to_thread(train, data, config, proxy_url=url, say=lines.append)
    assert second.plan.groups == ["d"] and version_of(second.promoted_as) == "policy-v2"
    latest = rows(data, "SELECT * FROM training_runs ORDER BY started_at DESC LIMIT 1")[0]
    assert latest["start_adapter"] == str(first.adapter_path)
    assert latest["max_logprob_gap"] < 1e-4  # the saved adapter is exactly what vLLM served
    await wait_for_rows(data, 16)
    report = (data / "reports" / "training.html").read_text()
    assert report.count("<svg") == 3 and second.run_id in report and second.promoted_as in report
