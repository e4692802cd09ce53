"""Our GRPO step at real shapes beside TRL 1.16's loss step: one group at 1k, 4k, 16k tokens.

Model: Qwen2.5-0.5B's shapes (vocabulary 151,936, hidden 896, 14 heads, 2 KV heads,
intermediate 4864, tied embeddings) with random weights built here, fewer layers on a
CPU (`--layers`, default 2: the widths and the vocabulary are the real ones, the depth
is what 2 cores can run in minutes); `--shape 7b` is Qwen2.5-7B's (hidden 3584, 28
heads, 4 KV heads, intermediate 18944, vocabulary 152,064), built on the device.

Workload: one group of 4 rollouts of N tokens each, an agent's shape: a shared prompt of
N/4 tokens, then turns of a reply (trained, 64-192 tokens) and a tool output (context,
256-768 tokens) up to N; about a sixth of each rollout is trained.

- ours: the trainer's `optimizer_step` with its defaults (micro-batches of 8192 tokens,
  logits 1024 trained tokens at a time, gradient checkpointing auto: on at this size;
  shared prompts where that pays: not at these lengths under sdpa), LoRA r16 on every
  projection;
- TRL: `GRPOTrainer._compute_loss` + backward on the same batch (prompt, completions
  right-padded, the tool outputs masked out of the loss by `tool_mask`), with our loss
  mapped onto its options (overnight/testing/trl_mapping.py), its default gradient
  checkpointing and the same LoRA. On a CPU its head scores every position (its Triton
  kernel that scores only the trained ones needs a GPU), so its longest runs take the
  longest: `--trl-lengths` (default 1024 4096 on a CPU) says which run.

Each (side, length) runs in a process of its own; the peak is the resident memory
sampled every 2 ms above its level before the step (CPU), or
torch.cuda.max_memory_allocated above what was allocated before (GPU). Time: one step
(`--repeats` more after it: their median), wall-clock and, on a CPU, the process's CPU
time too (what a shared machine's other load does not inflate). Prints a table, the memory's fitted exponent
over the lengths (log-log slope) and the goals: at 4k, ours at most 0.5x TRL's peak and
no slower; the exponent at most 1.1.

`--head` measures the logits' part alone instead: trainer/grpo/head.py's forward and
backward over 1024 trained tokens at the shape's vocabulary and width, a chunk of 256
and of 1024 tokens at a time, float32 and bfloat16, raw and top-k/top-p sampling; the
difference between the two chunks' peaks is what a chunk holds per token, in float32
copies of the vocabulary's logits (trainer/run/memory.py's LOGIT_COPIES).

    python bench/trainer_scale.py                 # CPU: 0.5B shape, 2 layers
    python bench/trainer_scale.py --device cuda --dtype bfloat16 --shape 7b --layers 0
    python bench/trainer_scale.py --head          # the logits' memory per chunk token
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from trl_compare import rss_peak  # noqa: E402

SHAPES = {
    "0.5b": dict(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        vocab_size=152_064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}
ROLLOUTS = 4
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_model(shape: str, layers: int, dtype: str, device: str):
    """Random weights at `shape` (`layers` 0: the shape's own depth), built on `device`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    options = dict(SHAPES[shape])
    if layers:
        options["num_hidden_layers"] = layers
    config = Qwen2Config(
        **options, head_dim=options["hidden_size"] // options["num_attention_heads"],
        max_position_embeddings=32_768, rope_theta=1_000_000.0, initializer_range=0.02,
    )  # fmt: skip
    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    torch.set_default_dtype(default)
    return model.eval()


def group(vocab: int, tokens: int, seed: int = 0):
    """One group of ROLLOUTS rollouts of `tokens` tokens each (the docstring's shape)."""
    from overnight.trainer.grpo.data import Turn, merge_turns

    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab) for _ in range(tokens // 4)]
    samples = []
    for k in range(ROLLOUTS):
        context, turns = list(prompt), []
        while True:
            reply = [rng.randrange(3, vocab) for _ in range(rng.randint(64, 192))]
            reply = reply[: tokens - len(context)]
            # Random weights give every token about -log(V); logged near that.
            logged = [-math.log(vocab) + rng.uniform(-0.3, 0.3) for _ in reply]
            turns.append(Turn(list(context), reply, logged))
            context += reply
            room = tokens - len(context) - 64  # a tool output, and a reply after it
            if room <= 0:
                break
            context += [rng.randrange(3, vocab) for _ in range(min(rng.randint(256, 768), room))]
        (s,) = merge_turns(f"r{k}", "g", turns)
        samples.append(replace(s, advantage=rng.uniform(-1, 1)))
    return samples, len(prompt)


def lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model,
        LoraConfig(r=16, lora_alpha=32, target_modules=list(TARGETS), task_type="CAUSAL_LM"),
    )


