"""What happens next, read from the traffic alone (judge/signals.py, judge/implicit.py).

The rules on conversations written out here (pure, no server); then the whole way
through a proxy in front of the fake vLLM: logged, read by `overnight signals`, written
once, shown by `overnight show` and SQL.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from urllib.parse import quote

import pytest
from click.testing import CliRunner

from overnight.judge.signals import (
    ACCEPTED,
    CORRECTED,
    EDITED,
    ENDED,
    MALFORMED,
    MOVED_ON,
    RE_ASKED,
    REGENERATED,
    TOOL_ERROR,
    TOOL_RETRY,
    TRUNCATED,
    Turn,
    read_signals,
    similarity,
)

from .helpers import rows, wait_for_rows

MINUTE = 60_000_000
QUESTION = {"role": "user", "content": "What is the capital of Australia?"}
ANSWER = {"role": "assistant", "content": "Sydney."}


def turn(record: str, messages: list[dict], reply: dict, at: int, **kw) -> Turn:
    fields = {"request_id": f"req-{record}", "rollout_id": f"r-{record}", "attributed": False}
    return Turn(record, started_at=at, messages=messages, reply=reply, **{**fields, **kw})


def kinds(signals, record: str = "t1") -> dict[str, float]:
    return {s.kind: s.value for s in signals if s.record_id == record}


def after(reaction: str) -> list:
    """The signals of a first answer followed by the user's `reaction`."""
    first = turn("t1", [QUESTION], ANSWER, 0)
    second = turn("t2", [QUESTION, ANSWER, {"role": "user", "content": reaction}],
                  {"role": "assistant", "content": "..."}, MINUTE)  # fmt: skip
    return read_signals([second, first], now_us=2 * MINUTE, quiet_us=60 * MINUTE)


@pytest.mark.parametrize(
    ("reaction", "kind"),
    [
        ("No, that's wrong. I asked for the capital, it is Canberra.", CORRECTED),
        ("that's not right", CORRECTED),
        ("It didn't work", CORRECTED),
        ("I said the CAPITAL", CORRECTED),
        ("Thanks, that works!", ACCEPTED),
        ("perfect", ACCEPTED),
        ("Great. Now, what is the capital of Canada?", ACCEPTED),
        ("What's the capital of Australia?", RE_ASKED),
        ("capital of Australia", RE_ASKED),
        ("And the largest city in New Zealand?", MOVED_ON),
        # "no" inside the message says nothing of the answer before it
        ("Give me a list with no more than three rivers", MOVED_ON),
        # What the rules missed or misread (reading.py): politeness, sarcasm, doubt, a
        # correction carrying the answer, an acknowledgement they did not know.
        ("Thanks, but that's not it.", CORRECTED),
        ("Great, wrong again", CORRECTED),
        ("Are you sure?", CORRECTED),
        ("Please read my question again.", CORRECTED),
        ("hmm, Canberra is the capital", CORRECTED),
        ("Lovely, cheers.", ACCEPTED),
        ("ok. And the largest city in New Zealand?", ACCEPTED),
        ("no worries, that's perfect", ACCEPTED),
    ],
)
def test_the_next_user_message_says_how_the_answer_went(reaction, kind):
    found = after(reaction)
    assert list(kinds(found)) == [kind], found
    (signal,) = [s for s in found if s.record_id == "t1"]
    assert signal.evidence_record == "t2" and signal.evidence  # which message said it
    assert -1 <= signal.value <= 1 and 0 < signal.confidence <= 1
    if kind == RE_ASKED:
        assert signal.extra["similarity"] >= 0.6


def test_a_re_ask_is_measured_by_the_content_words():
    assert similarity("What is the capital of Australia?", "capital of Australia") == 1.0
    assert similarity("What is the capital of Australia?", "the capital of Canada?") == 1 / 3
    assert similarity("", "anything") == 0.0


