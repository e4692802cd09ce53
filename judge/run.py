"""`overnight judge`: score the finished groups that have no score from this judge yet.

Reads the data directory with DuckDB, judges groups concurrently (a bounded number at
a time), and appends judgments and the rewards derived from them through the same
durable log the proxy uses (its own files, compacted to Parquet at the end). One
failing group is recorded as failed and never stops the batch. With a policy's scope
(`overnight judge --policy`, and each policy's night of `overnight train`), only that
policy's groups are scored, as its night trains them (storage/read/policy_scope.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from overnight.config import DEFAULT_TOOL_CALL_PARSER, SETTLE_SECONDS, JudgeConfig
from overnight.storage import (
    SCHEMA_VERSION,
    LogWriter,
    WriterConfig,
    finished_groups,
    new_id,
    now_us,
    open_db,
)
from overnight.storage.images import ImageStore
from overnight.storage.read.policy_scope import PolicyScope
from overnight.storage.read.siblings import add_turn_views
from overnight.telemetry import traced

from .budget import Counter as TokenCounter
from .budget import budget_for, counter_for
from .cache import NO_SIGNAL, Memory, remembered
from .images import fitted_with_images, sees_images
from .rewards import RewardFunction
from .ruler import (
    DEFAULT_RUBRIC,
    CallCounts,
    Judgment,
    import_litellm,
    judge_group,
    key_of,
    new_judgment,
    prompt_for,
    rubric_hash,
)
from .tool_calls import ToolCallParser, reparsed, sibling_parser
from .trajectories import Group, rollout_from_turns


@dataclass
class Summary:
    judged: int = 0
    failed: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> groups
    scored_by_function: int = 0
    turn_groups: int = 0  # of the groups scored: per-turn groups (a turn and its siblings)
    tool_calls: str = ""  # how siblings' tool calls were read, when there were siblings
    shortened: int = 0  # groups cut to fit the judge's budget
    calls: CallCounts = field(default_factory=CallCounts)  # the judge's, all groups
    seconds: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)  # (group, why)

    def lines(self) -> list[str]:
        calls = self.calls
        out = [
            f"judged {self.judged} group(s), failed {self.failed}, skipped {sum(self.skipped.values())} "
            f"in {self.seconds:.1f} s",
            f"judge tokens: {calls.prompt_tokens} prompt, {calls.completion_tokens} completion; "
            f"cost {calls.cost('unknown (no price for this judge)')}",
        ]
        if self.shortened:
            out.append(f"shortened {self.shortened} group(s) to fit the judge's prompt budget")
        if self.scored_by_function:
            out.append(f"scored {self.scored_by_function} group(s) with the reward function")
        if self.turn_groups:
            out.append(f"{self.turn_groups} of the groups: per-turn (a turn and its siblings)")
        if self.tool_calls:
            out.append(f"siblings' tool calls read with {self.tool_calls}")
        out += [f"  skipped {n}: {reason}" for reason, n in self.skipped.most_common()]
        out += [f"  failed {group}: {why}" for group, why in self.failures[:10]]
        return out


@traced("score", lambda s: {"judged": s.judged, "failed": s.failed, "cost_usd": s.calls.cost_usd})
def judge_step(
    data_dir: Path,
    config: JudgeConfig | None,
    reward: str | None,
    *,
    say: Callable[[str], None] = print,
    **options: Any,
) -> Summary:
    """The judge step of `overnight judge` and of `overnight train` (which scores first):
    score with the judge and/or the reward function (`module:function`), then say the
    summary. `options` are run_judge's."""
    function = RewardFunction(reward) if reward else None
    summary = asyncio.run(run_judge(data_dir, config, function, **options))
    for line in summary.lines():
        say(line)
    return summary


# Where groups are read from: served traffic, or per-turn groups (a served turn and its
# siblings, storage/read/siblings.py), whose members are rows of the same shape.
VIEWS = ("completions", "turn_completions")


def load_groups(
    con, group_ids: list[str], view: str = "completions", tool_calls: ToolCallParser | None = None
) -> list[Group]:
    """The groups' rollouts, each from all of its successful turns, in order. A per-turn
    group's members are each the conversation so far plus one alternative reply; with
    `tool_calls`, each sibling's reply is read with that parser (judge/tool_calls.py),
    the served one stays as vLLM parsed it."""
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
    if not group_ids:
        return []
    con.register("_wanted", pa.table({"group_id": pa.array(group_ids, pa.string())}))
    origin = "origin" if view == "turn_completions" else "'served'"
    rows = con.execute(
        f"""
        SELECT group_id, rollout_id, request, response, {origin} FROM {view}
        WHERE group_id IN (SELECT group_id FROM _wanted) AND logged AND error IS NULL
        ORDER BY group_id, rollout_id, started_at, turn_index, choice_index
        """
    ).fetchall()
    turns: dict[str, dict[str, list]] = {g: {} for g in group_ids}
    for group_id, rollout, request_text, response_text, source in rows:
        request = json.loads(request_text) if request_text else None
        response = json.loads(response_text) if response_text else None
        if tool_calls is not None and source != "served":
            response = reparsed(response, request, tool_calls)
        turns[group_id].setdefault(rollout, []).append((request, response))
    return [
        Group(g, [rollout_from_turns(r, ts) for r, ts in by_rollout.items()])
        for g, by_rollout in turns.items()
    ]


