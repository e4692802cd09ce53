"""What a --hindsight night trains on: the answers users corrected, as the model answers
once it is shown the correction (issue 48: learn from what they said, not only that
they were unhappy).

A correction often carries the right answer ("No, it's 7.", "that fails with KeyError:
'id'", "I asked for the population, not the area"); a scalar reward keeps only its sign.
The same model shown the user's next message is a better teacher for the turn it
reacts to (hindsight). This plan distils that teacher into the policy without the hint:

  turns whose next user message drew a negative signal (`signals`, value < 0, of a kind
  read from the user's words: HINT_KINDS), logged by a client, no night trained before
  (`hindsight:<record id>` in `training_runs.groups`), of the night's policy
  -> the teacher's prompt: the turn's own messages, its last user message followed by
     the hint (HINT: the user's next message, whole, from the request that carried it)
  -> the teacher's revised answer, asked of vLLM (the adapter that served the turn,
     temperature 0, the turn's token limit; `Teacher`, through the upstream --resample
     uses: calls and tokens counted)
  -> the student's sample: the turn's messages WITHOUT the hint -> the revised answer,
     rendered with the local chat template as an --sft night renders a reply
     (grpo/render.py), trained with the --sft objective (cross-entropy).

A revision identical to the served answer (the hint changed nothing), empty, cut at its
token limit, or speaking of the hint (quoting it, or its framing) is not trained (counted, and left to a later night, which may revise it
again from a better adapter). Turns held out for the gate by --sft-held-out (the same
hash of the group id an --sft night uses) are never taken. docs/grpo.md ("Hindsight")
argues revise-first against per-token distillation.
"""

from __future__ import annotations

import datetime as dt
import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa

from overnight.config import TrainConfig
from overnight.storage import open_db
from overnight.telemetry import traced
from overnight.trainer.grpo.data import DataError, Sample
from overnight.trainer.grpo.render import render_turn

from .inputs import Selection
from .plan import Plan, damaged_files, trained_groups
from .selection import HINDSIGHT_PREFIX
from .sft_plan import HELD_OUT, held_out

PREFIX = HINDSIGHT_PREFIX
# Signals read from the user's own next message: its words are the hint. (A regenerate,
# an edit, a tool's error or a cut answer say something went wrong, not what.)
HINT_KINDS = ("corrected", "re_asked")
# Appended to the turn's last user message for the teacher; never shown to the student.
HINT = '\n\n(The user replied to an earlier answer to this: "{hint}" Answer the question above.)'
# Hints longer than this are cut (a pasted traceback): the teacher needs its gist.
HINT_CHARS = 2000
# A turn that set no token limit: the teacher's revision stops here.
DEFAULT_MAX_TOKENS = 512
# The teacher's calls in flight at once (vLLM batches them).
CONCURRENCY = 4
CALL_TIMEOUT = 600.0

UNCHANGED = "the teacher's revision is the served answer (the hint changed nothing)"
ECHOED = "the teacher's revision speaks of the hint (the student never sees it)"
EMPTY = "the teacher's revision is empty"
CUT = "the teacher's revision was cut off at its token limit"
NOT_CHAT = "not a chat completion (the teacher is asked in the chat shape)"
NOT_SERVED = "the adapter that served it is no longer loaded (no teacher)"
TEACHER_FAILED = "the teacher's call failed"
NO_HINT = "the signal carries no text"


def hindsight_id(record_id: str) -> str:
    return PREFIX + record_id


def is_hindsight(group_id: str) -> bool:
    return group_id.startswith(PREFIX)


def teacher_messages(messages: list[dict], hint: str) -> list[dict]:
    """The turn's messages with the hint after its last user message (a message of its
    own when the conversation ends otherwise, or the content is not plain text)."""
    hint = " ".join(hint.split())
    if len(hint) > HINT_CHARS:
        hint = hint[: HINT_CHARS - 1] + "…"
    said = HINT.format(hint=hint)
    out = [dict(m) for m in messages]
    if out and out[-1].get("role") == "user" and isinstance(out[-1].get("content"), str):
        out[-1]["content"] = out[-1]["content"] + said
    else:
        out.append({"role": "user", "content": said.strip()})
    return out


