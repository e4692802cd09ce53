"""Storage: the record schema, the durable writer and the DuckDB reader.

The leaf of the dependency graph: it imports none of overnight's other parts (only the
ground they share, `overnight.errors`, for `StoreUnavailable`).
"""

from .files import fsync_path
from .ids import new_id, now_us
from .location import attach, data_url, segment_store
from .read.reader import finished_groups, open_db, query_rows
from .schema import SCHEMA_VERSION, SchemaVersionError, fit_row
from .write.commits import StoreUnavailable
from .write.compactor import recover
from .write.writer import LogWriter, WriterConfig, WriterHealth

__all__ = [
    "SCHEMA_VERSION",
    "LogWriter",
    "SchemaVersionError",
    "StoreUnavailable",
    "WriterConfig",
    "WriterHealth",
    "attach",
    "data_url",
    "finished_groups",
    "fit_row",
    "fsync_path",
    "new_id",
    "now_us",
    "open_db",
    "query_rows",
    "recover",
    "segment_store",
]
