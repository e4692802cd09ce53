"""The judge's prompt within a budget of tokens: counted, then shortened where it costs least.

A prompt larger than the judge's context window fails on every try, so a group over
the budget is shortened before it is sent, in order of least value to the judge:
first the middles of tool outputs (a judge needs their start and end to follow the
story), then the middles of long messages, never the last turn of a trajectory (the
answer being judged) and never the rubric or the instructions. What was cut is stated
in the prompt (so the judge knows) and kept with the judgment (so people know).

Tokens are counted with litellm's counter for the judge model where litellm knows the
model; otherwise with the stated estimate of 4 characters per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from overnight.config import JudgeConfig

from . import import_litellm
from .trajectories import shorten

CHARS_PER_TOKEN = 4  # the estimate for a judge litellm has no tokenizer for
FLOOR = 200  # a shortened text keeps at least this many characters, head and tail
LONG_MESSAGE = 600  # messages shorter than this are never cut: too little to gain
MARKER_CHARS = 60  # what `shorten`'s "[... N characters omitted ...]" adds
NOTE_TOKENS = 80  # room kept for the sentence that tells the judge what was cut


@dataclass(frozen=True)
class Counter:
    name: str  # "litellm" or "chars/4": recorded with what was cut
    count: Callable[[list[dict]], int]  # chat messages -> tokens


def estimate(messages: list[dict]) -> int:
    """Characters / 4, plus a few tokens per message for the chat template."""
    return sum(len(str(m.get("content") or "")) for m in messages) // CHARS_PER_TOKEN + 4 * len(
        messages
    )


def counter_for(model: str) -> Counter:
    """litellm's token counter when litellm knows the model, else the estimate."""
    litellm = import_litellm()
    try:
        litellm.get_model_info(model)
    except Exception:  # unmapped (a self-hosted judge): its tokenizer is unknown
        return Counter(f"chars/{CHARS_PER_TOKEN}", estimate)
    return Counter(
        "litellm", lambda messages: litellm.token_counter(model=model, messages=messages)
    )


def budget_for(config: JudgeConfig) -> int | None:
    """--judge-max-prompt-tokens, else the judge's input window when litellm knows it."""
    if config.max_prompt_tokens is not None:
        return config.max_prompt_tokens
    try:
        return import_litellm().get_model_info(config.model).get("max_input_tokens") or None
    except Exception:
        return None


@dataclass(frozen=True)
class Block:
    """One piece of the prompt's text: only `tool` and `message` blocks may be cut."""

    text: str
    kind: str  # "tool", "message" or "fixed"


@dataclass
class Cut:
    """What fitting a prompt into its budget cut (stored with the judgment)."""

    budget: int
    counter: str
    tokens_before: int
    tokens_after: int = 0
    tool_outputs: int = 0
    tool_chars: int = 0
    messages: int = 0
    message_chars: int = 0

    @property
    def fits(self) -> bool:
        return self.tokens_after <= self.budget

    def sentence(self) -> str:
        parts = []
        if self.tool_outputs:
            parts.append(f"{self.tool_outputs} tool output(s) by {self.tool_chars} characters")
        if self.messages:
            parts.append(f"{self.messages} long message(s) by {self.message_chars} characters")
        return (
            f"To fit the judge's budget of {self.budget} tokens, the middles of "
            f"{' and '.join(parts) or 'nothing'} were cut"
        )


def fit(
    blocks: list[Block], measure: Callable[[list[str]], int], budget: int | None, counter: str
) -> tuple[list[str], Cut | None]:
    """The blocks' texts, shortened until `measure` (the whole prompt's tokens) is within
    `budget`; and what was cut, or None when nothing had to be."""
    texts = [b.text for b in blocks]
    if budget is None:
        return texts, None
    tokens = measure(texts)
    if tokens <= budget:
        return texts, None
    cut = Cut(budget, counter, tokens)
    target = budget - NOTE_TOKENS
    caps: dict[int, int] = {}
    for kind, smallest in (("tool", FLOOR + MARKER_CHARS), ("message", LONG_MESSAGE)):
        # Counting is exact but the chars-per-token ratio is not: a few rounds converge.
        for _round in range(4):
            if tokens <= target:
                break
            chars = sum(map(len, texts))
            excess = int((tokens - target) * chars / max(tokens, 1) * 1.05) + 16
            sizes = {
                i: min(caps.get(i, len(b.text)), len(b.text))
                for i, b in enumerate(blocks)
                if b.kind == kind and len(b.text) > smallest
            }
            level = _level(list(sizes.values()), excess)
            if level is None:
                break
            for i, size in sizes.items():
                if size > level + MARKER_CHARS:
                    caps[i] = level
                    texts[i] = shorten(blocks[i].text, level)[0]
            tokens = measure(texts)
    cut.tokens_after = tokens
    for i in caps:
        saved = len(blocks[i].text) - len(texts[i])
        if blocks[i].kind == "tool":
            cut.tool_outputs, cut.tool_chars = cut.tool_outputs + 1, cut.tool_chars + saved
        else:
            cut.messages, cut.message_chars = cut.messages + 1, cut.message_chars + saved
    return texts, cut


def _level(sizes: list[int], excess: int) -> int | None:
    """The largest length L >= FLOOR such that cutting every size above L down to L
    saves at least `excess` characters (FLOOR when even that is not enough): the
    longest texts lose the most, and each keeps as much as the budget allows."""
    if not sizes or max(sizes) <= FLOOR + MARKER_CHARS:
        return None
    lo, hi = FLOOR, max(sizes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(max(0, s - mid - MARKER_CHARS) for s in sizes) >= excess:
            lo = mid
        else:
            hi = mid - 1
    return lo
