"""Overnight's own traffic apart from the agents' (issue 42): what the product sends
through its own proxy (the demo's held-out measurement, a judge served by the same
vLLM) is recorded as its own when the operator sent it, and only then; listings, /ui and
the counters show the agents' by default, the product's one filter away; nights never
train, judge or resample it unless a step names it.

A day here is the demo's in small: the agent's groups first, then more held-out groups
of one than a page of the listing holds (newer, so they would fill it), as the demo asks
them, and a client that sends the same mark without the operator's token.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.config import TrainConfig
from overnight.examples.sum_agent import HELD_OUT as SUM_HELD_OUT
from overnight.judge.rewards import RewardFunction
from overnight.judge.run import run_judge
from overnight.proxy.address import write_address
from overnight.proxy.alias.promotions import Route
from overnight.proxy.capture.attribution import Attribution
from overnight.proxy.capture.captures import Capture
from overnight.proxy.capture.recorder_main import frame_of, replayed
from overnight.proxy.capture.records import RecordFacts, record_rows
from overnight.proxy.observe.tracing import start_attributes
from overnight.storage import LogWriter, WriterConfig, now_us
from overnight.trainer.choose.inputs import Selection
from overnight.trainer.train import RunResult, plan_run, record_run

from .helpers import completion_row, rows, wait_for_rows
from .test_metrics import scrape, value

SUM_AGENT = Path(__file__).resolve().parent.parent / "examples" / "sum_agent.py"
ADMIN = "s3cret"
EVAL = {"X-Rollout-Origin": "eval", "X-Rollout-Origin-Token": ADMIN}
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "2+3?"}], "max_tokens": 2}
AGENT_GROUPS = ["sums-0", "sums-1", "sums-2"]
HELD_OUT = [f"heldout-{i}" for i in range(8)]
FORGED = ["forged-no-token", "forged-wrong-token"]
PAGE = 5  # fewer than the held-out groups: they alone would fill the first page


async def ask(proxy, group: str, headers: dict | None = None, status: int = 200) -> None:
    ids = {"X-Rollout-Group": group, "X-Rollout-Id": f"{group}.0"}
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={**ids, **(headers or {})})
    assert r.status == status, await r.text()


@pytest.fixture
async def day(make_proxy, tmp_path):
    proxy = await make_proxy(admin_token=ADMIN)
    for group in AGENT_GROUPS:
        await ask(proxy, group)
    for group in HELD_OUT:  # as the demo asks them: the operator's token with the mark
        await ask(proxy, group, EVAL)
    await ask(proxy, FORGED[0], {"X-Rollout-Origin": "eval"})
    await ask(proxy, FORGED[1], {"X-Rollout-Origin": "eval", "X-Rollout-Origin-Token": "guess"})
    data = tmp_path / "data"
    await wait_for_rows(data, len(AGENT_GROUPS) + len(HELD_OUT) + len(FORGED))
    return proxy, data


def sent_by_group(data) -> dict[str, str]:
    found = rows(data, "SELECT group_id, sent_by FROM completions")
    return {r["group_id"]: r["sent_by"] for r in found}


def run(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def listed(out: str) -> list[str]:
    """The group ids `overnight ls` printed, in its order."""
    return [line.split()[1].rstrip(":") for line in out.splitlines() if line.startswith("group ")]


async def test_the_operators_mark_is_recorded_and_a_clients_is_not(day, received):
    _, data = day
    senders = sent_by_group(data)
    assert {senders[g] for g in HELD_OUT} == {"eval"}
    # A client that sends the mark, without the admin token or with a wrong one, is a client.
    assert {senders[g] for g in AGENT_GROUPS + FORGED} == {"client"}
    # Neither the mark nor the token reaches the upstream (a hosted API would get the token).
    sent_upstream = {name.lower() for r in received for name in r["headers"]}
    assert not {"x-rollout-origin", "x-rollout-origin-token"} & sent_upstream
    assert len(received) == len(senders)


async def test_ls_lists_the_agents_groups_and_overnights_own_one_filter_away(day):
    _, data = day
    out = run("ls", "--data", str(data), "--limit", str(PAGE))
    assert sorted(listed(out)) == sorted(AGENT_GROUPS + FORGED)
    assert out.startswith("5 group(s), 5 rollout(s); newest 5 shown")
    assert "overnight's own: 8 eval; `--sent-by own` lists them" in out.splitlines()[0]
    own = run("ls", "--data", str(data), "--limit", "20", "--sent-by", "own")
    assert sorted(listed(own)) == sorted(HELD_OUT)
    assert "sent by overnight (eval)" in own
    assert sorted(listed(run("ls", "--data", str(data), "--limit", "20", "--sent-by", "all"))) == (
        sorted(AGENT_GROUPS + FORGED + HELD_OUT)
    )
    # A group named is shown whoever sent it; `show` says who did.
    assert listed(run("ls", "--data", str(data), "--group", HELD_OUT[0])) == [HELD_OUT[0]]
    assert "sent by overnight (eval)" in run("show", f"{HELD_OUT[0]}.0", "--data", str(data))
    bad = CliRunner().invoke(main, ["ls", "--data", str(data), "--sent-by", "gatee"])
    assert bad.exit_code != 0 and "--sent-by" in bad.output


async def test_ui_first_page_shows_the_agents_groups_and_a_control_for_overnights_own(day):
    proxy, _ = day
    auth = {"Authorization": f"Bearer {ADMIN}"}
    first = await (await proxy.get(f"/ui?limit={PAGE}", headers=auth)).text()
    assert all(f">{g}</a>" in first for g in AGENT_GROUPS + FORGED)
    assert not any(f">{g}</a>" in first for g in HELD_OUT)
    assert f"{PAGE} of 5 group(s) shown" in first
    # The switcher: the agents' shown, overnight's own one link away, with their counts.
    assert "<strong>agents (5)</strong>" in first
    assert 'href="/ui?sent_by=own">overnight&#x27;s own (8)</a>' in first
    own = await (await proxy.get("/ui?sent_by=own", headers=auth)).text()
    assert all(f">{g}</a>" in own for g in HELD_OUT)
    assert not any(f">{g}</a>" in own for g in AGENT_GROUPS + FORGED)
    assert 'name="sent_by" value="own"' in own  # the filters keep the choice
    one_kind = await (await proxy.get("/ui?sent_by=eval", headers=auth)).text()
    assert "8 of 8 group(s) shown" in one_kind
    refused = await proxy.get("/ui?sent_by=gatee", headers=auth)
    assert refused.status == 400


async def test_the_request_counters_say_who_sent_each_request(day):
    proxy, _ = day
    scraped = await scrape(proxy)
    requests = "overnight_requests_total"
    assert value(scraped, requests, sent_by="client") == len(AGENT_GROUPS) + len(FORGED)
    assert value(scraped, requests, sent_by="eval") == len(HELD_OUT)


def test_the_recorder_process_builds_the_rows_with_who_sent_the_request():
    """--recorder process: the frame the child gets carries the mark to the rows it builds."""
    capture = Capture("chat.completions", False, dict(CHAT), Route("fake-base", None, "policy"))
    capture.status = 200
    who = Attribution("heldout-0", "heldout-0.0", "header")
    facts = RecordFacts(now_us(), now_us(), True, sent_by="eval")
    again, who_again, facts_again, turns = replayed(frame_of(capture, who, facts, [0]))
    built = record_rows(again, who_again, turns, "recorder", facts_again)
    assert [row["sent_by"] for row in built] == ["eval"]


def test_a_span_says_who_sent_its_request():
    """Traces: the agents' spans are `overnight.sent_by = client` (Langfuse: its metadata)."""
    capture = Capture("chat.completions", False, dict(CHAT), Route("fake-base", None, "policy"))
    capture.sent_by = "eval"
    attributes = start_attributes("chat", capture, Attribution(None, None, "none"), CHAT)
    assert (
        attributes["overnight.sent_by"] == attributes["langfuse.trace.metadata.sent_by"] == "eval"
    )


