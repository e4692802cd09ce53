"""vLLM on a CPU: how much memory it takes for its KV cache, sized from the model, and
the scheduling that keeps seeded requests from stopping it (`whole_prefill_args`).

On a CPU, vLLM reads `--gpu-memory-utilization` (default 0.92) as a fraction of its
NUMA node's memory and refuses to start when that much is not free ("Available memory
on node 0 ... is less than desired CPU memory utilization"): a busy machine cannot
start it at all. `VLLM_CPU_KVCACHE_SPACE` (GiB) sets the KV cache instead; `overnight
serve --model` sets it from what the model needs for `--max-num-seqs` sequences of
`--max-model-len` tokens, between a floor and a cap, unless the user set it already.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# Set for a vLLM our launcher starts on a CPU: its LoRA ops replaced (vllm_cpu_lora.py).
CPU_LORA_ENV = "OVERNIGHT_VLLM_CPU_LORA"
# One GiB holds the tiny model's whole cache many times over, and vLLM wants a whole
# number of GiB; below that a real model cannot hold even one long sequence.
FLOOR_GIB = 1
# Never more than a quarter of the machine nor 64 GiB: the rest is the weights', the
# proxy's and everyone else's. A model needing more gets fewer sequences at once.
CAP_GIB = 64
CAP_SHARE = 0.25
# vLLM 0.32's default --max-num-seqs for its API server on a CPU (engine/arg_utils.py).
CPU_MAX_NUM_SEQS = 128
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def vllm_runs_on_cpu() -> bool:
    """The installed vLLM is the CPU build (vllm-cpu), or the user said so."""
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return True
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def kv_cache_env(
    model: str, extra_args: Sequence[str], environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """{KV_CACHE_ENV: GiB} to start vLLM with on a CPU; {} on a GPU or when already set."""
    if KV_CACHE_ENV in environ or not vllm_runs_on_cpu():
        return {}
    config = model_config(model)
    gib = FLOOR_GIB if config is None else kv_cache_gib(config, extra_args)
    return {KV_CACHE_ENV: str(gib)}


def kv_cache_gib(config: dict, extra_args: Sequence[str], total_bytes: int | None = None) -> int:
    """GiB for max-num-seqs sequences of max-model-len tokens, within [FLOOR_GIB, the cap].

    Per token the cache holds a key and a value for each layer and KV head:
    2 * layers * kv_heads * head_dim * bytes per value.
    """
    text = _language_model(config)
    layers = int(text["num_hidden_layers"])
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    dtype = _arg(extra_args, "--dtype") or text.get("dtype") or text.get("torch_dtype")
    per_token = 2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(str(dtype), 2)
    max_len = _max_model_len(config, extra_args)
    seqs = int(_arg(extra_args, "--max-num-seqs") or CPU_MAX_NUM_SEQS)
    wanted = math.ceil(per_token * max_len * seqs / 2**30)
    total = total_bytes if total_bytes is not None else _total_memory()
    cap = max(FLOOR_GIB, min(CAP_GIB, int(total * CAP_SHARE / 2**30)))
    return max(FLOOR_GIB, min(wanted, cap))


# vLLM's default step budget (its SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS).
DEFAULT_BATCHED_TOKENS = 2048
CHUNKED_PREFILL_FLAGS = ("--enable-chunked-prefill", "--no-enable-chunked-prefill")


def whole_prefill_args(model: str, extra_args: Sequence[str]) -> list[str]:
    """vLLM's arguments on a CPU that keep every prompt's prefill within one step.

    vllm-cpu 0.32 dies on a seeded request whose prefill is split across steps: after a
    partial prefill its model runner rewinds the request's random generator
    (`set_offset`, which only CUDA's generator has), the worker raises "CPU Generator
    does not use offset" and the engine stops, failing every request after it. One long
    prompt with a `seed` did it, or sixteen at once (BENCHMARKS.md, the implicit trial).
    With chunked prefill off, a prompt that does not fit what is left of a step waits for
    the next one; the step's budget is raised to the longest prompt (as vllm-cpu does
    itself for MLA models). Nothing when the user chose either setting."""
    chosen = (*CHUNKED_PREFILL_FLAGS, "--max-num-batched-tokens")
    if any(a == flag or a.startswith(flag + "=") for a in extra_args for flag in chosen):
        return []
    max_len = _max_model_len(model_config(model) or {}, extra_args)
    return [
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        str(max(max_len, DEFAULT_BATCHED_TOKENS)),
    ]


def _language_model(config: dict) -> dict:
    return config.get("text_config") or config  # multimodal configs nest the language model


def _max_model_len(config: dict, extra_args: Sequence[str]) -> int:
    """The longest sequence vLLM will take: --max-model-len, else the model's own."""
    given = _arg(extra_args, "--max-model-len")
    return int(given or _language_model(config).get("max_position_embeddings", 4096))


def model_config(model: str) -> dict | None:
    """The model's config.json: a local directory, or Hugging Face's cache; else None."""
    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        try:
            cached = try_to_load_from_cache(model, "config.json")
        except ValueError:  # not a repository id either (a path that does not exist)
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _arg(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in vLLM's extra arguments, as `--flag V` or `--flag=V`."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
