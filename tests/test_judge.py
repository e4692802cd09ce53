"""`overnight judge` end to end: real litellm over HTTP to a scripted judge server."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.config import JudgeConfig
from overnight.judge.rewards import RewardFunction
from overnight.judge.run import run_judge
from overnight.storage import LogWriter, WriterConfig

from .helpers import chat_response, completion_row, rows
from .judge_server import SEEN, answer, context_overflow, create_judge_server, error, good

SYSTEM = {"role": "system", "content": "Answer with the capital."}


def write_groups(
    data_dir, groups: dict[str, list[str]], finished: bool = True, posted: dict | None = None
):
    """Groups of one-turn rollouts: {group: [each rollout's answer]}."""
    writer = LogWriter(WriterConfig(data_dir, commit_interval=0.0))
    writer.start()
    now = time.time_ns() // 1000
    for group_id, answers in groups.items():
        for i, text in enumerate(answers):
            rollout = f"{group_id}.r{i}"
            request = {
                "model": "policy",
                "messages": [SYSTEM, {"role": "user", "content": f"Capital of {group_id}?"}],
            }
            writer.append(
                "completions",
                completion_row(
                    rollout,
                    group_id,
                    record_id=f"{rollout}.rec",
                    request_id=f"{rollout}.req",
                    request=request,
                    response=chat_response(text),
                ),
            )
            if finished:
                writer.append(
                    "finishes", {"rollout_id": rollout, "schema_version": 1, "finished_at": now}
                )
            if posted and rollout in posted:
                writer.append(
                    "rewards",
                    {
                        "reward_id": f"{rollout}.w",
                        "schema_version": 1,
                        "rollout_id": rollout,
                        "reward": posted[rollout],
                        "source": "agent",
                        "created_at": now,
                    },
                )
    writer.close()


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setenv("OVERNIGHT_JUDGE_BACKOFF", "0.01")


@pytest.fixture
def judge(aiohttp_server):
    async def start(*script):
        return await aiohttp_server(create_judge_server(list(script)))

    return start


def config_for(server, **kw) -> JudgeConfig:
    return JudgeConfig(
        model="openai/judge-model",
        base_url=str(server.make_url("/v1")),
        api_key="sk-judge",
        max_retries=2,
        timeout=10,
        **kw,
    )


async def test_good_answers_become_judgments_and_rewards(judge, tmp_path):
    write_groups(tmp_path, {"france": ["Paris", "Lyon", "I don't know"]})
    server = await judge(good(lambda i: [1.0, 0.3, 0.0][i - 1]))
    summary = await run_judge(tmp_path, config_for(server), progress=False)
    assert (summary.judged, summary.failed) == (1, 0)
    assert (summary.calls.prompt_tokens, summary.calls.completion_tokens) == (100, 20)
    (j,) = rows(tmp_path, "SELECT * FROM judgments")
    assert j["error"] is None and j["judge_model"] == "openai/judge-model" and j["attempts"] == 1
    assert [(s["rollout_id"], s["score"], s["explanation"]) for s in j["scores"]] == [
        ("france.r0", 1.0, "reason 1"),
        ("france.r1", 0.3, "reason 2"),
        ("france.r2", 0.0, "reason 3"),
    ]
    rewards = rows(
        tmp_path, "SELECT rollout_id, reward, source, judgment_id FROM rewards ORDER BY rollout_id"
    )
    assert [(r["rollout_id"], r["reward"], r["source"]) for r in rewards] == [
        ("france.r0", 1.0, "ruler"),
        ("france.r1", 0.3, "ruler"),
        ("france.r2", 0.0, "ruler"),
    ]
    assert {r["judgment_id"] for r in rewards} == {j["judgment_id"]}
    # What was sent: the structured-output request, over HTTP, with the judge's own key.
    (sent,) = server.app[SEEN]
    assert sent["response_format"]["type"] == "json_schema"
    assert "Paris" in sent["messages"][1]["content"]


async def test_a_malformed_answer_is_corrected_then_used(judge, tmp_path):
    write_groups(tmp_path, {"peru": ["Lima", "Cusco"]})
    server = await judge(answer("the first one is better"), good())
    summary = await run_judge(tmp_path, config_for(server), progress=False)
    assert summary.judged == 1
    second = server.app[SEEN][1]["messages"]
    assert second[-2] == {"role": "assistant", "content": "the first one is better"}
    assert (
        "not valid JSON" in second[-1]["content"] and "trajectories 1, 2" in second[-1]["content"]
    )
    (j,) = rows(tmp_path, "SELECT attempts, error FROM judgments")
    assert j == {"attempts": 2, "error": None}


async def test_a_judge_that_keeps_miscounting_fails_its_group_not_the_batch(judge, tmp_path):
    write_groups(
        tmp_path, {"chile": ["Santiago", "Valparaiso"], "spain": ["Madrid", "Seville", "Bilbao"]}
    )
    # Two scores for everyone: right for chile (2 rollouts), wrong for spain (3).
    two = answer(
        json.dumps(
            {"scores": [{"trajectory_id": str(i), "explanation": "", "score": 0.5} for i in (1, 2)]}
        )
    )
    server = await judge(two)
    summary = await run_judge(tmp_path, config_for(server, max_fixes=1), progress=False)
    assert (summary.judged, summary.failed) == (1, 1)
    found = {j["group_id"]: j for j in rows(tmp_path, "SELECT * FROM judgments")}
    assert found["chile"]["error"] is None
    assert found["spain"]["error"] == "unusable answer: trajectories 3 have no score"
    assert found["spain"]["attempts"] == 2 and found["spain"]["scores"] == []
    assert {r["rollout_id"] for r in rows(tmp_path, "SELECT rollout_id FROM rewards")} == {
        "chile.r0",
        "chile.r1",
    }


async def test_rate_limits_are_honoured_and_retried(judge, tmp_path):
    write_groups(tmp_path, {"italy": ["Rome", "Milan"]})
    server = await judge(error(429, {"Retry-After": "0"}), error(429), good())
    summary = await run_judge(tmp_path, config_for(server), progress=False)
    assert summary.judged == 1
    assert rows(tmp_path, "SELECT attempts FROM judgments") == [{"attempts": 3}]


async def test_a_judge_that_keeps_failing_is_recorded(judge, tmp_path):
    write_groups(tmp_path, {"japan": ["Tokyo", "Kyoto"]})
    server = await judge(error(500))
    summary = await run_judge(tmp_path, config_for(server), progress=False)
    assert summary.failed == 1
    (j,) = rows(tmp_path, "SELECT error, attempts FROM judgments")
    assert j["attempts"] == 3 and "InternalServerError" in j["error"]
    assert rows(tmp_path, "SELECT * FROM rewards") == []


async def test_judged_groups_are_cached_and_rejudging_adds_rows(judge, tmp_path):
    write_groups(tmp_path, {"egypt": ["Cairo", "Giza"]})
    server = await judge(good())
    await run_judge(tmp_path, config_for(server), progress=False)
    again = await run_judge(tmp_path, config_for(server), progress=False)
    assert (
        again.judged == 0
        and again.skipped["already judged by this judge, rubric and settings"] == 1
    )
    assert len(server.app[SEEN]) == 1  # nothing sent the second time
    other_rubric = await run_judge(
        tmp_path, config_for(server, rubric="Shorter is better."), progress=False
    )
    assert other_rubric.judged == 1
    forced = await run_judge(tmp_path, config_for(server), rejudge=True, progress=False)
    assert forced.judged == 1
    assert len(rows(tmp_path, "SELECT * FROM judgments")) == 3  # added, never overwritten


async def test_what_is_not_judged_and_why(judge, tmp_path):
    write_groups(tmp_path, {"solo": ["Alone"]})
    write_groups(tmp_path, {"open": ["A", "B"]}, finished=False)  # just now, not finished
    write_groups(tmp_path, {"posted": ["A", "B"]}, posted={"posted.r0": 1.0, "posted.r1": 0.0})
    write_groups(tmp_path, {"twins": ["Same", "Same", "Same"]})
    server = await judge(good())
    summary = await run_judge(tmp_path, config_for(server), progress=False)
    assert summary.skipped == {
        "one rollout: no relative signal": 1,
        "every rollout has a reward the agent posted": 1,
        "fewer than two distinct trajectories: not sent": 1,  # twins
    }
    assert summary.judged == 0 and server.app[SEEN] == []
    idle = await run_judge(tmp_path, config_for(server), settle_seconds=0.0, progress=False)
    assert idle.judged == 1  # "open" counts as finished once idle for the settle time
    assert (
        idle.skipped["fewer than two distinct trajectories (found before): no relative signal"] == 1
    )


def capital_reward(rollout: dict) -> float:
    return 1.0 if rollout["messages"][-1]["content"] in {"Paris", "Lima"} else 0.0


async def test_reward_function_alone_and_combined(judge, tmp_path):
    write_groups(tmp_path, {"france": ["Paris", "Lyon"]})
    fn = RewardFunction(f"{__name__}:capital_reward")
    summary = await run_judge(tmp_path, None, fn, progress=False)
    assert summary.scored_by_function == 1
    server = await judge(good(lambda i: 0.5))
    await run_judge(tmp_path, config_for(server), fn, combine=True, progress=False)
    found = rows(
        tmp_path,
        "SELECT rollout_id, reward, source FROM rewards ORDER BY source, rollout_id, created_at",
    )
    assert [(r["source"], r["rollout_id"], r["reward"]) for r in found] == [
        ("combined", "france.r0", 0.75),
        ("combined", "france.r1", 0.25),
        ("function", "france.r0", 1.0),
        ("function", "france.r0", 1.0),
        ("function", "france.r1", 0.0),
        ("function", "france.r1", 0.0),
        ("ruler", "france.r0", 0.5),
        ("ruler", "france.r1", 0.5),
    ]


CALLED: list[str] = []


def counted_reward(rollout: dict) -> float:
    CALLED.append(rollout["rollout_id"])
    return capital_reward(rollout)


async def test_a_reward_function_is_not_asked_again_for_groups_it_scored(tmp_path):
    """Every finished group is a candidate each night, trained or not: the function's
    rewards already recorded for a group are not asked for again (a night's judge and
    reward calls grow with the day's groups, not with the history). A new function,
    --rejudge, or a rollout the group gained since are scored."""
    write_groups(tmp_path, {"france": ["Paris", "Lyon"], "peru": ["Lima", "Cusco"]})
    fn = RewardFunction(f"{__name__}:counted_reward")
    CALLED.clear()
    first = await run_judge(tmp_path, None, fn, progress=False)
    assert first.scored_by_function == 2 and len(CALLED) == 4
    write_groups(tmp_path, {"chile": ["Santiago", "Lima"]})  # the next day's group
    again = await run_judge(tmp_path, None, fn, progress=False)
    assert again.scored_by_function == 1 and len(CALLED) == 6, again.lines()
    assert again.skipped == {"already scored by this reward function": 2}
    write_groups(tmp_path, {"peru": ["Arequipa", "Lima", "Cusco"]})  # peru.r2 joined peru
    grown = await run_judge(tmp_path, None, fn, progress=False)
    assert grown.scored_by_function == 1 and CALLED[-3:] == ["peru.r0", "peru.r1", "peru.r2"]
    other = RewardFunction(f"{__name__}:capital_reward")  # another scorer: its own rewards
    assert (await run_judge(tmp_path, None, other, progress=False)).scored_by_function == 3
    forced = await run_judge(tmp_path, None, fn, rejudge=True, progress=False)
    assert forced.scored_by_function == 3
    rewards = rows(tmp_path, "SELECT rollout_id FROM rewards WHERE source = 'function'")
    assert len(rewards) == 4 + 2 + 3 + 7 + 7


async def test_a_reward_function_scores_a_group_of_one_named_for_it(judge, tmp_path):
    """A score from a function is absolute: a question asked once and named (`--group`: a
    held-out one, say) gets its reward; unnamed, a group of one is left alone (nothing to
    train); a judge ranks siblings, and one rollout has none, named or not."""
    write_groups(tmp_path, {"solo": ["Paris"]})
    server = await judge(good())
    ranked = await run_judge(tmp_path, config_for(server), groups=["solo"], progress=False)
    assert ranked.skipped == {"one rollout: no relative signal": 1} and server.app[SEEN] == []
    fn = RewardFunction(f"{__name__}:capital_reward")
    unnamed = await run_judge(tmp_path, None, fn, progress=False)
    assert unnamed.skipped == {"one rollout: no relative signal": 1}
    summary = await run_judge(tmp_path, None, fn, groups=["solo"], progress=False)
    assert summary.scored_by_function == 1 and not summary.skipped
    (found,) = rows(tmp_path, "SELECT rollout_id, reward, source FROM rewards")
    assert (found["rollout_id"], found["reward"], found["source"]) == ("solo.r0", 1.0, "function")


async def test_a_reward_function_that_breaks_fails_its_group(tmp_path):
    write_groups(tmp_path, {"france": ["Paris", "Lyon"]})
    summary = await run_judge(tmp_path, None, RewardFunction("json:dumps"), progress=False)
    assert summary.failed == 1 and "expected a finite number" in summary.failures[0][1]


def test_cli_judge_prints_a_summary(tmp_path):
    write_groups(tmp_path, {"france": ["Paris", "Lyon"]})
    reward_file = tmp_path / "my_rewards.py"
    reward_file.write_text(
        "def score(rollout):\n    return float(rollout['messages'][-1]['content'] == 'Paris')\n"
    )
    out = CliRunner().invoke(
        main, ["judge", "--data", str(tmp_path), "--reward", f"{reward_file}:score"]
    )
    assert out.exit_code == 0, out.output
    assert "judged 0 group(s), failed 0" in out.output and "with the reward function" in out.output
    bad = CliRunner().invoke(main, ["judge", "--data", str(tmp_path), "--reward", "nope"])
    assert bad.exit_code != 0 and "module:function" in bad.output
    assert (
        "give --judge-model, --reward"
        in CliRunner().invoke(main, ["judge", "--data", str(tmp_path)]).output
    )


async def test_ls_and_show_carry_the_judges_scores(judge, tmp_path):
    write_groups(tmp_path, {"france": ["Paris", "Lyon"]})
    server = await judge(good(lambda i: [0.9, 0.2][i - 1]))
    await run_judge(tmp_path, config_for(server), progress=False)
    listing = CliRunner().invoke(main, ["ls", "--data", str(tmp_path)]).output
    line = next(x for x in listing.splitlines() if x.strip().startswith("france.r0"))
    assert "0.900" in line and "ruler" in line
    shown = CliRunner().invoke(main, ["show", "france.r1", "--data", str(tmp_path)]).output
    assert "judge openai/judge-model: 0.200: reason 2" in shown


def test_the_example_reward_function():
    fn = RewardFunction(
        str(Path(__file__).resolve().parent.parent / "examples" / "rewards.py") + ":weather_reward"
    )
    user = {"role": "user", "content": "What is the temperature in Oslo right now?"}
    right = {"messages": [user, {"role": "assistant", "content": "ANSWER: -3"}]}
    wrong = {"messages": [user, {"role": "assistant", "content": "ANSWER: 19"}]}
    silent = {"messages": [user, {"role": "assistant", "content": "-3"}]}
    assert [fn.fn(r) for r in (right, wrong, silent)] == [1.0, 0.0, 0.0]


# -- the whole rollout, the budget, what is remembered, what is passed on ------------------


def write_rollouts(data_dir, group_id: str, rollouts: dict[str, list[tuple[dict, dict]]]):
    """One group of multi-turn rollouts: {rollout: [(request, response) of each turn]}."""
    writer = LogWriter(WriterConfig(data_dir, commit_interval=0.0))
    writer.start()
    now = time.time_ns() // 1000
    for rollout, turns in rollouts.items():
        for i, (request, response) in enumerate(turns):
            writer.append(
                "completions",
                completion_row(
                    rollout,
                    group_id,
                    record_id=f"{rollout}.{i}",
                    request_id=f"{rollout}.{i}",
                    turn_index=i,
                    started_at=now + i,
                    request=request,
                    response=response,
                ),
            )
        writer.append("finishes", {"rollout_id": rollout, "schema_version": 1, "finished_at": now})
    writer.close()


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def compacted_rollout(tag: str, answer: str) -> list[tuple[dict, dict]]:
    """Turn 1 works from the task; turn 2 starts again from a summary of turn 1 (the
    history compacted): it does not extend turn 1."""
    task = user("Find the capital of France.")
    first = {"messages": [SYSTEM, task]}
    second = {"messages": [SYSTEM, task, user(f"Summary so far: {tag} looked in the atlas.")]}
    return [(first, chat_response(f"{tag}: checking the atlas")), (second, chat_response(answer))]


async def test_a_rollout_whose_second_turn_does_not_extend_its_first_is_judged_whole(
    judge, tmp_path
):
    write_rollouts(
        tmp_path,
        "compact",
        {"compact.a": compacted_rollout("A", "Paris"), "compact.b": compacted_rollout("B", "Lyon")},
    )
    server = await judge(good())
    summary = await run_judge(tmp_path, config_for(server), progress=False)
    assert summary.judged == 1
    (sent,) = server.app[SEEN]
    text = sent["messages"][1]["content"]
    for seen in ("A: checking the atlas", "B: checking the atlas", "Paris", "Lyon"):
        assert seen in text  # the first turn of each rollout is there, and the last
    assert text.count("turn 2 does not continue the conversation above") == 2
    assert "[user] Summary so far: A looked in the atlas." in text
    assert text.count("[user] Find the capital of France.") == 1  # shared context, once


async def test_a_group_of_identical_rollouts_costs_no_call(judge, tmp_path):
    write_groups(tmp_path, {"twins": ["Same", "Same", "Same"]})
    server = await judge(good())
    summary = await run_judge(tmp_path, config_for(server), progress=False)
    assert server.app[SEEN] == [] and summary.judged == summary.failed == 0
    assert summary.skipped == {"fewer than two distinct trajectories: not sent": 1}
    (j,) = rows(tmp_path, "SELECT error, attempts, notes FROM judgments")
    assert j["error"].startswith("not sent: fewer than two distinct trajectories")
    assert j["attempts"] == 0 and json.loads(j["notes"])["error_class"] == "no_signal"
    again = await run_judge(tmp_path, config_for(server), progress=False)
    assert again.skipped == {
        "fewer than two distinct trajectories (found before): no relative signal": 1
    }
    assert len(rows(tmp_path, "SELECT * FROM judgments")) == 1 and server.app[SEEN] == []


def long_search_rollout(i: int) -> list[tuple[dict, dict]]:
    task = user("What does the report say about Lima?")
    search = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "read", "arguments": "{}"}}
        ],
    }
    report = {"role": "tool", "tool_call_id": f"c{i}", "content": f"report {i} " + "x" * 12_000}
    first = ({"messages": [SYSTEM, task]}, {"choices": [{"index": 0, "message": search}]})
    last = ({"messages": [SYSTEM, task, search, report]}, chat_response(f"Answer {i}: rainy."))
    return [first, last]


