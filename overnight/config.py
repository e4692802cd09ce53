"""Configuration of each part: frozen dataclasses, each field documented once.

Precedence is CLI > environment (`OVERNIGHT_*`) > config file > the defaults below;
the CLI applies it (click's `auto_envvar_prefix` and `default_map`) and builds these.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

DEFAULT_DATA_DIR = Path("overnight-data")
# A rollout with no `finish` counts as finished after this many idle seconds: long
# enough for an agent's slowest tool call, short enough for a nightly batch.
SETTLE_SECONDS = 600.0
_ALIAS = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class ProxyConfig:
    # Base URL of the OpenAI-compatible server the proxy fronts (vLLM), without /v1.
    upstream: str
    # Where records, logs and adapter state live; every command takes the same one.
    data_dir: Path = DEFAULT_DATA_DIR
    # The stable model name agents ask for; it follows promotions.
    alias: str = "policy"
    # Client keys accepted as `Authorization: Bearer KEY`; empty means no client auth.
    api_keys: tuple[str, ...] = ()
    # Token for /admin/; without one the admin API answers loopback clients only.
    admin_token: str | None = None
    # Key the proxy sends upstream; never the client's key.
    upstream_api_key: str | None = None
    # Large enough for long multi-turn agent contexts with tool outputs.
    max_body_bytes: int = 32 * 1024 * 1024
    # Connecting to a local vLLM is instant; 10 s covers a busy host.
    connect_timeout: float = 10.0
    # Longest silence between two upstream bytes. Long generations are fine (there is
    # deliberately no total cap); a stalled upstream is not.
    read_timeout: float = 600.0
    # vLLM closes idle keep-alive connections after about 5 s; ours must close first
    # or a reused connection fails with "Server disconnected".
    keepalive_timeout: float = 4.0
    # How long an old adapter may keep serving in-flight requests before it is unloaded.
    drain_timeout: float = 600.0
    # The name vLLM serves the base model under; None discovers it from /v1/models.
    base_model: str | None = None
    # Group commit window of the write-ahead log (see storage.writer).
    commit_interval: float = 0.02
    # Roll the log into Parquet after this many seconds (and at 64 MiB).
    roll_seconds: float = 300.0

    def __post_init__(self) -> None:
        if not self.upstream.startswith(("http://", "https://")):
            raise ConfigError(f"upstream must be an http(s) URL, got {self.upstream!r}")
        object.__setattr__(self, "upstream", self.upstream.rstrip("/").removesuffix("/v1"))
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if not _ALIAS.fullmatch(self.alias):
            raise ConfigError(
                f"alias must be 1-64 characters of [A-Za-z0-9._-], got {self.alias!r}"
            )
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes must be at least 1024")
        for name in ("connect_timeout", "read_timeout", "keepalive_timeout", "drain_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.commit_interval < 0 or self.roll_seconds <= 0:
            raise ConfigError("commit_interval must be >= 0 and roll_seconds > 0")
        if any(not k for k in self.api_keys):
            raise ConfigError("api keys must not be empty")


@dataclass(frozen=True)
class JudgeConfig:
    # Any litellm model string, e.g. "openai/o3" or "openai/my-judge" with base_url.
    model: str
    # For a self-hosted judge (another vLLM); None lets litellm use the provider's URL.
    base_url: str | None = None
    # Key for the judge; None lets litellm read the provider's usual variable.
    api_key: str | None = None
    # What "better" means; empty uses judge.ruler.DEFAULT_RUBRIC (goal first, then efficiency).
    rubric: str = ""
    # Corrective retries after an answer that does not parse or does not fit.
    max_fixes: int = 2
    # Retries of one call on rate limits, timeouts and 5xx, with backoff.
    max_retries: int = 4
    # Groups judged at once; judges rate-limit, and a local one has few slots.
    concurrency: int = 8
    # Seconds for one judge call; long groups make long prompts.
    timeout: float = 120.0
    # None keeps the judge's default (some reasoning models refuse other values).
    temperature: float | None = None
    # Tool outputs longer than this are shortened in the middle for the judge.
    max_tool_chars: int = 2000
    # Cap on the judge's answer; None leaves it to the judge (a reasoning model needs room).
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("a judge model is required (any litellm model string)")
        if self.max_fixes < 0 or self.max_retries < 0 or self.concurrency < 1:
            raise ConfigError("max_fixes and max_retries must be >= 0, concurrency >= 1")
        if self.timeout <= 0 or self.max_tool_chars < 200:
            raise ConfigError("timeout must be positive and max_tool_chars at least 200")


@dataclass(frozen=True)
class TrainConfig:
    """Defaults suit a real model on a GPU; docs give the tiny-CPU-model preset."""

    # Base model as vLLM serves it (a path or hub name); None asks vLLM's /v1/models.
    base_model: str | None = None
    # LoRA's usual range for 7B-class models; the tiny model wants ~1e-3 (see docs).
    learning_rate: float = 1e-5
    # Passes over the night's data; the clipped ratio keeps later passes honest.
    epochs: int = 1
    # Rank and alpha of a fresh adapter (an existing adapter keeps its own).
    lora_rank: int = 16
    lora_alpha: int = 32
    # All attention and MLP projections: what vLLM's LoRA kernels serve.
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    # Groups per optimizer step; each step normalises over its own groups.
    groups_per_step: int = 8
    # Tokens per forward pass (micro-batch); gradients accumulate across them.
    micro_batch_tokens: int = 8192
    # Gradient norm clip: one odd group must not wreck the adapter.
    max_grad_norm: float = 1.0
    # Groups smaller than this carry too little relative signal to train on.
    min_group_size: int = 2
    # Divide advantages by the group's reward std (GRPO) or not (Dr. GRPO).
    scale_by_std: bool = True
    # Loss: see trainer/loss.py and docs/grpo.md.
    loss: str = "dapo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 3.0
    ratio_level: str = "token"
    kl_coef: float = 0.0
    max_tokens: int = 1024
    # Which reward to train on when a rollout has several, first found wins.
    reward_sources: tuple[str, ...] = ("agent", "combined", "function", "ruler")
    seed: int = 0
    # auto: bfloat16 where the GPU has it (half the memory, tensor cores), else float32
    # (the CPU, and where logprobs must match vLLM's float32 to 1e-6).
    dtype: str = "auto"
    # The rollouts of a group share their prompt: run it once per row, not once per
    # rollout (needs an attention kernel that takes a mask: sdpa or eager).
    share_prompts: bool = True
    # Under torchrun/accelerate with several processes: shard each decoder layer (FSDP)
    # instead of a whole model per process. `accelerate launch --use_fsdp` turns it on.
    fsdp: bool = False

    def __post_init__(self) -> None:
        if self.learning_rate <= 0 or self.epochs < 1 or self.lora_rank < 1:
            raise ConfigError("learning_rate must be positive, epochs and lora_rank at least 1")
        if self.groups_per_step < 1 or self.micro_batch_tokens < 16 or self.min_group_size < 2:
            raise ConfigError("groups_per_step >= 1, micro_batch_tokens >= 16, min_group_size >= 2")
        if self.max_grad_norm <= 0:
            raise ConfigError("max_grad_norm must be positive")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")


# The tiny local model (tests, the demo) on a CPU: its random weights need far bigger
# steps than a real model (measured: a numbers-only reward went 0.56 -> 0.84 in three
# nights of 64 rollouts at 6e-2; at 2e-2 it took eight).
TINY_CPU_PRESET = {
    "learning_rate": 6e-2,
    "epochs": 4,
    "lora_rank": 8,
    "lora_alpha": 16,
    "groups_per_step": 8,
}
