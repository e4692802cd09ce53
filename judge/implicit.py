"""`overnight signals`: what happens next in each conversation, read from the store and
written as `signals` rows (the rules are judge/signals.py's); with `--rewards`, the
reward source `implicit` made of them.

Recent turns are read (a window, `since`): chat completions, and Responses and Messages
turns, which the proxy records in the chat shape too (a `previous_response_id` turn with
its whole conversation: proxy/capture/conversation.py). Every signal is found again from scratch
(a turn's next message may have come after the last run), and only the signals not
written before are appended: a signal's id is a hash of what it is about and what said
so, so a second run over the same traffic writes nothing.

A turn's implicit reward is its signals' values weighted by their confidence
(`implicit_reward`; `ended` and `moved_on`, which say nothing, left out), in [-1, 1]. A
turn with no signal gets none: silence is not evidence, nor is a message nobody read. It goes to the turn's rollout when the
rollout is that one turn (a single call, the usual production request), else to the
turn's member of its per-turn group (`turn:<record>:served`, storage/read/siblings.py),
and never where a reward of another source is already there: an agent's posted reward,
a reward function's or the judge's come first (docs/grpo.md). Where an agent posted
rewards beside the signals, their agreement is measured and printed (`agreement`), so
an operator can see on their own traffic whether the rules read it right.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from overnight.config import JudgeConfig
from overnight.storage import LogWriter, WriterConfig, new_id, now_us, open_db
from overnight.storage.schema import SCHEMA_VERSION

from .reactions import SOURCE as CLASSIFIER
from .reactions import Reaction, Tally, classify
from .signals import MOVED_ON, Signal, Turn, read_signals
from .trajectories import content_text

# A conversation quiet this long has ended: no next message is coming for its last turn.
QUIET_SECONDS = 30 * 60

# The agents' turns only: overnight's own (a judge through the proxy, the demo's held-out
# measurement: storage/read/sent_by.py) say nothing of how the agents' turns went.
TURNS_SQL = """
SELECT record_id, request_id, rollout_id, group_id, attribution, epoch_us(started_at),
       request, response, finish_reason
FROM completions
WHERE endpoint IN ('chat.completions', 'responses', 'messages') AND coalesce(logged, true)
  AND error IS NULL
  AND sent_by = 'client'
  AND coalesce(http_status, 200) = 200 AND started_at >= to_timestamp(?::DOUBLE / 1e6)
