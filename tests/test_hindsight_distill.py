"""`overnight train --hindsight --hindsight-mode distill`: the student's own answers to the
turns users corrected, each token's advantage the teacher's logprob (the same policy, the
correction in its context) minus the student's (without it), trained by GRPO's loss
(trainer/choose/hindsight_distill.py, trainer/grpo/distill.py).

Conversations are written as the proxy logs vLLM's answers (token ids and logprobs), with
a resampled sibling beside one; the tiny model's template renders the teacher's context
and the tiny model itself is the teacher and the student.
"""

from __future__ import annotations

import time

import pytest
import torch

from overnight.config import TrainConfig
from overnight.errors import ConfigError
from overnight.storage import LogWriter, WriterConfig
from overnight.storage.read.siblings import sibling_rows
from overnight.trainer.choose.hindsight import hindsight_id
from overnight.trainer.choose.hindsight_distill import NO_TOKENS, plan_distill
from overnight.trainer.choose.inputs import Selection
from overnight.trainer.grpo import distill
from overnight.trainer.grpo.data import Sample
from overnight.trainer.grpo.loss import LossConfig, policy_loss, token_weights
from overnight.trainer.grpo.step import sample_logprobs

from .helpers import chat_response, completion_row

SYSTEM = {"role": "system", "content": "Reply with the number only."}


def ask(q: str) -> dict:
    return {"role": "user", "content": q}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from overnight.trainer.grpo.policy import load_policy
    from overnight.trainer.grpo.step import fresh_adapter

    torch.manual_seed(0)
    return fresh_adapter(load_policy(tiny_model_dir), TrainConfig(lora_rank=4))