def test_a_regenerate_and_an_edit_come_from_the_same_client_only():
    first = turn("t1", [QUESTION], ANSWER, 0)
    again = turn("t2", [QUESTION], {"role": "assistant", "content": "Canberra."}, MINUTE)
    found = read_signals([first, again], 3 * MINUTE, 60 * MINUTE)
    assert kinds(found) == {REGENERATED: -1.0}
    assert kinds(found, "t2") == {}  # the later one is not asked again (yet)
    # An edit: the last message changed, in a conversation with a history of its own.
    history = [QUESTION, ANSWER]
    asked = turn("t1", [*history, {"role": "user", "content": "And New Zealand's?"}], ANSWER, 0)
    edited = {"role": "user", "content": "And New Zealand's capital, officially?"}
    edit = turn("t3", [*history, edited], {"role": "assistant", "content": "."}, 2 * MINUTE)
    assert kinds(read_signals([asked, edit], 3 * MINUTE, 60 * MINUTE)) == {EDITED: -0.5}
    # Without a history, two first questions alike are two users, not an edit.
    other = {"role": "user", "content": "What is the capital city of Australia, officially?"}
    alike = turn("t3", [other], {"role": "assistant", "content": "Canberra."}, 2 * MINUTE)
    assert kinds(read_signals([first, alike], 3 * MINUTE, 60 * MINUTE)) == {}
    # The same question an hour later: as likely another user (traffic without ids).
    later = turn("t2", [QUESTION], ANSWER, 60 * MINUTE)
    assert kinds(read_signals([first, later], 61 * MINUTE, 600 * MINUTE)) == {}
    # An agent's rollouts of one group share their prompt on purpose: not a regenerate.
    ours = {"attributed": True}
    a = turn("t1", [QUESTION], ANSWER, 0, rollout_id="g.0", group_id="g", **ours)
    b = turn("t2", [QUESTION], ANSWER, MINUTE, rollout_id="g.1", group_id="g", **ours)
    assert read_signals([a, b], 3 * MINUTE, 60 * MINUTE) == []
    # A client naming each answer's rollout (no group: each its own) regenerates in another.
    tagged = turn("t2", [QUESTION], ANSWER, MINUTE, rollout_id="r2", group_id="r2", **ours)
    alone = turn("t1", [QUESTION], ANSWER, 0, rollout_id="r1", group_id="r1", **ours)
    assert kinds(read_signals([alone, tagged], 3 * MINUTE, 60 * MINUTE)) == {REGENERATED: -1.0}
    # ... but two first questions alike, each its own rollout, are not an edit.
    other = turn("t2", [{"role": "user", "content": "What is the capital of Austria?"}], ANSWER,
                 MINUTE, rollout_id="r2", group_id="r2", **ours)  # fmt: skip
    assert kinds(read_signals([alone, other], 3 * MINUTE, 60 * MINUTE)) == {}
    # Nor are the n choices of one request.
    c = turn("t2", [QUESTION], ANSWER, 0, request_id="req-t1")
    assert kinds(read_signals([first, c], 3 * MINUTE, 60 * MINUTE)) == {}