@dataclass
class Teacher:
    """vLLM's chat completions at `url`: the teacher's revisions, counted."""

    url: str
    key: str | None = None
    calls: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    # (url, body) -> the JSON answer; replaced in tests.
    post: Callable[[str, dict], dict] | None = None
    # The counts above are added to from CONCURRENCY threads.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def models(self) -> set[str] | None:
        """The models and adapters vLLM serves now; None where it does not say."""
        try:
            answer = self._call(self.url.rstrip("/") + "/v1/models", None)
        except (OSError, ValueError, http.client.HTTPException):
            return None
        return {m.get("id") for m in answer.get("data") or [] if isinstance(m, dict)}

    def revise(self, model: str, messages: list[dict], request: dict) -> dict:
        """The teacher's answer to `messages` (its first choice, as vLLM gives it), at
        temperature 0 and the turn's own token limit and tools."""
        limit = request.get("max_completion_tokens") or request.get("max_tokens")
        body = {"model": model, "messages": messages, "temperature": 0.0,
                "max_tokens": int(limit or DEFAULT_MAX_TOKENS)}  # fmt: skip
        for key in ("tools", "tool_choice"):
            if request.get(key):
                body[key] = request[key]
        started = time.perf_counter()
        answer = None
        try:
            answer = self._call(self.url.rstrip("/") + "/v1/chat/completions", body)
            return answer
        finally:
            usage = (answer or {}).get("usage") or {}
            with self.lock:
                self.calls += 1
                self.failed += answer is None
                self.seconds += time.perf_counter() - started
                self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
                self.completion_tokens += int(usage.get("completion_tokens") or 0)

    def line(self) -> str:
        return (
            f"hindsight teacher at {self.url}: {self.calls} call(s), {self.failed} failed, "
            f"{self.prompt_tokens} prompt and {self.completion_tokens} completion tokens in "
            f"{self.seconds:.1f} s of calls"
        )

    def _call(self, url: str, body: dict | None) -> dict:
        if self.post is not None:
            return self.post(url, body)
        request = urllib.request.Request(
            url,
            method="POST" if body is not None else "GET",
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Content-Type": "application/json",
                     **({"Authorization": f"Bearer {self.key}"} if self.key else {})},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=CALL_TIMEOUT) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300]
            raise OSError(f"vLLM answered {e.code} at {url}: {detail}") from e
        if not isinstance(answer, dict):
            raise ValueError(f"vLLM answered {url} with JSON that is not an object")
        return answer


def teacher_at(config: TrainConfig, proxy_url, token, state) -> Teacher:
    """The teacher: vLLM at --resample-upstream, else the proxy's first healthy replica
    (as --resample finds it)."""
    from .resample import ResampleError, _proxy_upstream

    if not (config.resample_upstream or proxy_url):
        raise ResampleError(
            "--hindsight asks vLLM for the teacher's revisions: give --proxy (to find vLLM) "
            "or --resample-upstream"
        )
    url = config.resample_upstream
    if not url:
        found = _proxy_upstream(proxy_url, token, config.policy, state)
        url = found[0] if isinstance(found, tuple) else found  # (url, state) in a later form
    return Teacher(url.rstrip("/"), os.environ.get("OVERNIGHT_UPSTREAM_API_KEY") or None)


@dataclass
class Corrected:
    """A turn the user's next message corrected, and what the teacher made of it."""

    record_id: str
    group_id: str
    rollout_id: str
    model: str
    request: dict
    served: str  # the served answer's text
    hint: str
    kind: str
    revised: str | None = None
    why: str | None = None  # why it is not trained tonight

    @property
    def teacher_prompt(self) -> list[dict]:
        return teacher_messages(self.request["messages"], self.hint)


@dataclass
class HindsightStats:
    turns: int = 0  # corrected turns looked at
    revised: int = 0  # with a revision to train
    skipped: dict[str, int] = field(default_factory=dict)


# Each turn's negative signals read from the user's words, with the turn and the request
# that carried the next message (for the message whole: the signal's evidence is cut).
_CORRECTED = """
    SELECT s.record_id, s.kind, s.evidence, c.group_id, c.rollout_id, c.endpoint,
           c.model_served, c.request, c.response, e.request AS next_request
    FROM signals s
    JOIN completions c ON c.record_id = s.record_id
    LEFT JOIN completions e ON e.record_id = s.evidence_record
    WHERE s.value < 0 AND s.kind IN (SELECT kind FROM _hindsight_kinds)
      AND c.sent_by = 'client' AND c.logged AND c.request IS NOT NULL {after}
    ORDER BY c.started_at, s.record_id, s.confidence DESC, s.source DESC
"""


def corrected_turns(con, since: dt.datetime | None, only: set[str] | None) -> list[Corrected]:
    """Every corrected turn once (its surest signal), oldest first; of `only` (record ids)
    when given. Why a turn cannot be used is set on it (`why`)."""
    con.register("_hindsight_kinds", pa.table({"kind": pa.array(list(HINT_KINDS))}))
    after = "AND c.started_at >= ?" if since is not None else ""
    rows = con.execute(_CORRECTED.format(after=after), [since] if since else []).fetchall()
    out: dict[str, Corrected] = {}
    for row in rows:
        record, kind, evidence, group, rollout, endpoint, model, request, response, following = row
        if record in out or (only is not None and record not in only):
            continue
        request = _json(request)
        turn = Corrected(record, group, rollout, model or "", request, _reply(response),
                         _hint(request, following) or evidence or "", kind)  # fmt: skip
        if endpoint != "chat.completions" or not isinstance(request.get("messages"), list):
            turn.why = NOT_CHAT
        elif not turn.hint.strip():
            turn.why = NO_HINT
        out[record] = turn
    return list(out.values())


