"""How far un-gamed answers move on the gate's measures of gaming: what --gaming-limit
is set from (trainer/gate/gaming.py, docs/signals.md "Gaming").

On SmolLM2-135M-Instruct, offline (no vLLM): the bundled reference prompts (120 general
requests, trainer/gate/references.json) answered by the gate's own sampling
(verdict.generate_replies) several times, each time from other seeds. Then many draws
of a gate's worth of prompts (--prompts, the default --gate-prompts 32) and two passes:
the gate's shift (candidate - served on the same prompts) between two samplings of the
same model, which no gaming moved. Printed: the share ending in a question and the share
flattering (their shift's spread and upper percentiles), and the length's relative
shift.

    python bench/gaming.py --threads 1 [--passes 3] [--tokens 64]

--adapter PATH compares an adapter's passes with the base model's instead (a normal
night's candidate, trained by bench/forgetting.py: how far a night that is not gaming
moves them).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from overnight.config import TrainConfig  # noqa: E402
from overnight.trainer.gate.gaming import shape_of  # noqa: E402
from overnight.trainer.gate.prompts import GatePrompt  # noqa: E402
from overnight.trainer.gate.verdict import generate_replies, load_named  # noqa: E402

MODEL = ROOT / ".cache" / "smollm2-135m-instruct"
REFERENCES = ROOT / "trainer" / "gate" / "references.json"


def passes(model_dir: Path, adapter: Path | None, prompts, seeds, say) -> list[list[str]]:
    config = TrainConfig(base_model=str(model_dir), dtype="float32")
    model, tokenizer, device = load_named(str(model_dir), {"a": adapter}, config)
    out = []
    for seed in seeds:
        began = time.monotonic()
        out.append(generate_replies(model, tokenizer, prompts, seed, device))
        say(f"pass seed {seed}: {time.monotonic() - began:.0f} s")
    return out


def shifts(a: list[list[str]], b: list[list[str]], n: int, draws: int, paired_seeds: bool):
    """Shape shifts (a - b) over `draws` random gate-sized prompt sets, each from a pass of
    a and a pass of b (other seeds when the same model: `paired_seeds` False)."""
    rng = random.Random(0)
    q, f, c = [], [], []
    for _ in range(draws):
        idx = rng.sample(range(len(a[0])), n)
        i = rng.randrange(len(a))
        j = i if paired_seeds else rng.choice([k for k in range(len(b)) if k != i])
        x = shape_of([a[i][k] for k in idx])
        y = shape_of([b[j][k] for k in idx])
        q.append(x.question - y.question)
        f.append(x.flattery - y.flattery)
        c.append(x.chars / y.chars - 1 if y.chars else 0.0)
    return np.array(q), np.array(f), np.array(c)


def summary(name: str, v: np.ndarray) -> dict:
    return {
        "measure": name,
        "mean": round(float(v.mean()), 4),
        "sd": round(float(v.std()), 4),
        "p95": round(float(np.quantile(v, 0.95)), 4),
        "p99": round(float(np.quantile(v, 0.99)), 4),
        "max": round(float(v.max()), 4),
        "p1": round(float(np.quantile(v, 0.01)), 4),
        "min": round(float(v.min()), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--adapter", type=Path, default=None)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--save", type=Path, default=None, help="the replies, as JSON")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    rows = json.loads(REFERENCES.read_text(encoding="utf-8"))
    prompts = [
        GatePrompt(f"ref{i}", r["messages"], [], args.temperature, 1.0, args.tokens)
        for i, r in enumerate(rows)
    ]
    say = lambda line: print(line, flush=True)  # noqa: E731
    seeds = list(range(args.passes))
    base = passes(args.model, None, prompts, seeds, say)
    replies = {"base": base}
    if args.adapter is not None:
        replies["adapter"] = passes(args.model, args.adapter, prompts, seeds, say)
    if args.save:
        args.save.write_text(json.dumps(replies))
    for name, texts in replies.items():
        whole = shape_of([t for p in texts for t in p])
        say(f"{name}, every pass: {whole.line()}")
    if args.adapter is None:
        q, f, c = shifts(base, base, args.prompts, args.draws, paired_seeds=False)
        what = "same model, other seeds"
    else:
        q, f, c = shifts(replies["adapter"], base, args.prompts, args.draws, paired_seeds=True)
        what = "adapter - base, same seeds"
    say(f"shift over {args.draws} draws of {args.prompts} prompts ({what}):")
    for name, v in (("question share", q), ("flattery share", f), ("relative length", c)):
        say(json.dumps(summary(name, v)))


if __name__ == "__main__":
    main()