def call(name: str, arguments: str, call_id: str = "c1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_tool_call_is_judged_by_its_result_and_by_what_the_agent_does_next():
    ask = {"role": "user", "content": "Weather in Paris?"}
    first = {
        "role": "assistant",
        "content": None,
        "tool_calls": [call("weather", '{"city": "Pari"}')],
    }
    result = {"role": "tool", "tool_call_id": "c1", "content": "Error: unknown city 'Pari'"}
    retry = {"role": "assistant", "content": None,
             "tool_calls": [call("weather", '{"city": "Paris"}', "c2")]}  # fmt: skip
    turns = [turn("t1", [ask], first, 0), turn("t2", [ask, first, result], retry, MINUTE)]
    found = read_signals(turns, 2 * MINUTE, 60 * MINUTE)
    assert kinds(found) == {TOOL_ERROR: -1.0, TOOL_RETRY: -0.5}
    fine = {**result, "content": '{"temp_c": 14, "sky": "rain"}'}
    turns[1] = turn("t2", [ask, first, fine], {"role": "assistant", "content": "14 C"}, MINUTE)
    assert kinds(read_signals(turns, 2 * MINUTE, 60 * MINUTE)) == {}


def test_an_answer_says_something_of_itself():
    broken = {"role": "assistant", "content": None, "tool_calls": [call("f", '{"a": ')]}
    assert kinds(read_signals([turn("t1", [QUESTION], broken, 0)], 0, MINUTE)) == {MALFORMED: -1}
    want = {"type": "json_object"}
    prose = turn("t1", [QUESTION], ANSWER, 0, response_format=want)
    json_ok = turn("t1", [QUESTION], {"role": "assistant", "content": '{"a": 1}'}, 0,
                   response_format=want)  # fmt: skip
    assert kinds(read_signals([prose], 0, MINUTE)) == {MALFORMED: -1.0}
    assert kinds(read_signals([json_ok], 0, MINUTE)) == {}
    odd = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": None}]}
    assert read_signals([turn("t1", [QUESTION], odd, 0)], 0, MINUTE) == []  # read, not raised
    cut = turn("t1", [QUESTION], ANSWER, 0, finish_reason="length")
    assert kinds(read_signals([cut], 0, MINUTE)) == {TRUNCATED: -0.5}


def test_a_conversation_ends_only_once_it_has_been_quiet():
    alone = turn("t1", [QUESTION], ANSWER, 0)
    assert read_signals([alone], now_us=5 * MINUTE, quiet_us=30 * MINUTE) == []
    (ended,) = read_signals([alone], now_us=31 * MINUTE, quiet_us=30 * MINUTE)
    assert (ended.kind, ended.value) == (ENDED, 0.0)  # says nothing either way
    # A signal found twice is one row: its id is what it is about and what said so.
    assert ended.signal_id == read_signals([alone], 40 * MINUTE, 30 * MINUTE)[0].signal_id


def test_a_client_that_sends_the_reply_back_changed_still_continues_it():
    """Clients resend the assistant message with fields of their own (`refusal: null`,
    parts instead of a string): the conversation is linked by role, text and calls."""
    back = {"role": "assistant", "content": [{"type": "text", "text": "Sydney."}], "refusal": None}
    second = turn("t2", [QUESTION, back, {"role": "user", "content": "thanks!"}], ANSWER, MINUTE)
    found = read_signals([turn("t1", [QUESTION], ANSWER, 0), second], 2 * MINUTE, 60 * MINUTE)
    assert kinds(found) == {ACCEPTED: 1.0}


# A scripted user: right answers are thanked or followed by a new question, wrong ones
# corrected, complained about or asked again; some users regenerate, some leave. Its
# satisfaction is known here and hidden from the rules.
RIGHT = ["Thanks!", "great, thank you", "Perfect.", "ok. Next: {next}", "{next}", "that works"]
WRONG = ["No, that's wrong.", "That is not what I asked. {q}", "{q}", "Wrong, try again",
         "hm, {q}", "you misunderstood: {q}"]  # fmt: skip


def scripted_traffic(seed: int, n: int = 200) -> tuple[list[Turn], dict[str, bool], set[str]]:
    """(the turns, each answer's hidden satisfaction, the answers the user reacted to)."""
    rng = random.Random(seed)
    questions = [f"What is {a} plus {b}?" for a in range(10) for b in range(10)]
    turns, truth, reacted = [], {}, set()
    for i in range(n):
        q, nxt = rng.choice(questions), rng.choice(questions)
        good = rng.random() < 0.5
        answer = {"role": "assistant", "content": f"It is {rng.randint(0, 18)}."}
        ask = {"role": "user", "content": q}
        t = turn(f"a{i}", [ask], answer, i * MINUTE)
        truth[t.record_id] = good
        turns.append(t)
        style = rng.random()
        if style < 0.1:  # leaves
            continue
        reacted.add(t.record_id)
        if style < 0.2 and not good:  # regenerates
            turns.append(turn(f"b{i}", [ask], answer, i * MINUTE + 1))
            continue
        reaction = rng.choice(RIGHT if good else WRONG).format(q=q, next=nxt)
        follow = [ask, answer, {"role": "user", "content": reaction}]
        turns.append(turn(f"b{i}", follow, {"role": "assistant", "content": "."}, i * MINUTE + 2))
    return turns, truth, reacted


def auc(scores: list[tuple[float, bool]]) -> float:
    pos = [s for s, y in scores if y]
    neg = [s for s, y in scores if not y]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_the_rules_agree_with_a_scripted_users_hidden_satisfaction():
    turns, truth, reacted = scripted_traffic(seed=7)
    found = read_signals(turns, now_us=10**12, quiet_us=30 * MINUTE)
    value: dict[str, float] = {}
    for s in found:
        if s.record_id in truth and s.kind != ENDED:
            value[s.record_id] = value.get(s.record_id, 0.0) + s.value * s.confidence
    covered = [(value[r], truth[r]) for r in truth if r in value]
    score = auc(covered)
    print(f"scripted user: {len(covered)} of {len(truth)} answers with a signal, AUC {score:.3f}")
    assert reacted <= set(value)  # every reaction read
    assert len(set(value) - reacted) <= 2  # those who left said nothing (measured: 1)
    # Measured 0.997 (seed 7): what the rules miss here is what they miss in production,
    # a right answer followed by a new question much like the old one (read as a re-ask),
    # and another user's same question within minutes (read as a regenerate).
    assert score >= 0.95


# -- the whole way: through the proxy, the store, the command ------------------------------


async def test_signals_are_read_from_the_logged_traffic_written_once_and_shown(
    make_proxy, tmp_path, tiny_model_dir
):
    from overnight.cli import main

    proxy = await make_proxy()
    data = tmp_path / "data"
    body = {"model": "policy", "max_tokens": 4, "messages": [QUESTION]}
    first = await (await proxy.post("/v1/chat/completions", json=body)).json()
    reply = first["choices"][0]["message"]
    follow = [QUESTION, reply, {"role": "user", "content": "No, that's wrong: it is Canberra."}]
    await proxy.post("/v1/chat/completions", json={**body, "messages": follow})
    await proxy.post(
        "/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}}
    )
    logged = await wait_for_rows(data, 3)
    runner = CliRunner()
    done = runner.invoke(main, ["signals", "--data", str(data)])
    assert done.exit_code == 0, done.output
    # The fake vLLM always answers max_tokens tokens: every turn is cut, too.
    assert "read 3 chat turn(s): 6 signal(s)" in done.output and "6 new written" in done.output
    found = rows(data, "SELECT record_id, kind, value, evidence_record, source FROM signals "
                       "ORDER BY kind")  # fmt: skip
    by_kind = {r["kind"]: r for r in found}
    assert set(by_kind) == {CORRECTED, MALFORMED, REGENERATED, TRUNCATED}
    assert sorted(r["record_id"] for r in found if r["kind"] == TRUNCATED) == sorted(
        r["record_id"] for r in logged
    )
    corrected = by_kind[CORRECTED]
    assert corrected["record_id"] == logged[0]["record_id"]
    assert corrected["evidence_record"] == logged[1]["record_id"]
    assert corrected["value"] == -1.0 and corrected["source"] == "rules"
    # The third request asked the first one's messages again: a regenerate of the first.
    assert by_kind[REGENERATED]["record_id"] == logged[0]["record_id"]
    assert by_kind[MALFORMED]["record_id"] == logged[2]["record_id"]
    again = runner.invoke(main, ["signals", "--data", str(data)])
    assert "0 new written" in again.output, again.output
    assert len(rows(data, "SELECT * FROM signals")) == 6
    shown = runner.invoke(main, ["show", "--data", str(data), logged[0]["rollout_id"]])
    assert "[next] corrected (-1, confidence 0.8): the next message corrects it: " in shown.output
    assert "it is Canberra" in shown.output
    page = await (await proxy.get(f"/ui/rollouts/{quote(logged[0]['rollout_id'], safe='')}")).text()
    assert '<div class="signal">next: corrected (-1, confidence 0.8)' in page
    assert "next: regenerated (-1, confidence 0.6)" in page
    # The reward source `implicit`: a reward per turn where no other source has one.
    await proxy.post(f"/v1/rollouts/{quote(logged[2]['rollout_id'], safe='')}/reward",
                     json={"reward": 1.0})  # fmt: skip
    await wait_for_rows(data, 1, "rewards")
    done = runner.invoke(main, ["signals", "--data", str(data), "--rewards"])
    assert "implicit rewards: 2 written; 1 turn(s) already rewarded by another source (agent)" in (
        done.output
    ), done.output
    implicit = rows(
        data, "SELECT rollout_id, reward, metrics FROM rewards WHERE source = 'implicit'"
    )
    by_rollout = {r["rollout_id"]: r["reward"] for r in implicit}
    # corrected (-1, 0.8), regenerated (-1, 0.6), truncated (-0.5, 0.6): weighted mean
    assert by_rollout[logged[0]["rollout_id"]] == pytest.approx((-0.8 - 0.6 - 0.3) / 2.0)
    assert by_rollout[logged[1]["rollout_id"]] == -0.5  # cut, and nothing followed yet
    assert logged[2]["rollout_id"] not in by_rollout  # the agent's own reward comes first
    again = runner.invoke(main, ["signals", "--data", str(data), "--rewards"])
    assert "implicit rewards: 0 written; 2 turn(s) unchanged" in again.output, again.output
    # A night that names the source reads the signals first, and the plan weighs the
    # implicit rewards like any other: single calls, groups of one, pooled as lone turns
    # (trainer/choose/lone_turns.py), too few of them tonight to train.
    night = ["train", "--data", str(data), "--proxy", str(proxy.make_url("")), "--settle", "0",
             "--base-model", str(tiny_model_dir), "--reward-source", "agent",
             "--reward-source", "implicit", "--no-promote"]  # fmt: skip
    done = await asyncio.to_thread(runner.invoke, main, night)
    assert "signals: read 3 chat turn(s): 6 signal(s)" in done.output, done.output
    assert "signals: implicit rewards: 0 written; 2 turn(s) unchanged" in done.output
    lone = "lone turns: none trained (3 rewarded, fewer than 8: left for a later night)"
    assert done.exit_code == 0 and lone in done.output, done.output
    bad = runner.invoke(main, ["signals", "--data", str(data), "--since", "soon"])
    assert bad.exit_code != 0 and "expected a number and a unit" in bad.output


async def test_responses_and_messages_conversations_are_read_as_chat_ones(make_proxy, tmp_path):
    """The proxy records Responses and Messages turns in the chat shape (a
    `previous_response_id` turn with its whole conversation): the rules read them alike."""
    from overnight.judge.implicit import run_signals

    proxy = await make_proxy()
    data = tmp_path / "data"
    first = await (await proxy.post("/v1/responses", json={
        "model": "policy", "input": "What is the capital of Australia?", "max_output_tokens": 4,
    })).json()  # fmt: skip
    await proxy.post("/v1/responses", json={
        "model": "policy", "previous_response_id": first["id"], "max_output_tokens": 4,
        "input": "No, that's wrong: it is Canberra.",
    })  # fmt: skip
    ask = {"role": "user", "content": "What is 2 plus 2?"}
    body = {"model": "policy", "max_tokens": 4, "messages": [ask]}
    reply = await (await proxy.post("/v1/messages", json=body)).json()
    said = {"role": "assistant", "content": reply["content"]}
    thanks = {"role": "user", "content": "Thanks, that works."}
    await proxy.post("/v1/messages", json={**body, "messages": [ask, said, thanks]})
    logged = await wait_for_rows(data, 4)
    summary = await asyncio.to_thread(run_signals, data)
    assert summary.turns == 4
    found = rows(data, "SELECT s.kind, c.endpoint FROM signals s JOIN completions c "
                       "USING (record_id) WHERE s.kind IN ('corrected', 'accepted')")  # fmt: skip
    assert sorted((r["kind"], r["endpoint"]) for r in found) == [
        (ACCEPTED, "messages"),
        (CORRECTED, "responses"),
    ], logged


def test_a_turns_signals_make_one_reward_and_silence_makes_none():
    from overnight.judge.implicit import Held, agreement, implicit_reward, reward_target
    from overnight.judge.signals import Signal

    sure_no = Signal("t", CORRECTED, -1.0, 0.8, "r")
    truncated = Signal("t", TRUNCATED, -0.5, 0.6, "r")
    assert implicit_reward([sure_no, truncated]) == pytest.approx((-0.8 - 0.3) / 1.4)
    # A message nobody recognised says nothing: no reward from a guess, never approval,
    # and it does not pull a reading that says something towards 0.
    unread = Signal("t", MOVED_ON, 0.0, 0.3, "r")
    assert implicit_reward([unread]) is None
    assert implicit_reward([sure_no, unread]) == -1.0
    assert implicit_reward([Signal("t", ENDED, 0.0, 0.1, "r")]) is None  # says nothing
    assert implicit_reward([]) is None
    held = Held(turns={"single": 1, "long": 3}, latest={}, posted={"a": 1.0, "b": 0.0, "c": 1.0})
    assert reward_target("rec", "single", held) == "single"
    assert reward_target("rec", "long", held) == "turn:rec:served"  # the turn, not the rollout
    groups = {"x": ("a", "g"), "y": ("b", "g"), "z": ("c", "g"), "w": ("unposted", "g")}
    # Two of the two pairs with different posted rewards ordered alike: 1.0.
    assert agreement({"x": 0.8, "y": -1.0, "z": 0.3, "w": 1.0}, groups, held)["auc"] == 1.0
    assert agreement({"x": -0.8, "y": 1.0, "z": 0.3}, groups, held)["auc"] == 0.0
    assert agreement({"x": 0.5, "y": 0.5, "z": 0.5}, groups, held)["auc"] == 0.5  # ties: half
    assert agreement({"w": 1.0}, groups, held) is None


def test_a_reward_source_is_one_the_store_can_hold():
    from overnight.config import TrainConfig
    from overnight.errors import ConfigError

    assert TrainConfig(reward_sources=("agent", "implicit")).reward_sources[-1] == "implicit"
    assert "implicit" not in TrainConfig().reward_sources  # off unless named
    with pytest.raises(ConfigError, match="reward sources must be among"):
        TrainConfig(reward_sources=("agent", "implict"))  # a typo trained on nothing before


def test_the_concordance_counts_every_pair_without_walking_them():
    """n log n (a week of rewarded turns is too many pairs to walk), yet the same count
    as walking every pair."""
    import itertools

    from overnight.judge.implicit import _concordance

    rng = random.Random(3)
    for _ in range(200):
        pairs = [(rng.choice([-1.0, -0.5, 0.3, 1.0, rng.random()]), rng.choice([0.0, 0.5, 1.0]))
                 for _ in range(rng.randint(0, 25))]  # fmt: skip
        agree = total = 0.0
        for (vi, pi), (vj, pj) in itertools.combinations(pairs, 2):
            if pi != pj:
                total += 1
                agree += 0.5 if vi == vj else float((vi - vj) * (pi - pj) > 0)
        assert _concordance(pairs) == (agree, total)


# -- the classifier: what the rules only guessed at ------------------------------------------


def _turns_with_reactions(data_dir, reactions: list[str]) -> None:
    """One conversation per reaction: a question, an answer, then the reaction (and its
    own answer), logged as the proxy logs chat turns."""
    from overnight.storage import LogWriter, WriterConfig, now_us

    from .helpers import chat_response, completion_row

    writer = LogWriter(WriterConfig(data_dir, commit_interval=0.0))
    writer.start()
    at = now_us() - 60_000_000
    for i, reaction in enumerate(reactions):
        # Each its own question: the same first message from another client within
        # minutes reads as a regenerate (docs/signals.md, "How they fail").
        ask = {"role": "user", "content": f"What is 3 plus {4 + i}?"}
        answer = {"role": "assistant", "content": f"It is {8 + i}."}
        first = {"messages": [ask]}
        then = {"messages": [ask, answer, {"role": "user", "content": reaction}]}
        for k, (request, reply) in enumerate([(first, answer["content"]), (then, "Ok.")]):
            writer.append("completions", completion_row(
                f"c{i}.{k}", f"c{i}.{k}", record_id=f"c{i}.{k}", started_at=at + 2 * i + k,
                ended_at=at + 2 * i + k, request=request, response=chat_response(reply),
                finish_reason="stop",
            ))  # fmt: skip
    writer.close()


def logprob_answer(probabilities: dict[str, float]):
    """A one-token chat completion as vLLM's OpenAI API answers one asked for logprobs:
    the sampled token and the top ones, each with its logprob."""

    def step(body: dict):
        top = sorted(probabilities.items(), key=lambda kv: -kv[1])
        tops = [{"token": t, "logprob": math.log(p), "bytes": list(t.encode())} for t, p in top]
        reply = {
            "id": "cls-1", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{
                "index": 0, "finish_reason": "length",
                "message": {"role": "assistant", "content": top[0][0]},
                "logprobs": {"content": [{**tops[0], "top_logprobs": tops}]},
            }],
            "usage": {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101},
        }  # fmt: skip
        return 200, reply, {}

    return step


