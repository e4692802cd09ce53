"""Groups made from single calls: the nightly stage that resamples logged turns.

Production agents make one attempt per request, so their groups hold one rollout and
train nothing. The nightly stage (`resample_turns`, run before scoring) asks vLLM for K
more samples of each such turn: its `/v1/completions` with the logged prompt token ids
(the context exactly as served), the adapter that served the turn, and the turn's
sampling parameters; vLLM returns each sample's token ids and processed logprobs. The
samples are stored as `siblings` rows (storage/read/siblings.py), never as served traffic.

The judge then scores each per-turn group (the served choice and its siblings) like any
group, and `turn_groups.add_turn_groups` puts the scored ones into the night's plan.

An imported turn (`overnight import`, docs/import.md: no token ids) is resampled when the
night has the base model's tokenizer (`Selection.tokenizer`): its messages are rendered
with the chat template into prompt token ids (trainer/grpo/render.py, as --sft renders
them), and K siblings are asked by those ids from the adapter that serves the policy now,
with the record's own sampling options (those naming another tokenizer's ids dropped).
The rendered ids are kept in each sibling's notes (`IMPORTED_PROMPT`): the served row has
none, and turn_groups.py trains the siblings from them, never the imported answer.

vLLM is called directly at the upstream the proxy reports, not through the proxy: the
proxy would log these calls as served traffic, and no header may tell the proxy that a
request is a sibling (a client could send it too).
"""

from __future__ import annotations

import datetime as dt
import http.client
import json
import os
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pyarrow as pa

from overnight.config import TrainConfig
from overnight.errors import OvernightError
from overnight.storage import LogWriter, WriterConfig, finished_groups, now_us, open_db
from overnight.storage.read.policy_scope import PolicyScope
from overnight.storage.read.siblings import (
    ENDPOINTS,
    TABLE,
    SiblingError,
    completion_request,
    context_lengths,
    decoding_unsupported,
    error_row,
    requested_limit,
    sibling_rows,
)
from overnight.telemetry import traced
from overnight.trainer.grpo.data import DataError
from overnight.trainer.grpo.logged_turns import chat_ids
from overnight.trainer.grpo.render import chat_messages
from overnight.trainer.serving.proxy_client import serving_state

from .inputs import Selection
from .turn_groups import IMPORTED_PROMPT

# Calls in flight at once: vLLM batches them; more only queue in its scheduler.
CONCURRENCY = 8
# Turns whose prompt token ids are held at once: an agent's context can be tens of
# thousands of tokens, and a night's budget hundreds of turns.
BATCH = 32
# A sampling call may generate K long answers on a busy server.
CALL_TIMEOUT = 600.0
# Imported turns (docs/import.md): the request fields that name token ids of the tokenizer
# the source's model had, not ours (the rendered prompt ids go under IMPORTED_PROMPT).
FOREIGN_TOKEN_FIELDS = ("logit_bias", "stop_token_ids", "allowed_token_ids", "bad_words")
NO_TOKENIZER = "imported: no token ids, and no tokenizer to render its messages"
NO_TARGET = "imported: which model serves the policy is not known (give the proxy)"


class ResampleError(OvernightError):
    code = "resample_error"


class Unreachable(ResampleError):
    """vLLM was not reached or did not answer: nothing is known about the turn."""


@dataclass
class ResampleSummary:
    turns: int = 0  # turns asked for siblings
    siblings: int = 0  # sibling rows stored
    failed: int = 0  # calls vLLM refused or answered unusably (recorded as error rows)
    unreached: int = 0  # calls that did not reach vLLM (no row: asked again next night)
    completion_tokens: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> turns
    seconds: float = 0.0
    upstream: str = ""
    stopped: str = ""  # why the stage stopped before its budget, if it did

    def lines(self) -> list[str]:
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        out = [
            f"resampled {self.turns} turn(s) at {self.upstream}: {self.siblings} sibling(s), "
            f"{self.failed} failed call(s), {self.completion_tokens} tokens in "
            f"{self.seconds:.1f} s ({rate:.0f} tokens/s)"
        ]
        if self.unreached:
            out.append(f"  {self.unreached} call(s) did not reach vLLM: asked again next run")
        if self.stopped:
            out.append(f"  stopped early: {self.stopped}")
        out += [f"  not resampled {n} turn(s): {why}" for why, n in self.skipped.most_common()]
        return out


