"""The judge's configuration (`overnight judge`): the litellm model and how it is called,
and what its prompt may hold."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from .common import DEFAULT_TOOL_CALL_PARSER


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
    # RULER's prompt is text: an image is a placeholder naming it; a judge that sees
    # images gets the pictures too (judge/images.py).
    images: str = field(
        default="auto",
        metadata={
            "help": "Show the judge the trajectories' images: auto (where litellm says the "
            "judge model supports vision), on, off (a placeholder naming each image).",
            "name": "judge_images",
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
        if self.images not in ("auto", "on", "off"):
            raise ConfigError(f"judge images must be auto, on or off, got {self.images!r}")
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
