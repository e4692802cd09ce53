"""Configuration of each part: frozen dataclasses, each field declared once.

A field's metadata carries its command-line help (and flag, where it is not
`--field-name`); overnight/options.py builds the click options from it, so the
defaults below are the only ones. The comments say why a default is what it is.
Precedence is CLI > environment (`OVERNIGHT_*`) > config file > the defaults below;
the CLI applies it (click's `auto_envvar_prefix` and `default_map`) and builds these.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError

DEFAULT_DATA_DIR = Path("overnight-data")
# A rollout with no `finish` counts as finished after this many idle seconds: long
# enough for an agent's slowest tool call, short enough for a nightly batch.
SETTLE_SECONDS = 600.0
# Largest |policy - logged| logprob of a trained token before a run's first update (its
# `max_logprob_gap`, in nats) that passes without a warning. The ratio of such a token
# starts off by e^gap: 0.02 is a 2% error, a tenth of the clip window's narrow side
# (clip_low 0.2), so below it the clip acts on the tokens it should. Float32 serving
# and training agree to ~2e-6; a bfloat16 server against a float32 trainer measured
# 0.077, and raw vLLM logprobs against a temperature-0.7 policy up to 2.3.
LOGPROB_GAP_WARNING = 0.02
_ALIAS = re.compile(r"[A-Za-z0-9._-]{1,64}")


# The tool call parser `overnight serve --model` starts vLLM with, and the one the judge
# reads siblings' tool calls with unless told otherwise (judge/tool_calls.py): one name,
# so that the two agree by default.
DEFAULT_TOOL_CALL_PARSER = "hermes"


@dataclass(frozen=True)
class ProxyConfig:
    # The first of `upstreams`: the one upstream of a proxy that fronts one, as
    # `ProxyConfig(upstream=URL)` says it. Give this or `upstreams`, not both.
    upstream: str = field(
        default="", metadata={"help": "The first upstream (see --upstream).", "flag": None}
    )
    # The OpenAI-compatible servers the proxy fronts: vLLM replicas of one model, each with
    # runtime LoRA on (proxy/forward/balancer.py). A trailing /v1 is dropped.
    upstreams: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "URL of an OpenAI-compatible server already running (repeatable: replicas "
            "of one model; a rollout sticks to one, promotions reach all).",
            "flag": "--upstream",
            "name": "upstream",
        },
    )
    # Every command takes the same one. A URL (s3://bucket/prefix) keeps the Parquet
    # segments in a bucket and the rest in `local_dir` (storage/location.py).
    data_dir: Path = field(
        default=DEFAULT_DATA_DIR,
        metadata={
            "help": "Data directory: records, logs, adapters; or a URL (s3://bucket/prefix) "
            "where the Parquet records go, the rest staying in --local-dir.",
            "flag": "--data",
            "envvar": "OVERNIGHT_DATA",
        },
    )
    # With --data a URL: this machine's log, runs, adapters and promotion state. The
    # default is derived from the URL, so every command on one machine finds the same one.
    local_dir: Path | None = field(
        default=None,
        metadata={
            "help": "With --data a URL: the local directory for the log, runs, adapters "
            "[default: ~/.local/state/overnight/SCHEME/BUCKET/PREFIX].",
            "envvar": "OVERNIGHT_LOCAL_DIR",
        },
    )
    # The stable model name agents ask for.
    alias: str = field(default="policy", metadata={"help": "Model name that follows promotions."})
    # `Authorization: Bearer KEY`; empty means no client auth.
    api_keys: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "Accepted client key (repeatable; env OVERNIGHT_API_KEYS, space-separated).",
            "flag": "--api-key",
            "envvar": "OVERNIGHT_API_KEYS",
        },
    )
    admin_token: str | None = field(
        default=None,
        metadata={
            "help": "Token for /admin/ (else loopback only; env OVERNIGHT_ADMIN_TOKEN).",
            "envvar": "OVERNIGHT_ADMIN_TOKEN",
        },
    )
    # Never the client's key.
    upstream_api_key: str | None = field(
        default=None,
        metadata={
            "help": "Key the proxy sends upstream (env OVERNIGHT_UPSTREAM_API_KEY).",
            "envvar": "OVERNIGHT_UPSTREAM_API_KEY",
        },
    )
    # Large enough for long multi-turn agent contexts with tool outputs.
    max_body_bytes: int = field(
        default=32 * 1024 * 1024,
        metadata={"help": "Largest request body accepted (413 above it)."},
    )
    # Connecting to a local vLLM is instant; 10 s covers a busy host.
    connect_timeout: float = field(
        default=10.0, metadata={"help": "Seconds to connect to the upstream."}
    )
    # Long generations are fine (there is deliberately no total cap); a stalled
    # upstream is not.
    read_timeout: float = field(
        default=600.0,
        metadata={
            "help": "Longest silence between two upstream bytes (no cap on a whole generation)."
        },
    )
    # vLLM closes idle keep-alive connections after about 5 s; ours must close first
    # or a reused connection fails with "Server disconnected".
    keepalive_timeout: float = field(
        default=4.0,
        metadata={"help": "Idle upstream connections are closed after this (below vLLM's 5 s)."},
    )
    # aiohttp's server has no timeout for reading a request's headers: a client that
    # never finishes them (slowloris) would hold its connection forever. The same limit
    # closes a client's idle keep-alive connection; SDKs keep theirs 5-15 s.
    header_timeout: float = field(
        default=30.0,
        metadata={
            "help": "Seconds a client may take to send a request's headers, or stay idle between requests."
        },
    )
    # DNS rebinding: a page at evil.example whose name resolves to this machine. An IP
    # literal, `localhost` and this machine's name cannot be rebound; other names must be
    # listed ('*' turns the check off).
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "Host name the proxy is served as, for the admin API, rewards and /ui (repeatable; "
            "IP addresses, localhost and this machine's name are always accepted).",
            "flag": "--allowed-host",
        },
    )
    drain_timeout: float = field(
        default=600.0,
        metadata={
            "help": "How long a replaced adapter may finish requests in flight before unloading."
        },
    )
    # No flag: `overnight serve` leaves it to /v1/models (vLLM's --served-model-name
    # names it when serve starts vLLM).
    base_model: str | None = field(
        default=None,
        metadata={"help": "Name the upstream serves the base model under.", "flag": None},
    )
    # See storage.writer.
    commit_interval: float = field(
        default=0.02,
        metadata={
            "help": "Group commit window of the write-ahead log, seconds (fsync at most this often)."
        },
    )
    roll_seconds: float = field(
        default=300.0,
        metadata={
            "help": "Roll the write-ahead log into Parquet after this many seconds (or 64 MiB)."
        },
    )
    # None stores records as they came; see proxy/capture/redact.py and examples/redact_emails.py.
    redact: str | None = field(
        default=None,
        metadata={
            "help": "Redaction hook (module:function or file.py:function) applied to each "
            "record before it is written."
        },
    )
    # vLLM restarted under the proxy has no adapters: this often, the proxy checks that the
    # promoted one is still served and loads it again (a 404 for it checks at once).
    upstream_check_interval: float = field(
        default=10.0,
        metadata={
            "help": "Seconds between health checks of each upstream, which also check that it "
            "still serves the promoted adapter (0: never)."
        },
    )
    # DATA/adapters.json is the promotion state of every proxy on the data directory
    # (`--workers`, or proxies on several machines sharing it): a stat this often finds a
    # promotion made through another proxy. The old adapter is unloaded no sooner than
    # twice this after a promotion, so that every proxy has switched away from it.
    state_poll_interval: float = field(
        default=1.0,
        metadata={
            "help": "Seconds between looks at DATA/adapters.json for promotions made through "
            "another proxy (0: never); with a bucket, one HEAD request each."
        },
    )
    # Shadow sampling (proxy/shadow/sampler.py): off unless asked, it costs upstream compute.
    shadow_samples: int = field(
        default=0,
        metadata={
            "help": "Siblings asked of vLLM for a served single-call turn, after its answer "
            "was sent, at low priority (0: no shadow sampling)."
        },
    )
    shadow_rate: float = field(
        default=1.0,
        metadata={"help": "Fraction of eligible turns shadow-sampled (random per turn)."},
    )
    # A burst beyond this is dropped (and counted), never waited for.
    shadow_queue: int = field(
        default=256, metadata={"help": "Turns waiting for shadow sampling at most."}
    )
    # One request of K siblings at a time keeps vLLM's batch (CPU: each step's cost) small.
    shadow_concurrency: int = field(
        default=1, metadata={"help": "Shadow sibling requests in flight at once."}
    )
    # vLLM's priority orders only what waits; a running sibling shares every batch step
    # with the served requests (on a CPU each step costs more with each sequence), so by
    # default siblings run only while no served request is in flight on their replica.
    shadow_max_served: int = field(
        default=0,
        metadata={
            "help": "Shadow requests run while a replica has at most this many served requests "
            "in flight; one running when more arrive is cancelled and asked again (raise it "
            "on a GPU, where a batch costs little more than one request)."
        },
    )
    # Started the instant an answer is written, a sibling request competes with that
    # answer's delivery and with a served request the proxy has read but not yet
    # forwarded (measured: bench/shadow_latency.py); an agent's next call often
    # comes moments after its answer, too.
    shadow_quiet: float = field(
        default=0.02,
        metadata={
            "help": "Seconds a replica must have been without served requests (beyond "
            "--shadow-max-served), and no served turn answered, before a shadow request "
            "starts on it (0: at once)."
        },
    )
    # vLLM serves lower values first (`--scheduling-policy priority`; ignored under fcfs).
    shadow_priority: int = field(
        default=10, metadata={"help": "vLLM priority of shadow requests (served turns: 0)."}
    )

    def __post_init__(self) -> None:
        self._check_upstreams()
        if self.shadow_samples < 0 or not 0.0 <= self.shadow_rate <= 1.0:
            raise ConfigError("shadow_samples must be >= 0 and shadow_rate within [0, 1]")
        if self.shadow_queue < 1 or self.shadow_concurrency < 1 or self.shadow_max_served < 0:
            raise ConfigError(
                "shadow_queue and shadow_concurrency must be at least 1, shadow_max_served >= 0"
            )
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if not _ALIAS.fullmatch(self.alias):
            raise ConfigError(
                f"alias must be 1-64 characters of [A-Za-z0-9._-], got {self.alias!r}"
            )
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes must be at least 1024")
        for name in (
            "connect_timeout",
            "read_timeout",
            "keepalive_timeout",
            "header_timeout",
            "drain_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.commit_interval < 0 or self.roll_seconds <= 0:
            raise ConfigError("commit_interval must be >= 0 and roll_seconds > 0")
        if self.upstream_check_interval < 0 or self.state_poll_interval < 0:
            raise ConfigError(
                "upstream_check_interval and state_poll_interval must be >= 0 (0: never)"
            )
        if self.redact is not None and ":" not in self.redact:
            raise ConfigError(
                f"redact must be module:function or file.py:function, got {self.redact!r}"
            )
        if any(not k for k in self.api_keys):
            raise ConfigError("api keys must not be empty")

    def _check_upstreams(self) -> None:
        """`upstreams` normalised (one URL given as text is a tuple of one), `upstream` its first."""
        urls = (self.upstreams,) if isinstance(self.upstreams, str) else tuple(self.upstreams)
        if not urls and self.upstream:
            urls = (self.upstream,)
        if not urls:
            raise ConfigError("an upstream URL is required")
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(f"upstream must be an http(s) URL, got {url!r}")
        urls = tuple(u.rstrip("/").removesuffix("/v1") for u in urls)
        if len(set(urls)) != len(urls):
            raise ConfigError(f"an upstream is given twice: {list(urls)}")
        first = self.upstream.rstrip("/").removesuffix("/v1")
        if self.upstream and first != urls[0]:
            raise ConfigError(f"upstream {self.upstream!r} is not the first of upstreams {urls}")
        object.__setattr__(self, "upstreams", urls)
        object.__setattr__(self, "upstream", urls[0])


@dataclass(frozen=True)
class VLLMConfig:
    """vLLM as `overnight serve --model` starts it (proxy/launch/launcher.py). It lives here,
    beside the other parts' configs, so that the CLI builds its options without
    importing the proxy."""

    model: str = field(metadata={"help": "Model to serve: vLLM is started as a child process."})
    # vLLM listens on loopback only, behind the proxy.
    host: str = field(default="127.0.0.1", metadata={"help": "vLLM's address.", "flag": None})
    # 0 picks a free port when vLLM starts.
    port: int = field(default=0, metadata={"help": "vLLM's port.", "flag": None})
    # vLLM's default is the model path.
    served_model_name: str | None = field(
        default=None,
        metadata={"help": "Name vLLM serves the base model under (default: the --model value)."},
    )
    # Upper bound on the rank of any adapter the trainer may promote.
    max_lora_rank: int = field(default=16, metadata={"help": "vLLM's --max-lora-rank."})
    # The current adapter plus one draining while the next is promoted.
    max_loras: int = field(default=2, metadata={"help": "vLLM's --max-loras."})
    # Hermes covers Qwen-family chat templates; other families need their own parser.
    tool_call_parser: str | None = field(
        default=DEFAULT_TOOL_CALL_PARSER,
        metadata={"help": "vLLM's tool call parser ('' for none)."},
    )
    # The logged logprobs are compared with the trainer's: serve in the dtype it computes
    # in. On a CPU that is float32 (vLLM would pick bfloat16: 0.077 nats apart on the tiny
    # model); on a GPU the trainer's auto is bfloat16, vLLM's auto the model's own dtype.
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "vLLM's --dtype (default: float32 on a CPU, as the trainer; vLLM's "
            "choice on a GPU).",
            "flag": "--vllm-dtype",
            "name": "vllm_dtype",
        },
    )
    extra_args: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "Extra argument for vLLM (repeatable), e.g. --vllm-arg=--dtype=float32.",
            "name": "vllm_args",
            "flag": "--vllm-arg",
        },
    )
    # Startup on CPU compiles kernels and profiles memory: minutes on a slow machine.
    startup_timeout: float = field(
        default=900.0, metadata={"help": "Seconds vLLM may take to start.", "flag": None}
    )
    log_path: Path | None = field(
        default=None, metadata={"help": "File vLLM's output goes to.", "flag": None}
    )
    # One per GPU (or per --tensor-parallel-size GPUs) on one machine: the proxy balances
    # over them as over several --upstream URLs (proxy/launch/launcher.py, replica_configs).
    replicas: int = field(
        default=1,
        metadata={
            "help": "vLLM replicas to start, each on its own GPU(s) (CUDA_VISIBLE_DEVICES) "
            "and port (from vLLM's, one up per replica); the proxy balances over them.",
            "name": "vllm_replicas",
            "flag": "--vllm-replicas",
        },
    )

    def __post_init__(self) -> None:
        if self.max_lora_rank < 1 or self.max_loras < 1:
            raise ConfigError("max_lora_rank and max_loras must be at least 1")
        if self.replicas < 1:
            raise ConfigError("vllm replicas must be at least 1")

    @property
    def url(self) -> str:
        """Where vLLM will listen: give it a `port` (launcher.free_port) to know it early."""
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class JudgeConfig:
    # Any litellm model string, e.g. "openai/o3" or "openai/my-judge" with base_url.
    model: str = field(
        metadata={
            "help": "litellm model string of the judge, e.g. openai/o3.",
            "name": "judge_model",
        }
    )
    # For a self-hosted judge (another vLLM); None lets litellm use the provider's URL.
    base_url: str | None = field(
        default=None,
        metadata={"help": "Base URL of a self-hosted judge (with /v1).", "name": "judge_base_url"},
    )
    # None lets litellm read the provider's usual variable.
    api_key: str | None = field(
        default=None,
        metadata={
            "help": "Key for the judge.",
            "name": "judge_api_key",
            "envvar": "OVERNIGHT_JUDGE_API_KEY",
        },
    )
    # What "better" means; empty uses judge.ruler.DEFAULT_RUBRIC (goal first, then efficiency).
    rubric: str = field(
        default="",
        metadata={
            "help": "File with the rubric (replaces the default).",
            "name": "rubric_file",
            "flag": "--rubric",
            "file": True,
        },
    )
    # Judges rate-limit, and a local one has few slots.
    concurrency: int = field(default=8, metadata={"help": "Groups judged at once."})
    # After an answer that does not parse or does not fit.
    max_fixes: int = field(default=2, metadata={"help": "Corrective retries."})
    # None leaves it to the judge (a reasoning model needs room).
    max_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Cap on the judge's answer (default: the judge's own; "
            "reasoning models need room)."
        },
    )
    # None keeps the judge's default (some reasoning models refuse other values).
    temperature: float | None = field(
        default=None, metadata={"help": "The judge's temperature (default: its own)."}
    )
    max_retries: int = field(
        default=4,
        metadata={"help": "Retries of one call on rate limits, timeouts and 5xx (with backoff)."},
    )
    # Long groups make long prompts.
    timeout: float = field(default=120.0, metadata={"help": "Seconds for one judge call."})
    max_tool_chars: int = field(
        default=2000,
        metadata={
            "help": "Tool outputs longer than this are shortened in the middle for the judge."
        },
    )
    # None: the judge's input window where litellm knows it, else no budget. A prompt
    # over it would fail on every try (judge/budget.py says what is cut first).
    max_prompt_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Budget for the whole judge prompt, in tokens; longer groups are "
            "shortened to fit (default: the judge's window where litellm knows it).",
            "name": "judge_max_prompt_tokens",
        },
    )
    # Whatever litellm passes on: reasoning_effort=low, seed=7, num_ctx=32768. Kept as
    # the KEY=VALUE text given; `extra_args` parses them.
    args: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "KEY=VALUE handed to the judge call through litellm (repeatable), e.g. "
            "reasoning_effort=low; VALUE is parsed as JSON when it parses.",
            "name": "judge_args",
            "flag": "--judge-arg",
        },
    )
    # Siblings come back from vLLM as text; the served turn's calls were parsed by the
    # server's parser, so the scorer reads siblings with the same (judge/tool_calls.py).
    tool_call_parser: str = field(
        default=DEFAULT_TOOL_CALL_PARSER,
        metadata={
            "help": "The serving vLLM's --tool-call-parser: siblings' tool calls are read "
            "with it, as the served turn's were ('' for none)."
        },
    )
    # Most parsers read text only; llama3_json and mistral look tokens up in the vocabulary.
    tool_parser_tokenizer: str | None = field(
        default=None,
        metadata={"help": "The served model's tokenizer (path or name), for parsers that need it."},
    )

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("a judge model is required (any litellm model string)")
        if self.max_fixes < 0 or self.max_retries < 0 or self.concurrency < 1:
            raise ConfigError("max_fixes and max_retries must be >= 0, concurrency >= 1")
        if self.timeout <= 0 or self.max_tool_chars < 200:
            raise ConfigError("timeout must be positive and max_tool_chars at least 200")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 256:
            raise ConfigError("max_prompt_tokens must be at least 256")
        object.__setattr__(self, "args", tuple(self.args))
        self.extra_args  # noqa: B018 -- validates every KEY=VALUE now, not at the first call

    @property
    def extra_args(self) -> dict:
        """The --judge-arg pairs as litellm keywords; a value that is JSON is parsed."""
        import json

        out = {}
        for arg in self.args:
            key, sep, value = arg.partition("=")
            key = key.strip()
            if not sep or not key.isidentifier():
                raise ConfigError(f"--judge-arg takes KEY=VALUE, got {arg!r}")
            if key in _JUDGE_OWN_ARGS:
                raise ConfigError(f"--judge-arg {key}: set by the judge itself or its own option")
            try:
                out[key] = json.loads(value)
            except ValueError:
                out[key] = value
        return out


# What the judge call sets from its own options (--judge-base-url, --temperature, ...).
_JUDGE_OWN_ARGS = frozenset(
    {
        "model",
        "messages",
        "api_base",
        "base_url",
        "api_key",
        "timeout",
        "num_retries",
        "temperature",
        "max_tokens",
    }
)


_DTYPES = ("auto", "float32", "bfloat16")
# The promotion gate (trainer/night/gate.py, docs/grpo.md).
GATE_MODES = ("not-worse", "better", "off")


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
    # Each step normalises over its own groups.
    groups_per_step: int = field(default=8, metadata={"help": "Groups per optimizer step."})
    micro_batch_tokens: int = field(
        default=8192,
        metadata={"help": "Tokens per forward pass; gradients accumulate across passes."},
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
    # When a rollout has several, the first found wins.
    reward_sources: tuple[str, ...] = field(
        default=("agent", "combined", "function", "ruler"),
        metadata={
            "help": "Which reward to train on, in order of preference (repeatable; default: "
            "agent, combined, function, ruler).",
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
    # Non-inferiority by default: a night that cannot be shown not worse than the served
    # adapter stays on disk; `better` asks for evidence of a gain; `off` promotes always.
    gate: str = field(
        default="not-worse",
        metadata={
            "help": "Before promoting, compare the new adapter with the served one on held-out "
            "prompts: promote when not worse (by --gate-margin), only when better, or always "
            "(off). Needs --reward or --judge-model to score; docs/grpo.md.",
            "choices": GATE_MODES,
        },
    )
    # In reward units: 0.05 of a reward in [0, 1] is a loss few users would notice.
    gate_margin: float = field(
        default=0.05,
        metadata={"help": "The largest loss in mean reward --gate not-worse tolerates."},
    )
    # 32 pairs put the interval's half-width near 0.35 sd of the per-prompt difference.
    gate_prompts: int = field(
        default=32, metadata={"help": "Held-out prompts the gate samples both adapters on."}
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
    # rollouts until `overnight watch` settles it on live rewards (trainer/night/canary.py).
    canary: float = field(
        default=0.0,
        metadata={
            "help": "Serve a candidate that passed the gate to this share of the alias's "
            "rollouts first (sticky per rollout); the watch promotes or drops it on live rewards."
        },
    )
    # Off by default: a night looks only at groups that changed since the last run's
    # selection (trainer/night/plan.py); a full look is for recovered logs or restored data.
    rescan: bool = field(
        default=False,
        metadata={
            "help": "Look at every untrained group, not only those changed since the last "
            "run's selection (after restoring data, or a proxy log recovered days later)."
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

    def __post_init__(self) -> None:
        if self.learning_rate <= 0 or self.epochs < 1 or self.lora_rank < 1:
            raise ConfigError("learning_rate must be positive, epochs and lora_rank at least 1")
        if self.groups_per_step < 1 or self.micro_batch_tokens < 16 or self.min_group_size < 2:
            raise ConfigError("groups_per_step >= 1, micro_batch_tokens >= 16, min_group_size >= 2")
        if self.max_grad_norm <= 0:
            raise ConfigError("max_grad_norm must be positive")
        if self.gate not in GATE_MODES or self.gate_margin < 0 or self.gate_prompts < 1:
            raise ConfigError(
                f"gate must be one of {', '.join(GATE_MODES)} (got {self.gate!r}), gate_margin "
                ">= 0 and gate_prompts >= 1"
            )
        if self.watch_min_rollouts < 2:
            raise ConfigError("watch_min_rollouts must be at least 2")
        if not 0 <= self.canary < 1:
            raise ConfigError(f"canary must be a share in [0, 1) of the traffic, got {self.canary}")
        if self.resample < 0 or self.resample_max_turns < 0:
            raise ConfigError("resample and resample_max_turns must be at least 0")
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


# The tiny local model (tests, the demo) on a CPU: its random weights need far bigger
# steps than a real model (measured: a numbers-only reward went 0.56 -> 0.84 in three
# nights of 64 rollouts at 6e-2; at 2e-2 it took eight). Alpha follows the rank.
TINY_CPU_PRESET = {
    "learning_rate": 6e-2,
    "epochs": 4,
    "lora_rank": 8,
    "groups_per_step": 8,
}