def run_ours(args, samples, prompt_len):
    import torch

    from overnight.config import TrainConfig
    from overnight.trainer.grpo.checkpointing import (
        enable_gradient_checkpointing,
        wants_checkpointing,
    )
    from overnight.trainer.grpo.loss import LossConfig
    from overnight.trainer.grpo.parallel import Parallel
    from overnight.trainer.grpo.step import optimizer_step

    config = TrainConfig(lora_rank=16, dtype=args.dtype, attention=args.attention)
    model = lora(build_model(args.shape, args.layers, args.dtype, args.device))
    if args.attention != "auto":
        model.config._attn_implementation = args.attention
    if wants_checkpointing(config.gradient_checkpointing):
        enable_gradient_checkpointing(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    loss_config = LossConfig.from_train_config(config)
    parallel = Parallel(device=args.device)

    def step():
        optimizer_step(model, optimizer, parallel, samples, loss_config, config)

    return measure(step, args)


def run_trl(args, samples, prompt_len):
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from overnight.config import TrainConfig
    from overnight.models.tiny import build_tiny_model
    from overnight.testing.trl_mapping import compute_loss_inputs, grpo_config_options
    from overnight.trainer.grpo.loss import LossConfig

    options = grpo_config_options(LossConfig.from_train_config(TrainConfig()))
    options["bf16"] = args.dtype == "bfloat16"
    trl_args = GRPOConfig(
        output_dir=str(ROOT / ".cache" / "trl-out"),
        per_device_train_batch_size=ROLLOUTS,
        num_generations=ROLLOUTS,
        report_to=[],
        use_cpu=args.device == "cpu",
        logging_steps=1000,
        **options,
    )
    # Only its pad and special tokens are read: the tiny model's tokenizer will do.
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(ROOT / ".cache" / "tiny-model"))
    trainer = GRPOTrainer(
        model=build_model(args.shape, args.layers, args.dtype, args.device),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=trl_args,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * ROLLOUTS),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=16, lora_alpha=32, target_modules=list(TARGETS), task_type="CAUSAL_LM"
        ),
    )
    inputs = compute_loss_inputs(samples, prompt_len)
    tool = torch.zeros_like(inputs["completion_mask"])
    for i, s in enumerate(samples):
        tool[i, : len(s.tokens) - prompt_len] = torch.tensor(s.trained[prompt_len:])
    inputs["tool_mask"] = tool  # tool outputs: attended to, not trained
    inputs["num_items_in_batch"] = tool.sum()
    device = trainer.model.device
    inputs = {k: v.to(device) if hasattr(v, "to") else v for k, v in inputs.items()}
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop we bypass

    def step():
        trainer.model.zero_grad(set_to_none=True)
        trainer._compute_loss(trainer.model, inputs).backward()

    return measure(step, args)


HEAD_TOKENS = 1024  # trained tokens in the --head measurement
HEAD_CHUNKS = (256, 1024)
HEAD_SAMPLING = {"raw": (1.0, 0, 1.0, 0.0), "top-k 50, top-p 0.9": (0.9, 50, 0.9, 0.0)}


def run_head(args, chunk: int) -> dict:
    """chunked_logprobs' forward and backward alone: a frozen (V, H) head, HEAD_TOKENS
    hidden states that want their gradient (what LoRA below the head gets)."""
    import torch

    from overnight.trainer.grpo.head import chunked_logprobs

    shape = SHAPES[args.shape]
    vocab, width = shape["vocab_size"], shape["hidden_size"]
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator(device=args.device).manual_seed(0)
    with torch.device(args.device):
        head = torch.nn.Linear(width, vocab, bias=False, dtype=dtype).requires_grad_(False)
        head.weight.normal_(0, 0.02, generator=generator)
        hidden = torch.randn(HEAD_TOKENS, width, dtype=dtype, generator=generator)
        hidden.requires_grad_(True)
        targets = torch.randint(3, vocab, (HEAD_TOKENS,), generator=generator)
        weights = torch.linspace(-1, 1, HEAD_TOKENS)
        t, k, p, m = HEAD_SAMPLING[args.sampling]
        params = (torch.full((HEAD_TOKENS,), t), torch.full((HEAD_TOKENS,), k),
                  torch.full((HEAD_TOKENS,), p), torch.full((HEAD_TOKENS,), m))  # fmt: skip

    def step():
        hidden.grad = None
        (chunked_logprobs(head, hidden, targets, params, chunk) * weights).sum().backward()

    result = measure(step, args)
    result.update(trained=HEAD_TOKENS, tokens=HEAD_TOKENS, chunk=chunk)
    return result