"""


@dataclass
class SignalSummary:
    turns: int = 0
    found: Counter = field(default_factory=Counter)  # kind -> signals found
    written: int = 0
    rewards: int | None = None  # implicit rewards written (None: not asked for)
    rewards_left: Counter = field(default_factory=Counter)  # why a turn got none
    agreement: dict | None = None  # beside the agent's posted rewards (`agreement`)
    classifier: Tally | None = None  # its calls this run (None: none made)
    seconds: float = 0.0

    def lines(self) -> list[str]:
        kinds = ", ".join(f"{k} {n}" for k, n in self.found.most_common()) or "none"
        with_signal = self.found.total()
        out = [
            f"read {self.turns} chat turn(s): {with_signal} signal(s) ({kinds}); "
            f"{self.written} new written in {self.seconds:.1f} s"
        ]
        if self.classifier is not None:
            out.append(self.classifier.line())
        if self.rewards is not None:
            left = "; ".join(f"{n} {why}" for why, n in self.rewards_left.most_common())
            out.append(f"implicit rewards: {self.rewards} written" + (f"; {left}" if left else ""))
        if self.agreement is not None:
            a = self.agreement
            out.append(
                f"agreement with the agent's posted rewards on {a['turns']} turn(s): "
                f"AUC {a['auc']:.3f} (1: the signals order them as the posted rewards do; "
                f"0.5: no better than chance)"
                if a["auc"] is not None
                else f"agreement with the agent's posted rewards: {a['turns']} turn(s), "
                "too few of one kind to measure"
            )
        return out


def implicit_reward(signals: list[Signal]) -> float | None:
    """A turn's signals as one reward in [-1, 1]: their values weighted by confidence, so a
    sure correction outweighs a weaker reading. None without a signal that says something:
    a value of 0 says nothing either way (`ended`; `moved_on`, a message nobody
    recognised), and is left out rather than pulling the others towards 0."""
    said = [s for s in signals if s.value != 0 and s.confidence > 0]
    if not said:
        return None
    return sum(s.value * s.confidence for s in said) / sum(s.confidence for s in said)


def turn_of(row: tuple) -> tuple[Turn, str] | None:
    """A `completions` row as the rules read it, with its group; None when its request or
    response is not a chat turn (unlogged bodies, odd JSON)."""
    record, request_id, rollout, group, attribution, started, request, response, finish = row
    try:
        body, answer = json.loads(request or "null"), json.loads(response or "null")
        messages = body["messages"]
        reply = answer["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(messages, list) or not isinstance(reply, dict):
        return None
    messages = [m for m in messages if isinstance(m, dict)]
    response_format = body.get("response_format")
    turn = Turn(
        record_id=record,
        request_id=request_id,
        rollout_id=rollout,
        attributed=attribution not in (None, "none"),
        started_at=int(started),
        messages=messages,
        reply=reply,
        finish_reason=finish,
        response_format=response_format if isinstance(response_format, dict) else None,
        group_id=group,
    )
    return turn, group


@dataclass
class Found:
    """What `find_signals` read of a window of chat turns."""

    turns: dict[str, Turn]  # record -> its turn
    groups: dict[str, tuple[str, str]]  # record -> (its rollout, its group)
    signals: list[Signal]  # what the rules read of them
    written: set[str]  # the signal ids the store holds already
    held: Held  # the rewards it holds
    # The classifier's readings written before, by (turn, message record): read once.
    classified: dict[tuple[str, str | None], Signal]


def find_signals(data_dir: Path, since_us: int, quiet_seconds: float = QUIET_SECONDS) -> Found:
    """The turns since `since_us`, the signals the rules read in them, and what the store
    holds already of signals and rewards."""
    con = open_db(data_dir)
    try:
        turns, groups = [], {}
        for row in con.execute(TURNS_SQL, [since_us]).fetchall():
            found = turn_of(row)
            if found is not None:
                turns.append(found[0])
                groups[found[0].record_id] = (found[0].rollout_id, found[1])
        # Only the window's: a signal about a turn of the window was written after it.
        written = {r[0] for r in con.execute(
            "SELECT signal_id FROM signals WHERE created_at >= to_timestamp(?::DOUBLE / 1e6)",
            [since_us],
        ).fetchall()}  # fmt: skip
        held = _held(con, groups)
        classified = _classified(con, since_us)
    finally:
        con.close()
    signals = read_signals(turns, now_us(), int(quiet_seconds * 1e6))
    return Found({t.record_id: t for t in turns}, groups, signals, written, held, classified)


def _classified(con, since_us: int) -> dict[tuple[str, str | None], Signal]:
    """The classifier's readings written before (reactions.py), by (turn, message record):
    a message is read once."""
    rows = con.execute(
        "SELECT record_id, kind, value, confidence, rule, evidence, evidence_record, extra "
        "FROM signals WHERE source = ? AND created_at >= to_timestamp(?::DOUBLE / 1e6)",
        [CLASSIFIER, since_us],
    ).fetchall()
    out = {}
    for record, kind, value, confidence, rule, evidence, evidence_record, extra in rows:
        extra = json.loads(extra) if extra else {}
        out[(record, evidence_record)] = Signal(
            record, kind, value, confidence, rule, evidence or "", evidence_record, extra,
            CLASSIFIER,
        )  # fmt: skip
    return out


def read_guesses(found: Found, classifier: JudgeConfig | None) -> tuple[list[Signal], Tally | None]:
    """The signals found, with the messages nobody read (`moved_on`) read by the
    classifier: as it read them before, or asked now when a classifier is given; kept
    where neither."""
    out, ask = [], []
    for s in found.signals:
        key = (s.record_id, s.evidence_record)
        if s.kind != MOVED_ON or s.source != "rules":
            out.append(s)
        elif key in found.classified:
            out.append(found.classified[key])
        elif classifier is not None:
            t = found.turns[s.record_id]
            question = next((content_text(m.get("content")) for m in reversed(t.messages)
                             if m.get("role") == "user"), "")  # fmt: skip
            ask.append(Reaction(s, question, content_text(t.reply.get("content"))))
        else:
            out.append(s)
    if not ask:
        return out, None
    tally = Tally()
    return out + asyncio.run(classify(ask, classifier, tally)), tally


@dataclass
class Held:
    """What the store holds that decides where an implicit reward goes, and whether."""

    turns: dict[str, int]  # rollout -> its turns
    latest: dict[str, tuple[str, float]]  # rollout -> (source, reward) of its latest reward
    posted: dict[str, float]  # rollout -> the agent's latest posted reward


def _held(con, groups: dict[str, tuple[str, str]]) -> Held:
    """What the store holds for the window's rollouts and their turns' per-turn members."""
    rollouts = sorted({rollout for rollout, _ in groups.values()})
    targets = rollouts + [f"turn:{record}:served" for record in groups]
    within = "WHERE rollout_id IN (SELECT unnest(?))"
    turns = dict(
        con.execute(
            f"SELECT rollout_id, count(*) FROM completions {within} GROUP BY ALL", [rollouts]
        ).fetchall()  # fmt: skip
    )
    latest = {
        r: (source, reward)
        for r, source, reward in con.execute(
            f"SELECT rollout_id, reward_source, reward FROM rollout_rewards {within}", [targets]
        ).fetchall()
    }
    posted = dict(
        con.execute(
            f"SELECT rollout_id, arg_max(reward, created_at) FROM rewards {within} "
            "AND source = 'agent' GROUP BY rollout_id",
            [rollouts],
        ).fetchall()
    )
    return Held(turns, latest, posted)


def run_signals(
    data_dir: Path,
    since_seconds: float = 7 * 86400,
    quiet_seconds: float = QUIET_SECONDS,
    rewards: bool = False,
    classifier: JudgeConfig | None = None,
) -> SignalSummary:
    """Read the signals of the chat turns of the last `since_seconds` and write the new
    ones; with `rewards`, the implicit rewards they make where no other source has one;
    with `classifier`, the messages nobody else read (`moved_on`) read by it (reactions.py)."""
    started = time.perf_counter()
    since = now_us() - int(since_seconds * 1e6)
    found = find_signals(data_dir, since, quiet_seconds)
    groups, written, held = found.groups, found.written, found.held
    signals, tally = read_guesses(found, classifier)
    summary = SignalSummary(turns=len(groups), found=Counter(s.kind for s in signals))
    summary.classifier = tally
    rows = [_row(s, *groups[s.record_id]) for s in signals if s.signal_id not in written]
    by_turn: dict[str, list[Signal]] = {}
    for s in signals:
        by_turn.setdefault(s.record_id, []).append(s)
    values = {r: v for r, ss in by_turn.items() if (v := implicit_reward(ss)) is not None}
    summary.agreement = agreement(values, groups, held)
    reward_rows = []
    if rewards:
        reward_rows = _reward_rows(values, groups, held, summary.rewards_left)
        summary.rewards = len(reward_rows)
    if rows or reward_rows:
        writer = LogWriter(WriterConfig(Path(data_dir), compact_in_process=True))
        writer.start()
        try:
            for row in rows:
                writer.append("signals", {**row, "proxy_id": writer.writer_id})
            for row in reward_rows:
                writer.append("rewards", {**row, "proxy_id": writer.writer_id})
        finally:
            writer.close()
    summary.written = len(rows)
    summary.seconds = time.perf_counter() - started
    return summary


def reward_target(record_id: str, rollout_id: str, held: Held) -> str:
    """Where a turn's implicit reward goes: its rollout when that is the one turn, else its
    member of the per-turn group (a turn of a longer rollout is not the whole rollout)."""
    return rollout_id if held.turns.get(rollout_id, 0) == 1 else f"turn:{record_id}:served"


def _reward_rows(values: dict, groups: dict, held: Held, left: Counter) -> list[dict]:
    out = []
    for record, value in values.items():
        target = reward_target(record, groups[record][0], held)
        source, reward = held.latest.get(target, (None, None))
        if source not in (None, "implicit"):
            left[f"turn(s) already rewarded by another source ({source})"] += 1
        elif source == "implicit" and reward == value:
            left["turn(s) unchanged since the last run"] += 1
        else:
            out.append(
                {
                    "reward_id": new_id(),
                    "schema_version": SCHEMA_VERSION,
                    "rollout_id": target,
                    "reward": value,
                    "metrics": {"record_id": record},
                    "source": "implicit",
                    "created_at": now_us(),
                    "judgment_id": None,
                }
            )
    return out


def agreement(values: dict[str, float], groups: dict, held: Held) -> dict | None:
    """How the implicit values order the turns whose rollout the agent rewarded, against
    those posted rewards: the share of pairs with different posted rewards that the
    implicit values order the same way, ties counting half (Harrell's concordance; the
    AUC when posted rewards are 0 or 1). None where no posted reward meets a signal."""
    pairs = [(v, held.posted[groups[r][0]]) for r, v in values.items()
             if groups[r][0] in held.posted]  # fmt: skip
    if not pairs:
        return None
    agree, total = _concordance(pairs)
    return {"turns": len(pairs), "auc": agree / total if total else None}


def _concordance(pairs: list[tuple[float, float]]) -> tuple[float, int]:
    """(pairs ordered alike by both, ties in the first counting half; pairs that differ
    in the second), in n log n: a week of rewarded turns makes too many pairs to walk.
    The pairs are taken by the second value, level by level; a Fenwick tree counts the
    first values already taken (all from lower levels) below and at each new one."""
    ranks = {v: i for i, v in enumerate(sorted({v for v, _ in pairs}), start=1)}
    tree = [0] * (len(ranks) + 1)

    def add(i: int) -> None:
        while i <= len(ranks):
            tree[i] += 1
            i += i & -i

    def upto(i: int) -> int:  # how many taken values have rank <= i
        n = 0
        while i > 0:
            n += tree[i]
            i -= i & -i
        return n

    agree, total, taken = 0.0, 0, 0
    by_level: dict[float, list[float]] = {}
    for v, p in pairs:
        by_level.setdefault(p, []).append(v)
    for level in sorted(by_level):
        for v in by_level[level]:  # each against every pair of a lower level
            below, at = upto(ranks[v] - 1), upto(ranks[v]) - upto(ranks[v] - 1)
            agree += below + 0.5 * at
            total += taken
        for v in by_level[level]:
            add(ranks[v])
        taken += len(by_level[level])
    return agree, total


def _row(s: Signal, rollout_id: str, group_id: str) -> dict:
    return {
        "signal_id": s.signal_id,
        "schema_version": SCHEMA_VERSION,
        "created_at": now_us(),
        "record_id": s.record_id,
        "rollout_id": rollout_id,
        "group_id": group_id,
        "kind": s.kind,
        "value": s.value,
        "confidence": s.confidence,
        "rule": s.rule,
        "source": s.source,
        "evidence": s.evidence,
        "evidence_record": s.evidence_record,
        "extra": json.dumps(s.extra) if s.extra else None,
    }
