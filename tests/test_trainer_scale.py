"""The trainer at real shapes, each part against the path it replaces (float32, tiny model).

- Logits in chunks (trainer/grpo/head.py): the same logprobs and LoRA gradients as the
  whole (N, V) projection, with and without top-k/top-p/min-p, at several chunk sizes,
  each token with its own parameters; and autograd keeps no tensor as wide as the
  vocabulary.
- Gradient checkpointing: the same gradients, with far less kept for the backward; in
  one process and under torchrun and FSDP (the same adapter as one process without it).
- Attention at length (trainer/grpo/attention.py): long rows forwarded alone (with and
  without a shared prompt's mask), and flex attention's block masks (forward only on a
  CPU), give the masked path's logprobs; an explicit mask is used only where it costs
  less than repeating the prompt.
"""

from __future__ import annotations

import copy
import itertools
import random
import subprocess
from dataclasses import replace
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from overnight.config import TrainConfig
from overnight.trainer.grpo import sampling
from overnight.trainer.grpo.attention import LONG_ROW, row_passes, sharing_pays
from overnight.trainer.grpo.checkpointing import enable_gradient_checkpointing, wants_checkpointing
from overnight.trainer.grpo.data import Turn, merge_turns
from overnight.trainer.grpo.head import chunked_logprobs
from overnight.trainer.grpo.loss import LossConfig, token_weights
from overnight.trainer.grpo.policy import _parts, load_policy, pack, trained_logprobs
from overnight.trainer.grpo.sampling import SamplingParams, processed_logprobs
from overnight.trainer.grpo.step import fresh_adapter, micro_batch_loss

pytestmark = pytest.mark.slow

SAMPLING = {
    "raw": SamplingParams(),
    "tempered": SamplingParams(temperature=0.7),
    "top-k": SamplingParams(temperature=0.9, top_k=40),
    "top-p": SamplingParams(top_p=0.8),
    "min-p and all": SamplingParams(temperature=1.2, top_k=200, top_p=0.9, min_p=0.05),
}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    """The tiny model with a LoRA adapter whose A and B are random and non-zero."""
    config = TrainConfig(lora_rank=8, target_modules=("q_proj", "v_proj", "o_proj", "up_proj"))
    model = fresh_adapter(load_policy(tiny_model_dir, trainable=True), config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def make_samples(
    vocab: int, params: SamplingParams | list[SamplingParams], lengths=(5, 30, 12), groups: int = 2
):
    """Groups of rollouts under one 16-token prompt each, two turns per rollout (the first
    reply is context of the second turn), sampled with `params`; a list: each turn the
    next of them in turn, so neighbouring trained tokens (and a chunk's rows) differ."""
    rng = random.Random(3)
    turn_params = itertools.cycle([params] if isinstance(params, SamplingParams) else params)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(16)]
        for k, n in enumerate(lengths):
            first = [rng.randrange(3, vocab) for _ in range(n)]
            tool = [rng.randrange(3, vocab) for _ in range(7)]
            second = [rng.randrange(3, vocab) for _ in range(n // 2 + 1)]
            turns = [
                Turn(prompt, first, [-3.0] * n, next(turn_params)),
                Turn(prompt + first + tool, second, [-3.0] * len(second), next(turn_params)),
            ]
            (s,) = merge_turns(f"{g}.{k}", f"g{g}", turns)
            samples.append(replace(s, advantage=rng.uniform(-1, 1)))
    return samples


def unchunked(model, batch) -> torch.Tensor:
    """The head as it was: every trained token's (N, V) logits at once, in one forward
    pass, the top-k/top-p filters over all rows at once (not a block of rows at a time)."""
    decoder, head = _parts(model)
    hidden = decoder(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        attention_mask=batch.get("attention_mask"),
        use_cache=False,
    ).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])[batch["predictor_index"]]
    targets = batch["input_ids"].reshape(-1)[batch["trained_index"]]
    params = [batch[k] for k in ("temperature", "top_k", "top_p", "min_p")]
    with mock.patch.object(sampling, "FILTER_ROWS", 10**9):
        return processed_logprobs(head(hidden), targets, *params)