@traced("resample", lambda s: {"turns": s.turns, "siblings": s.siblings, "failed": s.failed})
def resample_turns(
    selection: Selection,
    config: TrainConfig,
    *,
    proxy_url: str | None = None,
    admin_token: str | None = None,
    say=print,
    state: dict | None = None,
) -> ResampleSummary:
    """Ask vLLM for `config.resample` siblings of each eligible turn, newest first, up to
    `config.resample_max_turns`; store them. The stage `overnight train --resample K`
    runs before scoring, for each policy's night: of `scope`'s groups only, when given.
    `state`: the proxy's answer about the policy, when the night read it already."""
    data_dir, settle_seconds, since = selection.data_dir, selection.settle_seconds, selection.since
    scope = selection.scope
    summary = ResampleSummary()
    if config.resample < 1:
        return summary
    started = time.perf_counter()
    if config.resample_upstream:
        url = config.resample_upstream
    else:
        url, state = _proxy_upstream(proxy_url, admin_token, config.policy, state)
    url = url.rstrip("/")
    key = os.environ.get("OVERNIGHT_UPSTREAM_API_KEY") or None
    summary.upstream = url
    models = served_models(url, key)  # name -> context length, what vLLM serves now
    target = _policy_model(state, models) if selection.tokenizer is not None else None
    imported = NO_TOKENIZER if selection.tokenizer is None else None if target else NO_TARGET
    con = open_db(data_dir)
    try:
        turns = _choose(con, config, settle_seconds, since, models, summary.skipped, scope,
                        imported=(imported, target))  # fmt: skip
    finally:
        con.close()
    writer = LogWriter(WriterConfig(Path(data_dir), compact_in_process=True))
    writer.start()
    sample = partial(
        _sample, url, key, k=config.resample, models=models, writer_id=writer.writer_id
    )
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            for i in range(0, len(turns), BATCH):
                batch = _with_prompts(
                    data_dir, turns[i : i + BATCH], selection.tokenizer, summary.skipped
                )
                unreached = summary.unreached
                for rows in pool.map(sample, batch):
                    _count(summary, rows)
                    for row in rows or ():
                        writer.append(TABLE, row)
                if batch and summary.unreached - unreached == len(batch):
                    # vLLM went away: stop rather than wait out each turn's timeout.
                    summary.stopped = f"no call of a batch reached vLLM at {url}"
                    break
    finally:
        writer.close()
    summary.seconds = time.perf_counter() - started
    for line in summary.lines():
        say(line)
    return summary


def _count(summary: ResampleSummary, rows: list[dict] | None) -> None:
    summary.turns += 1
    if rows is None:
        summary.unreached += 1
        return
    summary.failed += sum(r.get("error") is not None for r in rows)
    summary.siblings += sum(r.get("error") is None for r in rows)
    summary.completion_tokens += sum(r.get("completion_tokens") or 0 for r in rows)


def _proxy_upstream(
    proxy_url: str | None, token: str | None, policy: str | None, state: dict | None
) -> tuple[str, dict]:
    """The first healthy vLLM replica the proxy forwards to (a per-policy admin token is
    not told: then --resample-upstream), from the proxy's `state` when the night has read
    it already; and that state."""
    if not proxy_url:
        raise ResampleError("--resample needs the proxy (to find vLLM) or --resample-upstream")
    if state is None:
        state = serving_state(proxy_url, token, policy)
    if state.get("upstream"):  # a hosted API (proxy/routes/hosted.py): never asked, with a key
        raise ResampleError(
            f"the proxy fronts a hosted API ({state['upstream']}), which gives no token ids "
            "to resample with: drop --resample (or give --resample-upstream, a vLLM)"
        )
    replicas = state.get("replicas") or []
    healthy = [r["url"] for r in replicas if r.get("healthy")] or [r["url"] for r in replicas]
    if not healthy:
        raise ResampleError(
            f"the proxy at {proxy_url} reports no upstream: give --resample-upstream"
        )
    return healthy[0], state


def _policy_model(state: dict | None, models: dict[str, int | None]) -> str | None:
    """The name vLLM serves the policy under now (its adapter, else the base model), as the
    proxy's state says; without a state, the one model vLLM serves, if only one. None: not
    known (imported turns are then not resampled: no served turn names a model for them)."""
    state = state or {}
    for name in ((state.get("current") or {}).get("name"), state.get("base_model")):
        if name and name in models:
            return name
    return next(iter(models)) if len(models) == 1 and not state else None


def served_models(url: str, key: str | None) -> dict[str, int | None]:
    """The models and adapters vLLM serves now, with their context length."""
    return context_lengths(_call(url + "/v1/models", key, None, 30.0).get("data", []))


