"""Which rollout group and rollout a request belongs to (the wire conventions).

First match wins: the `X-Rollout-Group`/`X-Rollout-Id` headers, then the URL prefix
`/rollouts/{group}/{rollout}/v1/...`, then `metadata.rollout_group/rollout_id` in the
body (those two keys removed before forwarding, and `metadata` with them when nothing
else is left: vLLM 0.32 accepts `metadata`, and a Responses answer echoes it). A request
with no ids is still logged: it is a rollout of its own, and the n choices of one
request form a group of their own; with `X-Rollout-Id: r`, the n choices are the
rollouts `r.0` ... `r.{n-1}`.
"""

from __future__ import annotations

from dataclasses import dataclass

from overnight.errors import OvernightError

GROUP_HEADER = "X-Rollout-Group"
ROLLOUT_HEADER = "X-Rollout-Id"
LOG_HEADER = "X-Rollout-Log"
# What of overnight's own sent a request (storage/read/sent_by.py), and the admin token
# that proves the operator sent it (routes/auth.py `Access._sent_by`). Like every
# X-Rollout-* header, neither is ever forwarded upstream (routes/relay.py).
ORIGIN_HEADER = "X-Rollout-Origin"
ORIGIN_TOKEN_HEADER = "X-Rollout-Origin-Token"
METADATA_GROUP = "rollout_group"
METADATA_ROLLOUT = "rollout_id"

MAX_ID_BYTES = 256
# Per-turn groups made from single calls (storage/read/siblings.py) are named "turn:<record>"
# and their members "turn:<record>:<id>"; the judge's rewards for them join on those
# ids. A client's id in that namespace could take or shadow those rewards, so it is
# refused rather than stored.
RESERVED_PREFIX = "turn:"


class BadRolloutId(OvernightError):
    status = 400
    code = "invalid_rollout_id"


@dataclass(frozen=True)
class Attribution:
    group_id: str | None
    rollout_id: str | None
    source: str  # header | url | metadata | none

    def rows(self, request_id: str, n: int) -> list[tuple[str, str]]:
        """(group_id, rollout_id) for each of n choices.

        Without a rollout id a choice is a rollout of its own; with one and n > 1 the
        choices branch into `{rollout}.{i}`. Without a group the request (or the
        rollout) is its own group.
        """
        base = self.rollout_id or request_id
        rollouts = [base] if n == 1 else [f"{base}.{i}" for i in range(n)]
        group = self.group_id or self.rollout_id or request_id
        return [(group, r) for r in rollouts]


def validate_id(value: str, what: str) -> str:
    """Ids are opaque text: any printable characters (spaces, slashes, any script), at
    most 256 bytes of UTF-8. They never become file names, and every link escapes them.
    Control characters (and undecodable bytes, which arrive as surrogates) are refused:
    they would corrupt logs and terminals. "." and ".." would make dead links (a client
    normalises them away). The "turn:" prefix is ours (see RESERVED_PREFIX)."""
    if (
        not isinstance(value, str)
        or not value
        or value in (".", "..")
        or not value.isprintable()
        or len(value.encode()) > MAX_ID_BYTES
    ):
        raise BadRolloutId(
            f"{what} must be 1-{MAX_ID_BYTES} bytes of printable UTF-8 text (no control "
            f"characters), and not '.' or '..'; got {value!r:.160}"
        )
    if value.startswith(RESERVED_PREFIX):
        raise BadRolloutId(
            f"{what} may not start with {RESERVED_PREFIX!r}: overnight names the per-turn "
            f"groups it makes from single calls that way; got {value!r:.160}"
        )
    return value


def attribute(headers, url_group: str | None, url_rollout: str | None, body: dict) -> Attribution:
    """Find the ids; removes ours from `body['metadata']` whatever wins."""
    meta_group = meta_rollout = None
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and (METADATA_GROUP in metadata or METADATA_ROLLOUT in metadata):
        meta_group = metadata.pop(METADATA_GROUP, None)
        meta_rollout = metadata.pop(METADATA_ROLLOUT, None)
        if not metadata:
            del body["metadata"]

    candidates = [
        ("header", headers.get(GROUP_HEADER), headers.get(ROLLOUT_HEADER)),
        ("url", url_group, url_rollout),
        ("metadata", meta_group, meta_rollout),
    ]
    for source, group, rollout in candidates:
        if group is None and rollout is None:
            continue
        return Attribution(
            group_id=None if group is None else validate_id(group, "rollout group"),
            rollout_id=None if rollout is None else validate_id(rollout, "rollout id"),
            source=source,
        )
    return Attribution(None, None, "none")


def logging_enabled(headers) -> bool:
    return headers.get(LOG_HEADER, "on").strip().lower() not in ("off", "0", "false", "no")
