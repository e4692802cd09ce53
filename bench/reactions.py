"""How well each reader of the user's next message reads people, on a labelled corpus.

    python bench/reactions.py                  # the test split: each reader, then combined
    python bench/reactions.py --split dev      # the split the thresholds were chosen on
    python bench/reactions.py --tune           # vader's thresholds, searched on dev only
    python bench/reactions.py --model-url http://127.0.0.1:8000/v1 --model policy
                                               # the served model read by its logprobs too

The corpus is tests/data/reactions.jsonl: reactions written the way people write them
(praise, acceptance then a new request, complaints, corrections carrying the answer,
doubt, sarcasm, "thanks but ...", typos, emoji, other languages, plain new requests),
each labelled and put in the dev or the test split. judge/reading.py's lexicon and
vader's thresholds were chosen on dev; numbers reported are the test split's.

For each reader: a confusion matrix (rows the true label, columns its reading:
approval, nothing, complaint), the AUC of its rewards (approval +1, nothing 0,
complaint -1; vader's own score for vader) ranking praised and accepted answers above
complained-about and corrected ones, the share of complaints and corrections read as
approval, of praise and acceptances read as a complaint, and how many it left unread.
Results: docs/signals.md.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "reactions.jsonl"
LABELS = ("praise", "accept", "complaint", "correction", "neutral")
GOOD, BAD = ("praise", "accept"), ("complaint", "correction")
READ = ("approval", "nothing", "complaint")


def corpus(split: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]
    return [r for r in rows if split is None or r["split"] == split]


@dataclass
class Measured:
    """One reader on one split."""

    name: str
    confusion: dict[str, Counter] = field(default_factory=dict)  # label -> reading -> n
    scores: list[tuple[float, bool]] = field(default_factory=list)  # (reward, good?)

    @property
    def auc(self) -> float:
        pos = [s for s, good in self.scores if good]
        neg = [s for s, good in self.scores if not good]
        wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
        return wins / (len(pos) * len(neg))

    def share(self, labels: tuple[str, ...], reading: str) -> float:
        total = sum(self.confusion[label].total() for label in labels)
        return sum(self.confusion[label][reading] for label in labels) / total

    @property
    def bad_as_approval(self) -> float:
        return self.share(BAD, "approval")

    @property
    def good_as_complaint(self) -> float:
        return self.share(GOOD, "complaint")

    @property
    def abstained(self) -> int:
        return sum(c["nothing"] for c in self.confusion.values())

    def lines(self) -> list[str]:
        n = sum(c.total() for c in self.confusion.values())
        out = [
            f"{self.name}: AUC {self.auc:.3f}; complaints+corrections read as approval "
            f"{100 * self.bad_as_approval:.1f}%, praise+acceptances read as a complaint "
            f"{100 * self.good_as_complaint:.1f}%; {self.abstained} of {n} unread",
            f"  {'':11}" + "".join(f"{r:>10}" for r in READ),
        ]
        for label in LABELS:
            out.append(f"  {label:11}" + "".join(f"{self.confusion[label][r]:>10}" for r in READ))
        return out


def measure(name: str, rows: list[dict], reader: Callable[[str], tuple[int, float]]) -> Measured:
    """`reader(text)` -> (its reading: +1, 0 or -1; the reward it ranks by)."""
    out = Measured(name, {label: Counter() for label in LABELS})
    for row in rows:
        said, score = reader(row["text"])
        out.confusion[row["label"]][READ[1 - said]] += 1
        if row["label"] in GOOD + BAD:
            out.scores.append((score, row["label"] in GOOD))
    return out


def readers() -> dict[str, Callable[[str], tuple[int, float]]]:
    from overnight.judge import reading

    def rules(text: str) -> tuple[int, float]:
        said = reading.rules(text) or 0
        return said, float(said)

    def cues(text: str) -> tuple[int, float]:
        said = (reading.cues(text) or (0, ""))[0]
        return said, float(said)

    def vader(text: str) -> tuple[int, float]:
        score = reading.vader(text)
        said = (
            1 if score >= reading.VADER_APPROVAL else -1 if score <= reading.VADER_COMPLAINT else 0
        )
        return said, score

    def combined(text: str) -> tuple[int, float]:
        found = reading.read(text)
        return (0, 0.0) if found is None else (int(found.value), found.value)

    return {"rules": rules, "cues": cues, "vader": vader, "combined": combined}


def model_reader(base_url: str, model: str, texts: list[str]) -> Callable[[str], tuple[int, float]]:
    """The served model as a reader: one prompt per message, the label tokens' logprobs
    of a one-token answer (judge/reactions.py), through the OpenAI API at `base_url`, all
    of `texts` asked at once. Ranked by the share of "good" less the share of "bad"."""
    import asyncio

    from overnight.config import JudgeConfig
    from overnight.judge.reactions import ask, prompt
    from overnight.judge.ruler import CallCounts

    config = JudgeConfig(model=f"hosted_vllm/{model}", base_url=base_url, api_key="none")
    calls = CallCounts()

    async def all_of_them() -> list:
        limit = asyncio.Semaphore(8)

        async def one(text: str):
            async with limit:
                return await ask(prompt("", "", text), config, calls)

        return await asyncio.gather(*map(one, texts))

    found = dict(zip(texts, asyncio.run(all_of_them()), strict=True))
    print(
        f"model {model}: {calls.prompt_tokens} prompt, {calls.completion_tokens} completion tokens"
    )

    def read(text: str) -> tuple[int, float]:
        label, shares = found[text]
        said = {"good": 1, "bad": -1}.get(label, 0)
        return said, shares.get("good", 0.0) - shares.get("bad", 0.0) if shares else 0.0

    return read


def tune(rows: list[dict]) -> None:
    """The combination on `rows` (dev) for a grid of vader thresholds: the pair chosen
    keeps complaints out of approval first, then reads as much as it can."""
    from overnight.judge import reading

    for up in (0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7):
        for down in (-0.05, -0.15, -0.25, -0.35, -0.5):
            reading.VADER_APPROVAL, reading.VADER_COMPLAINT = up, down
            m = measure("combined", rows, readers()["combined"])
            print(f"approval >= {up:+.2f}, complaint <= {down:+.2f}: " + m.lines()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=("dev", "test"), default="test")
    parser.add_argument("--tune", action="store_true", help="search vader's thresholds on dev")
    parser.add_argument("--model-url", help="an OpenAI API serving the model reader")
    parser.add_argument("--model", default="policy", help="the model name it serves")
    args = parser.parse_args()
    if args.tune:
        tune(corpus("dev"))
        return
    rows = corpus(args.split)
    print(
        f"{len(rows)} reactions of the {args.split} split: {dict(Counter(r['label'] for r in rows))}"
    )
    chosen = readers()
    if args.model_url:
        chosen["model"] = model_reader(args.model_url, args.model, [r["text"] for r in rows])
    for name, reader in chosen.items():
        print("\n".join(measure(name, rows, reader).lines()))


if __name__ == "__main__":
    main()
