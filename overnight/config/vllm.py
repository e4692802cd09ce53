"""vLLM's configuration: the server `overnight serve --model` starts under the proxy."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from .common import DEFAULT_TOOL_CALL_PARSER


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
    # On by default: a colocated night (one GPU serving by day, training by night) puts
    # vLLM to sleep through these routes. They exist only with VLLM_SERVER_DEV_MODE=1,
    # which also opens vLLM's other development routes on its own port (loopback here);
    # clients never reach them through the proxy (proxy/forward/paths.py).
    sleep_mode: bool = field(
        default=True,
        metadata={
            "help": "Start vLLM with its sleep routes (--enable-sleep-mode on a GPU, "
            "VLLM_SERVER_DEV_MODE=1), so that a colocated night can free the GPU."
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