async def test_a_group_over_the_budget_is_shortened_to_fit_and_says_what_was_cut(judge, tmp_path):
    write_rollouts(tmp_path, "long", {f"long.r{i}": long_search_rollout(i) for i in range(3)})
    server = await judge(good())
    summary = await run_judge(
        tmp_path, config_for(server, max_prompt_tokens=2000, max_tool_chars=50_000), progress=False
    )
    assert summary.judged == 1 and summary.shortened == 1
    assert "shortened 1 group(s) to fit the judge's prompt budget" in summary.lines()
    (sent,) = server.app[SEEN]
    # litellm does not know this judge: its prompt is counted as characters / 4.
    assert sum(len(m["content"]) for m in sent["messages"]) / 4 <= 2000
    text = sent["messages"][1]["content"]
    assert all(f"Answer {i}: rainy." in text and f"report {i} xxx" in text for i in range(3))
    assert "To fit the judge's budget of 2000 tokens, the middles of 3 tool output(s)" in text
    (j,) = rows(tmp_path, "SELECT notes FROM judgments")
    cut = json.loads(j["notes"])["prompt_cut"]
    assert cut["budget"] == 2000 and cut["counter"] == "chars/4" and cut["tool_outputs"] == 3
    assert cut["tokens_before"] > 9000 >= 2000 >= cut["tokens_after"]
    assert cut["what"].startswith("To fit the judge's budget of 2000 tokens")


