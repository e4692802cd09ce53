"""The record schema: one Arrow schema per table, and the version that names it.

Every row carries `schema_version`; readers refuse versions newer than
`SCHEMA_VERSION` with a message that says what to do, instead of misreading them.
Bump the version when a column changes meaning; adding a nullable column does not
need a bump (DuckDB unions segments by name).
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

_TS = pa.timestamp("us", tz="UTC")

# One row per choice of a chat or text completion that passed through the proxy.
COMPLETIONS = pa.schema(
    [
        ("record_id", pa.string()),  # unique per row
        ("request_id", pa.string()),  # shared by the n choices of one HTTP request
        ("schema_version", pa.int16()),
        ("started_at", _TS),
        ("ended_at", _TS),
        ("group_id", pa.string()),
        ("rollout_id", pa.string()),
        ("attribution", pa.string()),  # header | url | metadata | choices | none
        ("turn_index", pa.int32()),  # per rollout, in the order this proxy saw turns
        ("choice_index", pa.int32()),
        ("endpoint", pa.string()),  # chat.completions | completions
        ("model_requested", pa.string()),
        ("model_served", pa.string()),  # the name vLLM served: base model or lora name
        ("adapter_version", pa.int32()),  # null when the base model served
        ("request", pa.string()),  # JSON, as the client sent it (metadata removed)
        ("response", pa.string()),  # JSON, this choice as a non-streamed response
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("completion_logprobs", pa.list_(pa.float32())),
        ("finish_reason", pa.string()),
        ("http_status", pa.int16()),
        ("error", pa.string()),  # null on success; why the completion is partial
        ("partial", pa.bool_()),  # the stream ended before a finish_reason
        ("latency_ms", pa.float64()),
        ("ttft_ms", pa.float64()),  # time to the first upstream byte
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("stream", pa.bool_()),
        ("logged", pa.bool_()),  # false under X-Rollout-Log: off (bodies not kept)
        ("proxy_id", pa.string()),  # the proxy process that wrote the row
    ]
)

# Rewards an agent posted (source 'agent'); the judge adds its own sources later.
REWARDS = pa.schema(
    [
        ("reward_id", pa.string()),
        ("schema_version", pa.int16()),
        ("rollout_id", pa.string()),
        ("reward", pa.float64()),
        ("metrics", pa.string()),  # JSON object
        ("source", pa.string()),  # agent | ruler | function | combined
        ("created_at", _TS),
        ("proxy_id", pa.string()),  # the process that wrote it (a proxy or a judge run)
        ("judgment_id", pa.string()),  # for rewards derived from a judgment
    ]
)

# One row per group judged (or failed) by an LLM judge; re-judging adds rows.
JUDGMENTS = pa.schema(
    [
        ("judgment_id", pa.string()),
        ("schema_version", pa.int16()),
        ("group_id", pa.string()),
        ("judge_model", pa.string()),
        ("rubric_hash", pa.string()),
        ("prompt_hash", pa.string()),  # of exactly what was sent: the cache key
        ("created_at", _TS),
        (
            "scores",
            pa.list_(
                pa.struct(
                    [
                        ("rollout_id", pa.string()),
                        ("score", pa.float64()),
                        ("explanation", pa.string()),
                    ]
                )
            ),
        ),
        ("error", pa.string()),  # null when the group was scored
        ("attempts", pa.int32()),  # calls made, retries and corrections included
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("cost_usd", pa.float64()),  # null when the judge has no known price
        ("latency_ms", pa.float64()),
        ("proxy_id", pa.string()),
    ]
)

# A rollout is finished by an explicit POST .../finish; idle rollouts finish by time.
FINISHES = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("schema_version", pa.int16()),
        ("finished_at", _TS),
        ("proxy_id", pa.string()),
    ]
)

# One row per `overnight train` run: what it trained on, what it made, how it went.
TRAINING_RUNS = pa.schema(
    [
        ("run_id", pa.string()),
        ("schema_version", pa.int16()),
        ("started_at", _TS),
        ("ended_at", _TS),
        ("status", pa.string()),  # trained | failed
        ("base_model", pa.string()),
        ("start_adapter", pa.string()),  # the adapter training started from; null: fresh
        ("adapter_path", pa.string()),  # where the new adapter was saved
        ("promoted_as", pa.string()),  # the name vLLM serves it under; null if not promoted
        ("groups", pa.list_(pa.string())),
        ("rollouts", pa.int32()),
        ("trained_tokens", pa.int64()),
        ("steps", pa.int32()),
        ("reward_mean", pa.float64()),
        ("max_logprob_gap", pa.float64()),  # |policy - logged| before the first update
        ("config", pa.string()),  # JSON
        ("metrics", pa.string()),  # JSON: per step and per group statistics
        ("error", pa.string()),
        ("proxy_id", pa.string()),
    ]
)

TABLES: dict[str, pa.Schema] = {
    "completions": COMPLETIONS,
    "rewards": REWARDS,
    "finishes": FINISHES,
    "judgments": JUDGMENTS,
    "training_runs": TRAINING_RUNS,
}

# Columns written as JSON text that hold timestamps as ISO strings in the log.
TIMESTAMP_COLUMNS = {
    name: [f.name for f in schema if pa.types.is_timestamp(f.type)]
    for name, schema in TABLES.items()
}


class SchemaVersionError(Exception):
    """Data written by a newer overnight than this one."""


def check_versions(table: str, versions: list[int]) -> None:
    newer = sorted({v for v in versions if v is not None and v > SCHEMA_VERSION})
    if newer:
        raise SchemaVersionError(
            f"{table}: rows with schema version {newer} are newer than this overnight "
            f"understands (version {SCHEMA_VERSION}); upgrade overnight to read them"
        )
