"""Reading the store: DuckDB views over Parquet and the live logs (`reader`), and the
questions several parts ask of them: a policy's groups (`policy_scope`), responses by id
(`response_index`), a rollout's model and group (`rollout_lookup`), the newest nights
(`runs`), served turns' siblings (`siblings`)."""