async def test_a_context_overflow_is_not_resent_until_rejudge(judge, tmp_path):
    write_groups(tmp_path, {"peru": ["Lima", "Cusco"]})
    server = await judge(context_overflow(), good())
    first = await run_judge(tmp_path, config_for(server), progress=False)
    assert first.failed == 1 and len(server.app[SEEN]) == 1  # a 400 is not retried
    assert first.failures[0][1].startswith("[permanent] ContextWindowExceededError")
    (j,) = rows(tmp_path, "SELECT notes FROM judgments")
    assert json.loads(j["notes"])["error_class"] == "permanent"
    second = await run_judge(tmp_path, config_for(server), progress=False)
    assert second.failed == 0 and len(server.app[SEEN]) == 1  # nothing sent
    assert second.skipped == {
        "failed before with a permanent error (too long or refused; --rejudge resends)": 1
    }
    forced = await run_judge(tmp_path, config_for(server), rejudge=True, progress=False)
    assert forced.judged == 1 and len(server.app[SEEN]) == 2


async def test_a_permanent_failure_is_resent_when_the_judge_settings_change(judge, tmp_path):
    write_groups(tmp_path, {"peru": ["Lima", "Cusco"]})
    server = await judge(context_overflow(), good())
    await run_judge(tmp_path, config_for(server), progress=False)
    other = await run_judge(tmp_path, config_for(server, max_prompt_tokens=1000), progress=False)
    assert other.judged == 1 and len(server.app[SEEN]) == 2


