"""Storage: the record schema, the durable writer and the DuckDB reader.

The leaf of the dependency graph: it imports none of overnight's other parts.
"""

from .ids import new_id, now_us
from .reader import finished_groups, open_db
from .schema import SCHEMA_VERSION, SchemaVersionError
from .writer import LogWriter, WriterConfig, recover

__all__ = [
    "SCHEMA_VERSION",
    "LogWriter",
    "SchemaVersionError",
    "WriterConfig",
    "finished_groups",
    "new_id",
    "now_us",
    "open_db",
    "recover",
]
