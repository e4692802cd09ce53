"""Scoring two replies to one context, for the trainer's promotion gate
(trainer/gate/verdict.py's `Scorer`): a reward function when one is given, else RULER. It lives
in the judge because the trainer never imports the judge; the CLI hands it over."""

from __future__ import annotations

from overnight.config import JudgeConfig
from overnight.errors import OvernightError


def pair_scorer(reward: str | None, judge: JudgeConfig | None, data_dir=None):
    """Scores for the replies to one context: the reward function when one is given,
    else RULER (replies shuffled by the gate, unlabelled); None without either. A judge
    that sees images (judge/images.py) gets the pictures the context shows, read from
    `data_dir`'s image store, as the nightly scoring's judge does."""
    if reward is None and judge is None:
        return None
    from .trajectories import Group, Trajectory

    def group_of(messages: list[dict], tools: list[dict], replies: list[dict]) -> Group:
        return Group(
            "gate", [Trajectory(f"gate.{i}", [*messages, r], tools) for i, r in enumerate(replies)]
        )

    if reward is not None:
        from .rewards import RewardFunction

        function = RewardFunction(reward)

        async def by_function(messages, tools, replies) -> list[float]:
            scores = await function.score_group(group_of(messages, tools, replies))
            return [scores[f"gate.{i}"] for i in range(len(replies))]

        return by_function
    from .ruler import judge_group

    shown = None
    if data_dir is not None:
        from .images import sees_images

        if sees_images(judge):
            from .budget import budget_for, counter_for

            shown = (budget_for(judge), counter_for(judge.model))

    async def by_judge(messages, tools, replies) -> list[float]:
        if all(r == replies[0] for r in replies):
            return [0.0] * len(replies)  # the same reply twice: a tie, no call
        group, prompt = group_of(messages, tools, replies), None
        if shown is not None:
            from .images import fitted_with_images

            prompt = fitted_with_images(group, judge, *shown, data_dir)
        judgment = await judge_group(group, judge, prompt)
        if judgment.error:
            raise OvernightError(f"the judge failed: {judgment.error}")
        return [judgment.scores[f"gate.{i}"][0] for i in range(len(replies))]

    return by_judge
