"""`overnight train --hindsight`: the turns users corrected, answered again by a teacher
shown the correction, trained without it (trainer/choose/hindsight.py).

Conversations are written to a real store as the proxy logs them; `overnight signals`'
reader finds what the users said next; a scripted teacher stands for vLLM and records
what it was asked. The tiny model's chat template renders the student's samples.
"""

from __future__ import annotations

import time

import pytest

from overnight.config import TrainConfig
from overnight.storage import LogWriter, WriterConfig
from overnight.trainer.choose.hindsight import (
    ECHOED,
    HINT,
    NOT_SERVED,
    UNCHANGED,
    Teacher,
    hindsight_id,
    plan_hindsight,
    teacher_messages,
)
from overnight.trainer.choose.inputs import Selection

from .helpers import chat_response, completion_row, json_server

SYSTEM = {"role": "system", "content": "Reply with the number only."}


def ask(q: str) -> dict:
    return {"role": "user", "content": q}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Store:
    """Chat turns written as the proxy logs them, a conversation's turns resending it."""

    def __init__(self, data_dir) -> None:
        self.data_dir = data_dir
        self.writer = LogWriter(WriterConfig(data_dir, compact_in_process=True))
        self.writer.start()
        self.now = time.time_ns() // 1000 - 3_600_000_000  # an hour ago: all quiet since
        self.ticks = 0

    def turn(self, record: str, messages: list[dict], reply: str, model="policy-a") -> None:
        self.ticks += 1_000_000
        request = {"model": "policy", "max_tokens": 24, "messages": messages}
        self.writer.append("completions", completion_row(
            record, record, record_id=record, started_at=self.now + self.ticks,
            ended_at=self.now + self.ticks, request=request, response=chat_response(reply),
            model_served=model,
        ))  # fmt: skip

    def trained(self, groups: list[str]) -> None:
        self.writer.append("training_runs", {
            "run_id": "earlier", "schema_version": 2, "status": "trained", "groups": groups,
            "started_at": self.now, "ended_at": self.now,
        })  # fmt: skip

    def close(self) -> None:
        self.writer.close()


class ScriptedTeacher(Teacher):
    """vLLM's answers: the sum the hint names, or what a script says; what it was asked."""

    def __init__(self, answers: dict[str, str], served=("policy-a",)) -> None:
        super().__init__("http://vllm.test")
        self.answers, self.asked, self.served = answers, [], set(served)
        self.post = self._post

    def _post(self, url: str, body: dict | None) -> dict:
        if url.endswith("/v1/models"):
            return {"data": [{"id": m} for m in self.served]}
        self.asked.append(body)
        question = body["messages"][-1]["content"]
        text = next((a for q, a in self.answers.items() if q in question), "")
        return {**chat_response(text), "usage": {"prompt_tokens": 30, "completion_tokens": 2}}


def day(data_dir) -> None:
    """Four conversations: a correction carrying the answer, a thanks, a regenerate, and a
    correction the teacher cannot improve on; then their signals."""
    from overnight.judge.implicit import run_signals

    store = Store(data_dir)
    q1, q2, q3, q4 = (ask(f"What is {a} plus {b}?") for a, b in ((3, 4), (2, 2), (5, 1), (6, 3)))
    store.turn("a0", [SYSTEM, q1], "The sum is 5")
    store.turn("a1", [SYSTEM, q1, {"role": "assistant", "content": "The sum is 5"},
                      ask("No, it's 7.")], "7")  # fmt: skip
    store.turn("b0", [SYSTEM, q2], "4")
    store.turn("b1", [SYSTEM, q2, {"role": "assistant", "content": "4"},
                      ask("Thanks! What is 8 plus 1?")], "9")  # fmt: skip
    store.turn("c0", [SYSTEM, q3], "It is 7")
    store.turn("c1", [SYSTEM, q3], "6")  # the same messages again: a regenerate
    store.turn("d0", [SYSTEM, q4], "12")
    store.turn("d1", [SYSTEM, q4, {"role": "assistant", "content": "12"},
                      ask("Wrong, try again: What is 6 plus 3?")], "9")  # fmt: skip
    store.close()
    run_signals(data_dir, quiet_seconds=0)


def test_the_teachers_prompt_carries_the_users_next_message_after_the_question():
    messages = [SYSTEM, ask("What is 3 plus 4?")]
    shown = teacher_messages(messages, "No,   it's 7.\n")
    assert shown[:-1] == [SYSTEM] and messages[-1]["content"] == "What is 3 plus 4?"  # unchanged
    assert shown[-1] == ask('What is 3 plus 4?\n\n(The user replied to an earlier answer to '
                            'this: "No, it\'s 7." Answer the question above.)')  # fmt: skip
    # A conversation that does not end with the user's text: the hint is a message of its own.
    tool = [SYSTEM, ask("weather?"), {"role": "tool", "content": "sunny", "tool_call_id": "1"}]
    assert teacher_messages(tool, "wrong city")[-1] == {
        "role": "user", "content": HINT.format(hint="wrong city").strip()}  # fmt: skip


