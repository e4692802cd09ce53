"""`overnight prune`: delete the day partitions older than an age, table by table.

Retention works on whole days of Parquet (`{table}/date=YYYY-MM-DD/`), never on the
live logs (`wal/`) nor on today's partition, whatever the age. A day goes at once:
its directory is renamed out of the readers' pattern (`date=*`) in one step, then
deleted, so a reader sees the whole day or none of it (a query that had already named
the day's files fails once and can be run again). `training_runs` is kept: it is small,
it is the report's history, and it names the groups already trained on.

Images (storage/images.py) that no remaining row references go with the days that
referenced them, once older than a grace period (storage/upkeep/images.py).

Without `yes` nothing is deleted: the plan says what would go (days, files, rows and
bytes per table; images: how many and how big).
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from overnight.errors import ConfigError

# Every table but training_runs (see the module's doc).
PRUNED_TABLES = (
    "completions", "rewards", "finishes", "judgments", "siblings", "response_ids", "signals",
)  # fmt: skip
_AGE = re.compile(r"(\d+(?:\.\d+)?)\s*([dhw])")
_UNITS = {"h": dt.timedelta(hours=1), "d": dt.timedelta(days=1), "w": dt.timedelta(weeks=1)}


def parse_age(text: str) -> dt.timedelta:
    """'30d', '12h', '2w' -> a timedelta."""
    match = _AGE.fullmatch(text.strip().lower())
    if match is None:
        raise ConfigError(f"age {text!r}: expected a number and a unit, e.g. 30d, 12h, 2w")
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass
class TableDays:
    """The day partitions of one table that a prune removes."""

    days: list[Path | str] = field(default_factory=list)  # local folders, or `date=D` in a bucket
    files: int = 0
    rows: int = 0
    bytes: int = 0
    objects: dict[str, list[str]] = field(default_factory=dict)  # in a bucket: day -> files
    straddling: int = 0  # merged weeks/months with earlier and later days: rewritten


@dataclass
class PrunePlan:
    data_dir: Path
    before: dt.date  # partitions of days strictly before this one go
    tables: dict[str, TableDays] = field(default_factory=dict)
    store: Any = None  # storage.location.SegmentStore: where the days are
    rewritten: int = 0  # merged weeks and months that kept later days, rewritten without the rest
    images: Any = None  # storage.upkeep.images.ImageSweep: what goes once the days have

    @property
    def empty(self) -> bool:
        no_images = self.images is None or not self.images.unreferenced
        return no_images and not any(t.days or t.straddling for t in self.tables.values())

    def lines(self) -> list[str]:
        where = self.store.describe() if self.store is not None else self.data_dir
        out = [f"day partitions before {self.before.isoformat()} (UTC) in {where}:"]
        for name, t in self.tables.items():
            out.append(
                f"  {name:<12} {len(t.days):>4} day(s) {t.files:>6} file(s) "
                f"{t.rows:>12,} row(s) {_size(t.bytes):>10}"
            )
            if t.straddling:
                out.append(f"  {'':<12} and {t.straddling} merged week(s)/month(s) rewritten "
                           "without those days")  # fmt: skip
        total = sum(t.bytes for t in self.tables.values())
        out.append(f"  {'total':<12} {_size(total):>47}")
        if self.images is not None:
            out.append(self.images.line())
        return out


def plan_prune(
    data_dir: Path, older_than: dt.timedelta, now: dt.datetime | None = None
) -> PrunePlan:
    """What `prune` would delete: the days that ended more than `older_than` ago, never today."""
    from overnight.storage.location import segment_store
    from overnight.storage.upkeep.cutoff import straddling_files

    now = now or dt.datetime.now(dt.UTC)
    today = now.date()
    before = min((now - older_than).date(), today)
    plan = PrunePlan(Path(data_dir), before, store=segment_store(data_dir))
    for table in PRUNED_TABLES:
        days = plan.tables[table] = TableDays()
        days.straddling = len(straddling_files(plan.data_dir, table, before))
        if plan.store.remote:
            _plan_bucket(plan, table, days)
            continue
        for day_dir in sorted((plan.data_dir / table).glob("date=*")):
            day = _day_of(day_dir.name)
            if day is None or day >= before or not day_dir.is_dir():
                continue  # 'date=unknown' (rows without a time) is never pruned by age
            days.days.append(day_dir)
            for file in day_dir.glob("*.parquet"):
                days.files += 1
                days.bytes += file.stat().st_size
                days.rows += _rows(pq.read_metadata, file)
    plan.images = _plan_images(plan.data_dir, before)
    return plan


def _plan_images(data_dir: Path, before: dt.date) -> Any:
    """The images no row kept by the prune references (those of days before `before`
    only, or none)."""
    from overnight.storage.upkeep.images import plan_sweep

    midnight = dt.datetime.combine(before, dt.time(), tzinfo=dt.UTC)
    return plan_sweep(data_dir, since_us=int(midnight.timestamp() * 1_000_000))


def _plan_bucket(plan: PrunePlan, table: str, days: TableDays) -> None:
    """The same plan for segments in a bucket: one listing, the footers of the doomed."""
    for f in plan.store.list(table):
        folder = f.rel.partition("/")[0]
        day = _day_of(folder)
        if day is None or day >= plan.before:
            continue
        if folder not in days.objects:
            days.days.append(folder)
        days.objects.setdefault(folder, []).append(f.rel)
        days.files += 1
        days.bytes += f.size
        days.rows += _rows(plan.store.read_metadata, table, f.rel)


def _rows(read_footer: Any, *where: Any) -> int:
    """The rows a file's footer counts; 0 for a damaged file (it goes with its day)."""
    try:
        return read_footer(*where).num_rows
    except (OSError, ValueError):  # ArrowInvalid is a ValueError
        return 0


def prune(plan: PrunePlan) -> int:
    """Delete the plan's day partitions; the number of days removed. Each local day leaves
    the readers' view in one rename before its files are deleted; in a bucket (no rename)
    its objects are deleted in one request, and a reader that had already listed one
    fails once and can be run again."""
    from overnight.storage.upkeep.cutoff import drop_rows_before, remove_days

    removed = 0
    for table, t in plan.tables.items():  # under each table's merge lock, cutoff committed
        if t.days:
            removed += remove_days(plan.data_dir, table, t.days, t.objects, plan.before)
    # A merged week or month lives in its last day's folder: one that began before the
    # cutoff keeps its earlier days' rows until rewritten without them.
    plan.rewritten = drop_rows_before(plan.data_dir, tuple(plan.tables), plan.before)
    # Looked at again now the days are gone: a row written since the plan keeps its image.
    from overnight.storage.upkeep.images import sweep

    plan.images = sweep(plan.data_dir)
    return removed


def _day_of(folder: str) -> dt.date | None:
    try:
        return dt.date.fromisoformat(folder.removeprefix("date="))
    except ValueError:
        return None


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
