"""A night on implicit rewards beside a night on the true reward, from one day of scripted
users talking to SmolLM2-135M-Instruct (vLLM on the CPU): how much of the posted gain do
the signals recover?

    python bench/implicit_nights.py                       # 48 conversations, 8 samples
    python bench/implicit_nights.py --conversations 96 --samples 16 --seed 11

The trial is overnight/testing/implicit_trial.py (its docstring says each step): the
day's answers are groups of one, each night trains them as lone turns against its pool
(trainer/choose/lone_turns.py), and the held-out sums are sampled from the base model and
both adapters with the same seeds. It prints the agreement of the implicit rewards with
the true ones (AUC), what each night trained, the held-out means, both gains and the
implicit night's share of the posted one's. Results: BENCHMARKS.md.

    python bench/implicit_nights.py --hindsight          # issue 48: learn from what they said

--hindsight runs the hindsight trial instead (implicit_trial.run_hindsight_trial): users
who correct a wrong answer with the right sum ("No, it's 7."), a night on the implicit
rewards beside an `overnight train --hindsight` night on the same day, the held-out share
answered right of the base model and both adapters, and each adapter's forgetting.
Run it under `flock /tmp/overnight-heavy.lock` where other heavy jobs share the machine.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8, help="per held-out sum, per model")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--hindsight", action="store_true", help="the hindsight trial")
    args = parser.parse_args()

    from overnight.models.smollm2 import prepare_smollm2
    from overnight.proxy.launch.launcher import VLLMConfig, VLLMProcess
    from overnight.testing.implicit_trial import TrialSize, run_hindsight_trial, run_trial

    started = time.monotonic()

    def say(line: str) -> None:
        print(f"[{time.monotonic() - started:6.0f} s] {line}", flush=True)

    cache = Path(__file__).resolve().parent.parent / ".cache" / "smollm2-135m-instruct"
    model = prepare_smollm2(cache, say=say)
    size = TrialSize(args.conversations, args.turns, args.samples, args.seed)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory(prefix="implicit-nights-") as work:
        vllm = VLLMProcess(
            VLLMConfig(
                model=str(model), served_model_name="smollm2", max_lora_rank=8,
                extra_args=("--dtype", "float32", "--max-model-len", "1024"),
                log_path=Path(work) / "vllm.log",
            )
        )  # fmt: skip
        say("starting vLLM (CPU) with SmolLM2-135M-Instruct")
        vllm.start()
        try:
            vllm.wait_healthy()
            if args.hindsight:  # the base model's reference answers cached beside it
                run_hindsight_trial(vllm.url, model, Path(work), size, say, cache.parent)
            else:
                run_trial(vllm.url, model, Path(work), size, say=say)
        finally:
            vllm.stop()


if __name__ == "__main__":
    main()
