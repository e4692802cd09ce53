"""The trainer's configuration (`overnight train`): the GRPO loss and LoRA, the promotion
gate, the watch and canary, resampling; and the logprob gap a run warns above. Its
presets for a model on a machine: presets.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError

# Largest |policy - logged| logprob of a trained token before a run's first update (its
# `max_logprob_gap`, in nats) that passes without a warning. The ratio of such a token
# starts off by e^gap: 0.02 is a 2% error, a tenth of the clip window's narrow side
# (clip_low 0.2), so below it the clip acts on the tokens it should. Float32 serving
# and training agree to ~2e-6; a bfloat16 server against a float32 trainer measured
# 0.077, and raw vLLM logprobs against a temperature-0.7 policy up to 2.3.
LOGPROB_GAP_WARNING = 0.02

_DTYPES = ("auto", "float32", "bfloat16")
_SWITCHES = ("auto", "on", "off")
_ATTENTION = ("auto", "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
# The promotion gate (trainer/gate/verdict.py, docs/grpo.md).
GATE_MODES = ("not-worse", "better", "off")
COLOCATE_MODES = ("auto", "on", "off")
REPORT_TO = ("auto", "wandb", "none")  # where a night reports (trainer/run/wandb_run.py)
# Which logged rollouts an --sft night imitates (trainer/choose/sft_plan.py).
SFT_SELECTIONS = ("auto", "best", "min-reward", "all")
# Turns with nothing to compare with (trainer/choose/lone_turns.py): pooled or left out.
LONE_TURNS = ("auto", "pool", "skip")
HINDSIGHT_MODES = ("revise", "distill")  # how --hindsight distils its teacher


# Every source a reward row can name (storage/schema.py `rewards.source`).
REWARD_SOURCES = ("agent", "combined", "function", "ruler", "implicit")


@dataclass(frozen=True)
class TrainConfig:
    """Defaults suit a real model on a GPU; TINY_CPU_PRESET suits the tiny CPU model."""

    # None asks the proxy (vLLM's /v1/models).
    base_model: str | None = field(
        default=None, metadata={"help": "Base model path or name (default: ask the proxy)."}
    )
    # A request that omits temperature, top_k, top_p or min_p was sampled with vLLM's
    # default for it, which vLLM takes from the model's generation_config.json unless
    # started with `--generation-config vllm` (or a directory): say the same here.
    generation_config: str = field(
        default="auto",
        metadata={
            "help": "Where the serving vLLM took sampling defaults from, as its "
            "--generation-config: auto (the model's generation_config.json), vllm "
            "(none), or a directory."
        },
    )
    # LoRA's usual range for 7B-class models.
    learning_rate: float = field(
        default=1e-5,
        metadata={
            "help": "AdamW learning rate (the tiny CPU model wants 6e-2: --preset tiny-cpu)."
        },
    )
    # The clipped ratio keeps later passes honest.
    epochs: int = field(default=1, metadata={"help": "Passes over the night's groups."})
    lora_rank: int = field(
        default=16, metadata={"help": "Rank of a fresh adapter (an existing one keeps its own)."}
    )
    # None: twice the rank, LoRA's usual scale.
    lora_alpha: int | None = field(
        default=None, metadata={"help": "Alpha of a fresh adapter (default: twice the rank)."}
    )
    # All attention and MLP projections: what vLLM's LoRA kernels serve.
    target_modules: tuple[str, ...] = field(
        default=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        metadata={
            "help": "Module a fresh adapter adapts (repeatable; default: every attention "
            "and MLP projection).",
            "flag": "--target-module",
        },
    )
    # A vision-language model's tower sees the pictures; the language model reads what it
    # saw. Off: vLLM serves language-model LoRA unless started to serve the tower's too.
    lora_vision_tower: bool = field(
        default=False,
        metadata={
            "help": "A fresh adapter on a vision-language model also adapts its vision tower "
            "and connector (every linear layer there). vLLM must serve it with "
            "--enable-tower-connector-lora (overnight serve "
            "--vllm-arg=--enable-tower-connector-lora)."
        },
    )
    # Each step normalises over its own groups.
    groups_per_step: int = field(default=8, metadata={"help": "Groups per optimizer step."})
    micro_batch_tokens: int = field(
        default=8192,
        metadata={"help": "Tokens per forward pass; gradients accumulate across passes."},
    )
    # A chunk's logits are a few (chunk, vocabulary) float32 tensors: 1024 x 152k is
    # 0.6 GB each, small beside a real model, large enough for full-speed matmuls.
    logit_chunk_tokens: int = field(
        default=1024,
        metadata={
            "help": "Trained tokens whose vocabulary logits are computed at once, in the "
            "forward and the backward pass: the logits' memory is bounded by this many "
            "tokens instead of --micro-batch-tokens (same results)."
        },
    )
    # auto: decided by the memory check before the night (trainer/run/memory.py).
    gradient_checkpointing: str = field(
        default="auto",
        metadata={
            "help": "Recompute each decoder layer in the backward pass instead of keeping its "
            "activations (a third more compute, activations of one layer instead of all): "
            "auto (on only when the memory check finds the night fits only with it; the "
            "night's log says which), on, off.",
            "choices": _SWITCHES,
        },
    )
    # Shared prompts need a kernel that takes our mask (trainer/grpo/attention.py).
    attention: str = field(
        default="auto",
        metadata={
            "help": "Attention kernel to train with: auto (transformers' default, sdpa), sdpa, "
            "eager, flex_attention (shared prompts under a block mask instead of an "
            "(L x L) one; trains on CUDA only), or flash_attention_2/_3 (a micro-batch in "
            "one row with no mask, prompts repeated; CUDA and the flash-attn package).",
            "choices": _ATTENTION,
        },
    )
    # One odd group must not wreck the adapter.
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient norm clip."})
    # Yes: GRPO; no: Dr. GRPO.
    scale_by_std: bool = field(
        default=True,
        metadata={"help": "Divide advantages by the group's reward standard deviation."},
    )
    # Needs an attention kernel that takes a mask: sdpa or eager.
    share_prompts: bool = field(
        default=True,
        metadata={"help": "Run a group's shared prompt once per row instead of once per rollout."},
    )
    # With several processes, a whole model per process unless sharded;
    # `accelerate launch --use_fsdp` turns it on.
    fsdp: bool = field(
        default=False,
        metadata={
            "help": "Under torchrun: shard the model per layer (FSDP) instead of copying it."
        },
    )
    # The variants: trainer/grpo/loss.py and docs/grpo.md.
    loss: str = field(
        default="dapo",
        metadata={
            "help": "How token losses are normalised (docs/grpo.md).",
            "choices": ("grpo", "dr_grpo", "dapo"),
        },
    )
    clip_low: float = field(
        default=0.2,
        metadata={"help": "The ratio may fall to 1 - this before the clip stops the gradient."},
    )
    clip_high: float = field(
        default=0.28, metadata={"help": "The ratio may rise to 1 + this (DAPO's clip-higher)."}
    )
    # A token whose ratio exploded (data from an old adapter) cannot dominate; 0 means None.
    dual_clip: float | None = field(
        default=3.0,
        metadata={
            "help": "Cap on the loss of negative-advantage tokens with huge ratios (0: off)."
        },
    )
    ratio_level: str = field(
        default="token",
        metadata={
            "help": "Importance ratio per token, or one per sequence (GSPO-style).",
            "choices": ("token", "sequence"),
        },
    )
    max_tokens: int = field(
        default=1024,
        metadata={
            "help": "dr_grpo's constant normaliser (tokens per sequence).",
            "flag": "--loss-max-tokens",
        },
    )
    kl_coef: float = field(
        default=0.0,
        metadata={"help": "Weight of a KL term to the base model (0: off, no reference pass)."},
    )
    # When a rollout has several, the first found wins. `implicit` (the signals of what
    # happened next, `overnight signals --rewards`) is off unless named: its rules are
    # checked on an operator's own traffic before a night trusts them (docs/signals.md).
    reward_sources: tuple[str, ...] = field(
        default=("agent", "combined", "function", "ruler"),
        metadata={
            "help": "Which reward to train on, in order of preference (repeatable; default: "
            "agent, combined, function, ruler; also: implicit, from what happened next).",
            "flag": "--reward-source",
        },
    )
    seed: int = field(default=0, metadata={"help": "Shuffles and init."})
    # bfloat16 halves the memory and uses tensor cores; the CPU keeps float32, where
    # logprobs must match vLLM's float32 to 1e-6.
    dtype: str = field(
        default="auto",
        metadata={"help": "auto: bfloat16 on GPUs that have it, else float32.", "choices": _DTYPES},
    )
    min_group_size: int = field(
        default=2, metadata={"help": "Smaller groups are skipped (too little relative signal)."}
    )
    # Production traffic is mostly groups of one, and a reward read from what happened
    # next is the served answer's alone: GRPO has nothing to compare them with. Pooled,
    # each trains against the night's mean over all of them (trainer/choose/lone_turns.py).
    lone_turns: str = field(
        default="auto",
        metadata={
            "help": "Rewarded turns with nothing to compare with (groups smaller than "
            "--min-group-size, a conversation's turn rewarded on its own): train each against "
            "the mean reward of all of them tonight (pool), leave them out (skip), or pool "
            "when `implicit` is a reward source (auto). docs/grpo.md.",
            "choices": LONE_TURNS,
        },
    )
    # Non-inferiority by default: a night that cannot be shown not worse than the served
    # adapter stays on disk; `better` asks for evidence of a gain; `off` promotes always.
    gate: str = field(
        default="not-worse",
        metadata={
            "help": "Before promoting, compare the new adapter with the served one on held-out "
            "prompts: promote when not worse (by --gate-margin-spread), only when better, or always "
            "(off). Needs --reward or --judge-model to score; docs/grpo.md.",
            "choices": GATE_MODES,
        },
    )
    # Relative by default, so it means the same on any reward: a share of the served
    # adapter's spread of rewards over the gate's prompts (their standard deviation).
    # Half of it: 32 prompts leave an interval of about +-0.35 of that spread, so a
    # candidate no better than the served one still passes; a measurably worse one
    # (interval wholly below zero) never does, whatever the margin (docs/grpo.md).
    gate_margin_spread: float = field(
        default=0.5,
        metadata={
            "help": "--gate not-worse tolerates a loss of at most this share of the served "
            "adapter's per-prompt reward spread (standard deviation) on the gate's prompts."
        },
    )
    # Unset: relative (above). For a reward whose scale the operator knows.
    gate_margin: float | None = field(
        default=None,
        metadata={
            "help": "An absolute margin in reward units for --gate not-worse instead of "
            "--gate-margin-spread (the largest loss in mean reward it tolerates)."
        },
    )
    # Forgiven losses add up over many nights; the best adapter so far bounds the slide
    # (storage/read/best_adapter.py). Costs one more adapter's replies on the gate's prompts.
    gate_best: bool = field(
        default=True,
        metadata={
            "help": "With --gate not-worse, hold the candidate also to the policy's best "
            "adapter so far (placed by the gate's chained verdicts), by the same test, so "
            "losses each within the margin cannot add up night after night."
        },
    )
    # 32 pairs put the interval's half-width near 0.35 sd of the per-prompt difference.
    gate_prompts: int = field(
        default=32, metadata={"help": "Held-out prompts the gate samples both adapters on."}
    )
    # Forgetting (trainer/gate/forgetting.py, docs/grpo.md): the reference set's answers'
    # likelihood under the base, the served adapter and the candidate, every gated night.
    # auto: bundled, except on the tiny random model (--model tiny), which knows nothing.
    reference: str = field(
        default="auto",
        metadata={
            "help": "The reference set forgetting is measured on every gated night: bundled (a "
            "hundred-odd general prompts shipped with overnight, the base model's own greedy "
            "answers as references), a JSONL file of {messages, reference} lines (the "
            "operator's; a line without reference gets the base model's), imported:all or "
            "imported:FORMAT[:N] (up to N, default 200, imported turns with the answers "
            "they were given: docs/import.md), several comma-separated (bundled,PATH), off, "
            "or auto (bundled; off on overnight's tiny random model)."
        },
    )
    # Argued from measurements on SmolLM2 (docs/operations.md, BENCHMARKS.md): a normal
    # night moves the references by 0.046 nats per token, 8 epochs on the same data by
    # 0.128 (its task reward passing the gate); the budget sits between, counted from the
    # base model across promotions.
    forgetting_budget: float = field(
        default=0.1,
        metadata={
            "help": "The gate refuses a candidate whose reference answers lost more than this "
            "many nats per token of mean log-likelihood against the base model, whatever its "
            "task reward (unless it forgets less than the served adapter)."
        },
    )
    # Gaming (trainer/gate/gaming.py, docs/signals.md "Gaming"): the shares of the gate's
    # replies that end in a question or flatter, against the served adapter's and the base
    # model's. Sampling alone moved SmolLM2's question share by at most 0.0625 (2 of 32
    # prompts, bench/gaming.py); at a base rate of one half, two samplings of 32 differ by
    # more than 0.25 about 2% of the time: the limit sits there (docs/signals.md, "Gaming").
    gaming_limit: str = field(
        default="0.25",
        metadata={
            "help": "The gate refuses a candidate whose share of held-out answers that end in "
            "a question, or that flatter, is more than this (0 to 1) above the served "
            "adapter's or the base model's on the same prompts, whatever its reward (unless "
            "it moved less than the served adapter); off: measured and recorded only."
        },
    )
    # Off by default: a shorter answer is often the task itself (the sum agent's nights
    # shorten them by design); an operator whose answers should not shrink sets it.
    gaming_length_limit: str = field(
        default="off",
        metadata={
            "help": "The gate refuses a candidate whose held-out answers are shorter by more "
            "than this share (0 to 1) of the served adapter's or the base model's mean "
            "length; off (the default): measured and recorded only."
        },
    )
    watch: bool = field(
        default=True,
        metadata={
            "help": "Before training, roll back a promoted adapter whose live rewards are "
            "significantly worse than its predecessor's (as `overnight watch`)."
        },
    )
    # Fewer rollouts leave the interval so wide that only a collapse would show.
    watch_min_rollouts: int = field(
        default=30,
        metadata={"help": "Rewarded live rollouts each adapter needs before the watch compares."},
    )
    # 0: promote at once. A share serves the candidate to that many of the alias's
    # rollouts until `overnight watch` settles it on live rewards (trainer/live/canary.py).
    canary: float = field(
        default=0.0,
        metadata={
            "help": "Serve a candidate that passed the gate to this share of the alias's "
            "rollouts first (sticky per rollout); the watch promotes or drops it on live rewards."
        },
    )
    # The proxy's policies (proxy/alias/policies.py): a night trains one, on its own
    # groups (storage/read/policy_scope.py), from its served adapter, to it. Unset in
    # `overnight train`: each policy the proxy serves, one run after another. Kept in the
    # run's `config` JSON: its row says its policy without a schema change.
    policy: str | None = field(
        default=None,
        metadata={
            "help": "Train (watch, promote) this policy only: the groups that asked for its "
            "alias, from its served adapter [default: every policy the proxy serves, each "
            "its own run]."
        },
    )
    # auto: sleep vLLM while training when the proxy launched it on this machine (its
    # GPU) with sleep routes and the trainer uses a GPU (trainer/serving/colocation.py).
    colocate: str = field(
        default="auto",
        metadata={
            "help": "Put the proxy's vLLM to sleep while the night trains on the same GPU: "
            "auto (when the proxy launched it here and training uses a GPU), on, off.",
            "choices": COLOCATE_MODES,
        },
    )
    # Renewed every third of it; a night that dies stops renewing and the proxy wakes
    # vLLM when it runs out.
    maintenance_lease: float = field(
        default=120.0,
        metadata={"help": "Seconds of a colocated night's lease on vLLM's sleep, renewed."},
    )
    # Rollback targets: the previous N adapters of the promotion stack stay on disk.
    keep_adapters: int = field(
        default=5,
        metadata={
            "help": "After each night, delete adapters beyond the served one, a canary, "
            "the gate's best so far and the previous N of the promotion stack (0: keep "
            "every adapter)."
        },
    )
    # Off by default: a night looks only at groups that changed since the last run's
    # selection (trainer/choose/plan.py); a full look is for recovered logs or restored data.
    rescan: bool = field(
        default=False,
        metadata={
            "help": "Look at every untrained group, not only those changed since the last "
            "run's selection (after restoring data, or a proxy log recovered days later)."
        },
    )
    # Unset: records a promotion or more old are trained with their importance ratios
    # (clipped as any); 0 trains only what the starting adapter sampled itself.
    max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "Leave out groups sampled more than this many promotions before the "
            "adapter a run starts from (0: on-policy only; unset: train them all, weighted "
            "by their importance ratios)."
        },
    )
    # Off by default: it costs K more generations per turn (bench/resample_cost.py).
    resample: int = field(
        default=0,
        metadata={
            "help": "Before scoring, ask vLLM for this many more samples of each logged turn "
            "that is not in a group of two or more (same context token for token, same "
            "adapter and sampling): each turn and its samples form a group (docs/grpo.md)."
        },
    )
    # A night's generation budget: the newest turns first.
    resample_max_turns: int = field(
        default=256, metadata={"help": "Resample at most this many turns a night."}
    )
    resample_all_turns: bool = field(
        default=False,
        metadata={"help": "Resample turns of groups of two or more too (not only single calls)."},
    )
    # Empty: the upstream the proxy reports (its /admin/adapters replicas).
    resample_upstream: str = field(
        default="",
        metadata={"help": "vLLM URL to resample from (default: the proxy's upstream)."},
    )
    # auto, as ART decides: on when WANDB_API_KEY is set (an offline run, WANDB_MODE=offline,
    # needs no key but must be asked for). Off costs nothing: wandb is not even imported.
    report_to: str = field(
        default="auto",
        metadata={
            "help": "Report the night to Weights & Biases (a run per night: its steps, the gate, "
            "sample trajectories, the promotion): auto (when WANDB_API_KEY is set), wandb, or "
            "none. WANDB_PROJECT (default overnight), WANDB_ENTITY and WANDB_MODE are honoured.",
            "choices": REPORT_TO,
        },
    )
    # Off: GRPO. On: distil what the logged upstream answered (a hosted model's traffic,
    # or the best of the agent's own rollouts) into the adapter, through the same steps,
    # checkpoints, gate and promotion (trainer/choose/sft_plan.py, docs/grpo.md).
    sft: bool = field(
        default=False,
        metadata={
            "help": "Supervised fine-tuning instead of GRPO: the logged assistant turns, "
            "rendered with the local base model's chat template (tool calls and results "
            "included), trained with a token-mean cross-entropy (docs/grpo.md)."
        },
    )
    # auto suits distilling a hosted model: traffic nobody scored is imitated whole, a
    # scored group by its best rollout (rejection-sampling fine-tuning).
    sft_selection: str = field(
        default="auto",
        metadata={
            "help": "Which rollouts an --sft night imitates: auto (of a rewarded group those at "
            "or above --sft-min-reward if given, else its best; of a group without rewards, "
            "all), best, min-reward, or all (rewards ignored).",
            "choices": SFT_SELECTIONS,
        },
    )
    sft_min_reward: float | None = field(
        default=None,
        metadata={
            "help": "--sft: imitate only rollouts whose reward is at least this (with "
            "--sft-selection best: a group's best only if it reaches it)."
        },
    )
    # A tenth: held-out prompts like the training ones, never trained, for the gate. By a
    # hash of the group id, so a group held out once is held out every night.
    sft_held_out: float = field(
        default=0.1,
        metadata={
            "help": "--sft: share of the groups kept out of training for good (the same "
            "groups every night, by a hash of their id), where the gate finds its prompts."
        },
    )
    # Off: the plan above. On: the turns users corrected, revised by the model shown the
    # correction, imitated without it (trainer/choose/hindsight.py, docs/grpo.md).
    hindsight: bool = field(
        default=False,
        metadata={
            "help": "Learn from what users said: each answer whose next user message was a "
            "correction (a negative signal read from their words) is answered again by the "
            "served model shown that message as a hint (vLLM, temperature 0), and the "
            "revision trained without the hint by --sft's cross-entropy (docs/grpo.md)."
        },
    )
    hindsight_mode: str = field(
        default="revise",
        metadata={
            "help": "--hindsight: revise (the teacher's revision, trained by --sft's "
            "cross-entropy) or distill (on-policy: the served answer and its --resample "
            "siblings as they were sampled, each token's advantage the teacher's logprob "
            "with the hint minus the student's without, trained by GRPO's loss).",
            "choices": HINDSIGHT_MODES,
        },
    )

    def __post_init__(self) -> None:
        unknown = [s for s in self.reward_sources if s not in REWARD_SOURCES]
        if unknown or not self.reward_sources:
            raise ConfigError(
                f"reward sources must be among {', '.join(REWARD_SOURCES)}, got "
                f"{', '.join(map(repr, self.reward_sources)) or 'none'}"
            )
        if self.lone_turns not in LONE_TURNS:
            raise ConfigError(
                f"lone_turns must be one of {', '.join(LONE_TURNS)}, got {self.lone_turns!r}"
            )
        if self.learning_rate <= 0 or self.epochs < 1 or self.lora_rank < 1:
            raise ConfigError("learning_rate must be positive, epochs and lora_rank at least 1")
        if self.groups_per_step < 1 or self.micro_batch_tokens < 16 or self.min_group_size < 2:
            raise ConfigError("groups_per_step >= 1, micro_batch_tokens >= 16, min_group_size >= 2")
        if self.max_grad_norm <= 0:
            raise ConfigError("max_grad_norm must be positive")
        if self.logit_chunk_tokens < 1:
            raise ConfigError("logit_chunk_tokens must be at least 1")
        if self.gradient_checkpointing not in _SWITCHES or self.attention not in _ATTENTION:
            raise ConfigError(
                f"gradient_checkpointing must be one of {', '.join(_SWITCHES)} and attention one "
                f"of {', '.join(_ATTENTION)}"
            )
        margins = (self.gate_margin_spread, self.gate_margin or 0.0)
        if self.gate not in GATE_MODES or min(margins) < 0 or self.gate_prompts < 1:
            raise ConfigError(
                f"gate must be one of {', '.join(GATE_MODES)} (got {self.gate!r}), "
                "gate_margin_spread and gate_margin >= 0, and gate_prompts >= 1"
            )
        if self.forgetting_budget < 0 or not self.reference.strip():
            raise ConfigError("forgetting_budget must be at least 0 and reference not empty")
        _ = self.gaming_limits  # each a share from 0 to 1, or off (else a ConfigError)
        if self.colocate not in COLOCATE_MODES:
            raise ConfigError(f"colocate must be auto, on or off, got {self.colocate!r}")
        if self.maintenance_lease < 5 or self.keep_adapters < 0:
            raise ConfigError("maintenance_lease must be at least 5 s and keep_adapters >= 0")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError("max_staleness must be at least 0 (0: on-policy records only)")
        if self.watch_min_rollouts < 2:
            raise ConfigError("watch_min_rollouts must be at least 2")
        if not 0 <= self.canary < 1:
            raise ConfigError(f"canary must be a share in [0, 1) of the traffic, got {self.canary}")
        if self.resample < 0 or self.resample_max_turns < 0:
            raise ConfigError("resample and resample_max_turns must be at least 0")
        if self.sft_selection not in SFT_SELECTIONS or not 0 <= self.sft_held_out < 1:
            raise ConfigError(
                f"sft_selection must be one of {', '.join(SFT_SELECTIONS)} (got "
                f"{self.sft_selection!r}) and sft_held_out a share in [0, 1)"
            )
        if self.sft_selection == "min-reward" and self.sft_min_reward is None:
            raise ConfigError("--sft-selection min-reward needs --sft-min-reward")
        wrong = self.hindsight_mode not in HINDSIGHT_MODES
        if wrong or self.hindsight_mode == "distill" and (self.sft or not self.hindsight):
            raise ConfigError(
                f"hindsight_mode must be revise or distill (got {self.hindsight_mode!r}); "
                "--hindsight-mode distill is a --hindsight night's, by GRPO's loss (not --sft)"
            )
        if self.hindsight and self.hindsight_mode == "revise":  # imitates the revisions
            object.__setattr__(self, "sft", True)
        if self.sft and self.kl_coef > 0:
            raise ConfigError("--kl-coef is GRPO's: an --sft night's loss is the cross-entropy")
        if self.report_to not in REPORT_TO:
            raise ConfigError(f"report_to must be auto, wandb or none, got {self.report_to!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.lora_alpha is None:
            object.__setattr__(self, "lora_alpha", 2 * self.lora_rank)
        if self.dual_clip == 0:
            object.__setattr__(self, "dual_clip", None)
        if self.dual_clip is not None and self.dual_clip < 1 + self.clip_high:
            # TRL's delta there would also cap positive-advantage tokens (docs/grpo.md).
            raise ConfigError(
                f"dual_clip must be at least 1 + clip_high = {1 + self.clip_high:g}, or 0 (off)"
            )

    @property
    def gaming_limits(self) -> tuple[float | None, float | None]:
        """(--gaming-limit, --gaming-length-limit) as shares, None where off."""
        return _share_or_off(self.gaming_limit, "gaming_limit"), _share_or_off(
            self.gaming_length_limit, "gaming_length_limit"
        )


def _share_or_off(value: str, name: str) -> float | None:
    """A limit given as a share from 0 to 1, or `off` (None)."""
    if str(value).strip().lower() == "off":
        return None
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise ConfigError(f"{name} must be a share from 0 to 1, or off (got {value!r})")
    return share
