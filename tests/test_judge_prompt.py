"""RULER's prompt and the parsing of the judge's answer, as pure functions."""

from __future__ import annotations

import json

import pytest

from overnight.config import JudgeConfig
from overnight.errors import ConfigError
from overnight.judge.budget import Counter, estimate
from overnight.judge.cache import PERMANENT, TRANSIENT, error_class
from overnight.judge.ruler import DEFAULT_RUBRIC, BadAnswer, build_prompt, key_of, parse_scores
from overnight.judge.trajectories import (
    Group,
    Trajectory,
    rollout_from_turns,
    shorten,
    trajectory_from_turn,
)

SYSTEM = {"role": "system", "content": "You book flights."}
USER = {"role": "user", "content": "Book me Oslo to Lima."}
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def call(name: str, args: str, cid: str) -> dict:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
        ],
    }


def group_of(*endings: list[dict], tools=TOOLS) -> Group:
    return Group(
        "g", [Trajectory(f"r{i}", [SYSTEM, USER, *end], tools) for i, end in enumerate(endings)]
    )


def user_text(prompt) -> str:
    return prompt.messages[1]["content"]


def test_shared_messages_are_sent_once_as_context():
    group = group_of(
        [{"role": "assistant", "content": "Booked flight 12."}],
        [
            call("search", '{"from": "OSL"}', "c1"),
            {"role": "tool", "tool_call_id": "c1", "content": "3 flights"},
            {"role": "assistant", "content": "Booked the cheapest."},
        ],
        [{"role": "assistant", "content": "I cannot book flights."}],
    )
    prompt = build_prompt(group, DEFAULT_RUBRIC, 2000)
    text = user_text(prompt)
    assert (
        text.count("[system] You book flights.") == 1
        and text.count("[user] Book me Oslo to Lima.") == 1
    )
    context = text.split("</context>")[0]
    assert "[system]" in context and "Booked" not in context
    assert text.count("<trajectory id=") == 3 and prompt.ids == ["1", "2", "3"]
    assert '[assistant calls search] {"from": "OSL"} (id c1)' in text
    assert "[tool result c1] 3 flights" in text
    assert text.count('"name": "search"') == 1  # tools alike: shown once
    assert prompt.rollouts == {"1": "r0", "2": "r1", "3": "r2"}
    assert DEFAULT_RUBRIC in text and "Score all 3 trajectories, ids 1 to 3." in text


def test_identical_rollouts_are_judged_once_and_share_the_score():
    same = [{"role": "assistant", "content": "Booked flight 12."}]
    group = group_of(same, same, [{"role": "assistant", "content": "No."}], same)
    prompt = build_prompt(group, DEFAULT_RUBRIC, 2000)
    assert prompt.ids == ["1", "2"]
    assert prompt.representative == {"r0": "r0", "r1": "r0", "r2": "r2", "r3": "r0"}


def test_the_last_message_is_never_part_of_the_context():
    same = [{"role": "assistant", "content": "Booked."}]
    prompt = build_prompt(group_of(same, same), DEFAULT_RUBRIC, 2000)
    assert "[assistant] Booked." in user_text(prompt).split("</context>")[1]


def test_long_tool_outputs_are_cut_in_the_middle_but_never_the_last_turn():
    long = "A" * 3000 + "MIDDLE" + "Z" * 3000
    group = group_of(
        [
            call("search", "{}", "c1"),
            {"role": "tool", "tool_call_id": "c1", "content": long},
            {"role": "assistant", "content": "done"},
        ],
        [call("search", "{}", "c2"), {"role": "tool", "tool_call_id": "c2", "content": long}],
    )
    prompt = build_prompt(group, DEFAULT_RUBRIC, 1000)
    first, second = user_text(prompt).split('<trajectory id="2">')
    assert "characters omitted" in first and "MIDDLE" not in first
    assert first.count("A") < 1000 and "ZZZ" in first  # head and tail kept
    assert "MIDDLE" in second  # the second ends on the tool output: kept whole
    assert prompt.shortened == 1 and "1 long tool output(s) were shortened" in user_text(prompt)
    text, cut = shorten("x" * 100, 200)
    assert (text, cut) == ("x" * 100, False)


def test_trajectories_from_logged_turns():
    request = {"messages": [SYSTEM, USER], "tools": TOOLS}
    response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]}
    t = trajectory_from_turn("r", request, response)
    assert t.messages == [SYSTEM, USER, {"role": "assistant", "content": "ok"}] and t.tools == TOOLS
    t = trajectory_from_turn("r", {"prompt": "Once"}, {"choices": [{"text": " upon"}]})
    assert t.messages == [
        {"role": "user", "content": "Once"},
        {"role": "assistant", "content": " upon"},
    ]


def scores(*entries) -> str:
    return json.dumps(
        {"scores": [{"trajectory_id": i, "explanation": "e", "score": s} for i, s in entries]}
    )


