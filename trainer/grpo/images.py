"""Images in a trained sequence: the vision tower's features where vLLM put image tokens.

vLLM logs a prompt's token ids with each image already expanded to its placeholder
tokens (SmolVLM's `<image>` x 64 per tile, say), and feeds the vision tower's features
at those places. The trainer does the same: a sample that saw images carries its
images' hashes and how to make the processor's tensors for them (`VisionInputs`, built
and checked against the logged ids by trainer/choose/images.py); the embeddings of a
packed batch are the token embeddings with each image token's place taken, in order,
by the next row of the images' features
(what transformers' own vision-language models do inside `forward`, done here so that
packing, prompt sharing and row passes stay the trainer's).

The vision tower and the connector are not trained by default (LoRA targets the
language model: `language_model_targets`), so their features carry no gradient; with
--lora-vision-tower they are adapted too, and the features carry it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class VisionInputs:
    """A sequence's images: each one's sha256, in order, and how to get them as the
    model's processor prepares them (pixel values and what goes with them, each model
    its own) when a forward pass needs them. The pixels are made again each time, never
    held for the night: a screenshot's tiles are tens of MB in float32 (SmolVLM's)."""

    digests: tuple[str, ...]
    load: Callable[[], dict[str, torch.Tensor]] = field(repr=False)

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.load()

    def held(self) -> VisionInputs:
        """These images with their tensors made once, for every pass of one micro-batch
        (the policy's and, with --kl-coef, the reference's)."""
        tensors = self.load()
        return VisionInputs(self.digests, lambda: tensors)

    def extends(self, earlier: VisionInputs | None) -> bool:
        """Whether these images begin with `earlier`'s (the same conversation, later)."""
        before = earlier.digests if earlier is not None else ()
        return self.digests[: len(before)] == before


@dataclass(frozen=True)
class Rendering:
    """A conversation for a processor's chat template (trainer/choose/images.py): its
    messages (images as store references), tools, and whether the generation prompt
    follows."""

    messages: list
    tools: list | None = None
    add_generation_prompt: bool = True


def is_vision_config(config) -> bool:
    """A vision-language model's config (transformers keeps its tower's under vision_config)."""
    return getattr(config, "vision_config", None) is not None


def uses_multimodal_positions(config) -> bool:
    """Whether a vision-language model places its tokens with multimodal (3-D) rotary
    positions, M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, ...): its transformers
    module then computes them (`get_rope_index`), where others take plain positions."""
    import sys

    from transformers import AutoModelForImageTextToText

    try:
        model_class = AutoModelForImageTextToText._model_mapping[type(config)]
    except KeyError:
        return False
    module = sys.modules[model_class.__module__]
    return any(
        isinstance(value, type) and hasattr(value, "get_rope_index")
        for value in vars(module).values()
    )


def image_token_id(config) -> int | None:
    """The placeholder token of an image (the names differ between model families)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def language_model_targets(model, targets: list[str], tower: bool = False) -> list[str] | str:
    """LoRA's target modules on a vision-language model: `targets` in the language model
    only, as one regular expression (peft full-matches it against module names), since
    the vision tower has projections of the same names (q_proj, ...) and vLLM serves an
    adapter on the language model unless started with --enable-tower-connector-lora.
    With `tower`, also every linear layer of the vision tower and the connector (what
    vLLM adapts there when so started). A text model's targets are returned as they are."""
    if not is_vision_config(getattr(model, "config", None)):
        return targets
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    names = "|".join(re.escape(t) for t in targets)
    pattern = rf"{re.escape(prefix)}\..*\b({names})"
    if tower:
        pattern += "".join(f"|{re.escape(name)}" for name in tower_linears(model))
    return pattern


def _outside_language_model(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of each module that is not the language model's nor its output
    layer's: the vision tower's and the connector's, and the containers that hold them."""
    parts = (model.get_decoder(), model.get_output_embeddings())
    text = {id(m) for part in parts for m in part.modules()}
    return [(name, m) for name, m in model.named_modules() if id(m) not in text]


def tower_linears(model) -> list[str]:
    """The names of the vision tower's and the connector's linear layers."""
    return [n for n, m in _outside_language_model(model) if isinstance(m, torch.nn.Linear)]


def tower_parameters(config) -> int:
    """Parameters of a vision-language model outside its language model (the vision
    tower and the connector), counted on the meta device: no weights read or allocated."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    # Each parameter counted at the module that holds it (a tied one is the text's).
    outside = _outside_language_model(model)
    return sum(p.numel() for _, m in outside for p in m.parameters(recurse=False))


def image_embeddings(
    decoder, ids: torch.Tensor, images: list[VisionInputs], sampled: torch.Tensor | None = None
):
    """`with_image_features`, or None where there is nothing to put in (a text model, or
    no image placeholder and no image). Placeholders with no images is an error: training
    on their own embeddings would teach the model on pictures it never got.

    `sampled`: the flat positions of tokens the model sampled (the batch's trained
    tokens). A model can sample the image token itself (a random one does); vLLM feeds
    it back as text, never as a picture, so only the prompt's are placeholders."""
    config = decoder.config
    token = image_token_id(config) if is_vision_config(config) else None
    places = None if token is None else ids == token
    if places is not None and sampled is not None and bool(places.any()):
        places.view(-1)[sampled] = False
    if not images and (places is None or not bool(places.any())):
        return None
    if not images:
        raise ValueError("image tokens in the batch but no images for them")
    return with_image_features(decoder, ids, images, places)


def with_image_features(
    decoder, ids: torch.Tensor, images: list[VisionInputs], places: torch.Tensor | None = None
):
    """The input embeddings of `ids` (B, L) with every image placeholder's embedding
    (`places`, else every image token) replaced by the images' features, in order
    (`images`: those of the samples as laid out in the rows, row by row). A count that
    differs is a ValueError, never a silent shift."""
    embeds = decoder.get_input_embeddings()(ids)
    if places is None:
        places = ids == image_token_id(decoder.config)
    features = torch.cat([image_features(decoder, v, embeds.device) for v in images])
    if int(places.sum()) != features.shape[0]:
        raise ValueError(
            f"{int(places.sum())} image tokens in the batch but {features.shape[0]} image "
            "feature rows: the images do not match the token ids"
        )
    return embeds.masked_scatter(places.unsqueeze(-1), features.to(embeds.dtype))


def image_features(decoder, vision: VisionInputs, device) -> torch.Tensor:
    """(tokens, hidden): the features of one sample's images, one row per image token."""
    tensors = {k: v.to(device) for k, v in vision.tensors().items()}
    out = decoder.get_image_features(**tensors, return_dict=True).pooler_output
    if isinstance(out, list | tuple):  # some models give one tensor per image
        out = torch.cat([o.reshape(-1, o.shape[-1]) for o in out])
    return out.reshape(-1, out.shape[-1])