async def test_a_transient_503_is_retried_next_run(judge, tmp_path):
    write_groups(tmp_path, {"chile": ["Santiago", "Arica"]})
    server = await judge(error(503), error(503), error(503), good())
    first = await run_judge(tmp_path, config_for(server), progress=False)
    assert first.failed == 1 and len(server.app[SEEN]) == 3  # retried within the run
    assert first.failures[0][1].startswith("[transient] ServiceUnavailableError")
    (j,) = rows(tmp_path, "SELECT notes FROM judgments")
    assert json.loads(j["notes"])["error_class"] == "transient"
    second = await run_judge(tmp_path, config_for(server), progress=False)
    assert second.judged == 1 and len(server.app[SEEN]) == 4


async def test_judge_args_reach_the_request_and_change_the_cache_key(judge, tmp_path):
    write_groups(tmp_path, {"oman": ["Muscat", "Salalah"]})
    server = await judge(good())
    args = ("reasoning_effort=low", "seed=7", "num_ctx=32768", 'stop=["\\n\\n"]')
    await run_judge(tmp_path, config_for(server, args=args), progress=False)
    (sent,) = server.app[SEEN]
    assert (sent["reasoning_effort"], sent["seed"], sent["num_ctx"]) == ("low", 7, 32768)
    assert sent["stop"] == ["\n\n"] and sent["response_format"]["type"] == "json_schema"
    same = await run_judge(tmp_path, config_for(server, args=args), progress=False)
    assert same.judged == 0 and len(server.app[SEEN]) == 1  # cached
    reseeded = await run_judge(
        tmp_path, config_for(server, args=("reasoning_effort=low", "seed=8")), progress=False
    )
    assert reseeded.judged == 1 and server.app[SEEN][-1]["seed"] == 8
    hotter = await run_judge(
        tmp_path, config_for(server, args=args, temperature=0.7), progress=False
    )
    assert hotter.judged == 1 and len(server.app[SEEN]) == 3
    keys = rows(tmp_path, "SELECT prompt_hash, notes FROM judgments ORDER BY created_at")
    assert len({k["prompt_hash"] for k in keys}) == 3
    assert len({json.loads(k["notes"])["judge_key"] for k in keys}) == 3


def test_cli_takes_judge_args_and_a_budget(tmp_path):
    write_groups(tmp_path, {"france": ["Paris", "Lyon"]})
    shown = CliRunner().invoke(main, ["judge", "--help"]).output
    assert "--judge-arg" in shown and "--judge-max-prompt-tokens" in shown
    bad = CliRunner().invoke(
        main, ["judge", "--data", str(tmp_path), "--judge-model", "openai/j", "--judge-arg", "seed"]
    )
    assert bad.exit_code != 0 and "--judge-arg takes KEY=VALUE" in bad.output