def test_a_hindsight_plan_trains_corrected_turns_on_the_teachers_revision_without_the_hint(
    tmp_path, tokenizer
):
    day(tmp_path)
    config = TrainConfig(hindsight=True, sft_held_out=0.0)
    assert config.sft  # the --sft objective, checkpoints and record
    teacher = ScriptedTeacher({"3 plus 4": "7", "6 plus 3": "12"})
    echo = ScriptedTeacher({"3 plus 4": 'The user replied to an earlier answer: "No, it\'s 7."',
                            "6 plus 3": "Wrong, try again: What is 6 plus 3? It is 9"})  # fmt: skip
    plan = plan_hindsight(Selection(tmp_path, tokenizer=tokenizer), config, echo, print)
    assert plan.groups == [] and plan.skipped == {ECHOED: 2}  # it must not quote the hint
    said = []
    plan = plan_hindsight(Selection(tmp_path, tokenizer=tokenizer), config, teacher, said.append)
    # a0 corrected with the answer; d0 corrected too, but the teacher says 12 again. b0 was
    # thanked, c0 regenerated (a signal without the user's words): neither is asked.
    assert plan.groups == [hindsight_id("a0")]
    assert plan.skipped == {UNCHANGED: 1}
    asked = {b["messages"][-1]["content"] for b in teacher.asked}
    assert len(teacher.asked) == 2 and all(b["temperature"] == 0.0 for b in teacher.asked)
    assert 'What is 3 plus 4?\n\n(The user replied to an earlier answer to this: "No, it\'s 7."' \
        in "".join(asked)  # fmt: skip
    assert {b["model"] for b in teacher.asked} == {"policy-a"}  # the adapter that served it
    assert teacher.asked[0]["max_tokens"] == 24  # the turn's own limit
    assert said == ["hindsight teacher at http://vllm.test: 2 call(s), 0 failed, 60 prompt "
                    "and 4 completion tokens in " + said[0].split(" tokens in ")[1]]  # fmt: skip
    # The student's sample: the turn's messages WITHOUT the hint, then the revision.
    (sample,) = plan.samples
    assert sample.group_id == hindsight_id("a0") and sample.rollout_id == "a0"
    text = tokenizer.decode(sample.tokens)
    assert "What is 3 plus 4?" in text and "replied" not in text and "No, it" not in text
    trained = tokenizer.decode([t for t, on in zip(sample.tokens, sample.trained, strict=True)
                                if on])  # fmt: skip
    assert trained.startswith("7") and "The sum is 5" not in text
    assert plan.sft["hindsight"]["teacher_calls"] == 2


def test_nothing_is_trained_twice_and_the_teacher_must_still_be_served(tmp_path, tokenizer):
    day(tmp_path)
    config = TrainConfig(hindsight=True, sft_held_out=0.0)
    store = Store(tmp_path)
    store.trained([hindsight_id("a0")])  # an earlier night trained it
    store.close()
    teacher = ScriptedTeacher({"3 plus 4": "7", "6 plus 3": "9"})
    plan = plan_hindsight(Selection(tmp_path, tokenizer=tokenizer), config, teacher, print)
    assert plan.groups == [hindsight_id("d0")]
    assert [b["messages"][-1]["content"].split("\n")[0] for b in teacher.asked] == [
        "What is 6 plus 3?"
    ]
    # The adapter that served the turns is gone: no teacher to ask, nothing trained.
    gone = ScriptedTeacher({"6 plus 3": "9"}, served=("policy-b",))
    plan = plan_hindsight(Selection(tmp_path, tokenizer=tokenizer), config, gone, print)
    assert plan.groups == [] and plan.skipped == {NOT_SERVED: 1} and gone.asked == []
    # A resumed run's turns, exactly: even one trained since, as it was chosen then.
    again = ScriptedTeacher({"3 plus 4": "7"})
    only = [hindsight_id("a0")]
    plan = plan_hindsight(Selection(tmp_path, tokenizer=tokenizer, only=only), config, again)
    assert plan.groups == only


def test_turns_held_out_for_the_gate_stay_out_and_max_groups_leaves_the_rest(tmp_path, tokenizer):
    from overnight.trainer.choose.sft_plan import HELD_OUT, held_out

    day(tmp_path)
    answers = {"3 plus 4": "7", "6 plus 3": "9"}
    config = TrainConfig(hindsight=True, sft_held_out=0.5)  # by the group's hash, as --sft
    kept = [r for r in ("a0", "d0") if not held_out(r, 0.5)]
    plan = plan_hindsight(Selection(tmp_path, tokenizer=tokenizer), config,
                          ScriptedTeacher(answers), print)  # fmt: skip
    assert plan.groups == [hindsight_id(r) for r in kept]
    assert plan.skipped.get(HELD_OUT, 0) == 2 - len(kept)
    one = TrainConfig(hindsight=True, sft_held_out=0.0)
    teacher = ScriptedTeacher(answers)
    plan = plan_hindsight(Selection(tmp_path, tokenizer=tokenizer, max_groups=1), one, teacher)
    assert plan.groups == [hindsight_id("a0")] and len(teacher.asked) == 1  # d0: a later night


