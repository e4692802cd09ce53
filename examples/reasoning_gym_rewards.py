"""A reward function for examples/reasoning_gym_agent.py's conversations: the task's own verifier.

    REASONING_GYM_INDEX=index.json overnight train ... \\
        --gate-reward examples/reasoning_gym_rewards.py:score_answer

The agent posts reasoning-gym's `score_answer` as each attempt's reward itself; what has no
agent to post it is the gate, which samples the candidate and the served adapter on held-out
prompts and scores the replies with a reward function that gets only the conversation. The
agent's questions are deterministic for a task, its difficulty and a seed, so the function
finds a reply's entry from the question text: REASONING_GYM_INDEX names a JSON file listing
the datasets asked (`[{"task", "difficulty", "seed", "size"}]`, the agent's --task,
--difficulty, --seed (plus HELD_OUT_SEED when held out) and --size; bench/learning.py
writes it), and the reply (stripped, as the agent strips it) is scored by that dataset's
`score_answer`. A question in none of them is an error, not a zero: a wrong index would
otherwise pass for a model that never answers right. A verifier that raises on a malformed
reply scores it 0.0. Some tasks' questions depend on Python's string hashing (ransom_note,
isomorphic_strings): run the agent and `overnight train` with the same PYTHONHASHSEED.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

INDEX_ENV = "REASONING_GYM_INDEX"
_CACHE: dict[tuple[str, float], dict[str, tuple[object, dict]]] = {}


def datasets(specs: list[dict]) -> dict[str, tuple[object, dict]]:
    """Each question of the datasets `specs` names: (its dataset, its entry); the first
    dataset holding a question wins (a question asked twice has one answer)."""
    import reasoning_gym  # the `tasks` extra

    found: dict[str, tuple[object, dict]] = {}
    for spec in specs:
        ds = reasoning_gym.create_dataset(
            spec["task"], size=int(spec["size"]), seed=int(spec["seed"]),
            **spec.get("difficulty", {}),
        )  # fmt: skip
        for i in range(len(ds)):
            entry = ds[i]
            found.setdefault(entry["question"].strip(), (ds, entry))
    return found


def index(path: str | None = None) -> dict[str, tuple[object, dict]]:
    """The questions of the index file at `path` (default: $REASONING_GYM_INDEX), built once
    per version of the file."""
    path = path or os.environ.get(INDEX_ENV)
    if not path:
        raise LookupError(f"set {INDEX_ENV} to a JSON list of the datasets the agent asked")
    key = (str(Path(path).resolve()), Path(path).stat().st_mtime)
    if key not in _CACHE:
        _CACHE[key] = datasets(json.loads(Path(path).read_text()))
    return _CACHE[key]


def lookup(messages: list[dict], path: str | None = None) -> tuple[object, dict]:
    """The dataset and entry of the conversation's question: its last user message (the
    ones before it are the agent's worked examples)."""
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    question = users[-1] if users else None
    if isinstance(question, list):  # content parts: the text ones
        question = "".join(p.get("text", "") for p in question if isinstance(p, dict))
    found = index(path).get((question or "").strip())
    if found is None:
        raise LookupError(
            f"no dataset in the index asks {str(question)[:80]!r} (the agent and this "
            "process need the same PYTHONHASHSEED where a task's questions depend on it)"
        )
    return found


def score_answer(rollout: dict) -> float:
    """The task verifier's score of the conversation's last reply, as the agent scores it."""
    messages = rollout["messages"]
    dataset, entry = lookup(messages)
    reply = messages[-1].get("content") if messages[-1].get("role") == "assistant" else ""
    try:
        return float(dataset.score_answer((reply or "").strip(), entry))
    except Exception:  # a verifier that chokes on a malformed reply: a wrong answer
        return 0.0