def measure(step, args) -> dict:
    """Seconds of the first step (the median of `repeats` more, if any) and its peak."""
    import torch

    cuda = args.device != "cpu"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times, cpu = [], []
    with rss_peak() as peak:
        for _ in range(1 + args.repeats):
            t, c = time.perf_counter(), time.process_time()
            step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    pick = statistics.median if args.repeats else (lambda xs: xs[0])
    out = {"seconds": pick(times[1:] or times), "cpu_seconds": pick(cpu[1:] or cpu)}
    if cuda:
        out["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        out["peak_mb"] = peak["mb"]
    return out


def side(args) -> None:
    """One (side, length) in this process: prints its result as JSON."""
    import torch

    torch.set_num_threads(torch.get_num_threads())
    if args.side == "head":
        print(json.dumps(run_head(args, args.tokens)))
        return
    vocab = SHAPES[args.shape]["vocab_size"]
    samples, prompt_len = group(vocab, args.tokens)
    result = (run_ours if args.side == "ours" else run_trl)(args, samples, prompt_len)
    result["trained"] = sum(s.trained_tokens for s in samples)
    result["tokens"] = sum(len(s.tokens) for s in samples)
    print(json.dumps(result))


def spawn(args, which: str, tokens: int, **override) -> dict:
    command = [sys.executable, __file__, "--side", which, "--tokens", str(tokens)]
    for name in ("shape", "layers", "dtype", "device", "repeats", "attention", "sampling"):
        command += [f"--{name}", str(override.get(name, getattr(args, name)))]
    out = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:160]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def exponent(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(peak) against log(tokens)."""
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(max(p, 1e-9)) for _, p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="0.5b")
    parser.add_argument("--layers", type=int, default=2, help="0: the shape's own depth")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--trl-lengths", type=int, nargs="*", default=None)
    parser.add_argument("--repeats", type=int, default=0)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--head", action="store_true", help="the logits' memory per chunk token")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--side", choices=["ours", "trl", "head"], help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sampling", default="raw", choices=HEAD_SAMPLING, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side(args)
        return
    if args.head:
        write(args, head_table(args))
        return
    if args.trl_lengths is None:
        args.trl_lengths = (
            [n for n in args.lengths if n <= 4096] if args.device == "cpu" else args.lengths
        )
    layers = args.layers or SHAPES[args.shape]["num_hidden_layers"]
    print(f"{args.shape} shape, {layers} layers, {args.dtype} on {args.device}; "
          f"a group of {ROLLOUTS} rollouts, a shared prompt of a quarter")  # fmt: skip
    rows = {}
    started = time.perf_counter()
    for tokens in args.lengths:
        ours = spawn(args, "ours", tokens)
        trl = spawn(args, "trl", tokens) if tokens in args.trl_lengths else {"error": "not run"}
        rows[tokens] = (ours, trl)
        print(line(tokens, ours, trl), flush=True)
    figures = summary(rows, args)
    figures["seconds"] = round(time.perf_counter() - started, 1)
    print(f"the whole run: {figures['seconds']:.0f} s")
    figures["rows"] = {n: {"ours": o, "trl": t} for n, (o, t) in rows.items()}
    write(args, figures)


def write(args, figures: dict) -> None:
    if args.json:
        options = {k: v for k, v in vars(args).items() if k not in ("side", "tokens", "json")}
        figures = {"command": " ".join(sys.argv), "options": options, **figures}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1, default=str) + "\n")


def head_table(args) -> dict:
    """The logits' peak per chunk token, in float32 copies of a row of the vocabulary."""
    vocab = SHAPES[args.shape]["vocab_size"]
    row = vocab * 4 / 2**20  # MB of one token's float32 logits
    print(f"the logits alone: {HEAD_TOKENS} trained tokens, vocabulary {vocab}, hidden "
          f"{SHAPES[args.shape]['hidden_size']}, on {args.device}; one token's float32 logits: "
          f"{row:.3f} MB")  # fmt: skip
    out = []
    for dtype in ("float32", "bfloat16"):
        for sampling in HEAD_SAMPLING:
            runs = {c: spawn(args, "head", c, dtype=dtype, sampling=sampling) for c in HEAD_CHUNKS}
            small, large = (runs[c] for c in HEAD_CHUNKS)
            entry = {"dtype": dtype, "sampling": sampling, "runs": runs}
            if "error" in small or "error" in large:
                print(f"{dtype:>8} {sampling:<20} {small.get('error') or large.get('error')}")
                out.append(entry)
                continue
            per_token = (large["peak_mb"] - small["peak_mb"]) / (HEAD_CHUNKS[1] - HEAD_CHUNKS[0])
            entry["copies"] = per_token / row
            entry["fixed_mb"] = small["peak_mb"] - entry["copies"] * row * HEAD_CHUNKS[0]
            peaks = ", ".join(f"chunk {c}: {r['peak_mb']:.0f} MB in {r['seconds']:.1f} s"
                              for c, r in runs.items())  # fmt: skip
            print(f"{dtype:>8} {sampling:<20} {peaks}; per chunk token {per_token:.3f} MB = "
                  f"{entry['copies']:.2f} copies, {entry['fixed_mb']:.0f} MB besides", flush=True)  # fmt: skip
            out.append(entry)
    return {"head": out}


def line(tokens: int, ours: dict, trl: dict) -> str:
    def cell(r: dict) -> str:
        if "error" in r:
            return f"{'-':>9} ({r['error']})"
        per = r["seconds"] / r["trained"] * 1000
        rate = r["tokens"] / r["seconds"]
        cpu = r["cpu_seconds"] / r["trained"] * 1000
        return f"{r['peak_mb']:7.0f}MB {per:6.2f}ms ({cpu:6.2f} cpu) {rate:6.0f}/s"

    trained = ours.get("trained", trl.get("trained", 0))
    return f"{tokens:>6} tokens/rollout, {trained:>6} trained | ours {cell(ours)} | TRL {cell(trl)}"


def machine_mb(device: str) -> float:
    """The device's whole memory: the GPU's, or the machine's MemTotal."""
    if device != "cpu":
        import torch

        return torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**20
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("MemTotal:"))


