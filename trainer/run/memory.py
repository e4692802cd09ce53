"""Will the night fit? The peak memory of training, estimated before anything is loaded.

A night that runs out of memory an hour in has thrown the day's traffic away; one that
is told at once what does not fit can be fixed. From the model's config alone (no
weights read) the estimate adds:

  weights           every base parameter, in the training dtype
  LoRA + optimizer  the adapter's parameters in float32, with their gradients and
                    AdamW's two moments (4 copies)
  activations       per token of a micro-batch and per layer: what the backward keeps
                    (about 16 hidden + 2 intermediate values; one hidden value with
                    gradient checkpointing, plus one layer's whole)
  vision tower      a vision-language model's tower and connector, in the training
                    dtype (counted on the meta device); they are frozen, so their
                    forward keeps no activations for the backward. Its forward has a
                    peak of its own, before the language model's (so the larger of the
                    two counts, not their sum). It runs over one sequence's images at a
                    time (trainer/grpo/images.py), so the sequence with the most image
                    tokens sets it: per image token, the scale factor squared patches,
                    each one layer's hidden, MLP and attention-score values (eager
                    attention's; SDPA's is about half). Measured on SmolVLM-256M's tower
                    shape in float32 (8 tiles, 512 image tokens): 2.0-2.2 MiB an image
                    token eager, 1.0 with SDPA; this counts 2.1
                    (bench/vision_tower_memory.py)
  logits            per trained token of a chunk (--logit-chunk-tokens): the
                    vocabulary's logits in float32 1.7 times over (trainer/grpo/head.py
                    keeps one float32 (chunk, V) tensor, beside a bfloat16 projection
                    and the top-k/top-p mask), and the top-k/top-p filters' block of
                    rows (its sort) once; measured at 151,936 tokens (`bench/
                    trainer_scale.py --head`, BENCHMARKS.md): 0.99 MB per chunk token
                    and 0.47 GB besides in bfloat16, 0.77 MB and 0.50 GB in float32

and compares it with what the device has free (`torch.cuda.mem_get_info` on a GPU,
MemAvailable on a CPU), leaving a tenth spare. The gate samples afterwards with a model
of its own, the training one released, so its copy is a peak of its own, not added.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from overnight.config import TrainConfig
from overnight.errors import OvernightError
from overnight.trainer.grpo.images import is_vision_config, tower_parameters
from overnight.trainer.grpo.sampling import FILTER_ROWS

GIB = 1024**3
SPARE = 0.10  # of the free memory: allocator fragmentation, CUDA context, the unforeseen
# Float32 copies of a chunk token's logits held at once, measured by `bench/
# trainer_scale.py --head` at a 151,936-token vocabulary (BENCHMARKS.md, issue 23):
# 1.00 in float32 (1.33 with top-k/top-p: their mask), 1.50 in bfloat16 (the projection
# beside its float32 copy; 1.70 with top-k/top-p). The largest, whatever the dtype. (The
# unchunked head of before measured 4: logits, processing, log-softmax, backward.)
LOGIT_COPIES = 1.7
# Bytes per row of a top-k/top-p filter block and entry of the vocabulary (its sort:
# values, indices, softmax, cumulative sum): measured 0.47-0.50 GB besides the chunk's
# copies at 151,936 entries and FILTER_ROWS rows, 26-27 bytes.
FILTER_BYTES = 27


class WontFit(OvernightError):
    code = "wont_fit"


@dataclass(frozen=True)
class Estimate:
    weights: int
    lora: int
    activations: int
    logits: int
    checkpointing: bool = False  # the activations above are with gradient checkpointing
    # A vision tower's forward over a micro-batch's images: before the language model's
    # activations and logits exist, so the larger of the two is the peak.
    tower_forward: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.lora + max(self.activations + self.logits, self.tower_forward)

    def parts(self) -> str:
        tower = (f", the vision tower's forward {self.tower_forward / GIB:.1f} GiB (before the "
                 "activations, not beside them)" if self.tower_forward else "")  # fmt: skip
        return (f"weights {self.weights / GIB:.1f} GiB, LoRA and optimizer {self.lora / GIB:.2f} "
                f"GiB, activations {self.activations / GIB:.1f} GiB, logits "
                f"{self.logits / GIB:.1f} GiB{tower}")  # fmt: skip


def estimate(model_config, config: TrainConfig, bytes_per_value: int, shards: int = 1,
             longest: int = 0, checkpointing: bool | None = None,
             tower: int | None = None, image_tokens: int = 0,
             image_share: float = 0.0) -> Estimate:  # fmt: skip
    """The training peak for a transformers config of a decoder (Qwen2, Llama, Mistral);
    with FSDP the weights are split over `shards` devices. A sequence longer than a
    micro-batch (`longest` tokens) is forwarded alone, so the larger of the two counts.
    `checkpointing` overrides what --gradient-checkpointing would choose. A
    vision-language model's language model is its text config's, its tower counted apart
    (`tower`: its parameters, where already counted); `image_tokens`: the most image
    tokens of one sequence (the tower's forward takes one sequence's images at a time);
    `image_share`: the largest share of image tokens in a sequence (with the tower
    adapted, a micro-batch's every image keeps its tower's values for the backward)."""
    tower_forward = tower_kept = 0
    if is_vision_config(model_config):
        tower = tower_parameters(model_config) if tower is None else tower
        per_image_token = tower_bytes_per_image_token(model_config, bytes_per_value)
        tower_forward = int(image_tokens * per_image_token)
        if config.lora_vision_tower:  # adapted: every layer's values kept for the backward
            layers = getattr(model_config.vision_config, "num_hidden_layers", 1)
            in_batch = max(config.micro_batch_tokens, longest) * image_share
            tower_kept = int(in_batch * per_image_token * layers)
        model_config = model_config.get_text_config()
    tower = tower or 0
    h, layers = model_config.hidden_size, model_config.num_hidden_layers
    inter = getattr(model_config, "intermediate_size", 4 * h)
    vocab = model_config.vocab_size
    heads = model_config.num_attention_heads
    kv = getattr(model_config, "num_key_value_heads", heads) or heads
    head_dim = getattr(model_config, "head_dim", None) or h // heads
    shapes = {  # (in, out) of each linear layer a LoRA may target, per decoder layer
        "q_proj": (h, heads * head_dim),
        "k_proj": (h, kv * head_dim),
        "v_proj": (h, kv * head_dim),
        "o_proj": (heads * head_dim, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    per_layer = sum(i * o for i, o in shapes.values()) + 2 * h
    embeddings = vocab * h * (1 if getattr(model_config, "tie_word_embeddings", False) else 2)
    weights = (layers * per_layer + embeddings + h + tower) * bytes_per_value / shards
    adapted = [shapes[m] for m in config.target_modules if m in shapes]
    lora = layers * sum(config.lora_rank * (i + o) for i, o in adapted) * 4 * 4
    tokens = max(config.micro_batch_tokens, longest)
    # auto counts as off here: check_fits turns it on where the night needs it.
    checkpointed = config.gradient_checkpointing == "on" if checkpointing is None else checkpointing
    per_token = h if checkpointed else 16 * h + 2 * inter
    activations = tokens * (layers * per_token + (16 * h + 2 * inter)) * bytes_per_value
    activations += tower_kept
    chunk = min(config.logit_chunk_tokens, tokens)
    logits = chunk * vocab * 4 * LOGIT_COPIES + min(FILTER_ROWS, chunk) * vocab * FILTER_BYTES
    return Estimate(
        int(weights), int(lora), int(activations), int(logits), checkpointed, tower_forward
    )


def tower_bytes_per_image_token(model_config, bytes_per_value: int) -> float:
    """A vision tower's forward peak per image token it makes: its patches (the
    connector merges scale_factor^2 of them into one token; Qwen2-VL's spatial merge
    likewise), each one layer's residual, normed, q, k, v and output values, its MLP's
    intermediate twice, and a row of eager attention scores before and after softmax
    over the patches of its tile (frozen, no grad: one layer alive at a time)."""
    vision = model_config.vision_config
    vh = vision.hidden_size
    vi = getattr(vision, "intermediate_size", 4 * vh)
    heads = getattr(vision, "num_attention_heads", 1)
    merge = getattr(model_config, "scale_factor", None) or getattr(vision, "spatial_merge_size", 1)
    side, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    per_tile = (side // patch) ** 2 if side and patch else 0
    return merge**2 * (4 * vh + 2 * vi + 2 * heads * per_tile) * bytes_per_value


def image_tokens_of(model_config, sequences) -> dict:
    """`estimate`'s image arguments for `sequences` (token id lists): the most image
    tokens in one, and the largest share of them in one (a micro-batch packs whole
    sequences, so none has more); none for a text model."""
    from overnight.trainer.grpo.images import image_token_id

    token = image_token_id(model_config) if is_vision_config(model_config) else None
    counts = [(s.count(token), len(s)) for s in sequences if s] if token is not None else []
    return {
        "image_tokens": max((n for n, _ in counts), default=0),
        "image_share": max((n / length for n, length in counts), default=0.0),
    }


def free_memory(device: str) -> int:
    """Bytes the device can still give: the GPU's free memory, or MemAvailable."""
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(base_model: str, config: TrainConfig, device: str, bytes_per_value: int,
               say=print, free: int | None = None, shards: int = 1,
               longest: int = 0, sequences=()) -> Estimate:  # fmt: skip
    """Refuse, before loading anything, a night whose peak cannot fit; say the figures.

    Under `--gradient-checkpointing auto`, a night that fits only with checkpointing gets
    it (the returned estimate says so): a third more compute beats a night refused.
    `sequences`: the night's token ids (the longest of them, and a vision model's image
    tokens among them, count); `longest`: a sequence length to count where none are given."""
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(base_model)
    longest = max(longest, max(map(len, sequences), default=0))
    # Counted once (a model built on the meta device), for both estimates below.
    tower = tower_parameters(model_config) if is_vision_config(model_config) else None
    images = {"tower": tower, **image_tokens_of(model_config, sequences)}
    need = estimate(model_config, config, bytes_per_value, shards, longest, **images)
    free = free_memory(device) if free is None else free
    usable = int(free * (1 - SPARE))
    if config.gradient_checkpointing == "auto":
        with_it = estimate(model_config, config, bytes_per_value, shards, longest, True, **images)
        if need.total <= usable:
            say(f"memory: the night fits without gradient checkpointing (about "
                f"{need.total / GIB:.1f} GiB of {usable / GIB:.1f} GiB usable): it stays off, "
                "which saves a third of the compute")  # fmt: skip
        elif with_it.total <= usable:
            say(f"memory: without gradient checkpointing about {need.total / GIB:.1f} GiB, "
                f"more than the {usable / GIB:.1f} GiB usable: checkpointing turned on")  # fmt: skip
            need = with_it
    say(f"memory: about {need.total / GIB:.1f} GiB needed on {device} ({need.parts()}), "
        f"{free / GIB:.1f} GiB free")  # fmt: skip
    if need.total > usable:
        tokens = config.micro_batch_tokens
        smaller = max(16, 2 ** int(math.log2(max(tokens * usable / need.total, 16))))
        alone = (f" The longest sequence, {longest} tokens, is forwarded alone whatever "
                 "--micro-batch-tokens: its activations count in full."
                 if longest > tokens else "")  # fmt: skip
        raise WontFit(
            f"the night needs about {need.total / GIB:.1f} GiB on {device} ({need.parts()}) "
            f"and {free / GIB:.1f} GiB is free ({usable / GIB:.1f} usable): it stops before "
            f"loading anything. Lower --micro-batch-tokens (now {tokens}; the activations and "
            f"logits scale with it, try {smaller}), --logit-chunk-tokens, turn --gradient-checkpointing on, colocate "
            "with the vLLM that holds the GPU (--colocate on: it sleeps while the night trains), "
            "or shard the model over several GPUs (torchrun with --fsdp)." + alone,
            status=507,
        )
    return need
