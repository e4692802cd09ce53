"""Our GRPO loss step vs TRL's GRPOTrainer loss, on the same tensors and adapter.

Same workload as bench/grpo_step.py (8 prompts x 8 completions, 64-token prompts,
log-normal completion lengths up to 251, LoRA r8 on the tiny model, beta 0). Both
compute the same loss: TRL runs with our defaults mapped onto its options (docs/grpo.md:
dapo, epsilon 0.2, epsilon_high 0.28, delta 3.0) and in float32 (`bf16=False`; its
default autocasts to bfloat16, also on a CPU). Each side runs in its own process, so
the peak-memory measurement (resident memory sampled every 2 ms, above its level
before the first step) is not shared; TRL from this environment when the `test` extra
installed trl 1.16 here, else from `.cache/bench-trl`, made once: a venv that sees
this interpreter's packages, a venv's included, plus trl 1.16, with torch held to the
version installed here. Time is the median of the repeats of `loss + backward`.

    python bench/trl_compare.py --repeats 5

On the real model, a night of the demo's shape, with and without gradient checkpointing
on both sides (each pair side by side in one run):

    python bench/trl_compare.py --model-dir .cache/smollm2-135m-instruct --shape night \
        --checkpointing both
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import resource
import site
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRL_VENV = ROOT / ".cache" / "bench-trl"
TRL = "trl==1.16.0"


def side_environment(venv: Path, requirement: str) -> Path:
    """A venv that sees this interpreter's packages, with `requirement` installed on top.

    Not `--system-site-packages`: from a venv, that sees the base interpreter's packages
    only (no project, no peft), and pip then pulls a torch of its own (a CUDA build).
    Instead a .pth file adds this interpreter's site directories after the side venv's
    own (`site.addsitedir` also runs their .pth files: the project's editable install),
    and pip is held to the torch installed here. Returns the side environment's python.
    """
    python = venv / "bin" / "python"
    if (venv / "ready").exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    own = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dirs = site.getsitepackages()  # a venv's own first, then its base's if it sees them
    if site.ENABLE_USER_SITE and Path(site.getusersitepackages()).is_dir():
        dirs.append(site.getusersitepackages())
    adds = "; ".join(f"site.addsitedir({d!r})" for d in dirs)
    (Path(own) / "_bench_parent_env.pth").write_text(f"import site; {adds}\n")
    torch_version = importlib.metadata.version("torch")
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={torch_version}\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "-c", str(constraints), requirement], check=True
    )
    seen = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if seen != torch_version:
        raise SystemExit(f"{venv} has torch {seen}, not this environment's {torch_version}")
    (venv / "ready").touch()
    return python


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


@contextlib.contextmanager
def rss_peak():
    """The peak resident memory above the level at entry, in MB, sampled every 2 ms by a
    thread (ru_maxrss would include the model's loading): `peak["mb"]` once exited."""
    baseline = rss_mb()
    peak = {"max": baseline, "mb": 0.0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak["max"] = max(peak["max"], rss_mb())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()
        peak["mb"] = peak["max"] - baseline


def measure(step, repeats: int) -> dict:
    """Median time, and the peak resident memory above the level before the first step."""
    with rss_peak() as peak:
        step()  # warm-up (its memory counts: a first step is a step)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    return {"seconds": statistics.median(times), "peak_mb_above_start": peak["mb"]}


def run_ours(model_dir: Path, repeats: int, shape: str, checkpointing: bool) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    from grpo_step import shared_step, workload

    from overnight.config import TrainConfig
    from overnight.trainer.grpo.checkpointing import enable_gradient_checkpointing
    from overnight.trainer.grpo.policy import load_policy
    from overnight.trainer.grpo.step import fresh_adapter

    config = TrainConfig(
        lora_rank=8, lora_alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")
    )
    model = fresh_adapter(load_policy(model_dir, trainable=True), config)
    if checkpointing:
        enable_gradient_checkpointing(model)
    samples = workload(model.config.vocab_size, shape=shape)

    def step():
        model.zero_grad(set_to_none=True)
        shared_step(model, samples, config)  # the trainer's default: prompts shared

    return {**measure(step, repeats), "tokens": sum(len(s.tokens) for s in samples)}


def trl_here() -> bool:
    try:
        return importlib.metadata.version("trl") == TRL.split("==")[1]
    except importlib.metadata.PackageNotFoundError:
        return False


def run_trl(model_dir: Path, repeats: int, shape: str, checkpointing: bool) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT))
    from grpo_step import SHAPES, workload

    from overnight.config import TrainConfig
    from overnight.testing.trl_mapping import compute_loss_inputs, grpo_config_options
    from overnight.trainer.grpo.loss import LossConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sh = SHAPES[shape]
    args = GRPOConfig(
        output_dir=str(ROOT / ".cache" / "trl-out"),
        per_device_train_batch_size=sh["groups"] * sh["size"],
        num_generations=sh["size"],
        gradient_checkpointing=checkpointing,
        report_to=[],
        use_cpu=True,
        logging_steps=1000,
        **grpo_config_options(LossConfig.from_train_config(TrainConfig())),
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * sh["groups"] * sh["size"]),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            task_type="CAUSAL_LM",
        ),
    )
    samples = workload(trainer.model.config.vocab_size, shape=shape)
    inputs = compute_loss_inputs(samples, prompt_len=sh["prompt_len"])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop we bypass

    def step():
        trainer.model.zero_grad(set_to_none=True)
        trainer._compute_loss(trainer.model, inputs).backward()

    return measure(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-dir", type=Path, default=ROOT / ".cache" / "tiny-model")
    parser.add_argument("--shape", choices=["default", "night"], default="default")
    parser.add_argument("--checkpointing", choices=["off", "on", "both"], default="off")
    parser.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        run = run_ours if args.side == "ours" else run_trl
        print(json.dumps(run(args.model_dir, args.repeats, args.shape, args.checkpointing == "on")))
        return
    trl_python = sys.executable if trl_here() else side_environment(TRL_VENV, TRL)
    modes = ["off", "on"] if args.checkpointing == "both" else [args.checkpointing]
    for mode in modes:
        results = {}
        for side, python in (("ours", sys.executable), ("trl", str(trl_python))):
            command = [python, __file__, "--side", side, "--repeats", str(args.repeats),
                       "--model-dir", str(args.model_dir), "--shape", args.shape,
                       "--checkpointing", mode]  # fmt: skip
            out = subprocess.run(command, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
            results[side] = json.loads(out.stdout.strip().splitlines()[-1])
        ours, trl = results["ours"], results["trl"]
        tokens = ours["tokens"]
        print(f"{args.model_dir.name}, shape {args.shape}, gradient checkpointing {mode}:")
        for name, r in (("ours", ours), ("TRL", trl)):
            print(f"  {name:4}: {r['seconds'] * 1000:8.1f} ms a step ({tokens / r['seconds']:6.0f}"
                  f" tokens/s), peak +{r['peak_mb_above_start']:7.1f} MB")  # fmt: skip
        speed = trl["seconds"] / ours["seconds"]
        memory = ours["peak_mb_above_start"] / max(trl["peak_mb_above_start"], 1e-9)
        print(
            f"  speed-up vs TRL: {speed:.2f}x   target >= 1.5: {'PASS' if speed >= 1.5 else 'FAIL'}"
        )
        print(f"  peak memory vs TRL: {memory:.2f}x   target <= 0.7: "
              f"{'PASS' if memory <= 0.7 else 'FAIL'}")  # fmt: skip


if __name__ == "__main__":
    main()
