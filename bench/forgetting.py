"""Forgetting on the real model: a normal night promoted, a destructive one refused, and what
the measure costs (trainer/gate/forgetting.py; BENCHMARKS.md, docs/operations.md).

On SmolLM2-135M-Instruct, offline (no vLLM, no proxy): the sum agent's traffic
(examples/sum_agent.py) sampled from the base model with transformers, rewarded by
examples/rewards.py:bare_sum, and trained by the trainer's own loop twice:

  normal       the smollm2-cpu preset (learning rate 1e-3, 2 epochs)
  destructive  a learning rate 5x the preset's and 6 epochs on the same narrow data
               (task reward up, references drifting), and 30x (the model wrecked)

Each candidate then goes through the night's own gate (`trainer.train.Night.gate`'s two steps: the task
gate on the held-out sums, paired with the served adapter, then forgetting on the bundled
reference set against the base model), the normal one against the base model served, the
destructive one against the normal one served (nights stack). Prints both verdicts and the
figures, and the seconds the forgetting measure took (the default set, three models).

    PYTHONPATH=.shim python bench/forgetting.py --threads 1 [--destructive 5x6,30x6]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # examples/

from examples.rewards import bare_sum  # noqa: E402
from examples.sum_agent import ASKED, HELD_OUT, SYSTEM  # noqa: E402
from overnight.config import TrainConfig  # noqa: E402
from overnight.config.presets import SMOLLM2_CPU_PRESET  # noqa: E402

MODEL = ROOT.parent / "main" / ".cache" / "smollm2-135m-instruct"
GROUP = 4  # attempts per question, as the demo's agent
TEMPERATURE = 0.8


def messages_of(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def sample_traffic(model_dir: Path, questions: list[str], seed: int):
    """A day's groups: GROUP sampled replies per question from the base model, rewarded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from overnight.trainer.choose.plan import Plan
    from overnight.trainer.gate.prompts import GatePrompt
    from overnight.trainer.gate.verdict import prompt_ids
    from overnight.trainer.grpo.data import Sample, group_advantages

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    plan = Plan()
    for q, question in enumerate(questions):
        prompt = prompt_ids(tokenizer, GatePrompt("", messages_of(question), [], 0.0, 1.0, 0))
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt] * GROUP), do_sample=True,
                                 temperature=TEMPERATURE, max_new_tokens=16,
                                 pad_token_id=tokenizer.eos_token_id)  # fmt: skip
        group, samples, rewards = f"g{q}", [], {}
        for i, row in enumerate(out.tolist()):
            reply = row[len(prompt) :]
            while len(reply) > 1 and reply[-1] == tokenizer.eos_token_id == reply[-2]:
                reply = reply[:-1]  # padding after the end
            text = tokenizer.decode(reply, skip_special_tokens=True)
            rollout = f"{group}.{i}"
            rewards[rollout] = bare_sum(
                {"messages": [*messages_of(question), {"role": "assistant", "content": text}]}
            )
            samples.append(Sample(rollout, group, prompt + reply,
                                  [False] * len(prompt) + [True] * len(reply),
                                  [0.0] * (len(prompt) + len(reply)), 1, exact=False))  # fmt: skip
        advantages = group_advantages(rewards, True)
        if advantages is None:
            continue  # all equal: no signal, as the planner leaves it out
        plan.groups.append(group)
        plan.rewards.update(rewards)
        plan.samples += [replace(s, advantage=advantages.advantages[s.rollout_id]) for s in samples]
    return plan


async def score(messages: list[dict], tools: list[dict], replies: list[dict]) -> list[float]:
    """The gate's scorer: bare_sum on each reply."""
    return [bare_sum({"messages": [*messages, reply]}) for reply in replies]


def gate_prompts() -> list:
    from overnight.trainer.gate.prompts import GatePrompt

    return [GatePrompt(f"held-{i}", messages_of(q), [], TEMPERATURE, 1.0, 16)
            for i, q in enumerate(HELD_OUT)]  # fmt: skip