def test_the_trials_users_correct_a_wrong_sum_with_the_right_one():
    """overnight/testing/scripted_user.py's `corrects`: what the hindsight trial's users
    say after a wrong answer carries the sum, and the rules read it as a correction; the
    old users (the implicit trial's) still react as before."""
    import asyncio

    from overnight.judge.reading import read
    from overnight.testing.scripted_user import CORRECTING, DISPLEASED, converse, right_sum

    sent: list[list[dict]] = []

    async def chat(body: dict, headers: dict) -> dict:
        sent.append(body["messages"])
        return chat_response("The answer is 100")  # always wrong

    questions = ["What is 3 plus 4?", "What is 2 plus 5?"]
    for corrects, words in ((True, CORRECTING), (False, DISPLEASED)):
        sent.clear()
        asyncio.run(converse(chat, "u", questions, seed=3, turns=6, corrects=corrects))
        said = [m[-1]["content"] for m in sent if m[-1]["role"] == "user" and len(m) > 2]
        assert said, "the user reacted"
        forms = {w.format(sum=7, q=questions[0], next=questions[1]) for w in words}
        assert set(said) <= forms
    assert right_sum("What is 3 plus 4?") == 7
    assert all(read(w.format(sum=7)).value < 0 for w in CORRECTING)


def test_overnight_train_hindsight_plans_through_a_teacher_over_http(tmp_path, tiny_model_dir):
    """The option through the CLI and the night's plan step (trainer/train.py): a dry run
    asks the teacher at --resample-upstream over HTTP (a scripted vLLM here) and shows
    the hindsight plan; without a way to find vLLM it says what to give."""
    from click.testing import CliRunner

    from overnight.cli.main import main

    day(tmp_path)
    asked = []

    def vllm(method: str, path: str, body: dict | None) -> tuple[int, dict]:
        if method == "GET":
            return 200, {"data": [{"id": "policy-a"}]}
        asked.append(body)
        sums = {"3 plus 4": "7", "6 plus 3": "9"}
        text = next(a for q, a in sums.items() if q in body["messages"][-1]["content"])
        return 200, {**chat_response(text), "usage": {"prompt_tokens": 5}}

    with json_server(vllm) as url:
        args = ["train", "--data", str(tmp_path), "--base-model", str(tiny_model_dir),
                "--proxy", "", "--settle", "0", "--hindsight", "--sft-held-out", "0",
                "--dry-run"]  # fmt: skip
        done = CliRunner().invoke(main, [*args, "--resample-upstream", url])
        assert done.exit_code == 0, done.output
        assert f"hindsight teacher at {url}: 2 call(s), 0 failed" in done.output
        assert "2 group(s), 2 sequence(s)" in done.output
        assert "sft (hindsight): imitating 2 of 2 rollout(s)" in done.output
        assert len(asked) == 2
    lost = CliRunner().invoke(main, args)
    assert (
        lost.exit_code != 0
        and "--hindsight" in lost.output
        and "--resample-upstream" in (lost.output)
    )


def test_the_teacher_is_the_proxys_first_healthy_replica_without_resample_upstream():
    from overnight.trainer.choose.hindsight import teacher_at

    state = {"replicas": [{"url": "http://a:1", "healthy": False},
                          {"url": "http://b:2/", "healthy": True}]}  # fmt: skip
    config = TrainConfig(hindsight=True)
    assert teacher_at(config, "http://proxy", None, state).url == "http://b:2"
    given = TrainConfig(hindsight=True, resample_upstream="http://vllm:8000/")
    assert teacher_at(given, "http://proxy", None, state).url == "http://vllm:8000"


def test_the_gate_never_holds_out_a_prompt_a_hindsight_night_trained(tmp_path):
    """A turn trained as `hindsight:<record>` trained its prompt (with the teacher's
    answer): its conversation is no unseen prompt for a later gate."""
    from overnight.storage import open_db
    from overnight.trainer.choose.turn_groups import trained_turn_sources

    day(tmp_path)
    store = Store(tmp_path)
    store.trained([hindsight_id("d0")])
    store.close()
    con = open_db(tmp_path)
    try:
        (group,) = con.execute("SELECT group_id FROM completions WHERE record_id = 'd0'").fetchone()
        assert trained_turn_sources(con) == {group}
    finally:
        con.close()