# The turns not resampled yet, each with the reason it cannot be (null: it can), from
# what is cheap to tell in SQL; the request's decoding is looked at in `_choose`.
_PENDING = """
    SELECT c.record_id, c.endpoint, c.model_served, c.request, c.started_at,
           {imported} AS imported,
           CASE WHEN c.endpoint NOT IN (SELECT endpoint FROM _resample_endpoints)
                    THEN 'the endpoint logs no token ids (Responses, Messages)'
                WHEN {imported} AND c.request IS NOT NULL AND {imported_why} IS NOT NULL
                    THEN {imported_why}
                WHEN {imported} AND c.request IS NOT NULL THEN NULL
                WHEN coalesce(len(c.prompt_token_ids), 0) = 0
                     OR coalesce(len(c.completion_token_ids), 0) = 0
                    THEN 'no token ids logged'
                WHEN c.request IS NULL THEN 'the request was not logged'
                WHEN coalesce(c.model_served, '') NOT IN (SELECT model FROM _resample_models)
                    THEN 'the adapter that served it is no longer loaded'
           END AS why
    FROM completions c JOIN groups g USING (group_id)
    WHERE c.group_id IN (SELECT group_id FROM _resample_groups) {single} {after}
      AND c.logged AND c.error IS NULL AND NOT coalesce(c.partial, false)
      AND NOT EXISTS (SELECT 1 FROM siblings s WHERE s.sibling_of = c.record_id)
"""
# An imported row: its notes' upstream says so (overnight/imports/calls.py, docs/import.md).
_IMPORTED = "coalesce(starts_with(json_extract_string(c.notes, '$.upstream'), 'imported:'), false)"


def _literal(text: str | None) -> str:
    return "NULL::VARCHAR" if text is None else "'" + text.replace("'", "''") + "'"


def _choose(
    con,
    config: TrainConfig,
    settle_seconds: float,
    since: dt.datetime | None,
    models: dict[str, int | None],
    skipped: Counter,
    scope: PolicyScope | None = None,
    imported: tuple[str | None, str | None] = (NO_TOKENIZER, None),
) -> list[dict]:
    """Tonight's turns, newest first, within the budget: logged, successful turns of
    finished groups with no siblings yet (a shadow-sampled turn has some), of groups with
    one rollout or, with `resample_all_turns`, of every group. Why others are left out
    is counted in `skipped`. Their prompt token ids are read later, a batch at a time.
    `imported`: why imported turns are not resampled (None: they are), and the model
    that samples their siblings (the policy's, as vLLM serves it)."""
    imported_why, target = imported
    groups = finished_groups(con, settle_seconds, None)
    if scope is not None:  # a policy's night resamples its own groups' turns
        own = scope.groups(con, groups)
        groups = [g for g in groups if g in own]
    if not groups:
        return []
    con.register("_resample_groups", pa.table({"group_id": pa.array(groups, pa.string())}))
    con.register("_resample_endpoints", pa.table({"endpoint": pa.array(ENDPOINTS)}))
    con.register("_resample_models", pa.table({"model": pa.array(list(models), pa.string())}))
    pending = _PENDING.format(
        single="" if config.resample_all_turns else "AND g.rollouts < 2",
        after="AND c.started_at >= ?" if since is not None else "",
        imported=_IMPORTED,
        imported_why=_literal(imported_why),
    )
    params = [since] if since is not None else []
    counts = dict(
        con.execute(f"SELECT why, count(*) FROM ({pending}) GROUP BY why", params).fetchall()
    )
    eligible = counts.pop(None, 0)
    skipped.update(counts)
    # Twice the budget: turns left out below (constrained decoding) should not leave the
    # night's budget unspent; those not even read are over it.
    rows = con.execute(
        f"SELECT record_id, endpoint, model_served, request, imported FROM ({pending}) "
        "WHERE why IS NULL "
        "ORDER BY started_at DESC, record_id LIMIT ?",
        [*params, 2 * config.resample_max_turns],
    ).fetchall()
    if eligible > len(rows):
        skipped["over --resample-max-turns"] += eligible - len(rows)
    chosen = []
    for record_id, endpoint, model, text, from_import in rows:
        request = json.loads(text)
        request = request if isinstance(request, dict) else {}
        if from_import:  # sampled by the policy's model, its own ids' options dropped
            model = target
            request = {k: v for k, v in request.items() if k not in FOREIGN_TOKEN_FIELDS}
        why = decoding_unsupported(request)
        if why is None and requested_limit(request) is None and models[model] is None:
            why = "no max_tokens, and vLLM reports no context length (siblings would stop at 16)"
        if why is None and len(chosen) >= config.resample_max_turns:
            why = "over --resample-max-turns"
        if why is not None:
            skipped[why] += 1
        else:
            turn = dict(record_id=record_id, endpoint=endpoint, model_served=model,
                        request=request)  # fmt: skip
            chosen.append({**turn, "imported": True} if from_import else turn)
    return chosen