def logprobs_and_grads(model, batch, compute):
    """(logprobs, LoRA gradients of a fixed weighted sum of them)."""
    model.zero_grad(set_to_none=True)
    logp = compute(model, batch)
    weights = torch.linspace(-1, 1, len(logp))
    (logp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads


def assert_same(a, b, tolerance: float = 1e-5) -> None:
    (logp_a, grads_a), (logp_b, grads_b) = a, b
    assert (logp_a - logp_b).abs().max().item() <= tolerance
    assert grads_a.keys() == grads_b.keys() and grads_a
    scale = max(g.abs().max().item() for g in grads_b.values())
    for name, g in grads_b.items():
        assert (grads_a[name] - g).abs().max().item() <= tolerance * scale, name


@pytest.mark.parametrize("chunk", [1, 7, 64, 100_000])
@pytest.mark.parametrize("sampling", SAMPLING)
def test_chunked_logits_give_the_unchunked_logprobs_and_gradients(model, sampling, chunk):
    samples = make_samples(model.config.vocab_size, SAMPLING[sampling])
    batch = pack(samples, share_prompts=True)
    reference = logprobs_and_grads(model, batch, unchunked)
    ours = logprobs_and_grads(model, batch, lambda m, b: trained_logprobs(m, b, chunk))
    assert len(ours[0]) > 100  # several chunks at every size but the last
    assert_same(ours, reference)


@pytest.mark.parametrize("chunk", [1, 7, 64, 100_000])
def test_each_token_keeps_its_own_sampling_parameters_across_chunks(model, chunk):
    """Every turn sampled differently (raw, tempered, top-k, top-p, min-p; a greedy one):
    a chunk or a filter block that took its rows' parameters from the wrong rows would
    differ from the reference, whose rows all go through at once."""
    mixed = [*SAMPLING.values(), SamplingParams(temperature=0.0, top_k=5)]
    samples = make_samples(model.config.vocab_size, mixed, lengths=(5, 30, 12, 40), groups=3)
    batch = pack(samples, share_prompts=True)
    assert len(set(batch["top_k"].tolist())) == 3 and len(set(batch["top_p"].tolist())) == 3
    assert len(batch["trained_index"]) > 2 * sampling.FILTER_ROWS  # several filter blocks
    reference = logprobs_and_grads(model, batch, unchunked)
    ours = logprobs_and_grads(model, batch, lambda m, b: trained_logprobs(m, b, chunk))
    assert_same(ours, reference)
    # The parameters matter here: the raw logprobs of the same tokens are far from these.
    neutral = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    raw = {k: torch.full_like(batch[k], v) for k, v in neutral.items()}
    with torch.no_grad():
        plain = trained_logprobs(model, {**batch, **raw}, chunk)
    assert (plain - ours[0]).abs().max().item() > 0.1


def test_any_other_head_is_chunked_under_checkpoint(model):
    """A head that is not a plain linear layer (an adapted lm_head) runs each chunk under
    torch.utils.checkpoint: the same values and gradients."""
    samples = make_samples(model.config.vocab_size, SAMPLING["min-p and all"])
    batch = pack(samples)
    _, head = _parts(model)
    wrapped = torch.nn.Sequential(head)
    assert type(wrapped) is not torch.nn.Linear

    def through_wrapper(m, b):
        decoder, _ = _parts(m)
        hidden = decoder(
            input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False
        ).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])[b["predictor_index"]]
        targets = b["input_ids"].reshape(-1)[b["trained_index"]]
        params = tuple(b[k] for k in ("temperature", "top_k", "top_p", "min_p"))
        return chunked_logprobs(wrapped, hidden, targets, params, 9)

    assert_same(
        logprobs_and_grads(model, batch, through_wrapper),
        logprobs_and_grads(model, batch, unchunked),
    )