def rollout_counts(con) -> dict[str, int]:
    """Rollouts per group: a group of one is skipped without reading its turns."""
    return dict(con.execute("SELECT group_id, count(*) FROM rollouts GROUP BY group_id").fetchall())


def turn_candidates(
    con, sources: list[str], rejudge: bool, only: list[str] | None, no_signal: set[str]
) -> list[str]:
    """Per-turn groups (two members or more) in which some member has no reward from one
    of `sources` (what this run writes); every one under `rejudge`. Oldest turn first.
    A group the judge found no signal in (`no_signal`) never gets a judge reward: it is
    not asked for one again (that would rescore it with the function every night)."""
    add_turn_views(con)
    rows = con.execute(
        """
        SELECT t.group_id,
               bool_and(coalesce(list_contains(r.sources, 'function'), false)) AS by_function,
               bool_and(coalesce(list_contains(r.sources, 'ruler'), false)) AS by_judge
        FROM turn_completions t JOIN turn_groups g USING (group_id)
        LEFT JOIN (SELECT rollout_id, list(DISTINCT source) AS sources FROM rewards
                   GROUP BY rollout_id) r USING (rollout_id)
        WHERE g.members >= 2
        GROUP BY t.group_id ORDER BY min(g.started_at), t.group_id
        """
    ).fetchall()
    wanted = set(only) if only else None
    out = []
    for group_id, by_function, by_judge in rows:
        done = {"function": bool(by_function), "ruler": bool(by_judge) or group_id in no_signal}
        if wanted is not None and group_id not in wanted:
            continue
        if rejudge or not all(done[s] for s in sources):
            out.append(group_id)
    return out


def scored_by(con, function: RewardFunction) -> set[str]:
    """Groups in which every rollout has a reward from `function` (its `module:function`
    name, as recorded): a night that scores with it does not ask it again. Every finished
    group is a candidate each night, trained or not, so without this each night would
    score the whole history again (a rollout added since makes its group a candidate)."""
    rows = con.execute(
        "SELECT r.group_id FROM rollouts r LEFT JOIN (SELECT DISTINCT rollout_id FROM rewards "
        "WHERE source = 'function' AND json_extract_string(metrics, '$.function') = ?) f "
        "USING (rollout_id) GROUP BY r.group_id HAVING bool_and(f.rollout_id IS NOT NULL)",
        [function.name],
    ).fetchall()
    return {g for (g,) in rows}


def posted_complete(con) -> set[str]:
    """Groups in which every rollout has a reward the agent posted."""
    rows = con.execute(
        "SELECT r.group_id FROM rollouts r LEFT JOIN (SELECT DISTINCT rollout_id FROM rewards "
        "WHERE source = 'agent') p USING (rollout_id) GROUP BY r.group_id "
        "HAVING bool_and(p.rollout_id IS NOT NULL)"
    ).fetchall()
    return {g for (g,) in rows}


