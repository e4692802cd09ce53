"""The memory check before a night loads its model: the estimate's parts, a refusal that
names the numbers and what to change, and a pass on the tiny model."""

from __future__ import annotations

import pytest

from overnight.config import TrainConfig
from overnight.trainer.run import memory
from overnight.trainer.run.memory import GIB, WontFit, check_fits, estimate

# Qwen2.5-0.5B's shapes (config only: nothing is built).
QWEN_05B = dict(vocab_size=151_936, hidden_size=896, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                tie_word_embeddings=True)  # fmt: skip


def qwen_config(**shape):
    from transformers import Qwen2Config

    return Qwen2Config(**{**QWEN_05B, **shape})


def test_the_estimate_counts_weights_lora_activations_and_logits():
    # Logits unchunked (one chunk of the whole micro-batch), as measured.
    config = TrainConfig(micro_batch_tokens=4096, lora_rank=16, logit_chunk_tokens=4096)
    need = estimate(qwen_config(), config, bytes_per_value=4)
    # 0.49 B parameters (tied embeddings), float32.
    assert need.weights / 4 == pytest.approx(494e6, rel=0.02)
    # Logits: 1.7 float32 copies per chunk token, and the top-k/top-p filters' block.
    fixed = memory.FILTER_ROWS * 151_936 * memory.FILTER_BYTES
    assert need.logits == pytest.approx(4096 * 151_936 * 4 * 1.7 + fixed)
    assert 0 < need.lora < 0.2 * GIB and need.activations > 0  # 8.8 M LoRA parameters x 16 B
    bf16 = estimate(qwen_config(), config, bytes_per_value=2)
    assert bf16.weights == need.weights // 2 and bf16.logits == need.logits  # float32 logits
    halved = estimate(qwen_config(), TrainConfig(micro_batch_tokens=2048, lora_rank=16), 4)
    assert halved.activations < need.activations
    # Chunked (the default 1,024 trained tokens at a time): a quarter, whatever the batch.
    assert halved.logits - fixed == pytest.approx((need.logits - fixed) / 4)
    # Measured (bench/trainer_scale.py --head, BENCHMARKS.md): 1,480 MiB for a chunk of
    # 1,024 in bfloat16 with top-k/top-p, the most of the four ways (float32 raw: 615).
    assert halved.logits == pytest.approx(1480 * 2**20, rel=0.05)
    assert halved.logits >= 1480 * 2**20
    assert estimate(qwen_config(), TrainConfig(micro_batch_tokens=16384), 4).logits == halved.logits
    # Checkpointing keeps a fraction of the activations; `auto` is estimated as off (the
    # memory check turns it on where the night needs it).
    on = TrainConfig(micro_batch_tokens=2048, lora_rank=16, gradient_checkpointing="on")
    assert halved.activations > 4 * estimate(qwen_config(), on, 4).activations
    assert not halved.checkpointing
    sharded = estimate(qwen_config(), config, bytes_per_value=4, shards=4)
    assert sharded.weights == pytest.approx(need.weights / 4)


def test_a_night_that_cannot_fit_stops_before_loading_and_says_what_to_change(
    tiny_model_dir, monkeypatch
):
    loaded = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: loaded.append(a))  # fmt: skip
    said: list[str] = []
    config = TrainConfig(micro_batch_tokens=8192)
    with pytest.raises(WontFit) as refused:
        check_fits(str(tiny_model_dir), config, "cuda:0", 2, said.append, free=64 * 2**20)
    message = str(refused.value)
    assert "needs about" in message and "0.1 GiB is free" in message
    for option in ("--micro-batch-tokens (now 8192", "--gradient-checkpointing", "--colocate on",
                   "--fsdp"):  # fmt: skip
        assert option in message, message
    assert loaded == [], "nothing was loaded"
    assert said[0].startswith("memory: about") and "cuda:0" in said[0]


def test_the_tiny_model_fits_on_this_machine(tiny_model_dir):
    said: list[str] = []
    need = check_fits(str(tiny_model_dir), TrainConfig(), "cpu", 4, said.append)
    assert need.total < memory.free_memory("cpu") and "GiB free" in said[-1]
    assert "fits without gradient checkpointing" in said[0] and not need.checkpointing


def test_a_sequence_longer_than_a_micro_batch_counts_in_full():
    """Such a sequence is forwarded alone (trainer/grpo/attention.py): the estimate takes
    its length, not --micro-batch-tokens, and the refusal says so."""
    config = TrainConfig(micro_batch_tokens=2048)
    short = estimate(qwen_config(), config, 4)
    long = estimate(qwen_config(), config, 4, longest=16384)
    assert long.activations == pytest.approx(8 * short.activations)
    assert estimate(qwen_config(), config, 4, longest=1000) == short


