"""bench/learning.py --peer trl: the same nights' budget spent by TRL 1.16's online GRPOTrainer.

TRL learns the task the way its users run it: `GRPOTrainer` generates its own completions
(transformers' `generate` on the CPU, no vLLM) from the policy it is training, scores them
with a reward function, and steps. What it is given is what our side's agent and nights use:

  prompts:     the agent's own messages (examples/reasoning_gym_agent.py: its instruction,
               its worked examples, the question) for day 1's --size questions, then day 2's,
               ... in the agent's order (`shuffle_dataset=False`)
  sampling:    --group-size completions a prompt (`num_generations`), the agent's 64 tokens
               (`max_completion_length`), the traffic's --temperature, no top-k/top-p (the
               served model's generation_config.json sets none, so vLLM applies none)
  reward:      the task's own `score_answer` on the stripped reply, as the agent scores
  the update:  the smollm2-cpu preset (overnight/config/train.py): LoRA rank 8, alpha 16, every
               attention and MLP projection, no dropout; AdamW at 1e-3, constant, no weight
               decay; 4 groups a step (`per_device_train_batch_size` 16 of 4 generations);
               2 passes over each generation (`num_iterations`, our epochs); our loss in TRL's
               terms (overnight/testing/trl_mapping.py: dapo, clip 0.2/0.28, delta 3, beta 0)

The budget: each of our nights samples --size x --group-size completions; TRL trains for as
many, `max_steps` = nights x (size / groups a step) x epochs. TRL generates a step's groups
anew every `num_iterations` optimizer steps: the policy it samples from moves within a
night's worth, where ours samples a whole day from the served adapter. After
each night's worth a callback saves the adapter and notes the wall time; bench/learning.py
then measures each saved adapter's held-out score through the same path as ours (promoted
on the same `overnight serve`, the agent's --held-out run).

The training runs in a child process (`python bench/learning_trl.py SPEC RESULT`): its own
memory and threads, nothing of the product's trainer imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESET = "smollm2-cpu"


@dataclass(frozen=True)
class Budget:
    """How our nights' sampled completions become TRL's steps."""

    nights: int
    size: int  # questions a day: groups
    group_size: int  # completions a question
    groups_per_step: int  # the preset's
    epochs: int  # the preset's: passes over each generation (TRL's num_iterations)

    def __post_init__(self) -> None:
        if self.size % self.groups_per_step:
            raise ValueError(f"--size {self.size} is not a whole number of steps of "
                             f"{self.groups_per_step} groups: TRL's nights would not end "
                             "where ours do")  # fmt: skip

    @property
    def completions_per_night(self) -> int:
        return self.size * self.group_size

    @property
    def batch(self) -> int:
        """Completions a step: the groups TRL generates at once."""
        return self.groups_per_step * self.group_size

    @property
    def steps_per_night(self) -> int:
        return self.size // self.groups_per_step * self.epochs

    @property
    def max_steps(self) -> int:
        return self.nights * self.steps_per_night

    def completions_after(self, steps: int) -> int:
        """Completions TRL has sampled once `steps` steps are done (each generation is used
        for `epochs` steps)."""
        return -(-steps // self.epochs) * self.batch


def preset_budget(args) -> Budget:
    from overnight.config.presets import PRESETS

    preset = PRESETS[PRESET]
    return Budget(args.nights, args.size, args.group_size, preset["groups_per_step"],
                  preset["epochs"])  # fmt: skip


def question_order(nights: int, size: int, day_seed: int) -> list[tuple[int, int, int]]:
    """(day, seed, index) of every prompt, in the order our days ask them: day d asks the
    questions of seed day_seed + d, 0 to size - 1."""
    return [(d, day_seed + d, i) for d in range(1, nights + 1) for i in range(size)]


def agent_defaults():
    """The agent's own --shots and --max-tokens, as bench/learning.py runs it (unset)."""
    from examples.reasoning_gym_agent import parse_args

    return parse_args([])


