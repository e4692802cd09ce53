"""Our GRPO loss and its LoRA gradients equal TRL 1.16's under the mapping of docs/grpo.md.

One batch (two groups of four rollouts sharing 12-token prompts), one adapter with
non-zero A and B, behaviour logprobs shifted so that many tokens clip and some
negative-advantage tokens hit the dual clip. Ours runs the trainer's own micro-batch
path (prompts shared, two micro-batches accumulated); TRL runs
`GRPOTrainer._compute_loss` on an identical copy of the model, in float32.

The mapping: loss -> loss_type, clip_low -> epsilon, clip_high -> epsilon_high,
dual_clip -> delta (at or above 1 + clip_high), max_tokens -> max_completion_length,
ratio_level -> importance_sampling_level, kl_coef -> beta with
use_bias_correction_kl=False, and each record's temperature -> temperature.
"""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

PROMPT = 12
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """(ours, a pristine copy): the tiny model with random, non-zero LoRA A and B.

    TRL gets a fresh copy of the second per case: with beta > 0 it adds a "ref"
    adapter to a peft model it is given. (trl is imported here, not at collection:
    importing it takes seconds, and `-m "not slow"` runs should not pay them.)"""
    pytest.importorskip(
        "trl", reason="trl is not installed (the `test` extra: pip install -e '.[test]')"
    )
    from transformers import AutoModelForCausalLM

    from overnight.config import TrainConfig
    from overnight.trainer.grpo.step import fresh_adapter

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = TrainConfig(lora_rank=8, target_modules=("q_proj", "v_proj", "o_proj", "up_proj"))
    ours = fresh_adapter(base, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    ours.train()
    return ours, copy.deepcopy(ours)


def _full_logprobs(model, ids: list[int], temperature: float, adapter: bool = True) -> list[float]:
    """log pi(token t | tokens before t) for t >= 1, by a plain forward pass."""
    with torch.no_grad():
        if adapter:
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        else:
            with model.disable_adapter():
                logits = model(input_ids=torch.tensor([ids])).logits[0]
    logp = (logits[:-1].float() / temperature).log_softmax(-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()


def make_batch(model, temperature: float = 1.0):
    """Samples whose logged logprobs are the model's (at `temperature`), shifted by
    -1.5..+0.7 nats."""
    from overnight.trainer.grpo.data import Turn, merge_turns
    from overnight.trainer.grpo.sampling import SamplingParams

    vocab = model.config.vocab_size
    rng = random.Random(1)
    samples = []
    for g in range(2):
        prompt = [rng.randrange(3, vocab) for _ in range(PROMPT)]
        for k in range(4):
            completion = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 17))]
            logp = _full_logprobs(model, prompt + completion, temperature)[PROMPT - 1 :]
            logged = [lp - rng.uniform(-0.7, 1.5) for lp in logp]
            turn = Turn(prompt, completion, logged, SamplingParams(temperature=temperature))
            (s,) = merge_turns(f"{g}.{k}", f"g{g}", [turn])
            samples.append(replace(s, advantage=rng.choice([-1, 1]) * rng.uniform(0.3, 1.5)))
    return samples


@pytest.fixture(scope="module")
def batch(models):
    return make_batch(models[0])


def _ours(model, samples, loss_config):
    from overnight.trainer.grpo.loss import token_weights
    from overnight.trainer.grpo.step import micro_batch_loss

    model.zero_grad(set_to_none=True)
    weights = token_weights([s.trained_tokens for s in samples], loss_config)
    total, stats = 0.0, []
    for part in (slice(0, 3), slice(3, None)):  # two micro-batches, gradients accumulated
        loss, part_stats, _ = micro_batch_loss(model, samples[part], weights[part], loss_config)
        loss.backward()
        total += loss.item()
        stats.append(part_stats)
    return total, _grads(model), stats