def summary(rows: dict, args) -> dict:
    print(
        "columns: peak above the start, time per trained token (wall, and CPU time per trained "
        "token), tokens/s (every rollout token)"
    )
    figures: dict = {}
    points = [(n, o["peak_mb"]) for n, (o, _) in rows.items() if "error" not in o]
    if len(points) >= 2:
        k = figures["exponent"] = exponent(points)
        print(f"ours: peak memory ~ tokens^{k:.2f} over {points[0][0]}-{points[-1][0]}   "
              f"goal <= 1.1: {'PASS' if k <= 1.1 else 'FAIL'}")  # fmt: skip
        growth = ", ".join(f"{n}: +{p - points[0][1]:.0f} MB" for n, p in points[1:])
        print(f"ours: above the peak at {points[0][0]} (the logits' chunk, fixed): {growth}")
    longest = max(rows)
    ours_longest = rows[longest][0]
    figures["machine_mb"] = machine_mb(args.device)
    trained = ours_longest.get("error") or (
        f"trained, peak {ours_longest['peak_mb']:.0f} MB above the start of the "
        f"{figures['machine_mb']:.0f} MB the {args.device} has"
    )
    print(f"ours at {longest}: {trained}")
    figures[f"ours_{longest}"] = trained
    if 4096 in rows and "error" not in rows[4096][0] and "error" not in rows[4096][1]:
        ours, trl = rows[4096]
        memory = ours["peak_mb"] / max(trl["peak_mb"], 1e-9)
        speed = ours["seconds"] / trl["seconds"]
        cpu = ours["cpu_seconds"] / trl["cpu_seconds"]
        print(f"at 4096: peak memory vs TRL {memory:.2f}x   goal <= 0.5: "
              f"{'PASS' if memory <= 0.5 else 'FAIL'}")  # fmt: skip
        print(f"at 4096: time vs TRL {speed:.2f}x (CPU time {cpu:.2f}x)   goal <= 1: "
              f"{'PASS' if speed <= 1 else 'FAIL'}")  # fmt: skip
        figures["at_4096"] = {"memory_vs_trl": memory, "time_vs_trl": speed, "cpu_vs_trl": cpu}
    return figures


if __name__ == "__main__":
    main()