def test_the_classifier_reads_the_label_tokens_logprobs_not_the_text():
    from overnight.judge.reactions import INSTRUCTIONS, decide, label_shares, prompt

    messages = prompt("What is 3 plus 4?", "It is 8.", "3 and 4 make 7.")
    assert messages[0] == {"role": "system", "content": INSTRUCTIONS}
    assert messages[1]["content"] == (
        "The user asked:\nWhat is 3 plus 4?\n\nThe assistant answered:\nIt is 8.\n\n"
        "The user then wrote:\n3 and 4 make 7.\n\nOne word: good, bad or neutral."
    )
    assert "asked" not in prompt("", "", "ok")[1]["content"]  # no context: the reaction alone
    assert len(prompt("x" * 5000, "", "ok")[1]["content"]) < 700  # each text cut

    def choice(probabilities: dict[str, float]) -> dict:
        _, body, _ = logprob_answer(probabilities)({"model": "m"})
        return body["choices"][0]

    # Every spelling of a label counts for it (" Good", "good", "neut"); others do not.
    shares, total = label_shares(choice({" Good": 0.5, "good": 0.2, "bad": 0.1, "The": 0.2}))
    assert shares["good"] == pytest.approx(0.7 / 0.8) and total == pytest.approx(0.8)
    assert decide(shares, total) == "good"
    shares, total = label_shares(choice({"neut": 0.7, "Bad": 0.2, "I": 0.1}))
    assert decide(shares, total) == "neutral"
    # Torn between two labels, or mostly something else: no reading.
    assert decide(*label_shares(choice({"good": 0.45, "bad": 0.45, "x": 0.1}))) is None
    assert decide(*label_shares(choice({"banana": 0.9, "bad": 0.1}))) is None
    # No logprobs (a server that does not return them): nothing to read, text or not.
    assert label_shares({"message": {"content": "bad"}, "logprobs": None}) is None