async def test_without_an_admin_token_loopback_is_the_operator_and_a_kind_must_be_known(
    make_proxy, tmp_path
):
    # As the admin API: a loopback client may already promote and roll back adapters.
    proxy = await make_proxy()
    await ask(proxy, "judged", {"X-Rollout-Origin": "Judge "})
    await ask(proxy, "typo", {"X-Rollout-Origin": "gatee"}, status=400)
    await ask(proxy, "plain", {"X-Rollout-Origin": "client"})
    await wait_for_rows(tmp_path / "data", 2)
    assert sent_by_group(tmp_path / "data") == {"judged": "judge", "plain": "client"}


async def test_the_demos_held_out_measurement_is_sent_as_overnights_own(make_proxy, tmp_path):
    """The demo's agent, as the demo runs it on loopback without an admin token: its day's
    groups are the agent's, its held-out questions (`--held-out`) overnight's own."""
    proxy = await make_proxy()
    env = dict(os.environ, OPENAI_BASE_URL=str(proxy.make_url("/v1")), OPENAI_API_KEY="unused")
    env.pop("OVERNIGHT_ADMIN_TOKEN", None)
    for extra in (["--tasks", "2", "--group-size", "2"], ["--held-out", "--group-size", "1"]):
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(SUM_AGENT), "--run", "t", *extra, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(process.communicate(), timeout=120)
        assert process.returncode == 0, output.decode()
    await wait_for_rows(tmp_path / "data", 4 + len(SUM_HELD_OUT))
    found = rows(
        tmp_path / "data",
        "SELECT split_part(group_id, '-', 1) AS kind, sent_by, count(*) AS n "
        "FROM completions GROUP BY ALL ORDER BY kind",
    )
    assert [(r["kind"], r["sent_by"], r["n"]) for r in found] == [
        ("heldout", "eval", len(SUM_HELD_OUT)),
        ("sums", "client", 4),
    ]


