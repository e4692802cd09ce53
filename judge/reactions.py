"""The next user message read by a model where nobody else could read it.

The rules, the cue lexicons and vader (reading.py) read most reactions; what none of
them is sure of falls through to `moved_on`, which says nothing (value 0, no reward).
Those, and only those, go to a classifier: a model through litellm (`overnight signals
--classify-model`, any litellm model string; the model the proxy already serves, through
the local vLLM's OpenAI API, as much as a hosted one). One short prompt; a one-token
answer (`max_tokens` 1, temperature 0) whose `top_logprobs` are read, not its text: the
probability of each label's token (LABELS: "good", "bad", "neutral"), summed over the
spellings a tokenizer gives it ("good", " Good"), and shared out among the three. The
label with at least CONFIDENT of that share is the reading; a share split more evenly,
or an answer with too little of its mass on any label (MIN_MASS: the model answered
something else), is no reading at all, and is counted.

A reading replaces `moved_on` as a signal of its own (`source` "classifier", the model in
`rule`, the labels' shares in `extra`), at confidence CONFIDENCE: below the rules' sure
readings. "neutral" reads as `moved_on` again, value 0: a new request says nothing.
Calls, tokens and cost are counted as the judge's are (ruler.complete) and printed by
`overnight signals`. A message is read once: what the classifier said is a row of
`signals`, found again by the next run (implicit.py) instead of asking again. The model
must return logprobs (vLLM and OpenAI do); one that does not gives no reading.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field, replace

from overnight.config import JudgeConfig

from . import import_litellm
from .ruler import CallCounts, complete
from .signals import ACCEPTED, CORRECTED, MOVED_ON, Signal

# Each label's first token -> (kind, value): the rules' values for the same kinds.
LABELS = {
    "good": (ACCEPTED, 1.0),
    "bad": (CORRECTED, -1.0),
    "neutral": (MOVED_ON, 0.0),
}
# The share of the labels' probability the most likely one needs to be a reading.
CONFIDENT = 0.6
# The labels' tokens must hold this much of the answer's probability: below it the
# model meant something else, and its preference among them says little.
MIN_MASS = 0.2
TOP_LOGPROBS = 10
# Below the rules' sure readings (0.7-0.8: a pattern that fired).
CONFIDENCE = 0.6
SOURCE = "classifier"
# Each text cut to this many characters: the reaction is in the first words; the
# question and answer are context, not the point.
CONTEXT_CHARS = 600

INSTRUCTIONS = (
    "You read what a user wrote right after an assistant's answer, and say what it tells "
    "about that answer. Reply with one word: good (the user is pleased, thanks it, or "
    "accepts it and goes on), bad (the user complains, says it is wrong, doubts it, "
    "corrects it or asks the same again; politely or sarcastically too), or neutral (the "
    "user only asks something new and says nothing about the answer)."
)


@dataclass
class Tally:
    """What the classifier read this run; its calls counted as the judge's are."""

    model: str = ""
    asked: int = 0  # messages sent to it
    changed: int = 0  # readings other than moved_on
    unreadable: int = 0  # answers with no confident label: moved_on kept
    failed: int = 0  # calls that failed: moved_on kept, asked again next run
    calls: CallCounts = field(default_factory=CallCounts)

    def line(self) -> str:
        calls = self.calls
        return (
            f"classifier {self.model}: {self.asked} message(s) nobody else read, "
            f"{self.changed} read as approval or complaint, {self.unreadable} unreadable "
            f"answer(s), {self.failed} failed call(s); tokens {calls.prompt_tokens} prompt, "
            f"{calls.completion_tokens} completion; cost "
            f"{calls.cost('unknown (no price for this model)')}"
        )


@dataclass(frozen=True)
class Reaction:
    """A message nobody read: the `moved_on` signal and what it was about."""

    guess: Signal
    question: str
    answer: str

    def prompt(self) -> list[dict]:
        return prompt(self.question, self.answer, self.guess.evidence)