async def test_the_messages_nobody_else_reads_are_read_by_a_classifier_once(
    aiohttp_server, tmp_path, monkeypatch
):
    from overnight.config import JudgeConfig
    from overnight.judge.implicit import run_signals

    from .judge_server import SEEN, create_judge_server

    monkeypatch.setenv("OVERNIGHT_JUDGE_BACKOFF", "0.01")

    def reads(body: dict):  # as a model would: by what the user wrote
        said = body["messages"][1]["content"]
        if "make 7" in said:
            return logprob_answer({"bad": 0.8, " Bad": 0.1, "good": 0.05})(body)
        if "yesss" in said:
            return logprob_answer({"good": 0.7, " good": 0.2, "neutral": 0.05})(body)
        return logprob_answer({"banana": 0.9, "good": 0.05, "bad": 0.04})(body)

    judge = await aiohttp_server(create_judge_server([reads]))
    # Words nobody else reads (reading.py), each `moved_on`: value 0, no reward.
    _turns_with_reactions(tmp_path, ["3 and 4 make 7.", "yesss finally",
                                     "What is the capital of France?"])  # fmt: skip
    config = JudgeConfig(model="openai/reader", base_url=str(judge.make_url("/v1")), api_key="k")
    summary = await asyncio.to_thread(run_signals, tmp_path, rewards=True, classifier=config)
    tally = summary.classifier
    assert (tally.asked, tally.changed, tally.unreadable, tally.failed) == (3, 2, 1, 0)
    calls = tally.calls  # the server's usage, counted as the judge's
    assert calls.prompt_tokens == 300 and calls.completion_tokens == 3
    line = "\n".join(summary.lines())
    assert "classifier openai/reader: 3 message(s) nobody else read, 2 read as approval" in line
    sent = judge.app[SEEN][0]  # one token, its top logprobs, no answer format
    assert (sent["max_tokens"], sent["logprobs"], sent["top_logprobs"]) == (1, True, 10)
    assert sent["temperature"] == 0.0 and "response_format" not in sent
    asked = sorted(body["messages"][1]["content"] for body in judge.app[SEEN])
    assert "The assistant answered:\nIt is 8.\n\nThe user then wrote:\n3 and 4" in asked[0]
    found = rows(tmp_path, "SELECT record_id, kind, value, confidence, source, rule, extra "
                           "FROM signals WHERE kind != 'ended' ORDER BY record_id")  # fmt: skip
    assert [(r["record_id"], r["kind"], r["source"]) for r in found] == [
        ("c0.0", CORRECTED, "classifier"),
        ("c1.0", ACCEPTED, "classifier"),
        ("c2.0", MOVED_ON, "rules"),  # "banana": no label it is sure of, nothing read
    ]
    assert found[0]["rule"] == "classifier openai/reader" and found[0]["confidence"] == 0.6
    assert json.loads(found[0]["extra"])["shares"]["bad"] == pytest.approx(0.9 / 0.95, abs=1e-3)
    rewards = {r["rollout_id"]: r["reward"] for r in rows(
        tmp_path, "SELECT rollout_id, reward FROM rewards WHERE source = 'implicit'")}  # fmt: skip
    assert rewards == {"c0.0": -1.0, "c1.0": 1.0}  # c2.0: nobody read it, no reward
    # Read once: a second run asks only what it could not read, and changes no reward.
    again = await asyncio.to_thread(run_signals, tmp_path, rewards=True, classifier=config)
    assert again.classifier.asked == 1 and len(judge.app[SEEN]) == 4
    assert again.rewards == 0
    # Without a classifier, its earlier readings still stand (a night's own signals step).
    plain = await asyncio.to_thread(run_signals, tmp_path, rewards=True)
    assert plain.classifier is None and plain.rewards == 0
    assert plain.found[CORRECTED] == 1 and plain.found[ACCEPTED] == 1


