"""RULER: an LLM judge scores the trajectories of one group relative to each other.

GRPO only needs scores that order the rollouts of a group, and judging side by side
is easier than judging alone: the judge sees the shared context once, then every
trajectory from where it diverges, and answers with one score in [0, 1] and a short
explanation each. The answer is checked (one score per trajectory, ids that match,
numbers in range); a bad answer is sent back with what was wrong, a bounded number of
times. (RULER comes from OpenPipe ART; this is our own implementation.)

`build_prompt` and `parse_scores` are pure; `judge_group` makes the litellm call.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import random
import re
import time
from dataclasses import dataclass, field

from overnight.config import JudgeConfig
from overnight.telemetry import phase

from . import import_litellm
from .budget import Block, Counter, Cut, estimate, fit
from .cache import ANSWER, PERMANENT, error_class, judge_key, prompt_key
from .trajectories import (
    MARKER_ROLE,
    Group,
    content_text,
    distinct,
    shared_prefix,
    trim_tool_outputs,
)

DEFAULT_RUBRIC = """\
- A trajectory that reaches the goal set by the system and user messages scores higher
  than one that does not; one that makes progress scores higher than one that makes none.
- Among those that reach it, prefer correct details, fewer wasted steps and tool calls,
  and answers in the form that was asked for.
