"""`overnight train`: one nightly GRPO run over the groups no earlier run trained on.

A night reads as its steps (`train`, each a method of `Night`):

  open      the watch rolls back a promoted adapter that live rewards show worse
            (live/watch.py); the proxy's state, read once; resume an interrupted run
            or begin one (run/checkpoint.py)
  plan      finished, scored, untrained groups (choose/plan.py), per-turn groups joined
  hold out  the gate's prompts, from outside the plan where it can (gate/prompts.py)
  weigh     where training starts (the served adapter, or a fresh LoRA), and each
            record's age against it (choose/staleness.py)
  begin     the run's record on disk, its report
  train     GRPO steps, a checkpoint after each (run/loop.py), then the gate on held-out
  and gate  prompts (gate/verdict.py); vLLM asleep meanwhile when it shares the GPU
  promote   through the proxy's admin API (serving/proxy_client.py), or a canary first
  record    the run (run/record.py), the report; old adapters pruned

With --report-to wandb the steps, the gate and the promotion also go to the night's W&B
run (run/wandb_run.py).

With --sft the night imitates instead: the plan is choose/sft_plan.py's (the logged
conversations rendered with the local chat template, chosen by reward, a share held out
for the gate) and the step's objective the assistant tokens' cross-entropy; resuming,
the gate, the promotion and the record are the same.

With --hindsight the plan is choose/hindsight.py's: the answers users corrected, each
asked again of vLLM with the user's next message as a hint, the revision trained without
it by the same cross-entropy (an --sft night in every other step). With --hindsight-mode
distill the plan is choose/hindsight_distill.py's: the served answers (and resampled
siblings) of those turns, each token's advantage the teacher's logprob with the hint minus
the student's without (grpo/distill.py), trained by GRPO's loss.

Under torchrun every process runs this; process 0 decides what to train on and does
everything with side effects (files, the run record, the promotion). Progress goes to
`say` (a line per stage and per step, with rates).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from overnight.config import LOGPROB_GAP_WARNING, SETTLE_SECONDS, TrainConfig
from overnight.storage.read.policy_scope import PolicyScope
from overnight.telemetry import traced
from overnight.view.report import write_report

from .choose.hindsight import plan_hindsight, teacher_at
from .choose.hindsight_distill import plan_distill
from .choose.images import VisionReader, vision_reader
from .choose.inputs import Selection
from .choose.lone_turns import add_lone_turns
from .choose.plan import Plan, plan_run
from .choose.resample import resample_turns
from .choose.sft_plan import plan_sft
from .choose.staleness import staleness_of, weigh_staleness
from .choose.turn_groups import add_turn_groups, is_turn_group
from .gate.floor import tonights_floor
from .gate.forgetting import judge as judge_forgetting
from .gate.forgetting import load_references
from .gate.forgetting import measure as measure_forgetting
from .gate.forgetting import resolve as resolve_references
from .gate.gaming import judge as judge_gaming
from .gate.gaming import live as live_answers
from .gate.prompts import held_out_prompts
from .gate.verdict import (
    Scorer,
    Verdict,
    gaming_alone,
    run_gate,
    shapes_alone,
    skipped,
)
from .grpo.parallel import Parallel
from .grpo.sampling import server_defaults
from .grpo.step import fresh_adapter, micro_batch_loss
from .live.canary import start as start_canary
from .live.watch import watch as watch_served
from .run.checkpoint import RunDir, kill_point, this_run, unfinished_run
from .run.loop import TrainError, run_training, step_schedule
from .run.record import RunResult, record_run, to_serving
from .run.wandb_run import Report
from .serving.colocation import should_colocate
from .serving.colocation import window as maintenance_window
from .serving.proxy_client import (
    admin_call,
    base_model_of,
    local_adapter,
    promote_adapter,
    prune_adapters,
    served_adapter,
    serving_state,
    shared_adapter,
)

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
    state: dict | None = None,
    cycle: dict | None = None,
) -> RunResult:
    """One night, read as its steps. A run that was interrupted is resumed first, on the
    same groups. `judge`: the summary of the judge's batch that scored for it (its cost
    goes to W&B). `scope`: its policy's groups as the CLI found them (a dry run's may be
    read offline: overnight/cli/policy_runs.py); None: read from the proxy's state here.
    `state`: the proxy's answer about the policy as the caller read it moments ago (used
    unless the watch ran, which may change it); None: read here. `cycle`: who ran it and
    why (`overnight train`, or `overnight learn` and its trigger), kept in its record.
    """
    night = Night.open(Path(data_dir), config, proxy_url, admin_token, promote, dry_run, say,
                       scope, state)  # fmt: skip
    night.cycle = cycle
    try:
        return _steps(night, settle_seconds, since, max_groups, scorer, judge)
    finally:
        night.parallel.finish()  # a process group left to exit's teardown can abort


def _steps(night: Night, settle_seconds, since, max_groups, scorer, judge) -> RunResult:
    plan = night.plan(settle_seconds, since, max_groups)
    plan, gate = night.hold_out_gate_prompts(plan, scorer)
    plan = night.weigh_by_age(plan)
    result = RunResult(night.run_dir.run_id, plan, held_out=gate.given)
    if night.dry_run or not plan.groups:
        if not plan.groups:
            night.say("nothing to train on")
        return result
    night.begin(plan, judge)
    try:
        night.train_and_gate(result, gate, scorer)  # vLLM asleep meanwhile, when colocated
        if night.parallel.rank != 0:
            return result
        night.promote(result)
    except Exception as e:
        night.record_failure(result, e)
        raise
    night.record(result)
    return result


@dataclass
class HeldOut:
    """The gate's held-out prompts, and the plan's groups it took for them."""

    prompts: list = field(default_factory=list)
    given: list[str] = field(default_factory=list)


@dataclass
class Night:
    """What a night knows once opened, and its steps (train() reads them in order).

    The proxy's state is fetched once, after the watch (which may roll back), and read
    by every step; it is fetched again only after training, for the gate and the
    promotion (`served_now`): a night runs for minutes or hours, meanwhile an operator
    or another proxy may have promoted or rolled back, and the gate must compare the
    candidate with what is served then.
    """

    data_dir: Path
    config: TrainConfig
    proxy_url: str | None
    token: str | None
    promote_it: bool
    dry_run: bool
    say: Callable[[str], None]
    parallel: Parallel
    report: Report
    state: dict
    scope: PolicyScope | None
    run_dir: RunDir  # its id, path and checkpoint
    resumed: list[str] | None  # the interrupted run's groups, when resuming
    saved: dict
    base_model: str | None
    tokenizer: object
    defaults: object  # vLLM's sampling defaults for the base model (grpo/sampling.py)
    started: int = 0
    start_adapter: str | None = None
    started_from: str | None = None
    adapter_dir: Path | None = None
    shared: str | None = None  # the adapter as the proxies name it (bucket: its upload)
    colocated: bool = False  # vLLM sleeps while this night trains and gates
    vision: VisionReader | None = None  # a vision-language model's images (choose/images.py)
    cycle: dict | None = None  # who ran it and why (overnight/night/cycles.py), recorded

    @classmethod
    def open(cls, data_dir, config, proxy_url, token, promote, dry_run, say, scope, state=None):
        """Resume or begin the run; the watch first (it may roll back), then the proxy's
        state, read once, with what follows from it: the policy's scope, the base model."""
        parallel = Parallel() if dry_run else Parallel.start(fsdp=config.fsdp)
        if parallel.rank != 0:
            say = _silent
        report = Report(config, parallel.rank, say)  # W&B, or nothing (run/wandb_run.py)
        started = time.time_ns() // 1000
        watches = bool(promote and proxy_url and config.watch)
        if watches and parallel.rank == 0:
            watch_served(data_dir, proxy_url, token, config, say)
        # The night's policy (config.policy; None: the default, and every group as before
        # policies): its adapters, and its own groups, interrupted run and selection record.
        # Read once, after the watch (which may roll back, settle a canary or move a
        # handover); the caller's answer stands where no watch ran.
        if state is None or watches:
            state = serving_state(proxy_url, token, config.policy)
        state = parallel.agree(state)
        scope = parallel.agree(scope if scope is not None else PolicyScope.of(config.policy, state))
        run_dir, saved = parallel.agree(this_run(data_dir, dry_run, scope and scope.owns))
        resumed = saved.get("groups")
        if resumed is not None and bool(saved.get("sft")) != config.sft:
            was = "an --sft" if saved.get("sft") else "a GRPO"
            raise TrainError(
                f"the interrupted run {run_dir.run_id} was {was} run: resume it "
                f"{'with' if saved.get('sft') else 'without'} --sft (or delete {run_dir.path} "
                "to leave it)"
            )
        say(f"run {run_dir.run_id}: " + _what_it_trains_on(resumed))
        if promote and state.get("upstream"):  # a hosted API (proxy/routes/hosted.py): 409s
            say(f"the proxy fronts a hosted API ({state['upstream']}), which serves no adapter: "
                "tonight's is saved, with no gate and no promotion")  # fmt: skip
            promote = False
        base_model = config.base_model or (None if dry_run else _base_model(state))
        return cls(
            data_dir, config, proxy_url, token, promote, dry_run, say, parallel, report, state,
            scope, run_dir, resumed, saved, base_model, _tokenizer(base_model),
            server_defaults(base_model, config.generation_config),  # vLLM's, where unsaid
            started, vision=None if dry_run else vision_reader(base_model, data_dir),
        )  # fmt: skip

    def plan(self, settle_seconds: float, since, max_groups: int | None) -> Plan:
        """What tonight trains on: the finished, scored groups no earlier run took (or the
        interrupted run's); per-turn groups joined; or, --sft, the conversations to imitate."""
        config, only = self.config, self.resumed
        selection = Selection(
            self.data_dir, settle_seconds, since, max_groups, only, self.tokenizer,
            self.defaults, self.scope, self.vision,
        )  # fmt: skip
        if config.hindsight and config.hindsight_mode == "distill":
            # the student's own answers, weighed by the teacher (choose/hindsight_distill.py)
            return plan_distill(
                selection.but(tokenizer=_sft_tokenizer(self.tokenizer, self.base_model)), config
            )
        if config.hindsight:  # corrected turns, as revised with the hint (choose/hindsight.py)
            tokenizer = _sft_tokenizer(self.tokenizer, self.base_model)
            teacher = teacher_at(config, self.proxy_url, self.token, self.state)
            return plan_hindsight(selection.but(tokenizer=tokenizer), config, teacher, self.say)
        if config.sft:  # the logged conversations to imitate (choose/sft_plan.py)
            tokenizer = _sft_tokenizer(self.tokenizer, self.base_model)
            return plan_sft(selection.but(tokenizer=tokenizer), config)
        served_only = None if only is None else [g for g in only if not is_turn_group(g)]
        plan = plan_run(selection.but(only=served_only), config)
        # Per-turn groups (a served turn and its siblings: turn_groups.py) join the plan
        # before the gate takes its prompts, so that it takes them from outside the plan;
        # then the turns with nothing to compare with, against the night's pool.
        plan = add_turn_groups(selection, plan, config)
        return add_lone_turns(selection, plan, config)

    def hold_out_gate_prompts(self, plan: Plan, scorer: Scorer | None) -> tuple[Plan, HeldOut]:
        """The gate's held-out prompts, taken from outside the plan where the night has
        enough (gate/prompts.py); the plan without the groups it had to give them."""
        if not (self.promote_it and self.proxy_url and not self.dry_run):
            return plan, HeldOut()
        alone = gaming_alone(self.config, scorer)  # no scorer: the answers' shapes only
        if skipped(self.config, scorer) is not None and not alone:
            return plan, HeldOut()
        # An --sft night's held-out share is its gate's: none taken from the plan; nor
        # for the gaming check alone (the plan stays as it would without it).
        prompts, gated = held_out_prompts(
            self.data_dir, plan, self.config.gate_prompts,
            self.resumed is None and not (self.config.sft or self.config.hindsight) and not alone,
            scope=self.scope,
            images=self.vision is not None and self.vision.renders,
        )  # fmt: skip
        given = [g for g in plan.groups if g not in set(gated.groups)]
        self.say(f"gate: {len(prompts)} held-out prompt(s), {len(given)} of them from groups "
                 "left out of tonight's training")  # fmt: skip
        return gated, HeldOut(prompts, given)

    def weigh_by_age(self, plan: Plan) -> Plan:
        """Where training starts (a resumed run: where it started; a new one: the served
        adapter, its local copy with a bucket), and each record's age against it, in
        promotions (staleness.py); the plan's lines said."""
        if self.resumed is not None:
            self.started_from = self.start_adapter = self.saved["start_adapter"]
        else:
            self.started_from = served_adapter(self.state)
            self.start_adapter = local_adapter(self.data_dir, self.started_from)
        limit = self.config.max_staleness if self.resumed is None else None  # resumed: as is
        if not self.config.sft:  # imitated text has no importance ratio to weigh
            plan = weigh_staleness(plan, staleness_of(self.state, self.started_from), limit)
        for line in plan.lines():
            self.say(line)
        return plan

    def begin(self, plan: Plan, judge) -> None:
        """The run's record on disk (what a resumed night reads) and its report; whether
        vLLM must sleep while it trains (one GPU for both: colocation.py)."""
        config, start = self.config, self.start_adapter
        self.say(f"training on {self.base_model}, starting from {start or 'a fresh LoRA adapter'}")
        if self.parallel.rank == 0:
            self.run_dir.begin(plan.groups, start, config.policy, sft=config.sft)
        self.report.begin(self.run_dir.run_id, self.data_dir, config, self.base_model, start,
                          plan, self.tokenizer, judge, resumed=self.resumed is not None)  # fmt: skip
        self.adapter_dir = self.data_dir / "adapters" / self.run_dir.run_id
        spec = resolve_references(config.reference, self.base_model)
        if self.promote_it and self.proxy_url and spec is not None:
            load_references(spec, self.data_dir)  # a bad --reference fails before training
        self.colocated = bool(self.proxy_url) and should_colocate(
            config.colocate, self.state, _on_gpu(), self.say
        )

    def train_and_gate(self, result: RunResult, gate: HeldOut, scorer: Scorer | None) -> None:
        """GRPO (or SFT) steps, then the gate's verdict, while the GPU is held: with one GPU
        for vLLM and the night (colocation.py), vLLM sleeps meanwhile."""
        config, say, parallel = self.config, self.say, self.parallel
        holds = self.colocated and parallel.rank == 0
        with _asleep(holds, self.proxy_url, self.token, self.run_dir.run_id, config, say) as window:
            parallel.agree(True)  # every process waits until vLLM has let the GPU go
            if self.colocated:
                kill_point("asleep")
            result.metrics = run_training(
                result.plan, config, self.base_model, self.start_adapter, self.adapter_dir, say,
                self.run_dir.checkpoint, on_step=self.report.step, parallel=parallel,
            )  # fmt: skip
            for line in gap_lines(result.metrics.get("logprob_gaps", {})):
                if line.startswith("warning"):
                    log.warning(line)
                say(line)
            if parallel.rank == 0 and self.promote_it and self.proxy_url:
                # bucket: uploaded, and named as every proxy reads it
                self.shared = shared_adapter(self.data_dir, self.adapter_dir, config.policy)
                result.gate = self.gate(scorer, gate.prompts, result)
                kill_point("gated")  # the verdict given, nothing promoted
        if window is not None:
            result.metrics["maintenance"] = window.as_dict()
            kill_point("awake")

    @traced("gate", lambda v: {"promote": v.promote, "reason": v.reason})
    def gate(self, scorer: Scorer | None, prompts: list, result: RunResult) -> Verdict:
        """The gate's verdict on the new adapter against the one served now (the proxy's
        state read again: `served_now`), then forgetting on the reference set (the tiny
        model: none); a resumed run whose adapter (`shared`: as the proxies name it) is
        served already passed it before it was interrupted."""
        config, say = self.config, self.say
        served = served_adapter(self.served_now())
        if served == self.shared:
            return Verdict(config.gate, True, "promoted before the run was interrupted")
        served_path = local_adapter(self.data_dir, served)
        verdict = skipped(config, scorer) or run_gate(
            config, self.base_model, self.adapter_dir, served_path, prompts, scorer,
            result.held_out, self.vision, say=say,
            best=tonights_floor(config, self.data_dir, self.scope, self.base_model, self.state,
                                served, prompts, say),
        )  # fmt: skip
        verdict.candidate_adapter, verdict.served_adapter = self.shared, served
        if gaming_alone(config, scorer):  # no scorer: the answers' shapes still decide
            gaming = shapes_alone(config, self.base_model, self.adapter_dir, served_path,
                                  prompts, self.vision, say)  # fmt: skip
            if gaming is not None:
                judge_gaming(verdict, gaming)
        spec = resolve_references(config.reference, self.base_model)
        if spec is not None:  # what the nights cost elsewhere (gate/forgetting.py)
            judge_forgetting(verdict, measure_forgetting(
                config, self.data_dir, self.base_model, self.adapter_dir, served_path, spec,
                say=say,
            ))  # fmt: skip
        say(verdict.line())
        if not verdict.promote:
            say(f"not promoted: the adapter stays in {self.adapter_dir}; the proxy keeps "
                f"serving {served or 'the base model'}")  # fmt: skip
        return verdict

    def served_now(self) -> dict:
        """The proxy's state again, after training: what the gate compares with and the
        promotion checks (the one refresh of a night; see the class's docstring)."""
        self.state = serving_state(self.proxy_url, self.token, self.config.policy)
        return self.state

    def promote(self, result: RunResult) -> None:
        """As the gate decided: serve the adapter (or, with --canary, a share first)."""
        result.adapter_path = self.adapter_dir
        self.say(f"saved the adapter to {self.adapter_dir}")
        config, gate = self.config, result.gate
        if gate is not None and gate.promote:  # promote and a proxy: the gate decided
            if config.canary:
                # Live traffic decides: the next watch promotes or drops it (canary.py).
                name = start_canary(self.proxy_url, self.token, self.shared, config.canary,
                                    self.say, config.policy)  # fmt: skip
                gate.reason += f"; serving it first as canary {name} to {config.canary:.0%}"
                self.report.promotion(None, canary=name)
            else:
                result.promoted_as = _promote_once(self.proxy_url, self.token, self.shared,
                                                   self.say, config.policy, self.state)  # fmt: skip
                self.report.promotion(result.promoted_as)
        self.report.gate(gate)
        kill_point("promoting")

    def record(self, result: RunResult) -> None:
        """The run's row, then the run marked finished, the report, old adapters pruned.
        Recorded before it is marked finished: a run killed in between is found recorded
        by the next night (and only marked finished), never trained again."""
        # The served answers' shape, the day before the night against the day before that
        # (gate/gaming.py): watched in the report and /ui, not gated.
        result.metrics["answers"] = live_answers(self.data_dir, self.started, self.config.policy)
        if self.cycle is not None and result.promoted_as:  # the loop's latency, recorded
            delay = to_serving(self.data_dir, result.plan.groups, time.time(), self.started)
            self.cycle = {**self.cycle, "to_serving": delay}
            result.metrics["to_serving"] = delay
        record_run(self.data_dir, result, self.config, self.base_model, self.start_adapter,
                   self.started, None, self.cycle)  # fmt: skip
        kill_point("recorded")
        self.run_dir.finish()
        self.report.finish(result)
        if self.promote_it and self.proxy_url and self.config.keep_adapters:
            prune_adapters(self.proxy_url, self.token, self.config.keep_adapters, self.say,
                           self.config.policy)  # fmt: skip
        self.say(f"report: {_report(self.data_dir, self.config.policy)}")

    def record_failure(self, result: RunResult, e: Exception) -> None:
        """A failed run is recorded too: the report shows it."""
        error = f"{type(e).__name__}: {e}"
        if self.parallel.rank == 0:
            record_run(self.data_dir, result, self.config, self.base_model, self.start_adapter,
                       self.started, error, self.cycle)  # fmt: skip
            self.say(f"report: {_report(self.data_dir, self.config.policy)}")
        self.report.finish(result, error=error)


@traced("promotion", lambda name: {"promoted_as": name})
def _promote_once(
    proxy_url: str, token: str | None, shared: str, say, policy: str | None, state: dict
) -> str:
    """Promote the adapter (`shared`: its path, or its upload with a bucket) to `policy`
    unless the proxy serves it already (`state`, read after training: a resumed run killed
    after its promotion); its name."""
    current = state.get("current") or {}
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