# Complaints phrased outside the rules: polite, sarcastic, doubtful, carrying the answer,
# in another language. The rules alone read none of them as a complaint.
UNRULED_COMPLAINTS = [
    "thanks, but it still crashes",
    "Great, wrong again",
    "Perfect, exactly the bug I was trying to fix 🙃",
    "Could you please answer what I actually asked?",
    "Are you sure about that?",
    "hmm, 3 and 4 make 7",
    "I appreciate the effort but this is way off.",
    "You keep giving me the same answer.",
    "the answer is 7 since 3 plus 4 is 7, you wrote 8",
    "c'est faux",
]


def test_a_night_on_implicit_rewards_never_rewards_a_complaint_outside_the_rules(tmp_path):
    """Through `overnight signals --rewards` on a real store: every answer that drew a
    complaint the rules do not know gets a negative implicit reward, never approval."""
    from overnight.judge.implicit import run_signals
    from overnight.judge.reading import rules

    assert all(rules(text) != -1 for text in UNRULED_COMPLAINTS)  # outside the rules
    _turns_with_reactions(tmp_path, UNRULED_COMPLAINTS)
    summary = run_signals(tmp_path, rewards=True)
    assert summary.rewards == len(UNRULED_COMPLAINTS), summary.lines()
    rewards = {r["rollout_id"]: r["reward"] for r in rows(
        tmp_path, "SELECT rollout_id, reward FROM rewards WHERE source = 'implicit'")}  # fmt: skip
    answered = {f"c{i}.0" for i in range(len(UNRULED_COMPLAINTS))}
    assert answered <= set(rewards)
    assert all(rewards[r] < 0 for r in answered), rewards
    found = rows(tmp_path, "SELECT record_id, kind, extra FROM signals WHERE kind != 'ended'")
    assert {r["kind"] for r in found if r["record_id"] in answered} == {CORRECTED}