def night(name: str, plan, config: TrainConfig, model: Path, out: Path, served: Path | None):
    """Train a candidate and put it through the night's gate against `served`."""
    from overnight.trainer.gate.forgetting import judge, measure, resolve
    from overnight.trainer.gate.verdict import run_gate
    from overnight.trainer.run.loop import run_training

    adapter = out / name
    began = time.monotonic()
    run_training(plan, config, str(model), None, adapter, say=lambda line: None)
    trained = time.monotonic() - began
    # As Night.gate does it: the candidate against the served adapter on the held-out
    # prompts, then forgetting on the reference set.
    served_path = None if served is None else str(served)
    quiet = lambda line: None  # noqa: E731
    verdict = run_gate(config, str(model), adapter, served_path, gate_prompts(), score, [],
                       say=quiet)  # fmt: skip
    spec = resolve(config.reference, str(model))
    if spec is not None:
        judge(verdict, measure(config, out / "data", str(model), adapter, served_path, spec,
                               say=quiet))  # fmt: skip
    return {"night": name, "trained_s": round(trained, 1), "promote": verdict.promote,
            "reason": verdict.reason, "candidate_reward": verdict.candidate_mean,
            "served_reward": verdict.served_mean, "forgetting": verdict.forgetting}  # fmt: skip


def cost(model: Path, out: Path, candidate: Path, served: Path) -> None:
    """What the measure costs a night, on a fresh data directory: the first night (the
    base model's answers generated and its figures computed, then cached) and the next."""
    from overnight.trainer.gate.forgetting import measure

    config = TrainConfig(base_model=str(model))
    data = out / f"cost-{time.time_ns()}"
    for night_ in ("first night", "a later night"):
        f = measure(config, data, str(model), candidate, str(served), "bundled")
        print(f"cost, {night_}: {f.seconds:.1f} s for {f.references} references "
              f"(candidate {f.candidate:+.3f}, served {f.served:+.3f})", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--out", type=Path, default=Path("/tmp/overnight-forgetting"))
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument(
        "--destructive",
        default="5x6,30x6",
        help="destructive nights: learning rate times the preset's x epochs",
    )
    parser.add_argument("--reuse-normal", action="store_true",
                        help="the normal night's adapter from an earlier run (--out)")  # fmt: skip
    parser.add_argument(
        "--cost-only",
        action="store_true",
        help="only time the measure, on the adapters of an earlier run",
    )
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)  # a shared, loaded machine: one spins less
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cost_only:
        first = args.destructive.split(",")[0]
        cost(args.model, args.out, args.out / f"destructive-{first}", args.out / "normal")
        return
    questions = random.Random(0).sample(ASKED, args.questions)
    began = time.monotonic()
    plan = sample_traffic(args.model, questions, seed=0)
    print(f"traffic: {len(plan.groups)} groups with a signal of {len(questions)}, "
          f"reward mean {sum(plan.rewards.values()) / len(plan.rewards):.3f} "
          f"({time.monotonic() - began:.0f} s)", flush=True)  # fmt: skip
    normal = TrainConfig(base_model=str(args.model), **SMOLLM2_CPU_PRESET)
    if not (args.out / "normal" / "adapter_config.json").exists() or not args.reuse_normal:
        print(json.dumps(night("normal", plan, normal, args.model, args.out, None), indent=1),
              flush=True)  # fmt: skip
    for dose in args.destructive.split(","):
        times, epochs = (int(x) for x in dose.split("x"))
        lr = times * SMOLLM2_CPU_PRESET["learning_rate"]
        hard = TrainConfig(
            base_model=str(args.model),
            **{**SMOLLM2_CPU_PRESET, "learning_rate": lr, "epochs": epochs},
        )
        result = night(f"destructive-{dose}", plan, hard, args.model, args.out,
                       args.out / "normal")  # fmt: skip
        print(json.dumps({"learning_rate": lr, "epochs": epochs, **result}, indent=1), flush=True)


if __name__ == "__main__":
    main()
