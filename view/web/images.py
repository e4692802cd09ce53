"""/ui/images/{sha256}: a stored image (storage/images.py), for the rollout page's <img>.

The id is the only input, and only 64 lowercase hex characters are one: anything else
(`..`, a slash, uppercase, a short id) is 404 before any file is named. The file's name
is built from that id and one of the store's four extensions alone; a symbolic link in
its place is refused, and the bytes are sent only once they hash to the id (a damaged
image is 500 naming it, never wrong bytes). The type sent is the stored one's, from
the store's four (png, jpeg, gif, webp), with `X-Content-Type-Options: nosniff`. Access
is /ui's: the proxy's middleware guards every path under it (routes/auth.py).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from overnight.storage.images import DIGEST, ImageDamaged, ImageMissing, ImageStore

from .data import DATA_DIR


async def image(request: web.Request) -> web.Response:
    digest = request.match_info["digest"]
    if DIGEST.fullmatch(digest) is None:
        raise web.HTTPNotFound(text="not an image id: 64 lowercase hex characters expected")
    store = ImageStore(request.config_dict[DATA_DIR])

    def read() -> tuple[str, bytes] | None:
        found = store.find(digest)
        if found is None:
            return None
        return found[0], store.read(digest, found[0])

    try:
        found = await asyncio.to_thread(read)
    except ImageMissing:
        found = None
    except ImageDamaged as e:
        raise web.HTTPInternalServerError(text=str(e)) from e
    if found is None:
        raise web.HTTPNotFound(text=f"no image {digest} in the store")
    media_type, data = found
    return web.Response(
        body=data,
        content_type=media_type,
        headers={
            "X-Content-Type-Options": "nosniff",
            # Named by its hash: the same id is the same bytes, always.
            "Cache-Control": "private, max-age=31536000, immutable",
        },
    )