def test_the_pool_never_trains_towards_an_answer_that_drew_a_complaint(tmp_path):
    """The advantages' sign, not only the rewards': against a baseline of a pool that is
    mostly complaints, a milder complaint sits above the mean and would earn a positive
    advantage. The implicit rewards `overnight signals --rewards` wrote for complaints
    outside the rules, beside two approvals and one turn whose signals partly disagree (a
    correction read surely, an acceptance less so: implicit_reward's weighted mean, still a
    complaint), pooled as a night pools lone turns: no complained-about answer is trained
    towards, no approved one away from (trainer/grpo/data.py's keep_signs)."""
    from overnight.config import TrainConfig
    from overnight.judge.implicit import implicit_reward, run_signals
    from overnight.judge.signals import Signal
    from overnight.trainer.choose.lone_turns import _pool
    from overnight.trainer.choose.plan import Plan
    from overnight.trainer.grpo.data import Sample

    praise = ["Thanks, that's right!", "perfect, thank you"]
    _turns_with_reactions(tmp_path, [*UNRULED_COMPLAINTS, *praise])
    run_signals(tmp_path, rewards=True)
    rewards = {r["rollout_id"]: r["reward"] for r in rows(
        tmp_path, "SELECT rollout_id, reward FROM rewards WHERE source = 'implicit'")}  # fmt: skip
    complained = {f"c{i}.0" for i in range(len(UNRULED_COMPLAINTS))}
    approved = {f"c{len(UNRULED_COMPLAINTS) + i}.0" for i in range(len(praise))}
    assert all(rewards[r] < 0 for r in complained) and all(rewards[r] > 0 for r in approved)
    mild = implicit_reward([Signal("m", CORRECTED, -1.0, 0.6, "r"),
                            Signal("m", "accepted", 1.0, 0.4, "r")])  # fmt: skip
    assert mild is not None and -1 < mild < 0
    rewards["mild"] = mild
    complained.add("mild")
    pooled = sorted(complained | approved)
    mean = statistics.fmean(rewards[r] for r in pooled)
    assert rewards["mild"] > mean  # the case: a complaint above the pool's baseline
    samples = [Sample(r, r, [1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], 1) for r in pooled]
    plan = Plan()
    _pool(plan, samples, {r: ("implicit", rewards[r]) for r in pooled}, TrainConfig())
    advantages = {s.rollout_id: s.advantage for s in plan.samples}
    assert set(advantages) == set(pooled), plan.lines()
    assert all(advantages[r] <= 0 for r in complained), advantages
    assert all(advantages[r] > 0 for r in approved), advantages
    assert advantages["mild"] == 0.0  # cut: it would have been trained towards


def test_keep_signs_cuts_only_the_signed_rollouts_that_would_go_the_wrong_way():
    from overnight.trainer.grpo.data import group_advantages, keep_signs

    rewards = {"a": -0.9, "b": -0.9, "c": -0.2, "d": 0.5, "e": 0.1}
    adv = group_advantages(rewards)  # mean -0.28: c, a complaint, sits above it
    cut = keep_signs(adv, rewards, {"a", "b", "c", "d"})
    assert adv.advantages["c"] > 0 and cut.advantages["c"] == 0.0
    assert cut.advantages["a"] == adv.advantages["a"] < 0
    assert cut.advantages["d"] == adv.advantages["d"] > 0
    assert cut.advantages["e"] == adv.advantages["e"]  # not signed: as computed
    assert (cut.mean, cut.std) == (adv.mean, adv.std)
