"""Configuration of each part: frozen dataclasses, each field declared once.

A field's metadata carries its command-line help (and flag, where it is not
`--field-name`); overnight/cli/options.py builds the click options from it, so the
defaults in these modules are the only ones. The comments say why a default is what it
is. Precedence is CLI > environment (`OVERNIGHT_*`) > config file > the defaults;
the CLI applies it (click's `auto_envvar_prefix` and `default_map`) and builds these.

What lives where (import every name from here, `from overnight.config import ...`):

    common.py  DEFAULT_DATA_DIR, SETTLE_SECONDS, DEFAULT_TOOL_CALL_PARSER: shared defaults
    proxy.py   ProxyConfig (`overnight serve`: the proxy)
    vllm.py    VLLMConfig (`overnight serve --model`: the vLLM it starts)
    judge.py   JudgeConfig (`overnight judge`)
    train.py   TrainConfig, GATE_MODES, LOGPROB_GAP_WARNING (`overnight train`)
    presets.py PRESETS (tiny-cpu, smollm2-cpu): `overnight train --preset`
    keys.py    the --keys-file: scoped client keys, per-policy admin tokens
    upstream_kind.py  vLLM or a hosted API (openai, anthropic; auto by host)
    handover.py  HostedBeside: --hosted-upstream, a hosted API beside vLLM (the handover)
    shadow.py  ShadowSampling: the --shadow-* options of ProxyConfig

`ConfigError` (overnight/errors.py) is re-exported here, as it always was.
"""

from __future__ import annotations

from ..errors import ConfigError
from .common import DEFAULT_DATA_DIR, DEFAULT_TOOL_CALL_PARSER, SETTLE_SECONDS
from .judge import JudgeConfig
from .presets import PRESETS, TINY_CPU_PRESET
from .proxy import ProxyConfig
from .train import COLOCATE_MODES, GATE_MODES, LOGPROB_GAP_WARNING, TrainConfig
from .vllm import VLLMConfig

__all__ = [
    "DEFAULT_DATA_DIR",
    "DEFAULT_TOOL_CALL_PARSER",
    "COLOCATE_MODES",
    "GATE_MODES",
    "LOGPROB_GAP_WARNING",
    "SETTLE_SECONDS",
    "PRESETS",
    "TINY_CPU_PRESET",
    "ConfigError",
    "JudgeConfig",
    "ProxyConfig",
    "TrainConfig",
    "VLLMConfig",
]