async def run_judge(
    data_dir: Path,
    config: JudgeConfig | None,
    reward: RewardFunction | None = None,
    *,
    combine: bool = False,
    rejudge: bool = False,
    use_posted: bool = True,
    settle_seconds: float = SETTLE_SECONDS,
    groups: list[str] | None = None,
    max_groups: int | None = None,
    progress: bool = True,
    tool_call_parser: str | None = None,
    tool_parser_tokenizer: str | None = None,
    scope: PolicyScope | None = None,
) -> Summary:
    """Score the finished groups and per-turn groups not scored yet (of `scope`'s policy
    only, when given). Siblings' tool calls are read with `tool_call_parser` (the server's
    `--tool-call-parser`; '' for none; None: the judge config's, else hermes), built with
    `tool_parser_tokenizer` (the served model's; None: the config's) when it needs one."""
    started = time.perf_counter()
    summary = Summary()
    rubric = (config.rubric if config else "") or DEFAULT_RUBRIC
    con = open_db(data_dir)
    try:
        candidates = finished_groups(con, settle_seconds, groups)
        if scope is not None:  # another policy's groups are not looked at
            own = scope.groups(con, candidates)
            candidates = [g for g in candidates if g in own]
        memory = Memory()
        if config is not None and not rejudge:
            memory = remembered(con, config, rubric_hash(rubric), key_of(config))
        posted = posted_complete(con) if use_posted else set()
        scored = scored_by(con, reward) if reward is not None and not rejudge else set()
        sizes = rollout_counts(con)
        wanted: list[str] = []
        for group_id in candidates:
            why = _skip(group_id, memory, posted, scored, sizes, config, reward,
                        groups is not None)  # fmt: skip
            if why:
                summary.skipped[why] += 1
            else:
                wanted.append(group_id)
        sources = (["function"] if reward else []) + (["ruler"] if config else [])
        turns = turn_candidates(con, sources, rejudge, groups, memory.no_signal) if sources else []
        if scope is not None:  # a per-turn group is its served turn's group's policy's
            own = scope.turn_groups(con, turns)
            turns = [g for g in turns if g in own]
        if max_groups is not None:
            wanted = wanted[:max_groups]
            turns = turns[: max(max_groups - len(wanted), 0)]
        parser = _tool_calls(config, tool_call_parser, tool_parser_tokenizer) if turns else None
        summary.tool_calls = parser.how if parser else ""
        work = load_groups(con, wanted) + load_groups(con, turns, "turn_completions", parser)
        summary.turn_groups = len(turns)
    finally:
        con.close()

    budget, counter = None, None
    if config is not None and work:
        import_litellm()  # once, before the clock of the first group starts
        budget, counter = budget_for(config), counter_for(config.model)
    # A batch job has no event loop to protect: compact its few rows in-process.
    writer = LogWriter(WriterConfig(Path(data_dir), compact_in_process=True))
    writer.start()
    try:
        limit = asyncio.Semaphore(config.concurrency if config else 8)
        scoring = _Scoring(
            config, reward, combine, memory, budget, counter, rubric, limit, writer, summary,
            (Path(data_dir), ImageStore(data_dir)) if config and sees_images(config) else None,
        )  # fmt: skip
        tasks = [asyncio.create_task(scoring.score(g)) for g in work]
        await _with_progress(tasks, progress)
    finally:
        await asyncio.get_running_loop().run_in_executor(None, writer.close)
    summary.seconds = time.perf_counter() - started
    return summary


def _tool_calls(config: JudgeConfig | None, name: str | None, tokenizer: str | None):
    """The parser siblings' tool calls are read with; built (vLLM imported) only when a
    run has per-turn groups, before any is scored, so a bad name stops it first."""
    if name is None:
        name = config.tool_call_parser if config else DEFAULT_TOOL_CALL_PARSER
    if tokenizer is None and config is not None:
        tokenizer = config.tool_parser_tokenizer
    return sibling_parser(name, tokenizer)


def _skip(
    group_id: str,
    memory: Memory,
    posted: set[str],
    scored: set[str],
    sizes: dict[str, int],
    config: JudgeConfig | None,
    reward: RewardFunction | None,
    named: bool,
) -> str | None:
    """Why a group is not scored this run, decided before its turns are read; or None.
    A group the reward function scored already (`scored`) is not scored again unless the
    judge still has to judge it (its rewards are combined with the function's).
    A group of one has nothing to train and no rank, so it is left alone, unless it was
    named (`--group`) for a reward function alone, whose score is absolute: a held-out
    question asked once, scored to be measured. (Scoring every single call so would
    score each served turn twice: alone, and in its per-turn group.)"""
    judge_only = config is not None and not reward
    function_only = reward is not None and config is None and named
    if group_id in posted:
        return "every rollout has a reward the agent posted"
    if judge_only and group_id in memory.judged_groups:
        return "already judged by this judge, rubric and settings"
    if judge_only and group_id in memory.no_signal:
        return "fewer than two distinct trajectories (found before): no relative signal"
    judged = config is None or group_id in memory.judged_groups or group_id in memory.no_signal
    if group_id in scored and judged:
        return "already scored by this reward function" + ("" if config is None else
                                                            " and judged")  # fmt: skip
    if sizes.get(group_id, 0) < 2 and not function_only:
        return "one rollout: no relative signal"
    return None


async def _with_progress(tasks: list[asyncio.Task], show: bool) -> None:
    if not tasks:
        return
    from tqdm import tqdm

    with tqdm(total=len(tasks), desc="judging groups", unit="group", disable=not show) as bar:
        for finished in asyncio.as_completed(tasks):
            await finished
            bar.update(1)