async def test_a_judge_served_through_the_proxy_is_recorded_as_overnights_own(make_proxy, tmp_path):
    """`overnight judge` with its --judge-base-url at the proxy serving the data directory
    (a local judge on the same vLLM) marks its calls: every call it made is recorded as
    the judge's, none as a client's, and `overnight ls` lists the agent's group alone."""
    proxy = await make_proxy(admin_token=ADMIN)
    for rollout in ("0", "1"):  # two questions: trajectories the judge can tell apart
        ids = {"X-Rollout-Group": "agent", "X-Rollout-Id": f"agent.{rollout}"}
        body = {**CHAT, "messages": [{"role": "user", "content": f"2+{rollout}?"}]}
        assert (await proxy.post("/v1/chat/completions", json=body, headers=ids)).status == 200
        await proxy.post(f"/v1/rollouts/agent.{rollout}/finish")
    data = tmp_path / "data"
    await wait_for_rows(data, 2)
    write_address(data, str(proxy.make_url("")).rstrip("/"), admin_token_required=True)
    args = ["judge", "--data", str(data), "--settle", "0", "--judge-model", "openai/fake",
            "--judge-base-url", str(proxy.make_url("/v1")), "--max-retries", "0"]  # fmt: skip
    env = {"OVERNIGHT_ADMIN_TOKEN": ADMIN, "OVERNIGHT_JUDGE_API_KEY": "unused"}
    result = await asyncio.to_thread(CliRunner().invoke, main, args, env=env)
    assert result.exit_code == 0, result.output
    assert "judge tokens: 0 prompt" not in result.output  # it asked, through the proxy
    await wait_for_rows(data, 3)
    judged = rows(data, "SELECT sent_by, count(*) AS n FROM completions GROUP BY ALL ORDER BY 1")
    assert [r["sent_by"] for r in judged] == ["client", "judge"] and judged[0]["n"] == 2
    assert listed(run("ls", "--data", str(data))) == ["agent"]