def test_the_refusal_names_a_sequence_longer_than_a_micro_batch(tiny_model_dir):
    config = TrainConfig(micro_batch_tokens=256)
    with pytest.raises(WontFit) as refused:
        check_fits(str(tiny_model_dir), config, "cpu", 4, lambda _: None, free=2**20,
                   longest=9000)  # fmt: skip
    assert "The longest sequence, 9000 tokens, is forwarded alone" in str(refused.value)


def test_auto_turns_checkpointing_on_when_only_that_fits(tiny_model_dir):
    """`--gradient-checkpointing auto`, whatever the model's size: off while the night
    fits without it, on when only that fits, a refusal when nothing does; the night's
    log says which and why."""
    from transformers import AutoConfig

    config = TrainConfig(micro_batch_tokens=8192)
    shape = AutoConfig.from_pretrained(str(tiny_model_dir))
    without = estimate(shape, config, 4)
    with_it = estimate(shape, config, 4, checkpointing=True)
    assert not without.checkpointing and with_it.checkpointing
    assert with_it.total < without.total
    between = int((with_it.total + without.total) / 2 / (1 - memory.SPARE))
    said: list[str] = []
    need = check_fits(str(tiny_model_dir), config, "cpu", 4, said.append, free=between)
    assert need == with_it and "checkpointing turned on" in said[0]
    said.clear()
    roomy = check_fits(str(tiny_model_dir), config, "cpu", 4, said.append, free=2**40)
    assert roomy == without  # fits as it is: no recompute paid for nothing
    assert "it stays off" in said[0], said
    off = TrainConfig(micro_batch_tokens=8192, gradient_checkpointing="off")
    with pytest.raises(WontFit):  # the operator said off: refused, not overridden
        check_fits(str(tiny_model_dir), off, "cpu", 4, lambda _: None, free=between)
    with pytest.raises(WontFit):
        check_fits(str(tiny_model_dir), config, "cpu", 4, lambda _: None,
                   free=int(with_it.total * 0.9))  # fmt: skip


def test_a_vision_tower_s_forward_is_counted_per_image_token_before_the_activations():
    """SmolVLM-256M's shape: the tower's parameters are weights; its forward over one
    sequence's images (trainer/grpo/images.py runs it a sequence at a time) is a peak of
    its own, before the language model's activations (so the larger counts), per image
    token: measured 1.96-2.24 MiB in float32 with eager attention
    (bench/vision_tower_memory.py)."""
    from transformers import Idefics3Config

    from overnight.trainer.run.memory import image_tokens_of

    vision = Idefics3Config(
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                           num_attention_heads=12, image_size=512, patch_size=16),
        text_config=dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49280, tie_word_embeddings=True),
        scale_factor=4, image_token_id=49190,
    )  # fmt: skip
    config = TrainConfig(micro_batch_tokens=4096)
    text_only = estimate(vision, config, 4)
    assert text_only.tower_forward == 0  # no image token in the night
    # The tower and connector: SigLIP base's 86 M and a 12,288 x 576 projection.
    tower = (text_only.weights - estimate(vision.get_text_config(), config, 4).weights) / 4
    assert tower == pytest.approx(86e6 + 12_288 * 576, rel=0.02)
    token = vision.image_token_id
    found = image_tokens_of(vision, [[1, token, token, 2], [token, token, token] + [3] * 9])
    assert found == {"image_tokens": 3, "image_share": 0.5}
    assert image_tokens_of(qwen_config(), [[1, 2]])["image_tokens"] == 0  # a text model
    # One screenshot of 13 tiles: 832 image tokens, 16 patches each; per patch one
    # layer's 4 hidden (768) and 2 MLP (3,072) values and 2 x 12 heads' score rows over a
    # tile's 1,024 patches, in float32: 1.8 GB, beside 1.5 GB of activations and logits.
    shown = estimate(vision, config, 4, image_tokens=832)
    assert shown.tower_forward == 832 * 16 * (4 * 768 + 2 * 3072 + 2 * 12 * 1024) * 4
    assert shown.weights == text_only.weights and shown.activations == text_only.activations
    assert shown.total == text_only.total  # not beside the activations: below them here
    # Four such screenshots in one sequence: the tower's forward is the peak.
    four = estimate(vision, config, 4, image_tokens=4 * 832)
    assert four.tower_forward > four.activations + four.logits
    assert four.total == four.weights + four.lora + four.tower_forward
    assert "vision tower's forward" in four.parts()
    # --lora-vision-tower: the tower is adapted, so each image of a micro-batch keeps its
    # 12 layers' values for the backward: a half-image micro-batch of 4,096 tokens.
    adapted = TrainConfig(micro_batch_tokens=4096, lora_vision_tower=True)
    trained = estimate(vision, adapted, 4, image_tokens=832, image_share=0.5)
    per_image_token = 16 * (4 * 768 + 2 * 3072 + 2 * 12 * 1024) * 4
    assert trained.activations - shown.activations == 2048 * per_image_token * 12
