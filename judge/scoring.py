"""Scoring two replies to one context, for the trainer's promotion gate
(trainer/night/gate.py's `Scorer`): a reward function when one is given, else RULER. It lives
in the judge because the trainer never imports the judge; the CLI hands it over."""

from __future__ import annotations

from overnight.config import JudgeConfig
from overnight.errors import OvernightError


def pair_scorer(reward: str | None, judge: JudgeConfig | None):
    """Scores for the replies to one context: the reward function when one is given,
    else RULER (replies shuffled by the gate, unlabelled); None without either."""
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

    async def by_judge(messages, tools, replies) -> list[float]:
        if all(r == replies[0] for r in replies):
            return [0.0] * len(replies)  # the same reply twice: a tie, no call
        judgment = await judge_group(group_of(messages, tools, replies), judge)
        if judgment.error:
            raise OvernightError(f"the judge failed: {judgment.error}")
        return [judgment.scores[f"gate.{i}"][0] for i in range(len(replies))]

    return by_judge