# -- what a night does with it -------------------------------------------------------------


def write_day(data_dir, groups: dict[str, list[float]], sent_by: str | None = None) -> None:
    """One-turn rollouts with token ids, finished, rewards as given; `sent_by` None as
    rows written before the column (read as the client's)."""
    writer = LogWriter(WriterConfig(data_dir, commit_interval=0.0))
    writer.start()
    now = time.time_ns() // 1000
    for group, rewards in groups.items():
        for i, reward in enumerate(rewards):
            rollout = f"{group}.{i}"
            row = completion_row(
                rollout,
                group,
                prompt_token_ids=[1, 2, 3],
                completion_token_ids=[10 + i, 11],
                completion_logprobs=[-0.5, -0.25],
                request={"messages": [{"role": "user", "content": group}]},
                response={"choices": [{"message": {"role": "assistant", "content": "4"}}]},
            )
            writer.append("completions", {**row, "sent_by": sent_by} if sent_by else row)
            writer.append("finishes", {"rollout_id": rollout, "schema_version": 2, "finished_at": now})  # fmt: skip
            if reward is not None:
                writer.append(
                    "rewards",
                    {"reward_id": f"{rollout}.r", "schema_version": 2, "rollout_id": rollout,
                     "reward": reward, "source": "agent", "created_at": now},
                )  # fmt: skip
    writer.close()


AGENTS = {"agent-a": [1.0, 0.0], "agent-b": [0.2, 0.9, 0.5], "agent-flat": [1.0, 1.0]}
# Varied rewards: a client's groups like these would train.
OWN = {"heldout-x": [1.0, 0.0], "gate-y": [0.0, 1.0]}


def night(data_dir):
    plan = plan_run(Selection(data_dir, settle_seconds=600), TrainConfig())
    if plan.groups:
        record_run(data_dir, RunResult(f"run-{now_us()}", plan), TrainConfig(), "base", None,
                   now_us(), None)  # fmt: skip
    return plan


def test_a_day_with_overnights_own_traffic_trains_exactly_what_it_trained_before(tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    write_day(before, AGENTS)
    write_day(after, AGENTS)
    write_day(after, OWN, sent_by="eval")
    planned, with_own = night(before), night(after)
    assert with_own.groups == planned.groups == ["agent-a", "agent-b"]
    assert [s.tokens for s in with_own.samples] == [s.tokens for s in planned.samples]
    assert with_own.considered == planned.considered  # not even looked at
    # The next night looks at what changed since: own groups new since then stay out too.
    write_day(after, {"heldout-z": [0.0, 1.0]}, sent_by="gate")
    write_day(after, {"agent-c": [0.0, 1.0]})
    assert night(after).groups == ["agent-c"]


async def test_the_judge_scores_overnights_own_groups_only_when_named(tmp_path):
    write_day(tmp_path, {"agent-a": [None, None]})
    write_day(tmp_path, {"heldout-x": [None, None]}, sent_by="eval")
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def score(rollout):\n    return 1.0\n")
    function = RewardFunction(f"{rewards}:score")
    await run_judge(tmp_path, None, function, progress=False, settle_seconds=0)
    scored = {r["rollout_id"] for r in rows(tmp_path, "SELECT rollout_id FROM rewards")}
    assert scored == {"agent-a.0", "agent-a.1"}
    # As the demo scores its held-out measurement: the group named.
    await run_judge(tmp_path, None, function, progress=False, settle_seconds=0,
                    groups=["heldout-x"])  # fmt: skip
    scored = {r["rollout_id"] for r in rows(tmp_path, "SELECT rollout_id FROM rewards")}
    assert scored == {"agent-a.0", "agent-a.1", "heldout-x.0", "heldout-x.1"}
