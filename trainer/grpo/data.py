"""Logged records become training samples: token sequences exactly as vLLM sampled them.

No chat template is re-rendered. A rollout's turns are taken in order; a turn whose
prompt starts with everything before it (the previous prompt plus the completion the
model sampled) extends the same sequence, so a multi-turn conversation trains as one
sequence; otherwise a new sequence starts (for example when the agent rewrote its
history, or the template re-tokenised a reply differently from how it was sampled).
Only sampled tokens are trained: the system prompt, user turns and tool outputs are
context (masked out). Each trained token carries the logprob it was sampled with,
which is the behaviour policy of the importance ratio, and how it was sampled
(temperature, top-k, top-p: trainer/grpo/sampling.py), so the trainer computes the same
distribution.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from .images import VisionInputs
from .sampling import NEUTRAL, SamplingParams


class DataError(ValueError):
    """A record that cannot be trained on as logged; the message says why."""


@dataclass(frozen=True)
class Turn:
    prompt_ids: list[int]
    completion_ids: list[int]
    # One per completion token, as vLLM sampled it; None when unknown (re-tokenised).
    logprobs: list[float] | None
    # How the completion was sampled (the logprobs are of that distribution).
    sampling: SamplingParams = NEUTRAL
    # The model name that sampled it (`model_served`): which adapter's distribution.
    served_by: str | None = None
    # The images its prompt shows, through the model's processor (images.py); None: none.
    vision: VisionInputs | None = None

    def __post_init__(self) -> None:
        if not self.completion_ids:
            raise DataError("a turn without completion tokens")
        if self.logprobs is None:
            return
        if len(self.logprobs) != len(self.completion_ids):
            raise DataError(
                f"{len(self.completion_ids)} completion tokens but {len(self.logprobs)} logprobs"
            )
        if not all(math.isfinite(lp) for lp in self.logprobs):
            # An infinite behaviour logprob makes an infinite ratio; such a turn is unusable.
            raise DataError("a logged logprob is not finite")


@dataclass(frozen=True)
class Sample:
    """One sequence to train on: the merged turns of (part of) a rollout.

    Built whole, once (`from_turns`); the planner attaches the advantage and the trainer
    the behaviour logprobs of re-tokenised turns by making new samples (`replace`).
    """

    rollout_id: str
    group_id: str
    tokens: list[int]
    trained: list[bool]  # True where the model sampled the token
    behaviour_logprobs: list[float]  # 0.0 where not trained, or where unknown (not exact)
    turns: int
    advantage: float = 0.0
    exact: bool = True  # False when a turn was re-tokenised: behaviour logprobs unknown
    # Per token, how it was sampled (context tokens: NEUTRAL); empty: all NEUTRAL.
    sampling: tuple[SamplingParams, ...] = ()
    # The model names that sampled its turns, in order, and how many promotions the
    # oldest is from the adapter a run starts from (trainer/choose/staleness.py; None:
    # not known, as without a proxy).
    served_by: tuple[str, ...] = ()
    staleness: int | None = None
    # Every image of the sequence (its last turn's prompt shows them all); None: none.
    vision: VisionInputs | None = None
    # Per token, an advantage of its own (0.0 at context tokens): a --hindsight distill
    # night's teacher-minus-student logprobs (grpo/distill.py). Empty: `advantage` on
    # every trained token, as GRPO's sequence-level advantage.
    token_advantages: tuple[float, ...] = ()

    @property
    def trained_tokens(self) -> int:
        return sum(self.trained)

    def trained_advantages(self) -> list[float]:
        """The advantage of each trained token, in order."""
        if not self.token_advantages:
            return [self.advantage] * self.trained_tokens
        return [a for a, t in zip(self.token_advantages, self.trained, strict=True) if t]

    @classmethod
    def from_turns(cls, rollout_id: str, group_id: str, turns: list[Turn]) -> Sample:
        """Turns whose prompts each start with everything before them, as one sequence."""
        tokens: list[int] = []
        trained: list[bool] = []
        behaviour: list[float] = []
        sampling: list[SamplingParams] = []
        for turn in turns:
            context = turn.prompt_ids[len(tokens) :]
            sampled = (
                turn.logprobs if turn.logprobs is not None else [0.0] * len(turn.completion_ids)
            )
            tokens += context + turn.completion_ids
            trained += [False] * len(context) + [True] * len(turn.completion_ids)
            behaviour += [0.0] * len(context) + list(sampled)
            sampling += [NEUTRAL] * len(context) + [turn.sampling] * len(turn.completion_ids)
        exact = all(turn.logprobs is not None for turn in turns)
        sampled_as = () if all(p == NEUTRAL for p in sampling) else tuple(sampling)
        served_by = tuple(dict.fromkeys(t.served_by for t in turns if t.served_by is not None))
        return cls(
            rollout_id,
            group_id,
            tokens,
            trained,
            behaviour,
            len(turns),
            exact=exact,
            sampling=sampled_as,
            served_by=served_by,
            vision=turns[-1].vision,
        )


def merge_turns(rollout_id: str, group_id: str, turns: list[Turn]) -> list[Sample]:
    """Samples for one rollout; `turns` in the order they were served."""
    chains: list[list[Turn]] = []
    sequence: list[int] = []  # the current chain's tokens so far
    for turn in turns:
        # Image tokens are placeholders: the same ids may stand for other pictures.
        same_images = not chains or _images_extend(turn, chains[-1][-1])
        if chains and turn.prompt_ids[: len(sequence)] == sequence and same_images:
            chains[-1].append(turn)
        else:
            chains.append([turn])
        # Extended or new, the sequence is now this turn's prompt and completion.
        sequence = turn.prompt_ids + turn.completion_ids
    return [Sample.from_turns(rollout_id, group_id, chain) for chain in chains]


def _images_extend(turn: Turn, earlier: Turn) -> bool:
    if turn.vision is None:
        return earlier.vision is None
    return turn.vision.extends(earlier.vision)


@dataclass(frozen=True)
class GroupAdvantages:
    advantages: dict[str, float]  # rollout -> advantage
    mean: float
    std: float


def keep_signs(
    adv: GroupAdvantages, rewards: dict[str, float], signed: set[str]
) -> GroupAdvantages:
    """`adv` with the advantage of each rollout in `signed` cut to 0 where it has the
    opposite sign of its reward. For rewards whose sign says something of itself: an
    implicit reward below 0 is a complaint, above 0 approval (judge/implicit.py). Against
    a baseline of a pool that is mostly complaints, a milder complaint would otherwise
    earn a positive advantage, and the night would train towards the answer a user
    complained about."""
    cut = {}
    for r, a in adv.advantages.items():
        value = rewards[r]
        wrong_way = r in signed and ((value < 0 < a) or (a < 0 < value))
        cut[r] = 0.0 if wrong_way else a
    return GroupAdvantages(cut, adv.mean, adv.std)


def group_advantages(
    rewards: dict[str, float], scale_by_std: bool = True, eps: float = 1e-6
) -> GroupAdvantages | None:
    """Reward minus the group's mean, divided by its standard deviation if asked.

    None when the group carries no signal: fewer than two rollouts, or all rewards
    equal (every advantage would be zero). The std is the sample standard deviation
    (n - 1), as in GRPO's reference implementations.
    """
    if len(rewards) < 2:
        return None
    values = list(rewards.values())
    if any(not math.isfinite(v) for v in values):
        raise DataError(f"non-finite reward in {rewards}")
    mean = statistics.fmean(values)
    std = statistics.stdev(values)
    if std < eps:
        return None
    scale = std + eps if scale_by_std else 1.0
    return GroupAdvantages({r: (v - mean) / scale for r, v in rewards.items()}, mean, std)
