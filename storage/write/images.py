"""A request's base64 images moved to the image store as its row is written.

`ImageCapture.externalize(request)` gives the request to store: each base64 image,
in whichever of the three shapes the proxy meets,

    chat       {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
               (or "image_url": "data:...")
    Responses  {"type": "input_image", "image_url": "data:image/png;base64,..."}
    Messages   {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": "..."}}

stored once (storage/images.py) and its string (the data URL; in Messages the `data`)
replaced by the reference `overnight-image:image/png;sha256:<hex>`, the part's shape
otherwise kept. (Responses and Messages requests are recorded in the chat shape,
proxy/capture/conversation.py; all three are handled all the same.) An http(s) URL is
kept as it is, never fetched. The request given is never changed: what changes is
copied (the proxy still holds it, a Responses chain forwards it again).

It runs in the log writer's thread (writer.py `_encode`), off the event loop, before the
row's line is written: an image is durable before any log line names it.

What is not stored stays inline, never dropped, counted in `kept_inline` (the writer's
health: `images_kept_inline`), logged, and named in the row's `notes` (`images`):

- a media type not in the store's four (png, jpeg, gif, webp), or a data URL of another
  form (`data:image/png;charset=..;base64,`);
- base64 that does not decode, or does not read back as the same text once decoded
  (kept inline so that the request reads back exactly as it was sent);
- an image over `MAX_IMAGE_BYTES` decoded (the proxy's body limit comes first);
- a store that fails (a full disk, a bucket that is down).
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
from typing import Any

from overnight.storage.images import MEDIA_TYPES, ImageStore, reference

log = logging.getLogger("overnight.storage")

MAX_IMAGE_BYTES = 64 * 1024 * 1024
MAX_DEPTH = 64  # parts nested deeper than a request's are left as they are
_DATA_URL = re.compile(r"data:([^;,]*);base64,", re.ASCII)
_MIN_CHARS = 64  # smaller images are not worth a file (a reference is ~100 chars)


class ImageCapture:
    """Moves a data directory's requests' images to its store; counts what it did."""

    def __init__(self, data_dir: str | os.PathLike, min_chars: int = _MIN_CHARS):
        self.data_dir = data_dir
        self.min_chars = min_chars
        self._store: ImageStore | None = None
        self.stored = 0  # images replaced by a reference (stored now or already there)
        self.kept_inline = 0  # base64 images left inline (see the module's doc)

    @property
    def store(self) -> ImageStore:
        if self._store is None:
            self._store = ImageStore(self.data_dir)
        return self._store

    def externalize(self, request: Any) -> tuple[Any, list[str]]:
        """The request with its images as references; why any were kept inline."""
        problems: list[str] = []
        out = self._walk(request, problems, 0)
        if problems:
            self.kept_inline += len(problems)
            if self.kept_inline <= 10 or self.kept_inline % 1000 == 0:  # loud, not a flood
                log.warning(
                    "%d image(s) kept inline in a request (%d so far): %s",
                    len(problems),
                    self.kept_inline,
                    "; ".join(problems),
                )
        return out, problems

    def _walk(self, value: Any, problems: list[str], depth: int) -> Any:
        if depth > MAX_DEPTH:
            return value
        if isinstance(value, list):
            items = [self._walk(v, problems, depth + 1) for v in value]
            changed = any(a is not b for a, b in zip(items, value, strict=True))
            return items if changed else value
        if not isinstance(value, dict):
            return value
        part = self._part(value, problems)
        if part is not value:
            return part
        out = None
        for key, item in value.items():
            new = self._walk(item, problems, depth + 1)
            if new is not item:
                out = dict(value) if out is None else out
                out[key] = new
        return value if out is None else out

    def _part(self, part: dict, problems: list[str]) -> dict:
        """One content part with its image stored, or `part` itself."""
        kind = part.get("type")
        if kind == "image_url":
            inner = part.get("image_url")
            if isinstance(inner, dict):
                url = self._url(inner.get("url"), problems)
                return (
                    part
                    if url is inner.get("url")
                    else {**part, "image_url": {**inner, "url": url}}
                )
            url = self._url(inner, problems)
            return part if url is inner else {**part, "image_url": url}
        if kind == "input_image":
            url = self._url(part.get("image_url"), problems)
            return part if url is part.get("image_url") else {**part, "image_url": url}
        source = part.get("source")
        if kind == "image" and isinstance(source, dict) and source.get("type") == "base64":
            data = source.get("data")
            ref = self._store_base64(source.get("media_type"), data, problems)
            return part if ref is None else {**part, "source": {**source, "data": ref}}
        return part

    def _url(self, url: Any, problems: list[str]) -> Any:
        """A data URL's reference, or `url` itself (http(s), ours already, kept inline)."""
        if not isinstance(url, str) or not url.startswith("data:"):
            return url
        match = _DATA_URL.match(url)
        if match is None:
            problems.append(f"a data URL of another form ({url[:40]!r}...)")
            return url
        ref = self._store_base64(match.group(1), url[match.end() :], problems)
        return url if ref is None else ref

    def _store_base64(self, media_type: Any, text: Any, problems: list[str]) -> str | None:
        if not isinstance(text, str) or len(text) < self.min_chars:
            return None
        if media_type not in MEDIA_TYPES:
            problems.append(
                f"media type {str(media_type)[:40]!r} is not one of png, jpeg, gif, webp"
            )
            return None
        if len(text) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            problems.append(f"an image of {len(text) * 3 // 4} bytes, over {MAX_IMAGE_BYTES}")
            return None
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            problems.append("invalid base64")
            return None
        if base64.b64encode(data).decode("ascii") != text:
            problems.append("base64 that does not read back as sent (padding, line breaks)")
            return None
        try:
            digest = self.store.put(data, media_type)
        except OSError as e:
            problems.append(f"the image store failed: {e}")
            return None
        self.stored += 1
        return reference(media_type, digest)