def _trl(model, samples, loss_config, tiny_model_dir, tmp_path, temperature: float = 1.0):
    """TRL's loss on the same batch, with the options of docs/grpo.md's mapping."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from overnight.testing.trl_mapping import grpo_config_options

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        **grpo_config_options(loss_config),
        temperature=temperature,
        use_cpu=True,
        per_device_train_batch_size=len(samples),
        num_generations=4,
        report_to=[],
        logging_steps=1000,
    )
    model = copy.deepcopy(model)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * len(samples)),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop we bypass
    inputs = _trl_inputs(trainer.model, samples, loss_config.kl_coef > 0, temperature)
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.item(), _grads(model)


def _trl_inputs(model, samples, with_ref: bool, temperature: float) -> dict:
    """TRL's batch, with the base model's logprobs over each completion for the KL term."""
    from overnight.testing.trl_mapping import compute_loss_inputs

    ref = None
    if with_ref:
        full = [_full_logprobs(model, s.tokens, temperature, adapter=False) for s in samples]
        ref = [logps[PROMPT - 1 :] for logps in full]
    return compute_loss_inputs(samples, PROMPT, ref)


def _grads(model) -> dict:
    return {
        n: p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }


CASES = [
    (variant, level, kl)
    for variant in ("grpo", "dr_grpo", "dapo")
    for level in ("token", "sequence")
    for kl in (0.0, 0.05)
]


@pytest.mark.parametrize(("variant", "level", "kl_coef"), CASES)
def test_loss_and_lora_gradients_equal_trl(
    models, batch, tiny_model_dir, tmp_path, variant, level, kl_coef
):
    from overnight.trainer.grpo.loss import LossConfig

    config = LossConfig(variant=variant, level=level, kl_coef=kl_coef, max_tokens=64)
    ours_model, trl_model = models
    ours_loss, ours_grads, stats = _ours(ours_model, batch, config)
    trl_loss, trl_grads = _trl(trl_model, batch, config, tiny_model_dir, tmp_path)

    if level == "token":  # the batch exercises the clip and the dual clip
        assert max(s["clipped_fraction"] for s in stats) > 0.1
        assert max(s["dual_clipped_fraction"] for s in stats) > 0
    assert abs(ours_loss - trl_loss) <= TOLERANCE * max(1.0, abs(trl_loss))
    assert ours_grads.keys() == trl_grads.keys()
    assert len(ours_grads) > 0
    scale = max(g.abs().max().item() for g in trl_grads.values())
    for name, g in trl_grads.items():
        worst = (ours_grads[name] - g).abs().max().item()
        assert worst <= TOLERANCE * scale, f"{name}: {worst:.3g} vs largest gradient {scale:.3g}"


def test_without_dual_clip_equals_trl_without_delta(models, batch, tiny_model_dir, tmp_path):
    from overnight.trainer.grpo.loss import LossConfig

    config = LossConfig(variant="dapo", dual_clip=None)
    ours_loss, ours_grads, _ = _ours(models[0], batch, config)
    trl_loss, trl_grads = _trl(models[1], batch, config, tiny_model_dir, tmp_path)
    assert abs(ours_loss - trl_loss) <= TOLERANCE * max(1.0, abs(trl_loss))
    scale = max(g.abs().max().item() for g in trl_grads.values())
    for name, g in trl_grads.items():
        assert (ours_grads[name] - g).abs().max().item() <= TOLERANCE * scale


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_sampling_temperature_equals_trls_temperature(models, tiny_model_dir, tmp_path, level):
    """Records sampled at temperature 0.7: our per-record temperature is TRL's `temperature`
    (TRL has no top-k/top-p in its loss; ours has, tests/test_sampling.py)."""
    from overnight.trainer.grpo.loss import LossConfig

    samples = make_batch(models[0], temperature=0.7)
    config = LossConfig(variant="dapo", level=level, kl_coef=0.05)
    ours_loss, ours_grads, _ = _ours(models[0], samples, config)
    trl_loss, trl_grads = _trl(models[1], samples, config, tiny_model_dir, tmp_path, 0.7)
    assert abs(ours_loss - trl_loss) <= TOLERANCE * max(1.0, abs(trl_loss))
    scale = max(g.abs().max().item() for g in trl_grads.values())
    for name, g in trl_grads.items():
        assert (ours_grads[name] - g).abs().max().item() <= TOLERANCE * scale