def prompt(question: str, answer: str, reaction: str) -> list[dict]:
    """The classifier's messages: the instruction, then what was asked and answered (where
    known) and what the user wrote next, each cut to CONTEXT_CHARS."""

    def cut(text: str) -> str:
        return text[:CONTEXT_CHARS]

    said = ""
    if question:
        said += f"The user asked:\n{cut(question)}\n\n"
    if answer:
        said += f"The assistant answered:\n{cut(answer)}\n\n"
    said += f"The user then wrote:\n{cut(reaction)}\n\nOne word: good, bad or neutral."
    return [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": said}]


def call_config(config: JudgeConfig) -> JudgeConfig:
    """The judge's configuration for a one-token answer with its top logprobs."""
    args = (*config.args, "logprobs=true", f"top_logprobs={TOP_LOGPROBS}")
    return replace(config, max_tokens=1, temperature=0.0, args=args)


def _get(obj, name: str):
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def label_shares(choice) -> tuple[dict[str, float], float] | None:
    """A completion choice's first-token logprobs as (each label's share of the labels'
    probability, the labels' total probability); None where it carries no logprobs. A
    token counts for a label when, stripped and lowercased, it is a start of the label
    at least two letters long ("good", " Good", "neut")."""
    logprobs = _get(choice, "logprobs")
    content = _get(logprobs, "content") if logprobs is not None else None
    if not content:
        return None
    first = content[0]
    candidates = list(_get(first, "top_logprobs") or ()) or [first]
    mass = dict.fromkeys(LABELS, 0.0)
    seen = set()
    for entry in candidates:
        token, logprob = _get(entry, "token"), _get(entry, "logprob")
        if not isinstance(token, str) or not isinstance(logprob, int | float) or token in seen:
            continue
        seen.add(token)
        word = token.strip().strip(".\"'").lower()
        label = next((k for k in LABELS if len(word) >= 2 and k.startswith(word)), None)
        if label is not None:
            mass[label] += math.exp(logprob)
    total = sum(mass.values())
    if total <= 0:
        return {k: 0.0 for k in LABELS}, 0.0
    return {k: v / total for k, v in mass.items()}, total


def decide(shares: dict[str, float], total: float) -> str | None:
    """The label the model is sure of, or None."""
    if total < MIN_MASS:
        return None
    best = max(shares, key=shares.get)
    return best if shares[best] >= CONFIDENT else None


def reading(guess: Signal, label: str, shares: dict[str, float], model: str) -> Signal:
    """The classifier's label as a signal in the guess's place."""
    kind, value = LABELS[label]
    extra = {"answer": label, "shares": {k: round(v, 3) for k, v in shares.items()}}
    return replace(
        guess, kind=kind, value=value, confidence=CONFIDENCE, rule=f"classifier {model}",
        source=SOURCE, extra={**extra, "rules_said": guess.kind},
    )  # fmt: skip


async def ask(
    messages: list[dict], config: JudgeConfig, calls: CallCounts
) -> tuple[str | None, dict[str, float]]:
    """One call: (the label it is sure of or None, the labels' shares). Raises where the
    call fails."""
    litellm = import_litellm()
    response = await complete(litellm, messages, call_config(config), calls, None)
    found = label_shares(response.choices[0])
    if found is None:
        return None, {}
    shares, total = found
    return decide(shares, total), shares


async def classify(reactions: list[Reaction], config: JudgeConfig, tally: Tally) -> list[Signal]:
    """Each reaction's reading by the classifier, or its `moved_on` kept (no confident
    label, a failed call)."""
    tally.model = config.model
    limit = asyncio.Semaphore(config.concurrency)

    async def one(r: Reaction) -> Signal:
        async with limit:
            tally.asked += 1
            try:
                label, shares = await ask(r.prompt(), config, tally.calls)
            except Exception:  # a call that fails keeps the guess; the next run asks again
                tally.failed += 1
                return r.guess
        if label is None:
            tally.unreadable += 1
            return r.guess
        found = reading(r.guess, label, shares, config.model)
        tally.changed += found.kind != r.guess.kind
        return found

    return list(await asyncio.gather(*map(one, reactions)))
