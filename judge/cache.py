"""What the judge remembers between runs, so that it never pays twice for nothing.

Every judgment row records two keys (besides the judge model and the rubric's hash):
- the *judge key* (in `notes`): a hash of everything but the group that changes the
  answer: model, base URL, temperature, max tokens, the `--judge-arg`s, the rubric, the
  prompt's own wording and how it is shortened;
- the *prompt hash* (the `prompt_hash` column): the judge key and exactly the messages
  sent, so it changes when the group does.

A later run skips a group that was judged, or found to have fewer than two distinct
trajectories, under the same judge key; and a prompt whose last failure was permanent
(it overflowed the context, or the judge refused it as invalid) is not sent again. A
transient failure (rate limit, 5xx, timeout, an answer that did not parse) is retried
by the next run. `--rejudge` forgets all of it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from overnight.config import JudgeConfig

PERMANENT = "permanent"  # resending the same prompt to the same judge fails the same way
TRANSIENT = "transient"  # rate limits, 5xx, timeouts: the next run tries again
ANSWER = "answer"  # the judge answered, never usably: another try may do better
NO_SIGNAL = "no_signal"  # fewer than two distinct trajectories: nothing was sent

# What litellm raises for a request that will fail again as it is: too long for the
# context, refused as invalid (400, 404 for an unknown route, 413, 422), content policy.
_PERMANENT_ERRORS = frozenset(
    {
        "ContextWindowExceededError",
        "BadRequestError",
        "UnprocessableEntityError",
        "ContentPolicyViolationError",
        "UnsupportedParamsError",
    }
)
_PERMANENT_STATUS = frozenset({400, 413, 422})


def error_class(error: BaseException) -> str:
    """PERMANENT or TRANSIENT for an exception of the judge call. Authentication and
    'not found' count as transient: they are the configuration's, not the prompt's, and
    fixing them does not change the judge key."""
    names = {c.__name__ for c in type(error).__mro__}
    status = getattr(error, "status_code", None)
    if names & _PERMANENT_ERRORS or status in _PERMANENT_STATUS:
        return PERMANENT
    return TRANSIENT


def judge_key(config: JudgeConfig, rubric: str, prompt_format: str) -> str:
    """The hash of what, besides the group, changes the judge's answer."""
    what = {
        "model": config.model,
        "base_url": (config.base_url or "").rstrip("/"),
        "temperature": config.temperature,
        "max_tokens": config.max_tokens,
        "args": config.extra_args,
        "rubric": rubric,
        "max_tool_chars": config.max_tool_chars,
        "max_prompt_tokens": config.max_prompt_tokens,
        "format": prompt_format,
    }
    return _hash(what)[:16]


def prompt_key(key: str, messages: list[dict]) -> str:
    """The cache key of one request: the judge key and exactly the messages sent."""
    return _hash({"judge": key, "messages": messages})


def _hash(value) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Memory:
    """What earlier runs of this judge (model, rubric, settings) decided."""

    judged_groups: set[str] = field(default_factory=set)
    judged_prompts: set[str] = field(default_factory=set)
    no_signal: set[str] = field(default_factory=set)  # groups
    failed: dict[str, str] = field(default_factory=dict)  # prompt hash -> permanent error


def remembered(con, config: JudgeConfig, rubric_hash: str, key: str) -> Memory:
    """Memory from the judgments table. Rows written before the judge key was recorded
    count as this judge's whatever its settings (they were cached on model and rubric)."""
    rows = con.execute(
        "SELECT group_id, prompt_hash, error, notes FROM judgments "
        "WHERE judge_model = ? AND rubric_hash = ? ORDER BY created_at",
        [config.model, rubric_hash],
    ).fetchall()
    memory = Memory()
    for group_id, prompt_hash, error, notes in rows:
        notes = _notes(notes)
        if notes.get("judge_key", key) != key:
            continue
        kind = notes.get("error_class")
        if error is None:
            memory.judged_groups.add(group_id)
            memory.judged_prompts.add(prompt_hash)
            memory.failed.pop(prompt_hash, None)
        elif kind == NO_SIGNAL:
            memory.no_signal.add(group_id)
        elif kind == PERMANENT:
            memory.failed[prompt_hash] = error
        else:  # a transient failure: a later failure or success of the same prompt wins
            memory.failed.pop(prompt_hash, None)
    return memory


def _notes(notes) -> dict:
    if isinstance(notes, dict):
        return notes
    try:
        value = json.loads(notes) if notes else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
