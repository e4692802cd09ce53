"""Reward functions for the examples, for `overnight judge --reward examples/rewards.py:NAME`.

A reward function gets one rollout, `{"rollout_id", "group_id", "messages", "tools"}`
with the whole conversation in `messages`, and returns a number: higher is better.
"""

from __future__ import annotations

import re

try:  # installed: overnight.examples.rewards
    from .tool_agent import CITIES
except ImportError:  # loaded by path (examples/rewards.py:NAME): examples/ is on sys.path
    from tool_agent import CITIES


def weather_reward(rollout: dict) -> float:
    """1.0 when the last answer gives the asked city's temperature, else 0.0."""
    question = next((m["content"] for m in rollout["messages"] if m.get("role") == "user"), "")
    match = re.search(r"temperature in (\w+)", question or "")
    if not match:
        return 0.0
    expected = str(CITIES[match.group(1).lower()]["temperature"])
    last = rollout["messages"][-1].get("content") or ""
    answer = last.split("ANSWER:", 1)[1].split() if "ANSWER:" in last else []
    return 1.0 if expected in answer else 0.0


def numbers_only(rollout: dict) -> float:
    """The share of words in the last reply that are whole numbers (examples/number_agent.py)."""
    words = (rollout["messages"][-1].get("content") or "").split()
    return sum(w.isdigit() for w in words) / len(words) if words else 0.0


_SUM = re.compile(r"What is (\d+) plus (\d+)\?")
_NUMBER = re.compile(r"-?\d+")


def bare_sum(rollout: dict) -> float:
    """examples/sum_agent.py: 1.0 for the right sum alone ("7", "7."); for the right sum as
    the last number of a longer reply ("5 + 2 = 7"), 0.5 / sqrt(words), so that a shorter
    right reply always beats a longer one (a flat partial credit let a small model settle
    on the sentence: docs/grpo.md); 0.0 for a wrong or missing sum."""
    question = next((m["content"] for m in rollout["messages"] if m.get("role") == "user"), "")
    match = _SUM.search(question or "")
    if not match:
        return 0.0
    expected = str(int(match.group(1)) + int(match.group(2)))
    reply = (rollout["messages"][-1].get("content") or "").strip()
    if reply.rstrip(".") == expected:
        return 1.0
    numbers = _NUMBER.findall(reply)
    if not numbers or numbers[-1] != expected:
        return 0.0
    return 0.5 / len(reply.split()) ** 0.5