def test_parse_good_answers():
    assert parse_scores(scores(("1", 0.2), ("2", 1)), ["1", "2"]) == {
        "1": (0.2, "e"),
        "2": (1.0, "e"),
    }
    fenced = "```json\n" + scores(("1", 0), ("2", 0.5)) + "\n```"
    assert parse_scores(fenced, ["1", "2"])["2"] == (0.5, "e")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("not json", "not valid JSON"),
        ('{"score": 1}', '"scores" list'),
        (scores(("1", 0.5)), "trajectories 2 have no score"),
        (scores(("1", 0.5), ("2", 0.5), ("3", 0.1)), "unknown trajectory_id '3'"),
        (scores(("1", 0.5), ("1", 0.4)), "scored twice"),
        (scores(("1", 1.5), ("2", 0)), "outside [0, 1]"),
        (scores(("1", "high"), ("2", 0)), "not a number"),
        (json.dumps({"scores": [1, 2]}), "must be an object"),
    ],
)
def test_bad_answers_say_what_is_wrong(text, why):
    with pytest.raises(BadAnswer, match=None) as e:
        parse_scores(text, ["1", "2"])
    assert why in str(e.value)


def test_judging_never_reaches_the_internet_by_accident():
    import subprocess
    import sys

    code = (
        "import os, overnight.judge.ruler as r; r.import_litellm(); "
        "assert os.environ['LITELLM_LOCAL_MODEL_COST_MAP'] == 'True'"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "LITELLM_LOCAL_MODEL_COST_MAP"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_a_group_of_one_still_builds_a_prompt():
    # The batch skips such groups (no relative signal); the prompt itself stays sound.
    prompt = build_prompt(
        group_of([{"role": "assistant", "content": "Booked."}]), DEFAULT_RUBRIC, 2000
    )
    assert prompt.ids == ["1"] and "[assistant] Booked." in user_text(prompt).split("</context>")[1]


# -- a rollout from all of its turns ----------------------------------------------------


def turn(messages: list[dict], reply: dict, tools=None) -> tuple[dict, dict]:
    request = {"messages": messages, **({"tools": tools} if tools else {})}
    return request, {"choices": [{"index": 0, "message": reply, "finish_reason": "stop"}]}


def said(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_a_rollout_that_resends_its_history_is_its_last_turn():
    first = call("search", '{"from": "OSL"}', "c1")
    result = {"role": "tool", "tool_call_id": "c1", "content": "3 flights"}
    # Logged replies carry fields the agent drops when it sends them back.
    logged = {**first, "refusal": None, "reasoning": "think", "annotations": []}
    t = rollout_from_turns(
        "r",
        [
            turn([SYSTEM, USER], logged, TOOLS),
            turn([SYSTEM, USER, first, result], said("Booked."), TOOLS),
        ],
    )
    assert t.messages == [SYSTEM, USER, logged, result, said("Booked.")]
    assert t.conversation is None and t.last_conversation == t.messages and t.tools == TOOLS


def test_turns_that_do_not_extend_each_other_are_all_rendered():
    # Turn 1 searches; turn 2 asks for a summary (a new context); turn 3 continues from
    # the compacted history (system, task, summary); turn 4 finishes it.
    transcript = {"role": "user", "content": "Transcript: search found 3."}
    summary_request = [{"role": "system", "content": "Summarise."}, transcript]
    compacted = [SYSTEM, USER, {"role": "user", "content": "Notes: 3 flights found."}]
    turns = [
        turn([SYSTEM, USER], call("search", "{}", "c1")),
        turn(summary_request, said("3 flights found.")),
        turn(compacted, call("book", '{"n": 1}', "c2")),
        turn(
            [
                *compacted,
                call("book", '{"n": 1}', "c2"),
                {"role": "tool", "tool_call_id": "c2", "content": "ok"},
            ],
            said("Booked flight 1."),
        ),
    ]
    t = rollout_from_turns("r", turns)
    roles = [m["role"] for m in t.messages]
    assert roles == [
        "system", "user", "assistant",  # turn 1
        "overnight", "system", "user", "assistant",  # turn 2: a new context, nothing shared
        "overnight", "user", "assistant",  # turn 3: shares system and task with turn 1
        "tool", "assistant",  # turn 4 extends turn 3
    ]  # fmt: skip
    assert "turn 2 does not continue the conversation above" in t.messages[3]["content"]
    assert "same 2 message(s) as turn 1" in t.messages[7]["content"]
    assert t.last_conversation[-1] == said("Booked flight 1.")
    assert t.last_conversation[:3] == compacted  # what a reward function reads
    text = user_text(build_prompt(Group("g", [t, trajectory_from_turn("s", *turns[0])]), "R", 2000))
    assert "--- turn 2 does not continue" in text and "Notes: 3 flights found." in text
    assert "[system] Summarise." in text and "Booked flight 1." in text


def test_a_sub_agent_between_two_turns_is_shown_where_it_ran():
    sub = [
        {"role": "system", "content": "You are a fare checker."},
        {"role": "user", "content": "OSL-LIM?"},
    ]
    first = call("check_fare", "{}", "c1")
    turns = [
        turn([SYSTEM, USER], first),
        turn(sub, said("900 EUR")),
        turn(
            [SYSTEM, USER, first, {"role": "tool", "tool_call_id": "c1", "content": "900 EUR"}],
            said("Costs 900."),
        ),
    ]
    t = rollout_from_turns("r", turns)
    markers = [m["content"] for m in t.messages if m["role"] == "overnight"]
    assert markers == [
        "turn 2 does not continue the conversation above: a new context",
        "turn 3 continues the context of turn 1",
    ]
    assert t.messages[-1] == said("Costs 900.")


# -- the budget ---------------------------------------------------------------------------


def test_a_prompt_over_its_budget_is_cut_where_it_costs_least():
    long_tool = "T" * 20_000
    long_note = "N" * 8_000
    group = group_of(
        [
            call("search", "{}", "c1"),
            {"role": "tool", "tool_call_id": "c1", "content": long_tool},
            {"role": "user", "content": long_note},
            said("F" * 3000),  # the last turn: never cut
        ],
        [said("I cannot book flights.")],
    )
    counter = Counter("chars/4", estimate)
    whole = build_prompt(group, DEFAULT_RUBRIC, 50_000)
    assert whole.cut is None and estimate(whole.messages) > 7000
    # A budget only tool outputs need to give up: messages stay whole.
    mild = build_prompt(group, DEFAULT_RUBRIC, 50_000, budget=4500, counter=counter)
    assert estimate(mild.messages) <= 4500
    assert mild.cut.tool_outputs == 1 and mild.cut.messages == 0 and mild.cut.fits
    assert long_note in user_text(mild)
    # A tighter one: long messages too, the last turn still whole.
    tight = build_prompt(group, DEFAULT_RUBRIC, 50_000, budget=1500, counter=counter)
    assert estimate(tight.messages) <= 1500 and tight.cut.messages == 1
    assert "F" * 3000 in user_text(tight) and long_note not in user_text(tight)
    assert tight.cut.tokens_before > 7000 and tight.cut.tool_chars > 19_000
    assert "To fit the judge's budget of 1500 tokens, the middles of 1 tool output(s)" in user_text(
        tight
    )
    # Below what the last turns need: it cannot fit, and says so.
    assert not build_prompt(group, DEFAULT_RUBRIC, 50_000, budget=400, counter=counter).cut.fits


# -- what the cache key covers ------------------------------------------------------------


def test_the_judge_key_covers_every_setting_that_changes_the_answer():
    base = JudgeConfig(model="openai/j", base_url="http://a/v1")
    key = key_of(base)
    changed = [
        JudgeConfig(model="openai/k", base_url="http://a/v1"),
        JudgeConfig(model="openai/j", base_url="http://b/v1"),
        JudgeConfig(model="openai/j", base_url="http://a/v1", temperature=0.5),
        JudgeConfig(model="openai/j", base_url="http://a/v1", max_tokens=100),
        JudgeConfig(model="openai/j", base_url="http://a/v1", args=("seed=7",)),
        JudgeConfig(model="openai/j", base_url="http://a/v1", rubric="Shorter wins."),
        JudgeConfig(model="openai/j", base_url="http://a/v1", max_prompt_tokens=4000),
    ]
    assert len({key, *map(key_of, changed)}) == 1 + len(changed)
    same = JudgeConfig(model="openai/j", base_url="http://a/v1", api_key="k", concurrency=2)
    assert key_of(same) == key  # how it is reached does not change the answer


def test_judge_args_parse_as_json_when_they_can():
    config = JudgeConfig(model="m", args=("reasoning_effort=low", "seed=7", 'stop=["x"]', "t=1e"))
    assert config.extra_args == {"reasoning_effort": "low", "seed": 7, "stop": ["x"], "t": "1e"}
    for bad in ("seed", "=7", "temperature=0", "model=x"):
        with pytest.raises(ConfigError):
            JudgeConfig(model="m", args=(bad,))


def test_permanent_and_transient_errors():
    import litellm

    overflow = litellm.ContextWindowExceededError("too long", "m", "openai")
    refused = litellm.BadRequestError("bad", "m", "openai")
    limited = litellm.RateLimitError("slow down", "openai", "m")
    down = litellm.ServiceUnavailableError("down", "openai", "m")
    assert [error_class(e) for e in (overflow, refused, limited, down, TimeoutError())] == [
        PERMANENT, PERMANENT, TRANSIENT, TRANSIENT, TRANSIENT,
    ]  # fmt: skip