@dataclass
class _Scoring:
    """What every group of one `run_judge` batch is scored with, and where it goes."""

    config: JudgeConfig | None
    reward: RewardFunction | None
    combine: bool
    memory: Memory  # empty under --rejudge
    budget: int | None
    counter: TokenCounter | None
    rubric: str
    limit: asyncio.Semaphore
    writer: LogWriter
    summary: Summary
    images: tuple[Path, ImageStore] | None = None  # a judge that sees: where the pictures are

    async def score(self, group: Group) -> None:
        async with self.limit:
            function_scores = None
            if self.reward is not None:
                try:
                    function_scores = await self.reward.score_group(group)
                except Exception as e:  # the user's code fails this group, not the batch
                    self.summary.failed += 1
                    self.summary.failures.append((group.group_id, f"reward function: {e}"))
                    return
                _write_rewards(
                    self.writer, function_scores, "function", None, {"function": self.reward.name}
                )
                self.summary.scored_by_function += 1
            if self.config is None:
                return
            judgment = await self._judge(group)
            if judgment is None:
                return
        _account(self.summary, judgment)
        judgment_id = _write_judgment(self.writer, judgment, self.config, self.rubric)
        if judgment.error is None:
            scores = {r: s for r, (s, _) in judgment.scores.items()}
            _write_rewards(
                self.writer, scores, "ruler", judgment_id, {"judge_model": self.config.model}
            )
            if self.combine and function_scores is not None:
                both = {r: (scores[r] + function_scores[r]) / 2 for r in scores}
                _write_rewards(
                    self.writer, both, "combined", judgment_id, {"of": ["ruler", "function"]}
                )

    async def _judge(self, group: Group) -> Judgment | None:
        """The judge's verdict on the group, or None when it is skipped without a row."""
        assert self.config is not None
        if group.group_id in self.memory.no_signal:  # scored by the function only
            return None
        if self.images is not None:  # the pictures the prompt names, after its text
            prompt = fitted_with_images(group, self.config, self.budget, self.counter,
                                        *self.images)  # fmt: skip
        else:
            prompt = prompt_for(group, self.config, self.budget, self.counter)
        if len(prompt.ids) < 2:  # nothing to compare: no call, but a row that says why
            judgment = new_judgment(group, self.config, prompt)
            judgment.error = (
                f"not sent: fewer than two distinct trajectories "
                f"({len(group.trajectories)} rollouts, all the same)"
            )
            judgment.error_class = NO_SIGNAL
            self.summary.skipped["fewer than two distinct trajectories: not sent"] += 1
            _write_judgment(self.writer, judgment, self.config, self.rubric)
            return None
        judgment = new_judgment(group, self.config, prompt)
        if judgment.prompt_hash in self.memory.judged_prompts:
            self.summary.skipped["the same prompt was judged before (cache)"] += 1
            return None
        if judgment.prompt_hash in self.memory.failed:
            self.summary.skipped[
                "failed before with a permanent error (too long or refused; --rejudge resends)"
            ] += 1
            return None
        if prompt.cut is not None:
            self.summary.shortened += 1
        return await judge_group(group, self.config, prompt)


def _account(summary: Summary, j: Judgment) -> None:
    if j.error is None:
        summary.judged += 1
    else:
        summary.failed += 1
        summary.failures.append((j.group_id, f"[{j.error_class}] {j.error}"))
    summary.calls.add(j.calls)


def _write_judgment(writer: LogWriter, j: Judgment, config: JudgeConfig, rubric: str) -> str:
    judgment_id = new_id()
    writer.append(
        "judgments",
        {
            "judgment_id": judgment_id,
            "schema_version": SCHEMA_VERSION,
            "group_id": j.group_id,
            "judge_model": config.model,
            "rubric_hash": rubric_hash(rubric),
            "prompt_hash": j.prompt_hash,
            "created_at": now_us(),
            "scores": [
                {"rollout_id": r, "score": s, "explanation": why}
                for r, (s, why) in sorted(j.scores.items())
            ],
            "error": j.error,
            "attempts": j.calls.attempts,
            "prompt_tokens": j.calls.prompt_tokens,
            "completion_tokens": j.calls.completion_tokens,
            "cost_usd": j.calls.cost_usd,
            "latency_ms": j.latency_ms,
            "proxy_id": writer.writer_id,
            "notes": j.notes(),
        },
    )
    return judgment_id


def _write_rewards(
    writer: LogWriter, scores: dict[str, float], source: str, judgment_id: str | None, metrics: dict
) -> None:
    for rollout_id, value in scores.items():
        writer.append(
            "rewards",
            {
                "reward_id": new_id(),
                "schema_version": SCHEMA_VERSION,
                "rollout_id": rollout_id,
                "reward": float(value),
                "metrics": metrics,
                "source": source,
                "created_at": now_us(),
                "proxy_id": writer.writer_id,
                "judgment_id": judgment_id,
            },
        )
