"""Per-token advantages from a teacher: on-policy distillation through GRPO's loss.

A --hindsight distill night (trainer/choose/hindsight_distill.py) trains the student's
own tokens, the served answer to a turn a user corrected and its resampled siblings, each
as it was sampled. Its teacher is the same policy with the user's correction in its
context: each sample comes with a teacher sample, the teacher's prompt (the hint
included) followed by the same completion tokens. Before any update, one pass without
gradient gives each trained token two logprobs under the starting policy,

    teacher = log pi(y_t | hint, context, y_<t)      student = log pi(y_t | context, y_<t)

and its advantage is `teacher - student`: minus the per-token reverse KL of the student
from the teacher, as on-policy distillation uses it (Agarwal et al. 2024, "On-Policy
Distillation of Language Models"; Thinking Machines' "On-Policy Distillation", 2025). A
token the hint makes likelier is pushed up, one it makes less likely down; GRPO's loss
then weighs each by its importance ratio against the logprob it was sampled with and
clips it, exactly as a sequence advantage (loss.py).

Both logprobs come from the trainer's forward pass, with the same weights and the same
sampling transform (temperature, top-k, top-p: sampling.py), so the advantage is the
hint's effect alone, not the gap between vLLM and the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .data import Sample
from .step import sample_logprobs


@dataclass
class TeacherPass:
    """What the teacher pass found, for the run's record and its line."""

    sequences: int = 0
    tokens: int = 0
    advantage_mean: float = 0.0
    positive: int = 0  # tokens the teacher likes more than the student
    negative: int = 0
    most: float = 0.0  # the largest and smallest token advantage
    least: float = 0.0
    # Samples without a teacher sample: trained at their sequence advantage (0: nothing).
    without_teacher: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def line(self) -> str:
        return (
            f"hindsight teacher pass: {self.sequences} sequence(s), {self.tokens} token(s); "
            f"advantage (teacher - student logprob) mean {self.advantage_mean:+.3f}, from "
            f"{self.least:+.2f} to {self.most:+.2f}; {self.positive} token(s) pushed up, "
            f"{self.negative} down"
        )


def teacher_advantages(
    model, samples: list[Sample], teachers: dict[str, Sample], budget: int, chunk: int
) -> tuple[list[Sample], TeacherPass]:
    """`samples`, each one with a teacher sample (`teachers`, by rollout id) carrying
    its per-token advantages (see the module's docstring); the pass's figures."""
    taught = [s for s in samples if s.rollout_id in teachers]
    found = TeacherPass(without_teacher=len(samples) - len(taught))
    if not taught:
        return samples, found
    student = sample_logprobs(model, taught, budget, chunk)
    teacher = sample_logprobs(model, [teachers[s.rollout_id] for s in taught], budget, chunk)
    out: dict[int, Sample] = {}
    every: list[float] = []
    for s, mine, theirs in zip(taught, student, teacher, strict=True):
        if len(mine) != len(theirs):  # a teacher sample must end in the same completion
            raise ValueError(f"{s.rollout_id}: the teacher's sample has other trained tokens")
        advantages = [t - m for m, t in zip(mine, theirs, strict=True)]
        every += advantages
        out[id(s)] = replace(s, token_advantages=_spread(s, advantages), advantage=0.0)
    found.sequences, found.tokens = len(taught), len(every)
    found.advantage_mean = sum(every) / len(every) if every else 0.0
    found.positive = sum(a > 0 for a in every)
    found.negative = sum(a < 0 for a in every)
    found.most, found.least = max(every, default=0.0), min(every, default=0.0)
    return [out.get(id(s), s) for s in samples], found


def teacher_sample(student: Sample, teacher_prompt: list[int]) -> Sample:
    """The teacher's sequence for `student` (one turn: its prompt, then its completion):
    `teacher_prompt` (the hint in it) followed by the same completion tokens, sampled
    the same way."""
    start = student.trained.index(True)
    if not all(student.trained[start:]):
        raise ValueError("a teacher sample is made for one turn: a prompt, then a completion")
    completion = student.tokens[start:]
    sampling = ()
    if student.sampling:
        sampling = (student.sampling[0],) * len(teacher_prompt) + student.sampling[start:]
    return replace(
        student,
        tokens=list(teacher_prompt) + completion,
        trained=[False] * len(teacher_prompt) + [True] * len(completion),
        behaviour_logprobs=[0.0] * len(teacher_prompt) + student.behaviour_logprobs[start:],
        sampling=sampling,
        vision=None,
    )


def _spread(sample: Sample, trained: list[float]) -> tuple[float, ...]:
    """Trained tokens' advantages laid over the whole sequence (0.0 at context)."""
    values = iter(trained)
    return tuple(next(values) if t else 0.0 for t in sample.trained)
