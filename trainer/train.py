"""`overnight train`: one nightly GRPO run over the groups no earlier run trained on.

  resume an interrupted run, or begin one (run/checkpoint.py) -> select finished, scored,
  untrained groups (night/plan.py) -> start from the adapter the proxy serves (or a fresh
  LoRA) -> GRPO steps, a checkpoint after each (run/loop.py) -> save the adapter -> the
  gate compares it with the served adapter on held-out prompts (night/gate.py) -> promote
  it through the proxy's admin API (night/proxy_client.py) -> record the run
  (run/record.py), write the report. Before all that, the watch (night/watch.py) rolls
  back a promoted adapter that live rewards show worse. With --report-to wandb the steps,
  the gate and the promotion also go to the night's W&B run (run/wandb_run.py).

With --sft the night imitates instead: the plan is night/sft_plan.py's (the logged
conversations rendered with the local chat template, chosen by reward, a share held out
for the gate) and the step's objective the assistant tokens' cross-entropy; resuming,
the gate, the promotion and the record are the same.

Under torchrun every process runs this; process 0 decides what to train on and does
everything with side effects (files, the run record, the promotion). Progress goes to
`say` (a line per stage and per step, with rates).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from pathlib import Path

from overnight.config import LOGPROB_GAP_WARNING, SETTLE_SECONDS, TrainConfig
from overnight.telemetry import traced
from overnight.view.report import write_report

from .grpo.parallel import Parallel
from .grpo.sampling import server_defaults
from .grpo.step import fresh_adapter, micro_batch_loss
from .night.canary import start as start_canary
from .night.colocation import should_colocate
from .night.colocation import window as maintenance_window
from .night.gate import Scorer, Verdict, run_gate, skipped
from .night.gate_prompts import held_out_prompts
from .night.plan import Plan, plan_run
from .night.policy_scope import PolicyScope
from .night.proxy_client import (
    admin_call,
    base_model_of,
    local_adapter,
    promote_adapter,
    prune_adapters,
    served_adapter,
    serving_state,
    shared_adapter,
)
from .night.resample import resample_turns
from .night.sft_plan import plan_sft
from .night.staleness import staleness_of, weigh_staleness
from .night.turn_groups import add_turn_groups, is_turn_group
from .night.watch import watch as watch_served
from .run.checkpoint import kill_point, this_run, unfinished_run
from .run.loop import TrainError, run_training, step_schedule
from .run.record import RunResult, record_run
from .run.wandb_run import Report

# Re-exported: the CLI, the tests and the benchmarks import these from here.
__all__ = [
    "Plan",
    "RunResult",
    "TrainError",
    "admin_call",
    "fresh_adapter",
    "micro_batch_loss",
    "plan_run",
    "record_run",
    "resample_turns",
    "run_training",
    "step_schedule",
    "train",
    "unfinished_run",
]

log = logging.getLogger("overnight.trainer")


# One trace per night (overnight/telemetry.py): this root, or the CLI's around the judge too.
@traced("overnight night", lambda result: _night_attributes(result), root=True)
def train(
    data_dir: Path,
    config: TrainConfig,
    *,
    proxy_url: str | None = None,
    admin_token: str | None = None,
    promote: bool = True,
    dry_run: bool = False,
    settle_seconds: float = SETTLE_SECONDS,
    since: dt.datetime | None = None,
    max_groups: int | None = None,
    say=print,
    scorer: Scorer | None = None,
    judge=None,
    scope: PolicyScope | None = None,
) -> RunResult:
    """One night. A run that was interrupted is resumed first, on the same groups.
    `judge`: the summary of the judge's batch that scored for it (its cost goes to W&B).
    `scope`: its policy's groups as the CLI found them (a dry run's may be read offline:
    overnight/cli_policies.py); None: asked of the proxy here.

    Kept as one function on purpose: it is the night's story read top to bottom
    (resume, plan, train, save, promote, record); each step is a call.
    """
    data_dir = Path(data_dir)
    parallel = Parallel() if dry_run else Parallel.start(fsdp=config.fsdp)
    if parallel.rank != 0:
        say = _silent
    report = Report(config, parallel.rank, say)  # W&B, or nothing (run/wandb_run.py)
    # The night's policy (config.policy; None: every group, as before policies): its own
    # groups, its own interrupted run, its own selection record (policy_scope.py).
    if scope is None:
        scope = PolicyScope.of(config.policy, serving_state(proxy_url, admin_token, config.policy))
    scope = parallel.agree(scope)
    run_dir, saved = parallel.agree(this_run(data_dir, dry_run, scope and scope.owns))
    only = saved.get("groups")  # a resumed run's groups
    if only is not None and bool(saved.get("sft")) != config.sft:
        raise TrainError(
            f"the interrupted run {run_dir.run_id} was {'an --sft' if saved.get('sft') else 'a GRPO'}"
            f" run: resume it {'with' if saved.get('sft') else 'without'} --sft (or delete "
            f"{run_dir.path} to leave it)"
        )
    say(f"run {run_dir.run_id}: " + _what_it_trains_on(only))
    started = time.time_ns() // 1000
    if promote and proxy_url and config.watch and parallel.rank == 0:
        watch_served(data_dir, proxy_url, admin_token, config, say)
    # After the watch's rollback; of this night's policy (config.policy; None: the default).
    state = parallel.agree(serving_state(proxy_url, admin_token, config.policy))
    if promote and state.get("upstream"):  # a hosted API (proxy/routes/hosted.py): its 409s
        say(f"the proxy fronts a hosted API ({state['upstream']}), which serves no adapter: "
            "tonight's is saved, with no gate and no promotion")  # fmt: skip
        promote = False
    base_model = config.base_model or (None if dry_run else _base_model(state))
    defaults = server_defaults(base_model, config.generation_config)  # vLLM's, where unsaid
    served_only = None if only is None else [g for g in only if not is_turn_group(g)]
    tokenizer = _tokenizer(base_model)
    if config.sft:  # the logged conversations to imitate (night/sft_plan.py)
        plan = plan_sft(data_dir, config, settle_seconds, since, max_groups, only,
                        _sft_tokenizer(tokenizer, base_model), scope)  # fmt: skip
    else:
        plan = plan_run(
            data_dir, config, settle_seconds, since, max_groups, served_only, tokenizer,
            defaults, scope=scope,
        )  # fmt: skip
        # Per-turn groups (a served turn and its siblings: turn_groups.py) join the plan
        # before the gate takes its prompts, so that it takes them from outside the plan.
        plan = add_turn_groups(
            data_dir, plan, config, since=since, max_groups=max_groups, only=only,
            sampling_defaults=defaults, scope=scope,
        )  # fmt: skip
    gate_prompts: list = []
    given: list[str] = []  # groups the gate took from the plan
    if promote and proxy_url and not dry_run and skipped(config, scorer) is None:
        # An --sft night's held-out share is its gate's: none taken from the plan.
        gate_prompts, gated = held_out_prompts(
            data_dir, plan, config.gate_prompts, only is None and not config.sft, scope=scope
        )
        given = [g for g in plan.groups if g not in set(gated.groups)]
        plan = gated
        say(f"gate: {len(gate_prompts)} held-out prompt(s), {len(given)} of them from groups "
            "left out of tonight's training")  # fmt: skip
    # A resumed run starts from what it started from; a new one from the served adapter
    # (its local copy, with a bucket).
    started_from = saved["start_adapter"] if only is not None else served_adapter(state)
    start_adapter = started_from if only is not None else local_adapter(data_dir, started_from)
    # How many promotions old each record is, against the adapter training starts from.
    limit = config.max_staleness if only is None else None  # resumed: exactly its groups
    if not config.sft:  # imitated text has no importance ratio to weigh
        plan = weigh_staleness(plan, staleness_of(state, started_from), limit)
    for line in plan.lines():
        say(line)
    result = RunResult(run_dir.run_id, plan, held_out=given)
    if dry_run or not plan.groups:
        if not plan.groups:
            say("nothing to train on")
        return result
    say(f"training on {base_model}, starting from {start_adapter or 'a fresh LoRA adapter'}")
    if parallel.rank == 0:
        run_dir.begin(plan.groups, start_adapter, config.policy, sft=config.sft)
    report.begin(run_dir.run_id, data_dir, config, base_model, start_adapter, plan, tokenizer,
                 judge, resumed=only is not None)  # fmt: skip
    adapter_dir = data_dir / "adapters" / run_dir.run_id
    # One GPU for vLLM and the night: vLLM sleeps while training and the gate hold it.
    colocated = bool(proxy_url) and should_colocate(config.colocate, state, _on_gpu(), say)
    try:
        with _asleep(colocated and parallel.rank == 0, proxy_url, admin_token, run_dir.run_id,
                     config, say) as window:  # fmt: skip
            parallel.agree(True)  # every process waits until vLLM has let the GPU go
            if colocated:
                kill_point("asleep")
            result.metrics = run_training(
                plan, config, base_model, start_adapter, adapter_dir, say, run_dir.checkpoint,
                on_step=report.step,
            )  # fmt: skip
            for line in gap_lines(result.metrics.get("logprob_gaps", {})):
                if line.startswith("warning"):
                    log.warning(line)
                say(line)
            if parallel.rank == 0 and promote and proxy_url:
                shared = shared_adapter(data_dir, adapter_dir, config.policy)  # bucket: uploaded
                result.gate = _gate(config, scorer, base_model, adapter_dir, shared,
                                    gate_prompts, result, say, data_dir, proxy_url,
                                    admin_token)  # fmt: skip
        if window is not None:
            result.metrics["maintenance"] = window.as_dict()
            kill_point("awake")
        if parallel.rank != 0:
            return result
        result.adapter_path = adapter_dir
        say(f"saved the adapter to {adapter_dir}")
        if result.gate is not None:  # promote and proxy_url: the gate decided
            if result.gate.promote and config.canary:
                # Live traffic decides: the next watch promotes or drops it (canary.py).
                name = start_canary(
                    proxy_url, admin_token, shared, config.canary, say, config.policy
                )
                result.gate.reason += f"; serving it first as canary {name} to {config.canary:.0%}"
                report.promotion(None, canary=name)
            elif result.gate.promote:
                result.promoted_as = _promote_once(
                    proxy_url, admin_token, shared, say, config.policy
                )
                report.promotion(result.promoted_as)
        report.gate(result.gate)
        kill_point("promoting")
    except Exception as e:
        if parallel.rank == 0:  # failed runs are recorded too: the report shows them
            error = f"{type(e).__name__}: {e}"
            record_run(data_dir, result, config, base_model, start_adapter, started, error)
            say(f"report: {_report(data_dir, config.policy)}")
        report.finish(result, error=f"{type(e).__name__}: {e}")
        raise
    # Recorded before the run is marked finished: a run killed in between is found
    # recorded by the next night (and only marked finished), never trained again.
    record_run(data_dir, result, config, base_model, start_adapter, started, None)
    kill_point("recorded")
    run_dir.finish()
    report.finish(result)
    if promote and proxy_url and config.keep_adapters:
        prune_adapters(proxy_url, admin_token, config.keep_adapters, say, config.policy)
    say(f"report: {_report(data_dir, config.policy)}")
    return result


@traced("gate", lambda v: {"promote": v.promote, "reason": v.reason})
def _gate(
    config: TrainConfig,
    scorer: Scorer | None,
    base_model: str,
    adapter_dir: Path,
    shared: str,
    prompts: list,
    result: RunResult,
    say,
    data_dir: Path,
    proxy_url: str,
    token: str | None,
) -> Verdict:
    """The gate's verdict on the new adapter against the one served now; a resumed run
    whose adapter (`shared`: as the proxies name it) is served already passed it before
    it was interrupted."""
    served = served_adapter(serving_state(proxy_url, token, config.policy))
    if served == shared:
        return Verdict(config.gate, True, "promoted before the run was interrupted")
    verdict = skipped(config, scorer) or run_gate(
        config, base_model, adapter_dir, local_adapter(data_dir, served), prompts, scorer,
        result.held_out,
    )  # fmt: skip
    say(verdict.line())
    if not verdict.promote:
        say(f"not promoted: the adapter stays in {adapter_dir}; the proxy keeps serving "
            f"{served or 'the base model'}")  # fmt: skip
    return verdict


@traced("promotion", lambda name: {"promoted_as": name})
def _promote_once(
    proxy_url: str, token: str | None, shared: str, say, policy: str | None = None
) -> str:
    """Promote the adapter (`shared`: its path, or its upload with a bucket) to `policy`
    unless the proxy serves it already (a resumed run killed after its promotion); its name."""
    current = serving_state(proxy_url, token, policy).get("current") or {}
    if current.get("path") == shared:
        say(f"the proxy already serves it as {current['name']}")
        return current["name"]
    promoted = promote_adapter(proxy_url, token, shared, policy)
    say(f"promoted: the proxy now serves it as {promoted}")
    return promoted


def _report(data_dir: Path, policy: str | None) -> Path:
    """The whole report (every policy's runs), and the night's policy's own page: its path."""
    whole = write_report(data_dir)
    return whole if policy is None else write_report(data_dir, policy)


def _sft_tokenizer(tokenizer, base_model: str | None):
    """The tokenizer whose chat template an --sft night renders with; a clear error
    without one (a dry run without --base-model cannot render)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise TrainError(
            f"--sft renders the logged conversations with the base model's chat template: "
            f"{base_model or 'no base model'} has no tokenizer with one (give --base-model)"
        )
    return tokenizer


def _what_it_trains_on(only: list[str] | None) -> str:
    if only is not None:
        return f"resuming an interrupted run on its {len(only)} group(s)"
    return "selecting finished groups no earlier run trained on"


def _base_model(state: dict) -> str:
    base = base_model_of(state)
    if base and state.get("upstream"):  # the hosted model's name: no weights to load here
        raise TrainError(f"the proxy fronts a hosted API ({state['upstream']}) serving {base}, "
                         "which is not a model to train: give --base-model")  # fmt: skip
    if not base:
        raise TrainError("which base model? give --base-model (or --proxy, whose vLLM knows it)")
    return base


def _tokenizer(base_model: str | None):
    """The base model's tokenizer, for records without token ids; None if unavailable."""
    if base_model is None:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(base_model)
    except (OSError, ValueError):
        return None


def gap_lines(gaps: dict[str, dict]) -> list[str]:
    """What the first step's logprob gap says, by the records' age: a gap on records the
    starting adapter sampled itself is a serving mismatch (a warning, with its fix); one
    on older records is drift, expected and weighed by the importance ratios."""
    lines = []
    own = next((gaps[a] for a in ("0", "unknown") if a in gaps), None)
    if own is not None and own["max_gap"] <= LOGPROB_GAP_WARNING:
        lines.append(
            f"on-policy: {own['sequences']} sequence(s) the starting adapter sampled itself, "
            f"logprob gap {own['max_gap']:.2g} nats, first-step ratios "
            f"{own['ratio_min']:.6g} to {own['ratio_max']:.6g}"
        )
    elif own is not None:
        lines.append(
            f"warning: on {own['sequences']} sequence(s) the starting adapter sampled itself, "
            f"the trainer's logprobs differ from what vLLM logged by up to {own['max_gap']:.3g} "
            f"nats before any update (above {LOGPROB_GAP_WARNING}): serving and training "
            "disagree; serve in the trainer's dtype, with --logprobs-mode processed_logprobs "
            "(docs/grpo.md)"
        )
    stale = {a: g for a, g in gaps.items() if a not in ("0", "unknown")}
    if stale:
        worst = max(g["max_gap"] for g in stale.values())
        ratios = (min(g["ratio_min"] for g in stale.values()),
                  max(g["ratio_max"] for g in stale.values()))  # fmt: skip
        ages = ", ".join(sorted(stale))
        lines.append(
            f"stale data: {sum(g['sequences'] for g in stale.values())} sequence(s) sampled "
            f"{ages} promotion(s) before the starting adapter differ from it by up to "
            f"{worst:.3g} nats (first-step ratios {ratios[0]:.3g} to {ratios[1]:.3g}): drift, "
            "not a serving mismatch; trained with their importance ratios "
            "(--max-staleness 0 leaves them out)"
        )
    return lines


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _asleep(colocated: bool, proxy_url, token, holder: str, config: TrainConfig, say):
    """The maintenance window around training and the gate (colocation.py), or nothing."""
    if not colocated:
        return contextlib.nullcontext(None)
    return maintenance_window(proxy_url, token, holder, config.maintenance_lease, say)


def _silent(_line: str) -> None:
    pass


def _night_attributes(result: RunResult) -> dict:
    """What the night's root span says of it (a resumed night shows the same run id)."""
    gate = result.gate
    return {"run_id": result.run_id, "groups": len(result.plan.groups),
            "promoted_as": result.promoted_as, "gate_promote": gate and gate.promote}  # fmt: skip