class Store:
    """Chat turns as the proxy logs vLLM's: prompt and completion token ids, logprobs."""

    def __init__(self, data_dir, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.writer = LogWriter(WriterConfig(data_dir, compact_in_process=True))
        self.writer.start()
        self.now = time.time_ns() // 1000 - 3_600_000_000  # an hour ago: all quiet since
        self.ticks = 0
        self.rows: dict[str, dict] = {}

    def turn(self, record: str, messages: list[dict], reply: str, ids: bool = True) -> None:
        self.ticks += 1_000_000
        request = {"model": "policy", "max_tokens": 24, "messages": messages}
        tokens = {}
        if ids:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
            completion = self.tokenizer.encode(reply, add_special_tokens=False)
            tokens = {"prompt_token_ids": prompt, "completion_token_ids": completion,
                      "completion_logprobs": [-1.0] * len(completion)}  # fmt: skip
        row = completion_row(
            record, record, record_id=record, started_at=self.now + self.ticks,
            ended_at=self.now + self.ticks, request=request, response=chat_response(reply),
            model_served="policy-a", **tokens,
        )  # fmt: skip
        self.rows[record] = row
        self.writer.append("completions", row)

    def sibling(self, record: str, reply: str) -> None:
        """A --resample sibling of the served turn `record`, as vLLM sampled it."""
        ids = self.tokenizer.encode(reply, add_special_tokens=False)
        choice = {"text": reply, "token_ids": ids, "finish_reason": "stop",
                  "logprobs": {"token_logprobs": [-2.0] * len(ids)}}  # fmt: skip
        served = {**self.rows[record], "request": self.rows[record]["request"]}
        for row in sibling_rows(served, {"choices": [choice]}, origin="resample",
                                writer_id=self.writer.writer_id, started_at=self.now,
                                ended_at=self.now):  # fmt: skip
            self.writer.append("siblings", row)

    def close(self) -> None:
        self.writer.close()


def day(data_dir, tokenizer) -> None:
    """Three corrections (one turn logged without token ids) and a thanks; a sibling of
    the first corrected answer; then their signals."""
    from overnight.judge.implicit import run_signals

    store = Store(data_dir, tokenizer)
    q1, q2, q3 = (ask(f"What is {a} plus {b}?") for a, b in ((3, 4), (2, 2), (6, 3)))
    store.turn("a0", [SYSTEM, q1], "The sum is 5")
    store.turn("a1", [SYSTEM, q1, {"role": "assistant", "content": "The sum is 5"},
                      ask("No, it's 7.")], "7")  # fmt: skip
    store.sibling("a0", "7")
    store.turn("b0", [SYSTEM, q2], "4")
    store.turn("b1", [SYSTEM, q2, {"role": "assistant", "content": "4"},
                      ask("Thanks! What is 8 plus 1?")], "9")  # fmt: skip
    store.turn("d0", [SYSTEM, q3], "12", ids=False)  # not vLLM's: nothing sampled to weigh
    store.turn("d1", [SYSTEM, q3, {"role": "assistant", "content": "12"},
                      ask("Wrong, the answer is 9.")], "9")  # fmt: skip
    store.close()
    run_signals(data_dir, quiet_seconds=0)


def test_the_mode_is_a_hindsight_nights_and_trains_by_grpos_loss():
    config = TrainConfig(hindsight=True, hindsight_mode="distill")
    assert not config.sft  # GRPO's loss, its ratio and clip: not the cross-entropy
    assert TrainConfig(hindsight=True).sft  # revise stays the --sft objective
    with pytest.raises(ConfigError, match="--hindsight-mode distill"):
        TrainConfig(hindsight_mode="distill")
    with pytest.raises(ConfigError, match="--hindsight-mode distill"):
        TrainConfig(hindsight=True, hindsight_mode="distill", sft=True)
    with pytest.raises(ConfigError, match="hindsight_mode must be revise or distill"):
        TrainConfig(hindsight=True, hindsight_mode="copy")


def test_a_distill_plan_takes_the_served_answers_and_siblings_with_the_hint_for_the_teacher(
    tmp_path, tokenizer
):
    day(tmp_path, tokenizer)
    config = TrainConfig(hindsight=True, hindsight_mode="distill", sft_held_out=0.0)
    plan = plan_distill(Selection(tmp_path, tokenizer=tokenizer), config)
    # a0 corrected with the answer, its served answer and one sibling; d0 corrected but
    # logged without token ids; b0 thanked: not a correction.
    assert plan.groups == [hindsight_id("a0")]
    assert plan.skipped == {NO_TOKENS: 1}
    assert sorted(s.rollout_id for s in plan.samples)[1] == "turn:a0:served"
    assert len(plan.samples) == 2 and {s.group_id for s in plan.samples} == {hindsight_id("a0")}
    assert plan.hindsight == {"mode": "distill", "corrected_turns": 2, "turns": 1,
                              "sequences": 2, "siblings": 1,
                              "tokens": sum(s.trained_tokens for s in plan.samples)}  # fmt: skip
    assert any("hindsight (distill): 1 of 2 corrected turn(s)" in x for x in plan.lines())
    for student in plan.samples:
        teacher = plan.teachers[student.rollout_id]
        said, shown = tokenizer.decode(student.tokens), tokenizer.decode(teacher.tokens)
        # The student as it was sampled, without the hint; the teacher with it.
        assert "No, it's 7." not in said and 'this: "No, it\'s 7." Answer' in shown
        mine = [t for t, on in zip(student.tokens, student.trained, strict=True) if on]
        theirs = [t for t, on in zip(teacher.tokens, teacher.trained, strict=True) if on]
        assert mine == theirs and student.behaviour_logprobs[-len(mine) :] == [
            -1.0 if student.rollout_id.endswith(":served") else -2.0
        ] * len(mine)
    # A night trained them: never again.
    writer = LogWriter(WriterConfig(tmp_path, compact_in_process=True))
    writer.start()
    writer.append("training_runs", {"run_id": "earlier", "schema_version": 2,
                  "status": "trained", "groups": [hindsight_id("a0")],
                  "started_at": 1, "ended_at": 1})  # fmt: skip
    writer.close()
    assert plan_distill(Selection(tmp_path, tokenizer=tokenizer), config).groups == []


def test_the_teachers_logprobs_are_taken_with_the_hint_and_the_students_without(policy):
    student = Sample("r", "g", [5, 6, 7, 8, 9], [False, False, False, True, True],
                     [0.0, 0.0, 0.0, -1.0, -1.5], 1)  # fmt: skip
    hinted = distill.teacher_sample(student, [5, 6, 7, 11, 12, 13])
    assert hinted.tokens == [5, 6, 7, 11, 12, 13, 8, 9]
    assert hinted.trained == [False] * 6 + [True, True]
    out, found = distill.teacher_advantages(policy, [student], {"r": hinted}, 512, 64)
    (taught,) = out
    mine = sample_logprobs(policy, [student], 512, 64)[0]
    theirs = sample_logprobs(policy, [hinted], 512, 64)[0]
    expected = [t - m for m, t in zip(mine, theirs, strict=True)]
    assert taught.trained_advantages() == pytest.approx(expected, abs=1e-6)
    assert taught.token_advantages[:3] == (0.0, 0.0, 0.0) and any(abs(a) > 1e-4 for a in expected)
    assert found.sequences == 1 and found.tokens == 2 and "2 token(s)" in found.line()
    # The same context for both: the hint's effect is nothing, every advantage 0.
    same = distill.teacher_sample(student, [5, 6, 7])
    (plain,), _ = distill.teacher_advantages(policy, [student], {"r": same}, 512, 64)
    assert plain.trained_advantages() == pytest.approx([0.0, 0.0], abs=1e-6)


def test_a_token_the_teacher_likes_more_gets_a_positive_advantage(monkeypatch):
    student = Sample("r", "g", [1, 2, 3, 4], [False, False, True, True], [0.0, 0.0, -2, -1], 1)
    other = Sample("s", "g", [1, 2], [False, True], [0.0, -1.0], 1, advantage=0.5)
    logprobs = {4: [[-2.0, -1.0]], 5: [[-0.5, -3.0]]}  # student, then teacher (longer)
    monkeypatch.setattr(distill, "sample_logprobs", lambda m, s, b, c: logprobs[len(s[0].tokens)])
    teacher = distill.teacher_sample(student, [1, 9, 9])
    (taught, untaught), found = distill.teacher_advantages(
        None, [student, other], {"r": teacher}, 512, 64
    )
    assert taught.trained_advantages() == [1.5, -2.0]  # liked more: up; less: down
    assert taught.token_advantages == (0.0, 0.0, 1.5, -2.0) and taught.advantage == 0.0
    assert untaught.trained_advantages() == [0.5]  # no teacher: its sequence advantage
    assert (found.positive, found.negative, found.without_teacher) == (1, 1, 1)


def test_the_update_moves_the_students_logprob_towards_the_teachers():
    """One position, five tokens: a step of GRPO's loss with the per-token advantage
    teacher - student moves the sampled token's logprob towards the teacher's, up when
    the teacher likes it more, down when less; the ratio and clip are GRPO's."""
    teacher = torch.log_softmax(torch.tensor([0.0, 3.0, 0.0, 0.0, 0.0]), 0)
    config = LossConfig(variant="dapo")
    for token in (1, 2):  # the teacher's favourite, then a token it likes less
        logits = torch.zeros(5, requires_grad=True)
        before = torch.log_softmax(logits, 0)[token].item()
        advantage = teacher[token] - before
        for _ in range(3):  # the ratio moves off 1 after the first step: still the same way
            logp = torch.log_softmax(logits, 0)[token].reshape(1)
            loss, stats = policy_loss(
                logp, torch.tensor([before]), advantage.reshape(1),
                torch.tensor(token_weights([1], config)), torch.tensor([True]), config,
            )  # fmt: skip
            loss.backward()
            with torch.no_grad():
                logits -= 0.5 * logits.grad
            logits.grad = None
        after = torch.log_softmax(logits, 0)[token].item()
        assert abs(after - teacher[token].item()) < abs(before - teacher[token].item())
        assert (after > before) == (advantage > 0)


def test_per_token_advantages_meet_their_tokens_in_a_packed_micro_batch(policy):
    """Two samples packed together: the loss micro_batch_loss computes equals the one
    computed by hand with each token's own advantage and ratio (pack's order)."""
    from overnight.trainer.grpo.policy import pack, trained_logprobs
    from overnight.trainer.grpo.step import micro_batch_loss

    a = Sample("a", "g", [5, 6, 7, 8, 9], [False, False, True, True, True],
               [0.0, 0.0, -3.0, -4.0, -5.0], 1, token_advantages=(0, 0, 1.0, -2.0, 0.5))  # fmt: skip
    b = Sample("b", "g", [5, 6, 10, 11], [False, False, True, True], [0.0, 0.0, -4.5, -3.5], 1,
               token_advantages=(0, 0, -1.0, 3.0))  # fmt: skip
    config = LossConfig(variant="dapo")
    weights = token_weights([3, 2], config)
    loss, _, _ = micro_batch_loss(policy, [b, a], [weights[1], weights[0]], config)
    with torch.no_grad():
        logp = (
            trained_logprobs(policy, pack([a]), 64).tolist()
            + trained_logprobs(policy, pack([b]), 64).tolist()
        )
    behaviour = [-3.0, -4.0, -5.0, -4.5, -3.5]
    advantages = [1.0, -2.0, 0.5, -1.0, 3.0]
    expected = 0.0
    for lp, old, adv in zip(logp, behaviour, advantages, strict=True):
        ratio = torch.exp(torch.tensor(lp - old))
        surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
        surrogate = max(surrogate, torch.tensor(3.0 * adv)) if adv < 0 else surrogate
        expected += -float(surrogate) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-4)