def _with_prompts(
    data_dir: Path, batch: list[dict], tokenizer=None, skipped: Counter | None = None
) -> list[dict]:
    """The turns of `batch` with their prompt token ids, read now (see BATCH); an imported
    turn's rendered from its messages with `tokenizer`'s chat template (one the template
    cannot render is counted in `skipped` with its reason)."""
    if any(t.get("imported") for t in batch):
        return _with_rendered_prompts(data_dir, batch, tokenizer, skipped)
    con = open_db(data_dir)
    try:
        ids = pa.array([t["record_id"] for t in batch], pa.string())
        con.register("_resample_batch", pa.table({"record_id": ids}))
        prompts = dict(
            con.execute(
                "SELECT record_id, prompt_token_ids FROM completions "
                "WHERE record_id IN (SELECT record_id FROM _resample_batch)"
            ).fetchall()
        )
    finally:
        con.close()
    # A turn pruned since it was chosen is no longer there to resample.
    return [
        {**t, "prompt_token_ids": prompts[t["record_id"]]}
        for t in batch
        if prompts.get(t["record_id"])
    ]


def _with_rendered_prompts(
    data_dir: Path, batch: list[dict], tokenizer, skipped: Counter | None
) -> list[dict]:
    """`_with_prompts` for a batch with imported turns: the captured ones as it reads them,
    the imported ones rendered, in the batch's order."""
    captured = {t["record_id"]: t for t in _with_prompts(
        data_dir, [t for t in batch if not t.get("imported")])}  # fmt: skip
    out = []
    for turn in batch:
        if not turn.get("imported"):
            out += [captured[turn["record_id"]]] if turn["record_id"] in captured else []
            continue
        try:
            prompt = render_prompt(tokenizer, turn["request"])
        except DataError as e:
            if skipped is not None:
                skipped[f"imported: {e}"] += 1
            continue
        out.append({**turn, "prompt_token_ids": prompt})
    return out


def imported_tokenizer(data_dir: Path, base_model: str | None):
    """The base model's tokenizer where the store holds imported turns to render (the
    night's, overnight/night/scoring.py); None where it holds none, or the tokenizer cannot
    be loaded (imported turns are then not resampled, and the stage says why)."""
    if not base_model:
        return None
    con = open_db(data_dir)
    try:
        found = con.execute(
            f"SELECT 1 FROM completions c WHERE starts_with(c.record_id, 'imp-') AND {_IMPORTED} "
            "LIMIT 1"
        ).fetchall()
    finally:
        con.close()
    if not found:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(base_model)
    except (ImportError, OSError, ValueError):
        return None


def render_prompt(tokenizer, request: dict) -> list[int]:
    """An imported turn's context as the base model's chat template renders it, ready for
    the reply (trainer/grpo/render.py's rendering, as --sft nights use it)."""
    messages = chat_messages(request.get("messages"))
    return chat_ids(tokenizer, messages, request.get("tools") or None, add_generation_prompt=True)


def _sample(
    url: str, key: str | None, served: dict, *, k: int, models: dict, writer_id: str
) -> list[dict] | None:
    """Sibling rows for one served turn; one error row when vLLM refuses the call or its
    answer does not fit the turn (asking again would fail again: the row keeps the turn
    from being asked every night); None when vLLM was not reached (asked again)."""
    body = completion_request(served, k, max_model_len=models[served["model_served"]])
    started = now_us()
    try:
        response = _call(url + "/v1/completions", key, body, CALL_TIMEOUT)
        rows = sibling_rows(served, response, origin="resample", writer_id=writer_id,
                            started_at=started, ended_at=now_us(), sent=body)  # fmt: skip
        if served.get("imported"):  # the served row has no ids: the siblings keep theirs
            for row in rows:
                row["notes"] = {IMPORTED_PROMPT: list(served["prompt_token_ids"])}
        return rows
    except Unreachable:
        return None
    except (ResampleError, SiblingError) as e:
        return [error_row(served, str(e), origin="resample", writer_id=writer_id,
                          started_at=started, ended_at=now_us(), sent=body)]  # fmt: skip


def _call(url: str, key: str | None, payload: dict | None, timeout: float) -> dict:
    request = urllib.request.Request(
        url,
        method="POST" if payload is not None else "GET",
        data=json.dumps(payload).encode() if payload is not None else None,
        headers={
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {key}"} if key else {}),
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        raise ResampleError(f"vLLM answered {e.code} at {url}: {detail}") from e
    except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out
        raise Unreachable(f"cannot reach vLLM at {url}: {e}") from e
    try:
        answer = json.loads(body)
    except ValueError as e:
        raise ResampleError(f"vLLM answered {url} with something other than JSON") from e
    if not isinstance(answer, dict):
        raise ResampleError(f"vLLM answered {url} with JSON that is not an object")
    return answer