def test_a_trained_head_gets_the_unchunked_gradient_too(model):
    """With the head's weight trained (its gradient sums over tokens with the loss's
    weights), each chunk is recomputed in the backward instead: the same gradients,
    the head's included (tied to the embeddings in the tiny model: both paths add up)."""
    trained_head = copy.deepcopy(model)
    weight = _parts(trained_head)[1].weight
    weight.requires_grad_(True)
    samples = make_samples(model.config.vocab_size, SAMPLING["top-k"])
    batch = pack(samples, share_prompts=True)
    ours = logprobs_and_grads(trained_head, batch, lambda m, b: trained_logprobs(m, b, 13))
    reference = logprobs_and_grads(trained_head, batch, unchunked)
    assert any(g.shape == weight.shape for g in reference[1].values())
    assert_same(ours, reference)


def saved_for_backward(run) -> list[torch.Size]:
    """The shapes of the tensors autograd keeps for the backward while `run()` runs."""
    shapes = []

    def keep(tensor):
        shapes.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        run()
    return shapes


def test_no_tensor_as_wide_as_the_vocabulary_is_kept_for_the_backward(model):
    """Old code: the (N, V) log-softmax of every trained token stayed until the backward."""
    samples = make_samples(model.config.vocab_size, SAMPLING["top-p"])
    batch = pack(samples)
    vocab = model.config.vocab_size
    weight = _parts(model)[1].weight
    shapes = saved_for_backward(lambda: trained_logprobs(model, batch, 16))
    wide = [s for s in shapes if vocab in s and s != weight.shape]
    assert shapes and not wide, wide
    # And the reference does keep them: the check can see them.
    assert any(
        vocab in s and s != weight.shape
        for s in saved_for_backward(lambda: unchunked(model, batch))
    )


def step_gradients(model, samples, share: bool):
    """The trainer's micro-batch loss and its LoRA gradients; bytes kept for the backward."""
    loss_config = LossConfig()
    weights = token_weights([s.trained_tokens for s in samples], loss_config)
    model.zero_grad(set_to_none=True)
    kept = []

    def keep(tensor):
        kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss, stats, _ = micro_batch_loss(model, samples, weights, loss_config, share, 32)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, sum(kept), stats


@pytest.mark.parametrize("share", [True, False])
def test_gradient_checkpointing_gives_the_same_gradients_keeping_less(model, share):
    samples = make_samples(model.config.vocab_size, SAMPLING["top-k"], lengths=(5, 30, 12, 8))
    plain = step_gradients(model, samples, share)
    checkpointed_model = copy.deepcopy(model)
    enable_gradient_checkpointing(checkpointed_model)
    checkpointed = step_gradients(checkpointed_model, samples, share)
    assert plain[3]["prompts_shared"] == checkpointed[3]["prompts_shared"] == float(share)
    assert checkpointed[0] == pytest.approx(plain[0], abs=1e-6)
    assert_same((torch.zeros(1), checkpointed[1]), (torch.zeros(1), plain[1]), 1e-5)
    # Without checkpointing every layer's activations stay; with it, each layer's input.
    print(
        f"kept for the backward: {plain[2] / 2**20:.1f} MiB, checkpointed {checkpointed[2] / 2**20:.1f}"
    )
    assert checkpointed[2] < 0.5 * plain[2], (checkpointed[2], plain[2])


def test_checkpointing_is_on_only_when_asked_auto_waits_for_the_memory_check():
    # `auto` is the memory check's to decide (tests/test_memory_check.py), whatever the size.
    assert wants_checkpointing("on")
    assert not wants_checkpointing("off") and not wants_checkpointing("auto")


