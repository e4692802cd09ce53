"""The vision tower's forward peak, measured against the memory check's estimate.

    python bench/vision_tower_memory.py

A vision-language model's tower runs frozen (no autograd graph) at the start of each
forward pass, over the micro-batch's images. trainer/run/memory.py counts its peak per
image token; this measures it on SmolVLM-256M's tower shape (SigLIP base: hidden 768, 12
layers, 512-pixel tiles of 16-pixel patches, 64 image tokens a tile), random weights,
float32 on the CPU, each size in a fresh process (the peak resident set's rise over the
one-tile warm-up), with eager attention and with SDPA, side by side.
"""

from __future__ import annotations

import subprocess
import sys

SHAPE = {
    "vision_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                      "num_attention_heads": 12, "image_size": 512, "patch_size": 16},
    "text_config": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                    "num_hidden_layers": 2, "num_attention_heads": 9,
                    "num_key_value_heads": 3, "vocab_size": 49280},
    "scale_factor": 4,
    "image_token_id": 49190,
}  # fmt: skip


def config(attention: str):
    from transformers import Idefics3Config

    built = Idefics3Config(**SHAPE)
    built._attn_implementation = attention
    built.vision_config._attn_implementation = attention
    return built


def measure(tiles: int, attention: str) -> None:
    """In this process: print the image tokens made and the peak's rise, in bytes."""
    import os
    import resource

    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(config(attention)).eval()
    model.requires_grad_(False)  # frozen, as a night's tower is: no graph kept
    pixels = torch.randn(1, tiles, 3, 512, 512)
    mask = torch.ones(1, tiles, 512, 512, dtype=torch.bool)
    model.model.get_image_features(pixel_values=pixels[:, :1], pixel_attention_mask=mask[:, :1])
    with open(f"/proc/{os.getpid()}/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    out = model.model.get_image_features(pixel_values=pixels, pixel_attention_mask=mask)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    features = out.pooler_output
    print(features.reshape(-1, features.shape[-1]).shape[0], peak - resident)


def main() -> None:
    if len(sys.argv) == 3:
        measure(int(sys.argv[1]), sys.argv[2])
        return
    from overnight.trainer.run.memory import tower_bytes_per_image_token

    estimated = tower_bytes_per_image_token(config("eager"), 4)
    print(f"the memory check counts {estimated / 2**20:.2f} MiB an image token (float32)")
    for tiles in (4, 8):
        for attention in ("eager", "sdpa"):
            out = subprocess.run([sys.executable, __file__, str(tiles), attention],
                                 capture_output=True, text=True, check=True)  # fmt: skip
            tokens, rise = (int(x) for x in out.stdout.split()[-2:])
            per_token = rise / tokens
            print(f"{tiles} tiles, {attention:5}: {tokens} image tokens, peak +{rise / 2**20:5.0f} "
                  f"MiB = {per_token / 2**20:.2f} MiB an image token; estimate / measured "
                  f"{estimated / per_token:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