@traced(
    "plan",
    lambda plan: {"groups": len(plan.groups), "samples": len(plan.samples), "hindsight": True},
)
def plan_hindsight(selection: Selection, config: TrainConfig, teacher: Teacher, say=print) -> Plan:
    """The corrected turns a --hindsight night trains on, each with the teacher's revised
    answer as its sample (see the module's docstring); why the others wait or are left."""
    tokenizer = selection.tokenizer
    plan, turns, chosen = choose_corrected(selection, config)
    served = teacher.models() if chosen else None
    for t in chosen:
        if served is not None and t.model not in served:
            t.why = NOT_SERVED
    asking = [t for t in chosen if t.why is None]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(lambda t: _revise(teacher, t), asking))
    samples: list[Sample] = []
    for t in chosen:
        if t.why is None:
            try:
                turn = render_turn(tokenizer, t.request,
                                   {"role": "assistant", "content": t.revised}, selection.vision)  # fmt: skip
            except DataError as e:
                t.why = f"turns skipped: {e}"
        if t.why is not None:
            plan.skipped[t.why] += 1
            continue
        group = hindsight_id(t.record_id)
        samples.append(Sample.from_turns(t.rollout_id, group, [turn]))
        plan.groups.append(group)
        plan.group_stats[group] = {"kind": t.kind, "rollouts": 1, "imitated": 1}
    plan.loaded_groups = [hindsight_id(t.record_id) for t in chosen]
    plan.samples = samples
    plan.sft = {
        "selection": "hindsight",
        "min_reward": None,
        "rollouts": len(chosen),
        "selected_rollouts": len(samples),
        "held_out": sorted({t.group_id for t in turns if t.why == HELD_OUT}),
        "duplicates": 0,
        "hindsight": {
            "corrected_turns": len(turns),
            "teacher_calls": teacher.calls,
            "teacher_failed": teacher.failed,
            "teacher_prompt_tokens": teacher.prompt_tokens,
            "teacher_completion_tokens": teacher.completion_tokens,
        },
    }
    plan.waiting = list(plan.groups)
    plan.damaged = damaged_files(selection.data_dir)
    say(teacher.line())
    return plan


def choose_corrected(
    selection: Selection, config: TrainConfig
) -> tuple[Plan, list[Corrected], list[Corrected]]:
    """(a plan with the corrected turns looked at and why some are left, every corrected
    turn, those a night takes): never one an earlier hindsight night trained, nor one
    held out for the gate (--sft-held-out), at most --max-groups; a resumed run's own."""
    only, scope = selection.only, selection.scope
    if selection.tokenizer is None:
        raise ValueError("a --hindsight night renders conversations: it needs a tokenizer")
    con = open_db(selection.data_dir)
    try:
        done = trained_groups(con)
        wanted = None if only is None else {g.removeprefix(PREFIX) for g in only}
        turns = corrected_turns(con, selection.since, wanted)
        if scope is not None:
            own = scope.groups(con, sorted({t.group_id for t in turns}))
            turns = [t for t in turns if t.group_id in own]
    finally:
        con.close()
    plan = Plan(considered=[hindsight_id(t.record_id) for t in turns])
    chosen: list[Corrected] = []
    for t in turns:
        if only is None and hindsight_id(t.record_id) in done:
            continue  # trained by an earlier night: never again
        if t.why is None and only is None and held_out(t.group_id, config.sft_held_out):
            t.why = HELD_OUT
        if t.why is None and len(chosen) >= (selection.max_groups or len(turns) + 1):
            continue  # past --max-groups: a later night's
        if t.why is not None:
            plan.skipped[t.why] += 1
            continue
        chosen.append(t)
    return plan, turns, chosen


def _revise(teacher: Teacher, t: Corrected) -> None:
    """The teacher's revised answer set on `t`, or why there is none."""
    try:
        answer = teacher.revise(t.model, t.teacher_prompt, t.request)
    except (OSError, ValueError, http.client.HTTPException):
        t.why = TEACHER_FAILED
        return
    choice = (answer.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    text = (message.get("content") or "").strip()
    if choice.get("finish_reason") == "length":
        t.why = CUT
    elif not text:
        t.why = EMPTY
    elif text == t.served.strip():
        t.why = UNCHANGED
    elif _echoes(text, t.hint):
        t.why = ECHOED
    else:
        t.revised = text


def _echoes(text: str, hint: str) -> bool:
    """Whether a revision quotes the hint or its framing ("The user replied to an earlier
    answer, ..."): imitated, it would teach the student to answer a message it never saw."""
    said = " ".join(text.lower().split())
    hint = " ".join(hint.lower().split())
    return "replied to an earlier answer" in said or (len(hint) >= 8 and hint in said)


def _json(text) -> dict:
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _reply(response) -> str:
    choice = (_json(response).get("choices") or [{}])[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    return _text((message or {}).get("content"))


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return ""


def _hint(request: dict, following) -> str:
    """The user's next message, whole: the first user message the next request added
    after the turn's messages and its reply."""
    messages = _json(following).get("messages")
    turn = request.get("messages")
    if not isinstance(messages, list) or not isinstance(turn, list):
        return ""
    for m in messages[len(turn) + 1 :]:
        if isinstance(m, dict) and m.get("role") == "user":
            return _text(m.get("content"))
    return ""
