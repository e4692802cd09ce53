"""The write path: the durable writer (`writer`), its write-ahead log (`wal`), which rows
are on disk (`commits`), and sealed logs compacted to Parquet segments (`compactor`,
`log_to_parquet`, `segments`)."""
