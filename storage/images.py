"""Images stored once, named by the sha256 of their bytes, beside the tables.

A request's base64 images are moved here when its row is written (write/images.py) and
the stored request keeps a reference in their place (`reference`):

    overnight-image:image/png;sha256:<64 lowercase hex>

Self-describing (the media type and the hash of the bytes) and never valid base64 nor a
URL a client would send (the scheme is ours). The bytes live at

    DATA/images/<first 2 hex>/<64 hex>.<png|jpeg|gif|webp>

locally (written to a private temporary file, fsynced, renamed, the folder fsynced:
`files.replace_durably`), or under the bucket's prefix at the same name when `--data`
is a bucket (`images/..`, one whole-object PUT, as segments are put: location.py), so
every machine that reads the segments reads their images. A file that is there is never
written again: the same bytes have the same name. Only the four media types of
`MEDIA_TYPES` are stored (the extension is the type; the web view serves that type and
no other).

`read` verifies the bytes against their name: a flipped bit is `ImageDamaged` naming
the file, never wrong bytes handed on.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from .bucket.conditional import on_bucket
from .files import create_private, private_dir, replace_durably
from .location import segment_store

FOLDER = "images"
MEDIA_TYPES = {"image/png": "png", "image/jpeg": "jpeg", "image/gif": "gif", "image/webp": "webp"}
EXTENSIONS = {ext: media for media, ext in MEDIA_TYPES.items()}
PREFIX = "overnight-image:"
_REFERENCE = re.compile(r"overnight-image:(image/(?:png|jpeg|gif|webp));sha256:([0-9a-f]{64})")
DIGEST = re.compile(r"[0-9a-f]{64}")
# A stored file's name: what listing the store accepts (anything else there is not ours).
_NAME = re.compile(r"([0-9a-f]{64})\.(png|jpeg|gif|webp)")


class ImageDamaged(OSError):
    """A stored image whose bytes no longer hash to its name."""


class ImageMissing(FileNotFoundError):
    """A reference to an image the store does not have (pruned, or never stored)."""


def reference(media_type: str, digest: str) -> str:
    return f"{PREFIX}{media_type};sha256:{digest}"


def parse_reference(text: object) -> tuple[str, str] | None:
    """(media type, sha256 hex) of a reference; None for anything else."""
    if not isinstance(text, str) or not text.startswith(PREFIX):
        return None
    match = _REFERENCE.fullmatch(text)
    return (match.group(1), match.group(2)) if match else None


@dataclass(frozen=True)
class StoredImage:
    digest: str
    media_type: str
    size: int
    mtime: float  # seconds since the epoch (an object's LastModified)


class ImageStore:
    """The image store of a data directory: its `images/` folder, or the bucket's."""

    def __init__(self, data_dir: str | os.PathLike):
        self.segments = segment_store(data_dir)
        self.remote = self.segments.remote
        self._known: set[str] = set()  # names this process stored or found (never rewritten)
        self._lock = threading.Lock()

    @staticmethod
    def rel(digest: str, media_type: str) -> str:
        return f"{digest[:2]}/{digest}.{MEDIA_TYPES[media_type]}"

    def path(self, digest: str, media_type: str) -> Path:
        """The local file (a local store only)."""
        return self.segments.local_path(FOLDER, self.rel(digest, media_type))

    def describe(self, digest: str, media_type: str) -> str:
        rel = self.rel(digest, media_type)
        return self.segments.key(FOLDER, rel) if self.remote else str(self.path(digest, media_type))

    # -- writing -------------------------------------------------------------------------

    def put(self, data: bytes, media_type: str) -> str:
        """Store `data` (unless it is there already); its sha256 hex. Durable on return."""
        if media_type not in MEDIA_TYPES:
            raise ValueError(f"media type {media_type!r} is not one of {sorted(MEDIA_TYPES)}")
        digest = hashlib.sha256(data).hexdigest()
        rel = self.rel(digest, media_type)
        if rel in self._known:
            return digest
        if self.remote:
            if self.segments.size(FOLDER, rel) is None:
                self.segments.put_bytes(FOLDER, rel, data)
        else:
            self._put_local(self.path(digest, media_type), data)
        with self._lock:
            self._known.add(rel)
        return digest

    def _put_local(self, path: Path, data: bytes) -> None:
        if path.exists():
            return
        private_dir(path.parent)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            create_private(tmp)
            with open(tmp, "wb") as f:
                f.write(data)
            replace_durably(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    # -- reading -------------------------------------------------------------------------

    def read(self, digest: str, media_type: str) -> bytes:
        """The image's bytes, verified against its name (`ImageDamaged` if they differ,
        `ImageMissing` if it is not there)."""
        if not DIGEST.fullmatch(digest) or media_type not in MEDIA_TYPES:
            raise ValueError(f"not an image of the store: {digest!r} {media_type!r}")
        where = self.describe(digest, media_type)
        try:
            if self.remote:
                data = self.segments.read_bytes(FOLDER, self.rel(digest, media_type))
            else:
                data = _read_no_symlink(self.path(digest, media_type))
        except FileNotFoundError as e:
            raise ImageMissing(f"image {where} is not in the store (pruned?)") from e
        found = hashlib.sha256(data).hexdigest()
        if found != digest:
            raise ImageDamaged(
                f"image {where} is damaged: its bytes hash to sha256 {found}, not its name"
            )
        return data

    def find(self, digest: str) -> tuple[str, int] | None:
        """(media type, size) of a stored image by its hash alone; None if absent."""
        if not DIGEST.fullmatch(digest):
            return None
        for media_type in MEDIA_TYPES:
            size = self._size(digest, media_type)
            if size is not None:
                return media_type, size
        return None

    def _size(self, digest: str, media_type: str) -> int | None:
        if self.remote:
            return self.segments.size(FOLDER, self.rel(digest, media_type))
        try:
            st = self.path(digest, media_type).lstat()
        except FileNotFoundError:
            return None
        return st.st_size if not _is_link(st) else None

    def list(self) -> list[StoredImage]:
        """Every image in the store (temporary files and anything not named by a hash
        left out)."""
        if not self.remote:
            out = []
            for p in self.segments.local_path(FOLDER).glob("??/*.*"):
                match = _NAME.fullmatch(p.name)
                try:
                    st = p.lstat()
                except FileNotFoundError:
                    continue
                if match and p.parent.name == match.group(1)[:2] and not _is_link(st):
                    media = EXTENSIONS[match.group(2)]
                    out.append(StoredImage(match.group(1), media, st.st_size, st.st_mtime))
            return sorted(out, key=lambda i: i.digest)
        return self._list_bucket()

    def _bucket_objects(self) -> dict[str, dict]:
        """Every object under the bucket's `images/`, by its name there, with its details."""
        prefix = self.segments.key(FOLDER) + "/"
        try:
            with on_bucket(self.segments.url, "listing images"):
                found = self.segments.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}
        return {key[len(prefix) :]: info for key, info in found.items()}

    def _list_bucket(self) -> list[StoredImage]:
        from .location import _mtime

        out = []
        for rel, info in self._bucket_objects().items():
            folder, _, name = rel.partition("/")
            match = _NAME.fullmatch(name)
            if match and folder == match.group(1)[:2]:
                size = int(info.get("size") or 0)
                media = EXTENSIONS[match.group(2)]
                out.append(StoredImage(match.group(1), media, size, _mtime(info)))
        return sorted(out, key=lambda i: i.digest)

    def files(self) -> list[tuple[str, int]]:
        """(name under `images/`, size) of every file there, ours or not (`overnight
        check` tells them apart: `image_name`); a local store's symbolic links too,
        never followed."""
        if self.remote:
            found = self._bucket_objects()
            return sorted((rel, int(info.get("size") or 0)) for rel, info in found.items())
        root = self.segments.local_path(FOLDER)
        out = []
        for folder, dirs, names in os.walk(root):  # never into a linked folder
            for name in [*names, *(d for d in dirs if Path(folder, d).is_symlink())]:
                path = Path(folder, name)
                try:
                    size = path.lstat().st_size
                except FileNotFoundError:  # pruned meanwhile
                    continue
                out.append((path.relative_to(root).as_posix(), size))
        return sorted(out)

    def delete(self, images: list[StoredImage]) -> None:
        with self._lock:
            for image in images:
                self._known.discard(self.rel(image.digest, image.media_type))
        self.segments.delete(FOLDER, [self.rel(i.digest, i.media_type) for i in images])


def image_name(rel: str) -> tuple[str, str] | None:
    """(sha256 hex, media type) of a name under `images/` that is one of the store's
    (`ab/ab<62 hex>.png`); None for anything else."""
    folder, _, name = rel.partition("/")
    match = _NAME.fullmatch(name)
    if match is None or folder != match.group(1)[:2]:
        return None
    return match.group(1), EXTENSIONS[match.group(2)]


def _is_link(st: os.stat_result) -> bool:
    import stat

    return stat.S_ISLNK(st.st_mode)


def _read_no_symlink(path: Path) -> bytes:
    """A local image's bytes; a symbolic link in its place is refused (never followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ImageDamaged(f"image {path} cannot be read: {e.strerror}") from e
    with os.fdopen(fd, "rb") as f:
        return f.read()
