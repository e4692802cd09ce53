"""Images no row references any more, found and deleted (`overnight prune`).

An image is deleted when no remaining `completions` request names it (the Parquet
segments and the live logs, as every reader sees them: reader.py) and it is older than
`GRACE_SECONDS`: an image is stored a moment before the log line that names it is
written, and a recorder process may hold a row for a while. Nor is it deleted while
damaged files are set aside (their rows, not read, may name it and be restored); lines
the compaction set aside (`quarantine/*`) are read as text for references too.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from overnight.storage.images import ImageStore, StoredImage, parse_reference
from overnight.storage.integrity import SET_ASIDE, quarantined

GRACE_SECONDS = 24 * 3600.0
_REFERENCES = "overnight-image:image/[a-z]+;sha256:[0-9a-f]{64}"
_IN_TEXT = re.compile(rb"overnight-image:image/[a-z]+;sha256:[0-9a-f]{64}")


@dataclass
class ImageSweep:
    """What a sweep deletes: the images no row references, older than the grace."""

    unreferenced: list[StoredImage] = field(default_factory=list)
    kept: int = 0  # images still referenced, or too young to go
    refused: str | None = None  # why nothing may be deleted now

    @property
    def bytes(self) -> int:
        return sum(i.size for i in self.unreferenced)

    def line(self) -> str:
        if self.refused:
            return f"  images: none deleted ({self.refused})"
        return (
            f"  images: {len(self.unreferenced)} no longer referenced ({self.bytes:,} bytes), "
            f"{self.kept} kept"
        )


def referenced(data_dir: Path, since_us: int | None = None) -> set[tuple[str, str]]:
    """(media type, sha256) of every image a completion's request names; `since_us`: only
    rows that started then or later, or have no time (what a prune of older days keeps)."""
    from overnight.storage.read.reader import open_db

    con = open_db(data_dir)
    try:
        where = "request LIKE '%overnight-image:%'"
        params: list = []
        if since_us is not None:
            where += " AND (started_at IS NULL OR epoch_us(started_at) >= ?)"
            params.append(since_us)
        found = con.execute(
            f"SELECT DISTINCT unnest(regexp_extract_all(request, '{_REFERENCES}')) "
            f"FROM completions WHERE {where}",
            params,
        ).fetchall()
    finally:
        con.close()
    out = {ref for (text,) in found if (ref := parse_reference(text)) is not None}
    for path in (Path(data_dir) / "quarantine").glob("*"):
        if path.is_file():
            out |= {
                r for m in _IN_TEXT.findall(path.read_bytes()) if (r := parse_reference(m.decode()))
            }
    return out


def plan_sweep(
    data_dir: Path,
    since_us: int | None = None,
    now: float | None = None,
    grace: float = GRACE_SECONDS,
) -> ImageSweep:
    """What `sweep` would delete now (`since_us`: as `referenced` counts them)."""
    now = time.time() if now is None else now
    aside = quarantined(Path(data_dir)) if (Path(data_dir) / SET_ASIDE).exists() else []
    if aside:
        return ImageSweep(refused=f"{len(aside)} damaged file(s) set aside: see `overnight check`")
    stored = ImageStore(data_dir).list()
    if not stored:
        return ImageSweep()
    keep = referenced(Path(data_dir), since_us)
    sweep = ImageSweep()
    for image in stored:
        if (image.media_type, image.digest) in keep or image.mtime > now - grace:
            sweep.kept += 1
        else:
            sweep.unreferenced.append(image)
    return sweep


def sweep(data_dir: Path, now: float | None = None, grace: float = GRACE_SECONDS) -> ImageSweep:
    """Delete the images no remaining row references (older than `grace`); what went."""
    plan = plan_sweep(data_dir, None, now, grace)
    if plan.unreferenced:
        ImageStore(data_dir).delete(plan.unreferenced)
    return plan
