"""A stored request's image references read back (storage/images.py).

`restore_images(request, data_dir)` gives the request as it was sent: every reference
turned back into its base64 (a data URL, or a Messages part's `data`), the bytes verified
against their hash on the way (`ImageDamaged` names a damaged file, `ImageMissing` a
pruned one). For readers that need the pixels (the trainer); listings need only
`image_parts`: what each image of a message is, without reading it. `content_text`
gives a message's content as text with each image named by its label (`image_label`),
as the judge reads it and the gate's examples show it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from overnight.storage.images import ImageStore, parse_reference

MAX_DEPTH = 64  # as deep as write/images.py looks
_DATA_URL = re.compile(r"data:([^;,]*);base64,", re.ASCII)


def restore_images(
    request: Any, data_dir: str | os.PathLike, store: ImageStore | None = None
) -> Any:
    """`request` with every image reference replaced by its verified base64 (a copy
    where anything changed; `request` itself is never changed). Only an image's own
    place is read (a chat `image_url`, a Responses `input_image`, a Messages `source`):
    a message whose text reads like a reference is the client's text, left as it is."""
    store = store or ImageStore(data_dir)
    return _restore(request, store, 0)


def _restore(value: Any, store: ImageStore, depth: int) -> Any:
    if depth > MAX_DEPTH:
        return value
    if isinstance(value, list):
        items = [_restore(v, store, depth + 1) for v in value]
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    if not isinstance(value, dict):
        return value
    part = _restored_part(value, store)
    if part is not value:
        return part
    out = None
    for key, item in value.items():
        new = _restore(item, store, depth + 1)
        if new is not item:
            out = dict(value) if out is None else out
            out[key] = new
    return value if out is None else out


def _restored_part(part: dict, store: ImageStore) -> dict:
    """One content part with its referenced image read back, or `part` itself (the
    three shapes write/images.py stores)."""
    kind = part.get("type")
    if kind == "image_url":
        inner = part.get("image_url")
        if isinstance(inner, dict):
            url = _data_url(inner.get("url"), store)
            return part if url is None else {**part, "image_url": {**inner, "url": url}}
        url = _data_url(inner, store)
        return part if url is None else {**part, "image_url": url}
    if kind == "input_image":
        url = _data_url(part.get("image_url"), store)
        return part if url is None else {**part, "image_url": url}
    source = part.get("source")
    if kind == "image" and isinstance(source, dict) and source.get("type") == "base64":
        ref = parse_reference(source.get("data"))
        if ref is not None:
            data = base64.b64encode(store.read(ref[1], ref[0])).decode("ascii")
            return {**part, "source": {**source, "data": data}}
    return part


def _data_url(value: Any, store: ImageStore) -> str | None:
    """The data URL a reference stands for, read and verified; None: not a reference."""
    ref = parse_reference(value)
    if ref is None:
        return None
    return f"data:{ref[0]};base64,{base64.b64encode(store.read(ref[1], ref[0])).decode('ascii')}"


@dataclass(frozen=True)
class ImagePart:
    """One image of a message, as listings show it."""

    kind: str  # "stored" (a reference), "inline" (base64 in the row), "url" (http(s), ...)
    media_type: str | None
    digest: str | None = None  # sha256 hex of a stored one
    url: str | None = None  # an image given by its URL
    size: int | None = None  # bytes: an inline image's decoded length (a stored one: look)


def image_parts(message: Any) -> list[ImagePart | None]:
    """For each content part of a chat message: its image, or None when it is none."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return []
    return [image_of(p) for p in content]


def shows_images(messages: Any) -> bool:
    """Whether any message of a chat request shows an image (in any of the three shapes)."""
    return isinstance(messages, list) and any(any(image_parts(m)) for m in messages)


def image_of(part: Any) -> ImagePart | None:
    """The image a content part holds, in any of the three shapes; None if none."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind == "image_url":
        inner = part.get("image_url")
        return _of_url(inner.get("url") if isinstance(inner, dict) else inner)
    if kind == "input_image":
        return _of_url(part.get("image_url"))
    source = part.get("source")
    if kind == "image" and isinstance(source, dict):
        data = source.get("data")
        ref = parse_reference(data)
        if ref is not None:
            return ImagePart("stored", ref[0], ref[1])
        if source.get("type") == "base64" and isinstance(data, str):
            return ImagePart("inline", _text(source.get("media_type")), size=len(data) * 3 // 4)
        return ImagePart("url", None, url=_text(source.get("url")))
    return None


def _of_url(url: Any) -> ImagePart:
    ref = parse_reference(url)
    if ref is not None:
        return ImagePart("stored", ref[0], ref[1])
    if isinstance(url, str) and (match := _DATA_URL.match(url)):
        return ImagePart("inline", match.group(1), size=(len(url) - match.end()) * 3 // 4)
    return ImagePart("url", None, url=_text(url))


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) or value is None else str(value)


def content_text(content) -> str:
    if isinstance(content, list):  # content parts: keep the text, name the rest
        return " ".join(_part_text(p) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _part_text(part: dict) -> str:
    """A content part as the judge reads it: its text, or an image's label."""
    return image_label(part) or part.get("text") or f"<{part.get('type')}>"


def image_label(part: dict) -> str | None:
    """An image part's placeholder, which names it (its stored hash, its URL), so that
    trajectories showing other pictures stay apart; a judge that sees images gets each
    picture under its label (judge/images.py). None: not an image."""
    image = image_of(part)
    if image is None:
        return None
    if image.digest is not None:
        return f"[image sha256:{image.digest[:16]}]"
    if image.kind == "inline":  # kept inline (the store refused it): named by its text
        data = json.dumps(part, sort_keys=True).encode()
        return f"[image inline:{hashlib.sha256(data).hexdigest()[:16]}]"
    return f"[image {str(image.url)[:200]}]"
