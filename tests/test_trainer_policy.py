"""The policy's logprobs: packed like unpacked, and equal to what vLLM sampled with."""

from __future__ import annotations

import pytest
import torch

from overnight.storage import open_db
from overnight.trainer.grpo.data import Sample, Turn, merge_turns
from overnight.trainer.grpo.logged_turns import load_samples
from overnight.trainer.grpo.policy import load_policy, pack, trained_logprobs

from .helpers import wait_for_rows

pytestmark = pytest.mark.slow


def sample(prompt: list[int], completion: list[int], group: str = "g") -> Sample:
    (s,) = merge_turns("r", group, [Turn(prompt, completion, [0.0] * len(completion))])
    return s


@pytest.mark.parametrize("row_tokens", [0, 64])  # a row per long sample / everything in one row
def test_packing_is_exact(tiny_model_dir, row_tokens):
    model = load_policy(tiny_model_dir)
    samples = [
        sample([1, 5, 9, 30], [40, 41, 42]),
        sample([2, 7], [50]),
        sample([3, 3, 3, 3, 3], [60, 61]),
    ]
    batch = pack(samples, row_tokens)
    assert batch["input_ids"].shape == ((3, 7) if row_tokens == 0 else (1, 17))
    assert batch["sequence_index"].tolist() == [0, 0, 0, 1, 2, 2]  # sample order, whatever the rows
    with torch.no_grad():
        packed = trained_logprobs(model, batch)
        alone = torch.cat([trained_logprobs(model, pack([s])) for s in samples])
        # And against the plain full-logits forward of each sequence.
        full = []
        for s in samples:
            logits = model(torch.tensor([s.tokens])).logits[0]
            logp = torch.log_softmax(logits.float(), -1)
            full += [logp[j - 1, s.tokens[j]].item() for j, t in enumerate(s.trained) if t]
    assert packed.shape == (6,)
    assert torch.allclose(packed, alone, atol=1e-5)
    assert packed.tolist() == pytest.approx(full, abs=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompts_give_each_rollout_its_own_logprobs(tiny_model_dir, attention):
    model = load_policy(tiny_model_dir)
    model.config._attn_implementation = attention
    prompt = list(range(10, 30))  # 20 tokens every rollout of group "a" starts with
    samples = [
        # All three sampled 50 first: a trained token inside the shared part, trained
        # once per rollout (with each one's own advantage), computed once.
        sample(prompt, [50, 41, 42]),
        sample(prompt, [50, 51]),
        sample(prompt + [50], [52, 53, 54]),
        sample(prompt[:5], [60, 61], group="b"),  # alone in its group: nothing to share
        sample([7] * 12, [70], group="c"),
        sample([7] * 12, [71, 72], group="c"),
    ]
    samples[2].trained[len(prompt)] = True  # sampled in an earlier turn
    samples[2].behaviour_logprobs[len(prompt)] = -1.0
    shared = pack(samples, row_tokens=64, share_prompts=True)
    plain = pack(samples, row_tokens=64)
    assert "attention_mask" in shared and "attention_mask" not in plain
    # Group a: 21 shared tokens (its prompt plus the common 50) once instead of three times.
    assert shared["input_ids"][0, :21].tolist() == prompt + [50]
    assert shared["input_ids"].numel() < plain["input_ids"].numel()
    assert shared["sequence_index"].tolist() == plain["sequence_index"].tolist()
    with torch.no_grad():
        ours = trained_logprobs(model, shared)
        reference = trained_logprobs(model, plain)
    assert ours.shape == reference.shape == (14,)
    assert torch.allclose(ours, reference, atol=1e-5), (ours - reference).abs().max()


def test_flash_attention_gets_one_row_without_a_mask(tiny_model_dir):
    """Under flash attention's variable-length kernel a micro-batch is one row with no mask,
    shared prompts repeated, each sequence's positions from 0 (what transformers reads the
    sequences' bounds from). The kernel needs CUDA, so the layout itself is checked here:
    run under sdpa, which reads the same position ids, it gives today's logprobs."""
    prompt = list(range(10, 30))
    samples = [sample(prompt, [50, 41, 42]), sample(prompt, [50, 51]), sample([7] * 5, [70], "b")]
    batch = pack(samples, share_prompts=True, attention="flash_attention_2")
    assert batch["input_ids"].shape == (1, 23 + 22 + 6)
    assert "attention_mask" not in batch and "block" not in batch
    starts = (batch["position_ids"][0] == 0).nonzero().squeeze(1).tolist()
    assert starts == [0, 23, 45]
    model = load_policy(tiny_model_dir)
    with torch.no_grad():
        one_row = trained_logprobs(model, batch)
        today = trained_logprobs(model, pack(samples, share_prompts=True))
    assert torch.allclose(one_row, today, atol=1e-5), (one_row - today).abs().max()


def test_flash_attention_without_its_kernel_is_a_clear_error(tiny_model_dir):
    from overnight.errors import ConfigError

    with pytest.raises(ConfigError, match="flash_attention_2 cannot be used here.*flash-attn"):
        load_policy(tiny_model_dir, attention="flash_attention_2")


def test_shared_prompts_keep_rows_no_longer_than_the_longest_rollout():
    prompt = list(range(3, 23))
    samples = [sample(prompt, list(range(100, 100 + n))) for n in (30, 10, 10, 5)]
    batch = pack(samples, share_prompts=True)
    # The longest rollout is 50 tokens: it fills a row by itself; the other three share
    # one copy of the prompt in the second row (20 + 10 + 10 + 5). Unshared: 4 rows.
    assert batch["input_ids"].shape == (2, 50)
    assert batch["input_ids"][1, :20].tolist() == prompt
    assert pack(samples)["input_ids"].shape == (4, 50)
    assert batch["trained_index"].numel() == 55


@pytest.mark.vllm
async def test_logprobs_match_what_vllm_sampled_with(
    vllm_server, lora_adapter, tiny_model_dir, make_proxy, tmp_path
):
    proxy = await make_proxy(upstream=vllm_server.url)
    body = {
        "model": "policy",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 3,
        "n": 2,
        "messages": [
            {"role": "system", "content": "You answer."},
            {"role": "user", "content": "Say hi"},
        ],
    }
    r = await proxy.post("/v1/chat/completions", json=body, headers={"X-Rollout-Group": "base"})
    assert r.status == 200
    await proxy.post("/admin/adapters/promote", json={"path": str(lora_adapter)})
    r = await proxy.post("/v1/chat/completions", json=body, headers={"X-Rollout-Group": "tuned"})
    assert r.status == 200
    await wait_for_rows(tmp_path / "data", 4)
    con = open_db(tmp_path / "data")
    gaps = {}
    for group, adapter in (("base", None), ("tuned", lora_adapter)):
        loaded = load_samples(con, [group])
        assert len(loaded.samples) == 2 and not loaded.skipped
        model = load_policy(tiny_model_dir, adapter)
        batch = pack(loaded.samples)
        with torch.no_grad():
            ours = trained_logprobs(model, batch)
        gaps[group] = (ours - batch["behaviour_logprobs"]).abs().max().item()
    print(f"largest logprob gap vs vLLM: {gaps}")
    # Measured here: 1.4e-6 (base) and 2.4e-6 (adapter) in float32.
    assert gaps["base"] < 1e-4 and gaps["tuned"] < 1e-4, gaps
