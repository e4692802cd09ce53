"""Small objects in a bucket with optimistic concurrency: ETags and conditional PUTs.

What the merge manifests (location.py's `SegmentStore`), the shared promotion state
(proxy/alias/bucket_state.py) and the adapters' manifests (adapter_sync.py) need from a
bucket, on top of an fsspec filesystem (s3fs for S3 and its compatibles). An object's ETag changes with every write, so a HEAD is a cheap
"has it changed?"; a PUT with `If-Match: <etag>` succeeds only if nobody wrote since
that ETag was read, and one with `If-None-Match: *` only if the object does not exist
yet (S3 since 2024, MinIO, moto). s3fs passes both through to `put_object` and raises
an OSError (FileExistsError for `If-None-Match`) whose cause is botocore's
`PreconditionFailed`; S3 answers 409 `ConditionalRequestConflict` when two conditional
writes of one key overlap, which means the same: someone else wrote.

Other filesystems (gs://, az://, file://) get unconditional writes: see
docs/deployment.md (the promotion state there is only as safe as one writer at a time).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

ABSENT = None  # `put_if(..., expect=ABSENT)`: only if the object does not exist yet
_REFUSED = ("PreconditionFailed", "ConditionalRequestConflict")


class BucketError(OSError):
    """The bucket could not be reached, or refused a request (credentials, permissions)."""


def conditional(url: str) -> bool:
    """Whether the bucket of `url` honours If-Match / If-None-Match on PUT."""
    return url.split("://", 1)[0] in ("s3", "s3a")


@contextmanager
def on_bucket(url: str | None, what: str) -> Iterator[None]:
    """botocore's own exceptions (no connection, no credentials) as a BucketError (an
    OSError, for callers that already handle a failing disk); FileNotFoundError passes
    through, a refused condition too (see `refused`)."""
    try:
        yield
    except (FileNotFoundError, BucketError):
        raise
    except Exception as e:
        if refused(e):
            raise
        raise BucketError(f"{url}: {what}: {type(e).__name__}: {e}") from e


def refused(e: BaseException) -> bool:
    """A conditional write refused because another writer got there first."""
    seen: BaseException | None = e
    for _ in range(8):  # the chain is short; never follow a cycle forever
        if seen is None:
            break
        code = getattr(seen, "response", {}).get("Error", {}).get("Code")
        if code in _REFUSED or "pre-condition" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def etag(fs: Any, url: str, key: str) -> str | None:
    """The object's current ETag (one HEAD), None when it does not exist."""
    try:
        with on_bucket(url, f"looking at {key}"):
            return fs.info(key).get("ETag")
    except FileNotFoundError:
        return None


def get(fs: Any, url: str, key: str) -> tuple[bytes | None, str | None]:
    """The object and the ETag it had (HEAD, then GET); (None, None) when absent.
    In that order a write in between makes the ETag older than the bytes, so a
    `put_if` based on them is refused rather than overwriting what was not read."""
    try:
        with on_bucket(url, f"reading {key}"):
            tag = fs.info(key).get("ETag")
            return fs.cat_file(key), tag
    except FileNotFoundError:
        return None, None


def put_if(fs: Any, url: str, key: str, data: bytes, expect: str | None) -> str | None:
    """Write `data` if the object is still at ETag `expect` (ABSENT: does not exist).
    Returns the new ETag, or None when another writer got there first."""
    condition = {"IfMatch": expect} if expect else {"IfNoneMatch": "*"}
    if not conditional(url):
        condition = {}
    try:
        with on_bucket(url, f"writing {key}"):
            out = fs.pipe_file(key, data, **condition)
    except OSError as e:
        if refused(e):
            return None
        raise
    tag = out.get("ETag") if isinstance(out, dict) else None
    return tag or etag(fs, url, key)


def put(fs: Any, url: str, key: str, data: bytes) -> None:
    with on_bucket(url, f"writing {key}"):
        fs.pipe_file(key, data)


def delete(fs: Any, url: str, key: str) -> None:
    try:
        with on_bucket(url, f"deleting {key}"):
            fs.rm_file(key)
    except FileNotFoundError:
        pass
