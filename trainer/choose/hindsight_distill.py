"""What a `--hindsight --hindsight-mode distill` night trains on: the student's own answers
to the turns users corrected, each token weighed by what the correction says of it.

The corrected turns are hindsight.py's (`choose_corrected`: the same signals, the same
turns left out). Instead of asking the teacher for a revision to imitate, the night keeps
the student's tokens as they were sampled, and the teacher only scores them:

  a corrected turn (record R)
  -> the student's samples: the served answer (its logged prompt and completion token
     ids and logprobs, the per-turn group's `turn:R:served`) and every sibling `--resample`
     stored for it (`turn:R`'s other members), each one sequence of group `hindsight:R`
  -> the teacher's context for each: the turn's messages with the hint after its last user
     message (hindsight.py's `teacher_messages`), rendered with the local chat template,
     followed by the same completion tokens (grpo/distill.py's `teacher_sample`)
  -> before training, one pass of the starting policy over both (grpo/distill.py): each
     token's advantage is the teacher's logprob minus the student's, trained through
     GRPO's loss with its importance ratio against the logged logprob, and its clip.

No text is written for the student, so nothing the teacher says of the hint can leak into
it (the revise mode's `ECHOED` skips), and no call to vLLM is made (the teacher is the
trainer's own forward pass). What it cannot do: show the student a token it never
sampled. docs/grpo.md ("Hindsight") compares the two on measurements.

Skipped, each counted in the plan: a turn with no token ids or logprobs logged (not
vLLM's, or re-tokenised: no behaviour logprobs to weigh), one whose served answer failed,
one the template cannot render with the hint.
"""

from __future__ import annotations

import pyarrow as pa

from overnight.config import TrainConfig
from overnight.storage import open_db
from overnight.storage.read.siblings import TURN_PREFIX, add_turn_views
from overnight.telemetry import traced
from overnight.trainer.grpo.data import DataError, Sample
from overnight.trainer.grpo.distill import teacher_sample
from overnight.trainer.grpo.logged_turns import chat_ids, load_samples
from overnight.trainer.grpo.render import chat_messages

from .hindsight import Corrected, choose_corrected, hindsight_id
from .inputs import Selection
from .plan import Plan, damaged_files

NO_TOKENS = "the served answer has no token ids or logprobs logged (nothing sampled to weigh)"
NOT_LOADED = "the served answer could not be read as it was sampled"
NO_TEMPLATE = "the teacher's context: the local chat template cannot render it"


@traced(
    "plan",
    lambda plan: {"groups": len(plan.groups), "samples": len(plan.samples), "distill": True},
)
def plan_distill(selection: Selection, config: TrainConfig) -> Plan:
    """The corrected turns a distill night trains on, each the student's own samples
    with their teacher samples (`plan.teachers`); why the others are left."""
    plan, turns, chosen = choose_corrected(selection, config)
    loaded, skipped = _student_samples(selection, [t.record_id for t in chosen])
    siblings = 0
    for t in chosen:
        group = hindsight_id(t.record_id)
        mine = loaded.get(t.record_id, [])
        why = skipped.get(t.record_id) if not mine else None
        try:
            teachers = {s.rollout_id: teacher_sample(s, _teacher_prompt(selection, t))
                        for s in mine}  # fmt: skip
        except (DataError, ValueError):
            why = why or NO_TEMPLATE
        if why is not None or not mine:
            plan.skipped[why or NOT_LOADED] += 1
            continue
        plan.groups.append(group)
        plan.samples += mine
        plan.teachers.update(teachers)
        siblings += len(mine) - 1
        plan.group_stats[group] = {"kind": t.kind, "rollouts": len(mine), "distilled": 1}
    plan.loaded_groups = [hindsight_id(t.record_id) for t in chosen]
    plan.hindsight = {
        "mode": "distill",
        "corrected_turns": len(turns),
        "turns": len(plan.groups),
        "sequences": len(plan.samples),
        "siblings": siblings,
        "tokens": sum(s.trained_tokens for s in plan.samples),
    }
    plan.waiting = list(plan.groups)
    plan.damaged = damaged_files(selection.data_dir)
    return plan


def _teacher_prompt(selection: Selection, t: Corrected) -> list[int]:
    """The teacher's context token ids: the turn's messages with the hint, ready for the
    reply."""
    messages = chat_messages(t.teacher_prompt)
    return chat_ids(selection.tokenizer, messages, t.request.get("tools"), True)


def _student_samples(
    selection: Selection, records: list[str]
) -> tuple[dict[str, list[Sample]], dict[str, str]]:
    """Each record's samples as it was sampled (record id -> the served answer first,
    then its siblings), in group `hindsight:<record>`; why a record has none."""
    if not records:
        return {}, {}
    groups = [TURN_PREFIX + r for r in records]
    con = open_db(selection.data_dir)
    try:
        add_turn_views(con)
        served = load_samples(con, groups, None, selection.sampling_defaults, "served_turns")
        more = load_samples(con, groups, None, selection.sampling_defaults, "turn_completions")
        failed = _failed(con, records)
    finally:
        con.close()
    out: dict[str, list[Sample]] = {}
    for s in served.samples + [s for s in more.samples if not s.rollout_id.endswith(":served")]:
        record = s.group_id.removeprefix(TURN_PREFIX)
        if s.exact and s.trained_tokens:
            out.setdefault(record, []).append(_renamed(s, record))
    why = {r: NOT_LOADED if r in failed else NO_TOKENS for r in records if r not in out}
    return out, why


def _renamed(sample: Sample, record: str) -> Sample:
    from dataclasses import replace

    return replace(sample, group_id=hindsight_id(record))


def _failed(con, records: list[str]) -> set[str]:
    con.register("_distill_records", pa.table({"record_id": pa.array(records, pa.string())}))
    rows = con.execute(
        "SELECT record_id FROM completions WHERE error IS NOT NULL "
        "AND record_id IN (SELECT record_id FROM _distill_records)"
    ).fetchall()
    return {r for (r,) in rows}