def spec_for(task: str, difficulty: dict, model_dir: str, out: Path, args) -> dict:
    """What the child needs, as JSON: the task, the questions, the budget, the settings."""
    from overnight.config.presets import PRESETS
    from overnight.config.train import TrainConfig
    from overnight.testing.trl_mapping import grpo_config_options
    from overnight.trainer.grpo.loss import LossConfig

    config = TrainConfig(**PRESETS[PRESET])
    budget = preset_budget(args)
    options = grpo_config_options(LossConfig.from_train_config(config))
    agent = agent_defaults()
    options.update(  # the agent's traffic and the preset's update
        max_completion_length=agent.max_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        num_generations=budget.group_size,
        # A step of `groups_per_step` groups, one group a forward pass (as our micro-batches
        # bound the memory: 16 completions at once were killed for memory on a shared
        # 24 GiB machine, 4.7 GB resident); TRL generates a step's groups at once and
        # normalises the loss over them all, so the step is the same as one batch of 16
        per_device_train_batch_size=budget.group_size,
        gradient_accumulation_steps=budget.groups_per_step,
        steps_per_generation=budget.groups_per_step,
        num_iterations=budget.epochs,
        max_steps=budget.max_steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=config.max_grad_norm,
        scale_rewards="group" if config.scale_by_std else "none",
        shuffle_dataset=False,
        # TRL's default is on; our nights here run without it (the memory check finds they
        # fit), and it costs a third more compute
        gradient_checkpointing=False,
    )
    lora = {"r": config.lora_rank, "lora_alpha": config.lora_alpha,
            "target_modules": list(config.target_modules), "lora_dropout": 0.0}  # fmt: skip
    return {
        "task": task,
        "difficulty": difficulty,
        "order": question_order(args.nights, args.size, args.day_seed),
        "size": args.size,
        "shots": agent.shots,
        "model_dir": model_dir,
        "out": str(out),
        "budget": asdict(budget),
        "grpo": options,
        "lora": lora,
    }


# -- the child: TRL ------------------------------------------------------------------------


def prompt_rows(spec: dict) -> tuple[dict, list[dict]]:
    """Each day's dataset by seed, and TRL's dataset rows: the agent's messages for each
    question in the spec's order, with the seed and index that find it again."""
    import reasoning_gym

    sys.path.insert(0, str(ROOT))
    from examples.reasoning_gym_agent import task_messages, worked_examples

    task, difficulty = spec["task"], spec["difficulty"]
    days = {seed: reasoning_gym.create_dataset(task, size=spec["size"], seed=seed, **difficulty)
            for seed in sorted({seed for _, seed, _ in spec["order"]})}  # fmt: skip
    examples = worked_examples(task, difficulty, spec["shots"])
    rows = [{"prompt": task_messages(days[seed][i]["question"], examples), "seed": seed,
             "index": i} for _, seed, i in spec["order"]]  # fmt: skip
    return days, rows


def task_reward(days: dict, scores: list[float]):
    """TRL's reward function: the task's own score of each stripped reply, as the agent
    scores; every score is also appended to `scores` (the traffic's, night by night)."""

    def reward(completions, seed, index, **_) -> list[float]:
        got = []
        for completion, s, i in zip(completions, seed, index, strict=True):
            reply = (completion[-1]["content"] or "").strip()
            got.append(float(days[s].score_answer(reply, days[s][i])))
        scores.extend(got)
        return got

    return reward


def train(spec: dict) -> dict:
    """TRL's GRPOTrainer on the spec: per night's worth, the adapter saved and the time."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    started = time.monotonic()
    budget, out = Budget(**spec["budget"]), Path(spec["out"])
    days, rows = prompt_rows(spec)
    scores: list[float] = []
    nights: list[dict] = []

    class EachNight(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % budget.steps_per_night == 0:
                n = state.global_step // budget.steps_per_night
                path = out / f"night-{n}"
                model.save_pretrained(path)
                done = budget.completions_after(state.global_step)
                night_scores = scores[done - budget.completions_per_night : done]
                nights.append({"night": n, "adapter": str(path), "steps": state.global_step,
                               "completions": done, "seconds": time.monotonic() - started,
                               "train_reward": sum(night_scores) / max(len(night_scores), 1)})  # fmt: skip
                print(f"TRL night {n}: {done} completions, {nights[-1]['seconds']:.0f} s, "
                      f"mean reward {nights[-1]['train_reward']:.3f}", flush=True)  # fmt: skip

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[task_reward(days, scores)],
        args=GRPOConfig(
            output_dir=str(out / "trl"),
            report_to=[],
            use_cpu=True,
            seed=0,
            save_strategy="no",
            logging_steps=1,
            **spec["grpo"],
        ),  # fmt: skip
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=LoraConfig(task_type="CAUSAL_LM", **spec["lora"]),
        callbacks=[EachNight()],
    )
    trainer.train()
    return {"nights": nights, "completions": len(scores), "seconds": time.monotonic() - started,
            "log": trainer.state.log_history}  # fmt: skip


def run_peer(spec: dict, say) -> dict:
    """The child's result; its lines about each night passed to `say` as they come."""
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    command = [sys.executable, __file__, str(out / "spec.json"), str(out / "result.json")]
    with open(out / "trl.log", "w") as log:  # its warnings, progress bars and step logs
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
        for line in process.stdout:  # type: ignore[union-attr]
            log.write(line)
            if line.startswith("TRL "):
                say(line.rstrip("\n"))
    if process.wait() != 0:
        tail = (out / "trl.log").read_text()[-2000:]
        raise RuntimeError(f"TRL's side failed ({out / 'trl.log'}):\n{tail}")
    return json.loads((out / "result.json").read_text())


if __name__ == "__main__":
    result = train(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(result, indent=1))
