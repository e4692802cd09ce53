"""The next user message read the way people write it (judge/reading.py), held to a
labelled corpus (tests/data/reactions.jsonl) rather than to phrasings of the rules' own
kind: the test split, never used to choose the lexicon or vader's thresholds (the dev
split was), through the signals and the implicit reward a night would train on.
bench/reactions.py prints each reader's confusion matrix on the same split.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from overnight.judge.implicit import implicit_reward
from overnight.judge.signals import Turn, read_signals

CORPUS = Path(__file__).resolve().parent / "data" / "reactions.jsonl"
GOOD, BAD = ("praise", "accept"), ("complaint", "correction")
MINUTE = 60_000_000


def corpus() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


def reward_after(reaction: str) -> float | None:
    """The implicit reward of an answer the user reacted to with `reaction`."""
    ask = {"role": "user", "content": "Can you look at this for me?"}
    answer = {"role": "assistant", "content": "Here it is."}
    first = Turn("t1", "q1", "r1", False, 0, [ask], answer)
    then = [ask, answer, {"role": "user", "content": reaction}]
    second = Turn("t2", "q2", "r2", False, MINUTE, then, {"role": "assistant", "content": "."})
    signals = read_signals([first, second], now_us=2 * MINUTE, quiet_us=60 * MINUTE)
    return implicit_reward([s for s in signals if s.record_id == "t1"])


def auc(scores: list[tuple[float, bool]]) -> float:
    pos = [s for s, good in scores if good]
    neg = [s for s, good in scores if not good]
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def test_the_corpus_is_varied_labelled_and_split():
    rows = corpus()
    assert len(rows) >= 300
    assert {r["label"] for r in rows} == {*GOOD, *BAD, "neutral"}
    splits = Counter(r["split"] for r in rows)
    assert set(splits) == {"dev", "test"} and splits["test"] >= 150
    assert len({r["text"] for r in rows}) == len(rows)  # no reaction twice
    for split in ("dev", "test"):
        labels = Counter(r["label"] for r in rows if r["split"] == split)
        assert min(labels.values()) >= 20, (split, labels)


def test_implicit_rewards_rank_praise_above_complaints_on_the_held_out_split():
    rows = [r for r in corpus() if r["split"] == "test"]
    read = {r["text"]: reward_after(r["text"]) for r in rows}
    # A message nobody read makes no reward: ranked as 0 (between approval and complaint).
    scores = [(read[r["text"]] or 0.0, r["label"] in GOOD) for r in rows if r["label"] != "neutral"]
    bad = [r for r in rows if r["label"] in BAD]
    good = [r for r in rows if r["label"] in GOOD]
    bad_approved = sum((read[r["text"]] or 0) > 0 for r in bad) / len(bad)
    good_complained = sum((read[r["text"]] or 0) < 0 for r in good) / len(good)
    unread = Counter(r["label"] for r in rows if read[r["text"]] is None)
    neutral = [read[r["text"]] for r in rows if r["label"] == "neutral"]
    print(
        f"test split, {len(rows)} reactions: AUC {auc(scores):.3f}; complaints and corrections "
        f"read as approval {100 * bad_approved:.1f}% of {len(bad)}, praise and acceptances "
        f"read as a complaint {100 * good_complained:.1f}% of {len(good)}; unread {dict(unread)}; "
        f"new requests given a reward {sum(v is not None for v in neutral)} of {len(neutral)}"
    )
    # Measured (the test split, first read): AUC 0.982, 1.4% (1 of 72, sarcasm: "Wonderful,
    # it deleted all my data. Thanks."), 0.0%; 45 of 167 unread, 2 new requests misread.
    assert auc(scores) >= 0.95
    assert bad_approved <= 0.02
    assert good_complained <= 0.05
    # Praise alone against complaints alone, the measure.
    strict = [(read[r["text"]] or 0.0, r["label"] == "praise") for r in rows
              if r["label"] in ("praise", "complaint")]  # fmt: skip
    assert auc(strict) >= 0.95