def test_long_rows_run_alone_with_the_one_pass_logprobs(model):
    """Rows of LONG_ROW tokens or more are forwarded one at a time, without padding (a row
    of one sequence then needs no mask): the same logprobs as one pass over all rows."""
    rng = random.Random(5)
    vocab = model.config.vocab_size
    samples = []
    for i, n in enumerate((LONG_ROW + 300, LONG_ROW + 40, 200, 150, 90)):
        prompt = [rng.randrange(3, vocab) for _ in range(n // 2)]
        reply = [rng.randrange(3, vocab) for _ in range(n - n // 2)]
        samples.append(merge_turns(f"r{i}", f"g{i}", [Turn(prompt, reply, [-2.0] * len(reply))])[0])
    batch = pack(samples)
    lengths = batch["row_lengths"].tolist()  # first fit: [1324], [1064 + 200], [150 + 90]
    assert lengths == [LONG_ROW + 300, LONG_ROW + 240, 240]
    assert row_passes(lengths, flex=False) == [(0, 1, lengths[0]), (1, 2, lengths[1]), (2, 3, 240)]
    with torch.no_grad():
        ours = trained_logprobs(model, batch)
        one_pass = unchunked(model, batch)  # transformers' (B, L, L) mask from the position ids
    assert (ours - one_pass).abs().max().item() < 1e-5


def long_shared_samples(vocab: int) -> list:
    """A group whose two shorter rollouts share a 900-token prompt in a row of 1250 tokens
    (its longest, 1400, fills a row alone), a short group sharing a 40-token prompt in the
    same row, and two short unshared sequences in a third."""
    rng = random.Random(8)

    def tokens(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    def rollout(name, group, prompt, reply):
        logged = [-2.0] * len(reply)
        return merge_turns(name, group, [Turn(prompt, reply, logged, SAMPLING["top-k"])])[0]

    long_prompt, short_prompt = tokens(900), tokens(40)
    samples = [rollout(f"a{i}", "a", long_prompt, tokens(n)) for i, n in enumerate((500, 200, 150))]
    samples += [rollout(f"b{i}", "b", short_prompt, tokens(n)) for i, n in enumerate((30, 20))]
    samples += [rollout(f"c{i}", f"c{i}", tokens(100), tokens(100)) for i in range(2)]
    return samples


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_long_rows_with_shared_prompts_run_alone_under_their_part_of_the_mask(model, attention):
    """A long row that shares a prompt runs alone under its own rows and columns of the
    explicit mask: the logprobs (and, sdpa, the gradients) of one pass over the whole
    (B, 1, L, L) mask, and those of the prompts repeated."""
    samples = long_shared_samples(model.config.vocab_size)
    batch = pack(samples, share_prompts=True)
    lengths = batch["row_lengths"].tolist()
    assert lengths == [1400, 900 + 200 + 150 + 40 + 30 + 20, 400] and "attention_mask" in batch
    assert row_passes(lengths, flex=False) == [(0, 1, 1400), (1, 2, 1340), (2, 3, 400)]
    ours_model = model
    if attention == "eager":
        ours_model = copy.deepcopy(model)
        ours_model.config._attn_implementation = "eager"
    with torch.no_grad():
        repeated = trained_logprobs(model, pack(samples))
    if attention == "eager":
        with torch.no_grad():
            ours = trained_logprobs(ours_model, batch)
            reference = unchunked(model, batch)
    else:
        ours, grads = logprobs_and_grads(model, batch, trained_logprobs)
        reference, reference_grads = logprobs_and_grads(model, batch, unchunked)
        assert_same((ours, grads), (reference, reference_grads))
    assert (ours - reference).abs().max().item() < 1e-5
    assert (ours - repeated).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def flex_model(tiny_model_dir, model):
    """The same adapted model under flex attention (compiled; on a CPU, forward only)."""
    flex = copy.deepcopy(model)
    flex.config._attn_implementation = "flex_attention"
    assert flex.get_base_model().model.config._attn_implementation == "flex_attention"
    return flex


def test_flex_block_masks_give_the_masked_paths_logprobs(model, flex_model):
    samples = make_samples(model.config.vocab_size, SAMPLING["tempered"], lengths=(5, 30, 12, 8))
    masked = pack(samples, share_prompts=True)  # sdpa: the explicit (B, 1, L, L) mask
    flex = pack(samples, share_prompts=True, attention="flex_attention")
    assert "attention_mask" in masked and "attention_mask" not in flex
    # A group's branches all hang off one copy of its prompt (no row-length bound).
    assert flex["input_ids"].shape[0] == 2 < masked["input_ids"].shape[0]
    with torch.no_grad():
        reference = trained_logprobs(model, masked)
        ours = trained_logprobs(flex_model, flex)
        # Without shared prompts: transformers' block mask from the position ids.
        packed = trained_logprobs(flex_model, pack(samples, 64, attention="flex_attention"))
    assert (ours - reference).abs().max().item() < 1e-5
    assert (packed - reference).abs().max().item() < 1e-5


def test_flex_attention_trains_only_on_cuda(flex_model):
    """torch 2.13 has no flex-attention backward on a CPU: what `--attention
    flex_attention` needs a GPU for."""
    samples = make_samples(flex_model.config.vocab_size, SAMPLING["raw"])
    batch = pack(samples, share_prompts=True, attention="flex_attention")
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        trained_logprobs(flex_model, batch)


QWEN_05B = SimpleNamespace(
    config=SimpleNamespace(
        hidden_size=896,
        num_attention_heads=14,
        head_dim=64,
        num_key_value_heads=2,
        intermediate_size=4864,
    )
)


def test_an_explicit_mask_is_used_where_it_costs_less_than_repeating():
    # Four 1000-token rollouts after a 600-token prompt: one masked row of 2200 tokens
    # saves 1800 tokens of linear layers, more than its square of attention costs.
    assert sharing_pays(QWEN_05B, [(2200, 1, True)], [(1000, 1, False)] * 4)
    # Four 14k-token branches after a 2k prompt would make a masked row of 58k: its
    # square costs far more than the 6k prompt tokens it saves.
    assert not sharing_pays(QWEN_05B, [(58_000, 1, True)], [(16_000, 1, False)] * 4)


def test_the_micro_batch_repeats_prompts_when_sharing_costs_more(model, monkeypatch):
    from overnight.trainer.grpo import step

    samples = make_samples(model.config.vocab_size, SAMPLING["raw"], lengths=(5, 30, 12, 8))
    weights = token_weights([s.trained_tokens for s in samples], LossConfig())
    _, stats, _ = micro_batch_loss(model, samples, weights, LossConfig(), True)
    assert stats["prompts_shared"] == 1.0  # short rows: sharing pays
    monkeypatch.setattr(step, "sharing_pays", lambda *a: False)
    _, stats, _ = micro_batch_loss(model, samples, weights, LossConfig(), True)
    assert stats["prompts_shared"] == 0.0


def test_a_run_with_checkpointing_says_so_and_trains_the_same_adapter(tmp_path, tiny_model_dir):
    from .test_train_ddp import GROUPS, assert_same_adapter, train_command, trained_adapter, write

    adapters, outputs = {}, {}
    for mode in ("off", "on"):
        data = tmp_path / mode
        write(data, GROUPS)
        command = train_command(data, tiny_model_dir) + ["--gradient-checkpointing", mode]
        run = subprocess.run(command, capture_output=True, text=True)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        adapters[mode], outputs[mode] = trained_adapter(data), run.stdout
    assert "gradient checkpointing on" in outputs["on"]
    assert "gradient checkpointing off" in outputs["off"]
    assert "shared prompts once per row under an explicit mask" in outputs["on"]
    assert_same_adapter(adapters["off"], adapters["on"], "checkpointed")
