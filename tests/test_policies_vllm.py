"""Two agents, two policies, two nights, on real vLLM (CPU) and the tiny model (issue 27).

An old data directory (one alias, an adapter promoted) is served again with a second
policy: the default policy keeps its adapter. Then each day both agents log groups
under their own alias; each night trains each policy on its own groups only, from its
own served adapter, and promotes to its own alias. The second night the support
policy's gate refuses its candidate: it keeps its adapter while the default policy is
promoted again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from overnight.config import TrainConfig
from overnight.trainer.train import train

from .helpers import TINY_NIGHT, log_digit_group, rows, version_of, wait_for_rows

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TASKS = {
    "policy": [{"role": "user", "content": "Name a colour."}],
    "support": [{"role": "user", "content": "Say a number."}],
}
CONFIG = TrainConfig(**TINY_NIGHT, watch=False, gate="off")


async def log_group(proxy, alias: str, group: str, size: int = 3) -> None:
    """`size` rollouts of the alias's task, rewarded with the share of digits."""
    await log_digit_group(proxy, group, TASKS[alias], size, model=alias, max_tokens=8)


async def same_score(messages, tools, replies) -> list[float]:
    return [0.5 for _ in replies]  # no evidence either way: the "better" gate refuses


async def serves(proxy, alias: str) -> str:
    state = await (await proxy.get("/admin/adapters", params={"policy": alias})).json()
    return state["current"]["name"]


async def test_two_policies_over_two_nights(vllm_server, make_proxy, lora_adapter, tmp_path):
    data = tmp_path / "data"
    # A data directory of one alias, as before policies: an adapter promoted.
    old = await make_proxy(upstream=vllm_server.url, data_dir=data)
    r = await old.post("/admin/adapters/promote", json={"path": str(lora_adapter)})
    assert r.status == 200, await r.text()
    legacy = (await r.json())["promoted"]
    await old.close()
    proxy = await make_proxy(upstream=vllm_server.url, data_dir=data, policies=("support",))
    assert await serves(proxy, "policy") == legacy  # upgraded in place: still served
    url = str(proxy.make_url(""))
    lines: list[str] = []
    promoted: dict[str, list[str]] = {"policy": [legacy], "support": []}
    logged = 0
    for night in range(2):
        groups = {alias: [f"{alias}-{night}-{g}" for g in range(2)] for alias in TASKS}
        for g in range(2):
            for alias in TASKS:
                await log_group(proxy, alias, groups[alias][g])
        logged += 12
        await wait_for_rows(data, logged)
        for alias in TASKS:
            refuse = night == 1 and alias == "support"
            config = dataclasses.replace(CONFIG, policy=alias, gate="better" if refuse else "off")
            result = await asyncio.to_thread(
                train, data, config, proxy_url=url, settle_seconds=0.0, say=lines.append,
                scorer=same_score,
            )  # fmt: skip
            summary = "\n".join(lines)
            # Its own groups only: the selection names no group of the other policy.
            assert sorted(result.plan.groups) == groups[alias], summary
            (run,) = rows(data, "SELECT * FROM training_runs WHERE run_id = ?", [result.run_id])
            assert json.loads(run["metrics"])["policy"] == alias
            # From its own served adapter: the legacy one for the default policy.
            start = run["start_adapter"]
            if alias == "policy" and night == 0:
                assert start == str(lora_adapter)
            elif alias == "support" and night == 0:
                assert start is None  # a fresh LoRA: it never served an adapter
            if refuse:
                assert result.gate is not None and not result.gate.promote, summary
                assert result.promoted_as is None
            else:
                assert version_of(result.promoted_as).startswith(f"{alias}-v"), summary
                promoted[alias].append(result.promoted_as)
            assert await serves(proxy, alias) == promoted[alias][-1]
            lines.clear()
    # The refused policy kept its night-0 adapter; the other moved on to its night-1 one.
    assert len(promoted["support"]) == 1 and len(promoted["policy"]) == 3
    # Each alias serves its own adapter to new traffic.
    for alias in TASKS:
        await log_group(proxy, alias, f"{alias}-after", size=1)
    await wait_for_rows(data, logged + 2)
    after = rows(
        data,
        "SELECT model_requested, model_served FROM completions WHERE group_id LIKE '%-after'",
    )
    assert {r["model_requested"]: r["model_served"] for r in after} == {
        alias: promoted[alias][-1] for alias in TASKS
    }
