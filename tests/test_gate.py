"""The promotion gate and the watch: statistics by hand, a sabotaged night refused, a worse
adapter rolled back (the tiny model sampled with peft; the proxy in front of the fake vLLM)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.config import TrainConfig
from overnight.judge.scoring import pair_scorer
from overnight.progress import Progress
from overnight.storage import LogWriter, WriterConfig
from overnight.storage.read.best_adapter import levels
from overnight.trainer.gate.prompts import GatePrompt
from overnight.trainer.gate.verdict import bootstrap_means, decide, paired_interval, run_gate
from overnight.trainer.live.watch import check, watch

from .helpers import chat_response, completion_row, rows, wait_for_rows

# -- the statistics, against numbers worked out by hand ------------------------------------


def test_the_paired_bootstrap_interval_matches_hand_computed_numbers():
    # Two differences, 0 and 1: a resample's mean is 0, 0.5 or 1 with chances 1/4, 1/2,
    # 1/4, so the 2.5% and 97.5% points are 0 and 1.
    assert paired_interval([0.0, 1.0]) == pytest.approx((0.5, 0.0, 1.0))
    # Four differences 1, 1, 1, 0: a resample's mean is k/4 with k ~ Binomial(4, 3/4);
    # P(k = 0) = 1/256 < 2.5% < P(k <= 1) = 13/256, and P(k = 4) = 81/256 > 2.5%, so
    # the interval is [1/4, 1].
    assert paired_interval([1.0, 1.0, 1.0, 0.0]) == pytest.approx((0.75, 0.25, 1.0))
    # No spread, no doubt.
    assert paired_interval([-0.2] * 5) == pytest.approx((-0.2, -0.2, -0.2))
    # Unpaired: mean(a) - mean(b) with both constant is exact.
    assert set(bootstrap_means([1.0, 1.0], [0.25, 0.25, 0.25], resamples=50)) == {0.75}


def test_the_decision_rules():
    tie = [0.0] * 10
    assert decide(tie, "not-worse", 0.05)[0] is True  # a tie is not worse ...
    assert decide(tie, "better", 0.05)[0] is False  # ... nor better
    slightly_worse = [0.06, -0.08] * 10  # worse on average by less than the margin ...
    assert decide(slightly_worse, "not-worse", 0.05)[0] is True  # ... but not measurably
    assert decide(slightly_worse, "not-worse", 0.01)[0] is False
    measurably = [-0.02, -0.03] * 10  # by less than the margin, but surely worse
    assert decide(measurably, "not-worse", 0.05)[0] is False
    promote, numbers = decide([0.1, 0.2, 0.3] * 4, "better", 0.05)
    assert promote and numbers["low"] > 0 and numbers["bar"] == 0.0


def test_bad_gate_options_fail_loudly():
    from overnight.errors import ConfigError

    with pytest.raises(ConfigError, match="gate must be one of"):
        TrainConfig(gate="maybe")
    out = CliRunner().invoke(main, ["train", "--gate", "sometimes", "--dry-run"])
    assert out.exit_code != 0 and "sometimes" in out.output


# -- progress on the long steps ------------------------------------------------------------


def test_a_long_step_says_how_far_it_has_come_each_quarter_or_ten_seconds():
    now, lines = [0.0], []
    slow = Progress(lines.append, "gate: sampled", 100, "replies", clock=lambda: now[0])
    for _ in range(100):  # a reply a second: a line every 10 s, and at each quarter
        now[0] += 1.0
        slow.advance()
    slow.finish()
    assert lines[0] == "gate: sampled 10/100 replies, 1 replies/s, about 90 s left"
    assert "gate: sampled 25/100 replies, 1 replies/s, about 75 s left" in lines
    assert lines[-1] == "gate: sampled 100 replies in 100 s (1 replies/s)"
    assert len(lines) == 12, lines  # 10, 20, 25, 35, 45, 50, 60, 70, 75, 85, 95; the last
    lines.clear()
    quick = Progress(lines.append, "forgetting: scored", 8, "answers", clock=lambda: 5.0)
    quick.expect(4)  # found on the way, before any was done
    for _ in range(6):
        quick.advance(2)
    quick.finish()
    assert [line.split(",")[0] for line in lines] == [
        "forgetting: scored 4/12 answers",  # a quarter passed (3 of 12)
        "forgetting: scored 6/12 answers",
        "forgetting: scored 10/12 answers",
        "forgetting: scored 12 answers in 0 s (0 answers/s)",
    ]


def test_the_gates_sampling_and_scoring_say_their_progress(tiny_model_dir, lora_adapter):
    """run_gate on the tiny model with a scorer that needs no model: a line each quarter
    of the replies sampled (both adapters) and of the pairs scored, with the counts, and a
    last line each."""
    pytest.importorskip("peft")
    prompts = [GatePrompt(f"g{i}", [{"role": "user", "content": f"Question {i}?"}], [], 0.0,
                          1.0, 3) for i in range(20)]  # fmt: skip

    async def scorer(messages, tools, replies):
        return [float(len(r["content"])) for r in replies]

    lines: list[str] = []
    verdict = run_gate(TrainConfig(gate="not-worse"), str(tiny_model_dir), lora_adapter, None,
                       prompts, scorer, say=lines.append)  # fmt: skip
    assert verdict.prompts == 20, verdict.reason
    # 16 prompts generated at a time: 16, 20 (the candidate's), 36, 40 (the base model's).
    sampled = [line for line in lines if line.startswith("gate: sampled")]
    assert [line.split(",")[0] for line in sampled[:-1]] == [
        "gate: sampled 16/40 replies", "gate: sampled 20/40 replies", "gate: sampled 36/40 replies"
    ]  # fmt: skip
    assert all("s left" in line for line in sampled[:-1]), sampled
    assert sampled[-1].startswith("gate: sampled 40 replies in "), sampled
    scored = [line for line in lines if line.startswith("gate: scored")]
    assert [line.split(",")[0] for line in scored[:-1]] == [
        f"gate: scored {n}/20 pairs of replies" for n in (5, 10, 15)
    ]
    assert scored[-1].startswith("gate: scored 20 pairs of replies in "), scored
    assert lines == sampled + scored, "sampling first, then scoring, nothing else"


# -- a sabotaged night ------------------------------------------------------------------------

SABOTAGE = " the the the the the the"
HONEST = " 4 7 1 9 2 6"


def write_night(data_dir, tasks: int, held_out: int) -> None:
    """`tasks` groups of two one-turn rollouts whose posted rewards favour SABOTAGE, and
    `held_out` single calls on other prompts (no group: never trained on)."""
    writer = LogWriter(WriterConfig(data_dir, commit_interval=0.0))
    writer.start()
    now = time.time_ns() // 1000

    def turn(rollout: str, group: str, prompt: str, reply: str) -> None:
        request = {"model": "policy", "messages": [{"role": "user", "content": prompt}]}
        writer.append(
            "completions",
            completion_row(
                rollout, group, request={**request, "max_tokens": 8}, response=chat_response(reply)
            ),
        )
        writer.append("finishes", {"rollout_id": rollout, "schema_version": 1, "finished_at": now})

    for t in range(tasks):
        for i, (reply, reward) in enumerate([(SABOTAGE, 1.0), (HONEST, 0.0)]):
            turn(f"task{t}.{i}", f"task{t}", f"Task {t}: answer.", reply)
            writer.append(
                "rewards",
                {
                    "reward_id": f"task{t}.{i}",
                    "schema_version": 1,
                    "rollout_id": f"task{t}.{i}",
                    "reward": reward,
                    "source": "agent",
                    "created_at": now,
                },
            )
    for h in range(held_out):
        turn(f"single{h}", f"single{h}", f"Question {h}?", HONEST)
    writer.close()


# The gate's reward at three scales: [0, 1]; all below 0.05, where the old absolute
# margin (0.05) tolerated any loss; and [-10, 10]. The default margin refuses at each.
SCALES = [(1.0, 0.0), (0.04, 0.0), (20.0, -10.0)]


@pytest.mark.parametrize("scale, offset", SCALES)
async def test_a_sabotaged_night_is_refused_and_the_old_adapter_keeps_serving(
    make_proxy, tmp_path, tiny_model_dir, lora_adapter, scale, offset
):
    pytest.importorskip("peft")
    proxy = await make_proxy()
    url, data = str(proxy.make_url("")), tmp_path / "data"
    old = await (
        await proxy.post("/admin/adapters/promote", json={"path": str(lora_adapter)})
    ).json()
    write_night(data, tasks=8, held_out=12)
    # The gate's reward function: a reply that says "the" fails it.
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def no_the(rollout):\n"
        "    said = 'the' in rollout['messages'][-1]['content'].split()\n"
        f"    return {offset} + {scale} * (0.0 if said else 1.0)\n"
    )
    config = TrainConfig(
        base_model=str(tiny_model_dir),
        learning_rate=0.1,  # the sabotage: a step size that pushes hard on a bad signal
        epochs=6,
        lora_rank=4,
        groups_per_step=8,
        gate_prompts=12,
    )
    from overnight.trainer.train import train

    lines: list[str] = []
    result = await asyncio.to_thread(
        train, data, config, proxy_url=url, scorer=pair_scorer(f"{reward}:no_the", None),
        say=lines.append,
    )  # fmt: skip
    verdict = result.gate
    assert verdict is not None and not verdict.promote, lines
    assert verdict.prompts == 12 and verdict.high < 0, verdict.reason  # measurably worse
    assert verdict.examples and {"candidate", "served", "prompt"} <= set(verdict.examples[0])
    assert result.promoted_as is None and (result.adapter_path / "adapter_config.json").exists()
    served = await (await proxy.get("/admin/adapters")).json()
    assert served["current"]["name"] == old["promoted"], "the old adapter keeps serving"
    assert any(line.startswith("gate (not-worse): refused") for line in lines), lines
    (run,) = rows(data, "SELECT status, promoted_as, metrics FROM training_runs")
    assert run["status"] == "trained" and run["promoted_as"] is None
    listing = CliRunner().invoke(main, ["runs", "--data", str(data)])
    assert listing.exit_code == 0 and "refused" in listing.output, listing.output
    assert "candidate - served" in listing.output, listing.output
    page = await (await proxy.get("/ui/runs")).text()
    assert "refused" in page and "candidate - served" in page
    report = (data / "reports" / "training.html").read_text()
    assert "refused" in report and "candidate - served" in report


# -- the watch --------------------------------------------------------------------------------


async def live_traffic(proxy, tag: str, rewards: list[float]) -> None:
    """One rollout per reward, through the alias, the reward posted by the agent."""
    for i, reward in enumerate(rewards):
        rollout = f"{tag}.{i}"
        r = await proxy.post(
            "/v1/chat/completions",
            headers={"X-Rollout-Id": rollout},
            json={"model": "policy", "messages": [{"role": "user", "content": f"q{i}"}]},
        )
        assert r.status == 200
        await proxy.post(f"/v1/rollouts/{rollout}/reward", json={"reward": reward})


async def test_the_watch_rolls_back_an_adapter_that_does_worse_on_live_traffic(
    make_proxy, tmp_path, lora_adapter
):
    proxy = await make_proxy()
    url, data = str(proxy.make_url("")), tmp_path / "data"
    second = tmp_path / "second-adapter"
    shutil.copytree(lora_adapter, second)
    first = await (
        await proxy.post("/admin/adapters/promote", json={"path": str(lora_adapter)})
    ).json()
    await live_traffic(proxy, "day1", [0.7, 0.8, 0.9, 0.8] * 8)
    await proxy.post("/admin/adapters/promote", json={"path": str(second)})
    await live_traffic(proxy, "day2", [0.8, 0.9] * 4)
    await wait_for_rows(data, 40)
    config = TrainConfig(watch_min_rollouts=20)
    state = await (await proxy.get("/admin/adapters")).json()
    early = check(data, state, config)
    assert not early.worse and "too few rewarded rollouts" in early.reason
    await live_traffic(proxy, "day2b", [0.2, 0.4, 0.3, 0.5] * 6)
    await wait_for_rows(data, 64)
    lines: list[str] = []
    verdict = await asyncio.to_thread(watch, data, url, None, config, lines.append)
    assert verdict.worse and verdict.new == 32 and verdict.old == 32, verdict.reason
    assert verdict.high < 0 and verdict.diff_mean == pytest.approx(
        (8 * 0.85 + 24 * 0.35) / 32 - 0.8
    )
    assert lines[0].startswith(f"watch: rolled back {state['current']['name']}"), lines
    after = await (await proxy.get("/admin/adapters")).json()
    now = after["current"]
    assert now["path"] == first["current"]["path"], "the predecessor serves again"
    # Why, kept with the rollback in the shared state and shown on /ui's adapters page.
    (event,) = [e for e in after["events"] if e["action"] == "rollback"]
    assert event["adapter"] == state["current"]["name"] and event["serves"] == now["name"]
    assert event["reason"] == f"watch: {state['current']['name']} worse on live traffic: " + (
        verdict.reason
    )
    page = await (await proxy.get("/ui/adapters")).text()
    assert "worse on live traffic" in page and f"{verdict.new_mean:.3f} on 32 rollouts" in page
    # Run again, the predecessor now serves: it has no predecessor of its own to lose to.
    again = await asyncio.to_thread(
        CliRunner().invoke, main, ["watch", "--data", str(data), "--proxy", url]
    )
    assert again.exit_code == 0 and "keeps serving" in again.output, again.output


async def test_an_unchanged_adapter_passes_with_prompts_the_plan_gave_up(
    make_proxy, tmp_path, tiny_model_dir, lora_adapter
):
    """Too few prompts outside the plan: the plan gives up a quarter of its groups (left
    untrained); a candidate that barely moved writes the same replies and is promoted."""
    pytest.importorskip("peft")
    proxy = await make_proxy()
    url, data = str(proxy.make_url("")), tmp_path / "data"
    await proxy.post("/admin/adapters/promote", json={"path": str(lora_adapter)})
    write_night(data, tasks=8, held_out=6)
    reward = tmp_path / "reward.py"
    reward.write_text("def length(rollout):\n    return len(rollout['messages'][-1]['content'])\n")
    # Forgetting measured on an operator's set (the tiny model has none by default).
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(f'{{"prompt": "Tell me about {t}."}}\n' for t in ("cats", "tea")))
    config = TrainConfig(
        base_model=str(tiny_model_dir), learning_rate=1e-9, lora_rank=4, gate_prompts=8,
        reference=str(mine), forgetting_budget=0.0,
    )  # fmt: skip
    from overnight.trainer.train import train

    lines: list[str] = []
    result = await asyncio.to_thread(
        train, data, config, proxy_url=url, scorer=pair_scorer(f"{reward}:length", None),
        say=lines.append,
    )  # fmt: skip
    verdict = result.gate
    assert verdict is not None and verdict.promote and verdict.prompts == 8, lines
    # The served (random) adapter forgets; the candidate, barely trained from it, as much:
    # over a budget of 0, but no further from the base model than what it replaces.
    forgot = verdict.forgetting
    assert forgot["references"] == 2 and forgot["served_path"] == str(lora_adapter)
    assert forgot["served"] > 0 and forgot["candidate"] == pytest.approx(forgot["served"], abs=1e-3)
    assert "forgetting on 2 reference answers" in verdict.reason
    given = verdict.held_out_from_plan
    assert len(given) == 2 and set(given) < {f"task{t}" for t in range(8)}, verdict
    assert result.plan.groups == [f"task{t}" for t in range(8) if f"task{t}" not in given]
    served = await (await proxy.get("/admin/adapters")).json()
    assert served["current"]["name"] == result.promoted_as
    (run,) = rows(data, "SELECT groups, metrics FROM training_runs")
    assert not set(given) & set(run["groups"]), "the held-out groups stay untrained"
    gate = json.loads(run["metrics"])["gate"]
    assert gate["forgetting"] == forgot
    # What it compared, as the proxy names them: the chain the best so far is placed on
    # (storage/read/best_adapter.py). The served adapter was promoted by hand, so the
    # chain starts there.
    assert gate["served_adapter"] == str(lora_adapter) and gate["best"] is None
    assert gate["candidate_adapter"] == str(result.adapter_path.resolve())
    placed = levels(data, lambda metrics: metrics.get("policy") is None, str(tiny_model_dir))
    assert placed == {str(lora_adapter): 0.0, gate["candidate_adapter"]: verdict.diff_mean}
