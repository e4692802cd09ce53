"""The next user message read by a model where the rules only guessed.

The rules (signals.py) read a reaction at the start of the next message: precise where
they fire, blind to the words they do not know ("Are you sure?", "hmm, 7 + 1 is 8",
another language). Every message they do not recognise falls through to `moved_on`, a
guess (value +0.3 at confidence 0.3). Those, and only those, go to a classifier: the
judge model through litellm (`overnight signals --classify-model`, any litellm model
string, a local vLLM as much as a hosted API), with a short prompt and a one-word
answer in a JSON schema. Its reading replaces the guess, as a signal of its own
(`source` "classifier", the model in `rule`, its answer in `evidence`), at confidence
CONFIDENCE: below the rules' sure readings, above their guess.

An answer that is not one of READINGS (garbage, a refusal, a failed call) leaves the
rules' guess as it was, and is counted. Calls, tokens and cost are counted as the
judge's are (ruler.complete) and printed by `overnight signals`. A message is read once:
what the classifier said is a row of `signals`, found again by the next run
(implicit.py) instead of asking again.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace

from overnight.config import JudgeConfig

from . import import_litellm
from .ruler import CallCounts, complete
from .signals import ACCEPTED, CORRECTED, MOVED_ON, RE_ASKED, Signal

# What the classifier may answer -> (kind, value): the rules' values for the same kinds.
READINGS = {
    "accepted": (ACCEPTED, 1.0),
    "corrected": (CORRECTED, -1.0),
    "asked_again": (RE_ASKED, -1.0),
    "new_request": (MOVED_ON, 0.0),
}
# Below the rules' sure readings (0.7-0.8: a pattern that fired), above their guess (0.3).
CONFIDENCE = 0.6
SOURCE = "classifier"
# Each text cut to this many characters: the reaction is in the first words; the
# question and answer are context, not the point.
CONTEXT_CHARS = 600

INSTRUCTIONS = (
    "You read what a user wrote right after an assistant's answer, and say what it tells "
    "about that answer. Answer with one of: accepted (the user is satisfied, thanks it, or "
    "builds on it), corrected (the user says it is wrong, complains, doubts it, or corrects "
    "it), asked_again (the user asks the same thing again), new_request (the user asks "
    "something else and says nothing about the answer)."
)
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "reaction",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"reaction": {"type": "string", "enum": list(READINGS)}},
            "required": ["reaction"],
            "additionalProperties": False,
        },
    },
}


@dataclass
class Tally:
    """What the classifier read this run; its calls counted as the judge's are."""

    model: str = ""
    asked: int = 0  # messages sent to it
    changed: int = 0  # readings that differ from the rules' guess
    unreadable: int = 0  # answers that were none of READINGS: the guess kept
    failed: int = 0  # calls that failed: the guess kept, asked again next run
    calls: CallCounts = field(default_factory=CallCounts)

    def line(self) -> str:
        calls = self.calls
        return (
            f"classifier {self.model}: {self.asked} message(s) the rules only guessed, "
            f"{self.changed} read otherwise, {self.unreadable} unreadable answer(s), "
            f"{self.failed} failed call(s); tokens {calls.prompt_tokens} prompt, "
            f"{calls.completion_tokens} completion; cost "
            f"{calls.cost('unknown (no price for this model)')}"
        )


@dataclass(frozen=True)
class Reaction:
    """A guess to read again: the rules' `moved_on` signal and what it was about."""

    guess: Signal
    question: str
    answer: str

    def prompt(self) -> list[dict]:
        def cut(text: str) -> str:
            return text[:CONTEXT_CHARS]

        said = (
            f"The user asked:\n{cut(self.question)}\n\nThe assistant answered:\n"
            f"{cut(self.answer)}\n\nThe user then wrote:\n{cut(self.guess.evidence)}"
        )
        return [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": said}]


def reading(guess: Signal, answer_text: str, model: str) -> Signal | None:
    """The classifier's answer as a signal in the guess's place; None when it is not one
    of READINGS."""
    word = _word(answer_text)
    if word not in READINGS:
        return None
    kind, value = READINGS[word]
    return replace(
        guess, kind=kind, value=value, confidence=CONFIDENCE, rule=f"classifier {model}",
        source=SOURCE, extra={"answer": word, "rules_said": guess.kind},
    )  # fmt: skip


def _word(text: str) -> str | None:
    try:
        answer = json.loads(text)
    except (ValueError, TypeError, RecursionError):
        answer = text
    if isinstance(answer, dict):
        answer = answer.get("reaction")
    if not isinstance(answer, str):
        return None
    return answer.strip().strip(".\"'").lower().replace(" ", "_") or None


async def classify(reactions: list[Reaction], config: JudgeConfig, tally: Tally) -> list[Signal]:
    """Each reaction's reading by the classifier, or its guess kept (unreadable, failed)."""
    litellm = import_litellm()
    tally.model = config.model
    limit = asyncio.Semaphore(config.concurrency)

    async def one(r: Reaction) -> Signal:
        async with limit:
            tally.asked += 1
            try:
                response = await complete(litellm, r.prompt(), config, tally.calls, RESPONSE_FORMAT)
                text = response.choices[0].message.content or ""
            except Exception:  # a call that fails keeps the guess; the next run asks again
                tally.failed += 1
                return r.guess
        found = reading(r.guess, text, config.model)
        if found is None:
            tally.unreadable += 1
            return r.guess
        tally.changed += found.kind != r.guess.kind
        return found

    return list(await asyncio.gather(*map(one, reactions)))