- Use the whole range: the best trajectory here can score near 1 and the worst near 0;
  differences in score should follow differences in quality. Equal work, equal score."""

SYSTEM = """\
You are a careful judge. Several attempts (trajectories) at the same task are shown
side by side. Messages every attempt shares are given once as <context>; each
<trajectory> continues from there. Score every trajectory from 0 to 1 against the
rubric, relative to the others, and explain each score in one or two sentences.
A line "--- turn N does not continue the conversation above ... ---" marks a turn of
the same attempt that starts a new context (a compacted history, a summary, a
sub-agent): what follows belongs to the attempt as much as what came before.
Answer with JSON only: {"scores": [{"trajectory_id": "1", "explanation": "...",
"score": 0.5}, ...]}, one entry per trajectory."""

RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "ruler_scores",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "scores": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "trajectory_id": {"type": "string"},
                            "explanation": {"type": "string"},
                            "score": {"type": "number", "minimum": 0, "maximum": 1},
                        },
                        "required": ["trajectory_id", "explanation", "score"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["scores"],
            "additionalProperties": False,
        },
    },
}


def rubric_hash(rubric: str) -> str:
    return hashlib.sha256(rubric.encode()).hexdigest()[:16]


# The prompt's own wording and answer format: a new wording is a new judge (cache key).
PROMPT_FORMAT = hashlib.sha256(
    (SYSTEM + json.dumps(RESPONSE_FORMAT, sort_keys=True)).encode()
).hexdigest()[:16]


def key_of(config: JudgeConfig) -> str:
    """The judge key (judge/cache.py) of this judge, its settings and its rubric."""
    return judge_key(config, config.rubric or DEFAULT_RUBRIC, PROMPT_FORMAT)


# -- the prompt -----------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    messages: list[dict]  # what is sent to the judge
    ids: list[str]  # trajectory ids in the prompt, "1".."N"
    rollouts: dict[str, str]  # trajectory id -> the rollout it stands for
    representative: dict[str, str]  # every rollout -> the judged rollout it duplicates
    shortened: int  # tool outputs cut in the middle
    cut: Cut | None = None  # what fitting the budget cut; None when nothing had to be

    @property
    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.messages, sort_keys=True).encode()).hexdigest()


def render_message(message: dict) -> str:
    role = message.get("role", "?")
    if role == MARKER_ROLE:
        return f"--- {message.get('content')} ---"
    content = content_text(message.get("content"))
    lines = []
    if role == "tool":
        lines.append(
            f"[tool result {message.get('tool_call_id') or ''}] {content}".replace("  ", " ")
        )
    elif content:
        lines.append(f"[{role}] {content}")
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        lines.append(f"[{role} calls {fn.get('name')}] {fn.get('arguments')} (id {call.get('id')})")
    return "\n".join(lines) or f"[{role}]"


def _block(message: dict, last: bool = False) -> Block:
    """A rendered message, and whether the budget may cut it (never a trajectory's last)."""
    role = message.get("role")
    kind = "fixed" if last or role == MARKER_ROLE else "tool" if role == "tool" else "message"
    return Block(render_message(message), kind)


def build_prompt(
    group: Group,
    rubric: str,
    max_tool_chars: int,
    share_prefix: bool = True,
    *,
    budget: int | None = None,
    counter: Counter | None = None,
) -> Prompt:
    """The judge's messages, within `budget` tokens (as `counter` counts them) when given.
    `share_prefix=False` sends every trajectory whole (and its tools with it): only for
    measuring what the packing saves."""
    unique, representative = distinct(group.trajectories)
    prefix = shared_prefix(unique) if share_prefix else 0
    context = unique[0].messages[:prefix]
    tools_alike = share_prefix and all(t.tools == unique[0].tools for t in unique)
    fixed = lambda text: Block(text, "fixed")  # noqa: E731
    blocks = [fixed("<context>"), *map(_block, context), fixed("</context>")]
    if tools_alike and unique[0].tools:
        blocks += [fixed("<tools>"), fixed(json.dumps(unique[0].tools, ensure_ascii=False))]
        blocks.append(fixed("</tools>"))
    rollouts, shortened = {}, 0
    for i, t in enumerate(unique, start=1):
        messages, cut = trim_tool_outputs(t.messages[prefix:], max_tool_chars)
        shortened += cut
        blocks.append(fixed(f'<trajectory id="{i}">'))
        if not tools_alike and t.tools:
            blocks.append(fixed("<tools>" + json.dumps(t.tools, ensure_ascii=False) + "</tools>"))
        blocks += [_block(m, last=j == len(messages) - 1) for j, m in enumerate(messages)]
        blocks.append(fixed("</trajectory>"))
        rollouts[str(i)] = t.rollout_id
    blocks += [fixed("<rubric>"), fixed(rubric), fixed("</rubric>")]
    blocks.append(fixed(f"Score all {len(unique)} trajectories, ids 1 to {len(unique)}."))
    count = counter or Counter("chars/4", estimate)
    texts, budget_cut = fit(blocks, lambda texts: count.count(_messages(texts)), budget, count.name)
    notes = []
    if shortened:
        notes.append(f"{shortened} long tool output(s) were shortened in the middle")
    if budget_cut is not None:
        notes.append(budget_cut.sentence())
    if notes:
        texts.insert(
            len(texts) - 1,
            f"Note: {'; '.join(notes)}; the marker '[... N characters omitted ...]' shows where.",
        )
    return Prompt(_messages(texts), list(rollouts), rollouts, representative, shortened, budget_cut)


def _messages(texts: list[str]) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\n".join(texts)}]


# -- the answer -----------------------------------------------------------------------


class BadAnswer(Exception):
    """The judge's answer does not fit; the message says how, for the retry."""


def parse_scores(text: str | None, ids: list[str]) -> dict[str, tuple[float, str]]:
    """{trajectory id: (score, explanation)} or BadAnswer."""
    if not text or not text.strip():
        raise BadAnswer("the answer was empty")
    text = re.sub(r"^\s*```(?:json)?\s*|\s*```\s*$", "", text.strip())
    try:
        data = json.loads(text)
    except ValueError as e:
        raise BadAnswer(f"the answer is not valid JSON ({e})") from None
    scores = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(scores, list):
        raise BadAnswer('the answer needs a "scores" list')
    found: dict[str, tuple[float, str]] = {}
    for entry in scores:
        if not isinstance(entry, dict):
            raise BadAnswer("each score must be an object")
        tid = str(entry.get("trajectory_id", "")).strip()
        score = entry.get("score")
        if tid not in ids:
            raise BadAnswer(f"unknown trajectory_id {tid!r}; the ids are {', '.join(ids)}")
        if tid in found:
            raise BadAnswer(f"trajectory {tid} was scored twice")
        if (
            isinstance(score, bool)
            or not isinstance(score, int | float)
            or not math.isfinite(score)
        ):
            raise BadAnswer(f"the score of trajectory {tid} is not a number")
        if not 0 <= score <= 1:
            raise BadAnswer(f"the score of trajectory {tid} is {score}, outside [0, 1]")
        found[tid] = (float(score), str(entry.get("explanation", "")))
    missing = [i for i in ids if i not in found]
    if missing:
        raise BadAnswer(f"trajectories {', '.join(missing)} have no score")
    return found


# -- the call -------------------------------------------------------------------------


@dataclass
class CallCounts:
    """What a model's calls cost, counted by `complete`: the judge's per group and per run,
    the reaction classifier's per run (judge/reactions.py)."""

    attempts: int = 0  # calls made, retries included
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None  # None: litellm knows no price for the model

    def add(self, other: CallCounts) -> None:
        self.attempts += other.attempts
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        if other.cost_usd is not None:
            self.cost_usd = (self.cost_usd or 0.0) + other.cost_usd

    def cost(self, unknown: str) -> str:
        return unknown if self.cost_usd is None else f"${self.cost_usd:.4f}"


@dataclass
class Judgment:
    group_id: str
    prompt_hash: str  # the cache key: the judge key and the messages (judge/cache.py)
    judge_key: str = ""
    scores: dict[str, tuple[float, str]] = field(default_factory=dict)  # rollout -> (score, why)
    error: str | None = None
    error_class: str | None = None  # judge/cache.py: PERMANENT, TRANSIENT, ANSWER, NO_SIGNAL
    cut: Cut | None = None  # what fitting the budget cut from the prompt
    calls: CallCounts = field(default_factory=CallCounts)
    latency_ms: float = 0.0

    def notes(self) -> dict:
        """What the judgments table keeps in `notes`: the judge key, why it failed, what
        was cut."""
        notes: dict = {"judge_key": self.judge_key}
        if self.error_class:
            notes["error_class"] = self.error_class
        if self.cut is not None:
            notes["prompt_cut"] = {**vars(self.cut), "what": self.cut.sentence()}
        return notes


def prompt_for(
    group: Group, config: JudgeConfig, budget: int | None = None, counter: Counter | None = None
) -> Prompt:
    return build_prompt(
        group,
        config.rubric or DEFAULT_RUBRIC,
        config.max_tool_chars,
        budget=budget,
        counter=counter,
    )


def new_judgment(group: Group, config: JudgeConfig, prompt: Prompt) -> Judgment:
    key = key_of(config)
    return Judgment(group.group_id, prompt_key(key, prompt.messages), key, cut=prompt.cut)


def _judge_span(j: Judgment) -> dict:
    """A judge call's span (one per group, its retries and corrections included): the
    GenAI conventions' names for the model and tokens; never the prompt."""
    return {
        "gen_ai.operation.name": "chat",
        "gen_ai.usage.input_tokens": j.calls.prompt_tokens,
        "gen_ai.usage.output_tokens": j.calls.completion_tokens,
        "group_id": j.group_id,
        "judge.attempts": j.calls.attempts,
        "judge.cost_usd": j.calls.cost_usd,
        "error.type": j.error_class,
    }


async def judge_group(group: Group, config: JudgeConfig, prompt: Prompt | None = None) -> Judgment:
    """Score a group; never raises for the judge's failures (they are in `.error`). In a
    traced night, a span each (overnight/telemetry.py)."""
    model = {"gen_ai.request.model": config.model, "gen_ai.provider.name": "litellm"}
    with phase("judge", group_id=group.group_id, **model) as span:
        judgment = await _judge_group(group, config, prompt)
        span.set(**_judge_span(judgment))
    return judgment


async def _judge_group(group: Group, config: JudgeConfig, prompt: Prompt | None) -> Judgment:
    litellm = import_litellm()

    prompt = prompt or prompt_for(group, config)
    judgment = new_judgment(group, config, prompt)
    if prompt.cut is not None and not prompt.cut.fits:  # it would fail on every try
        judgment.error = (
            f"not sent: the prompt is {prompt.cut.tokens_after} tokens after shortening "
            f"everything but the last turns, over the budget of {prompt.cut.budget}"
        )
        judgment.error_class = PERMANENT
        return judgment
    messages = list(prompt.messages)
    started = time.perf_counter()
    try:
        for _fix in range(config.max_fixes + 1):
            response = await complete(litellm, messages, config, judgment.calls)
            text = response.choices[0].message.content
            try:
                by_id = parse_scores(text, prompt.ids)
            except BadAnswer as e:
                judgment.error, judgment.error_class = f"unusable answer: {e}", ANSWER
                messages += [
                    {"role": "assistant", "content": text or ""},
                    {
                        "role": "user",
                        "content": f"That answer cannot be used: {e}. Answer again "
                        f"with JSON only, one score for each of the "
                        f"trajectories {', '.join(prompt.ids)}.",
                    },
                ]
                continue
            judgment.error = judgment.error_class = None
            judgment.scores = {
                rollout: by_id[_id_of(prompt, rep)]
                for rollout, rep in prompt.representative.items()
            }
            break
    except Exception as e:  # a broken judge fails its group, never the batch
        judgment.error = f"{type(e).__name__}: {e}"[:2000]
        judgment.error_class = error_class(e)
    judgment.latency_ms = (time.perf_counter() - started) * 1000
    return judgment


def _id_of(prompt: Prompt, rollout_id: str) -> str:
    return next(i for i, r in prompt.rollouts.items() if r == rollout_id)


TRANSIENT = (
    "RateLimitError",
    "APIConnectionError",
    "InternalServerError",
    "ServiceUnavailableError",
    "Timeout",
    "APITimeoutError",
    "BadGatewayError",
)


async def complete(
    litellm,
    messages: list[dict],
    config: JudgeConfig,
    counts: CallCounts,
    response_format: dict = RESPONSE_FORMAT,
):
    """One judge call with retries on transient errors; its attempts, tokens and cost
    counted on `counts`."""
    for attempt in range(config.max_retries + 1):
        counts.attempts += 1
        try:
            response = await litellm.acompletion(
                model=config.model,
                messages=messages,
                api_base=config.base_url,
                api_key=config.api_key,
                timeout=config.timeout,
                num_retries=0,
                **_optional(temperature=config.temperature, max_tokens=config.max_tokens),
                # --judge-arg may replace the answer format (a judge without json_schema)
                **{"response_format": response_format, **config.extra_args},
            )
        except Exception as e:
            if type(e).__name__ not in TRANSIENT or attempt == config.max_retries:
                raise
            await asyncio.sleep(_retry_delay(e, attempt))
            continue
        usage = getattr(response, "usage", None)
        counts.prompt_tokens += getattr(usage, "prompt_tokens", 0) or 0
        counts.completion_tokens += getattr(usage, "completion_tokens", 0) or 0
        cost = _cost(litellm, response)
        if cost is not None:
            counts.cost_usd = (counts.cost_usd or 0.0) + cost
        return response
    raise AssertionError("unreachable")


def _optional(**kwargs) -> dict:
    return {k: v for k, v in kwargs.items() if v is not None}


def _retry_delay(e: Exception, attempt: int) -> float:
    """Retry-After when the server sent one (a 429), else exponential backoff with jitter."""
    headers = getattr(getattr(e, "response", None), "headers", None) or {}
    retry_after = headers.get("retry-after") if hasattr(headers, "get") else None
    try:
        if retry_after is not None:
            return min(float(retry_after), 60.0)
    except ValueError:
        pass
    base = float(os.environ.get("OVERNIGHT_JUDGE_BACKOFF", "0.5"))
    return base * 2**attempt * (0.5 + random.random())


def _cost(litellm, response) -> float | None:
    # litellm prices the call itself when it knows the model; a self-hosted judge has
    # no price (asking completion_cost then only raises, and prints a provider list).
    cost = (getattr(response, "_hidden_params", None) or {}).get("response_cost")
    return float(cost) if cost is not None else None
