"""RULER's prompt and the parsing of the judge's answer, as pure functions."""

from __future__ import annotations

import json

import pytest
from overnight.judge.ruler import DEFAULT_RUBRIC, BadAnswer, build_prompt, parse_scores
from overnight.judge.trajectories import Group, Trajectory, shorten, trajectory_from_turn

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
