"""The proxy's configuration (`overnight serve`): upstreams, data directory, client and
admin auth, timeouts, the write-ahead log and shadow sampling."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from .common import DEFAULT_DATA_DIR
from .handover import HostedBeside, check_hosted_beside
from .keys import PolicyToken, ScopedKey, check_keys, parse_keys, policy_names
from .shadow import ShadowSampling, check_shadow_sampling
from .upstream_kind import check_upstream_kind, check_upstream_url

_ALIAS = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class ProxyConfig(ShadowSampling, HostedBeside):  # their fields: shadow.py, handover.py
    # The first of `upstreams`: the one upstream of a proxy that fronts one, as
    # `ProxyConfig(upstream=URL)` says it. Give this or `upstreams`, not both.
    upstream: str = field(
        default="", metadata={"help": "The first upstream (see --upstream).", "flag": None}
    )
    # The OpenAI-compatible servers the proxy fronts: vLLM replicas of one model, each with
    # runtime LoRA on (proxy/forward/balancer.py). A trailing /v1 is dropped.
    upstreams: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "URL of an OpenAI-compatible server already running (repeatable: replicas "
            "of one model; a rollout sticks to one, promotions reach all).",
            "flag": "--upstream",
            "name": "upstream",
        },
    )
    # Every command takes the same one. A URL (s3://bucket/prefix) keeps the Parquet
    # segments in a bucket and the rest in `local_dir` (storage/location.py).
    data_dir: Path = field(
        default=DEFAULT_DATA_DIR,
        metadata={
            "help": "Data directory: records, logs, adapters; or a URL (s3://bucket/prefix) "
            "where the Parquet records go, the rest staying in --local-dir.",
            "flag": "--data",
            "envvar": "OVERNIGHT_DATA",
        },
    )
    # With --data a URL: this machine's log, runs, adapters and promotion state. The
    # default is derived from the URL, so every command on one machine finds the same one.
    local_dir: Path | None = field(
        default=None,
        metadata={
            "help": "With --data a URL: the local directory for the log, runs, adapters "
            "[default: ~/.local/state/overnight/SCHEME/BUCKET/PREFIX].",
            "envvar": "OVERNIGHT_LOCAL_DIR",
        },
    )
    # The stable model name agents ask for.
    alias: str = field(default="policy", metadata={"help": "Model name that follows promotions."})
    # More aliases, each a policy of its own (its own promotion stack, canary and nights;
    # proxy/alias/policies.py). The alias above is always one and the default: an
    # admin request without `?policy=` and DATA/adapters.json are its.
    policies: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "Another alias served as a policy of its own: its own adapter, promotions "
            "and nights (repeatable; --alias stays the default policy).",
            "flag": "--policy",
        },
    )
    # `Authorization: Bearer KEY`; empty means no client auth.
    api_keys: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "Accepted client key (repeatable; env OVERNIGHT_API_KEYS, space-separated).",
            "flag": "--api-key",
            "envvar": "OVERNIGHT_API_KEYS",
        },
    )
    admin_token: str | None = field(
        default=None,
        metadata={
            "help": "Token for /admin/ (else loopback only; env OVERNIGHT_ADMIN_TOKEN).",
            "envvar": "OVERNIGHT_ADMIN_TOKEN",
        },
    )
    # Scoped client keys and per-policy admin tokens (overnight/config/keys.py): a TOML
    # file of its own, since a list of tables cannot be a command-line option. The field
    # holds the file's text until __post_init__ parses it into `keys` and `policy_tokens`.
    keys_toml: str = field(
        default="",
        metadata={
            "help": "TOML file of scoped client keys ([[key]]: name, sha256 or key_env, "
            "policies, models, group_prefixes, rate, burst, concurrency) and per-policy admin "
            "tokens ([[admin]]: name, policy, sha256 or key_env).",
            "name": "keys_file",
            "flag": "--keys-file",
            "file": True,
            "envvar": "OVERNIGHT_KEYS_FILE",
        },
    )
    keys: tuple[ScopedKey, ...] = field(
        default=(),
        metadata={"help": "Scoped client keys (from --keys-file).", "flag": None},
    )
    policy_tokens: tuple[PolicyToken, ...] = field(
        default=(),
        metadata={"help": "Per-policy admin tokens (from --keys-file).", "flag": None},
    )
    # Prometheus (proxy/observe/metrics.py): bounded labels, no prompt, key or id, so open
    # like /health unless a scraper's token is set; the admin token is never required
    # (a scraper holding it could promote adapters).
    metrics: bool = field(default=True, metadata={"help": "Serve Prometheus metrics at /metrics."})
    metrics_token: str | None = field(
        default=None,
        metadata={
            "help": "Bearer token /metrics requires (the admin token is accepted too); unset: "
            "open like /health (env OVERNIGHT_METRICS_TOKEN).",
            "envvar": "OVERNIGHT_METRICS_TOKEN",
        },
    )
    # Never the client's key.
    upstream_api_key: str | None = field(
        default=None,
        metadata={
            "help": "Key the proxy sends upstream (env OVERNIGHT_UPSTREAM_API_KEY).",
            "envvar": "OVERNIGHT_UPSTREAM_API_KEY",
        },
    )
    # A hosted API refuses what the proxy asks vLLM for (upstream_kind.py). `auto`: known
    # hosts by their URL, others asked once at `overnight serve`'s start (vLLM if no answer).
    upstream_kind: str = field(
        default="auto",
        metadata={
            "help": "What the upstream is: vllm, openai (a hosted OpenAI-compatible API: "
            "nothing added, no adapters), anthropic (the Messages API, x-api-key), or auto "
            "(known hosts by URL, else its /v1/models at start; vllm when it cannot tell).",
            "choices": ("auto", "vllm", "openai", "anthropic"),
        },
    )
    # Never both keys: `client` forwards the client's own Authorization (openai) or x-api-key
    # (anthropic) and the proxy's keys move to X-Overnight-Key; `configured` sends ours.
    upstream_auth: str = field(
        default="configured",
        metadata={
            "help": "Key a hosted upstream gets: configured (--upstream-api-key, never the "
            "client's) or client (the client's own; the proxy's keys then come in "
            "X-Overnight-Key).",
            "choices": ("configured", "client"),
        },
    )
    # What the alias means against a hosted upstream (an adapter's name against vLLM).
    upstream_model: str | None = field(
        default=None,
        metadata={"help": "Hosted model a request for the alias (or a policy) is sent as."},
    )
    # Large enough for long multi-turn agent contexts with tool outputs.
    max_body_bytes: int = field(
        default=32 * 1024 * 1024,
        metadata={"help": "Largest request body accepted (413 above it)."},
    )
    # Connecting to a local vLLM is instant; 10 s covers a busy host.
    connect_timeout: float = field(
        default=10.0, metadata={"help": "Seconds to connect to the upstream."}
    )
    # Long generations are fine (there is deliberately no total cap); a stalled
    # upstream is not.
    read_timeout: float = field(
        default=600.0,
        metadata={
            "help": "Longest silence between two upstream bytes (no cap on a whole generation)."
        },
    )
    # vLLM closes idle keep-alive connections after about 5 s; ours must close first
    # or a reused connection fails with "Server disconnected".
    keepalive_timeout: float = field(
        default=4.0,
        metadata={"help": "Idle upstream connections are closed after this (below vLLM's 5 s)."},
    )
    # aiohttp's server has no timeout for reading a request's headers: a client that
    # never finishes them (slowloris) would hold its connection forever. The same limit
    # closes a client's idle keep-alive connection; SDKs keep theirs 5-15 s.
    header_timeout: float = field(
        default=30.0,
        metadata={
            "help": "Seconds a client may take to send a request's headers, or stay idle between requests."
        },
    )
    # An image given by URL is vLLM's to fetch, never the proxy's, unless the operator
    # names the host (proxy/capture/image_urls.py): then the proxy fetches it once and
    # the night can train on what the model saw.
    fetch_images_from: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "Host whose image URLs the proxy fetches, stores and sends vLLM as data "
            "(repeatable; example.com, *.example.com for its subdomains, or an IP address; "
            "public addresses only unless named by number). Default: none, never fetched.",
            "flag": "--fetch-images-from",
        },
    )
    # DNS rebinding: a page at evil.example whose name resolves to this machine. An IP
    # literal, `localhost` and this machine's name cannot be rebound; other names must be
    # listed ('*' turns the check off).
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "Host name the proxy is served as, for the admin API, rewards and /ui (repeatable; "
            "IP addresses, localhost and this machine's name are always accepted).",
            "flag": "--allowed-host",
        },
    )
    drain_timeout: float = field(
        default=600.0,
        metadata={
            "help": "How long a replaced adapter may finish requests in flight before unloading."
        },
    )
    # A colocated night (vllm_sleep.py) puts vLLM to sleep while it trains: a
    # generating request meanwhile waits this long, then gets 503 with Retry-After (the
    # OpenAI SDKs retry a 503 and honour the header).
    maintenance_hold: float = field(
        default=30.0,
        metadata={
            "help": "Seconds a generating request waits while vLLM sleeps for a colocated "
            "night before it is answered 503 with Retry-After."
        },
    )
    maintenance_drain: float = field(
        default=120.0,
        metadata={
            "help": "Seconds a colocated night waits for requests in flight to finish "
            "before vLLM sleeps."
        },
    )
    # No flag: set by `overnight serve --model`, which launched vLLM on this machine; the
    # nightly `--colocate auto` reads it from /admin/adapters.
    launched_vllm: bool = field(
        default=False,
        metadata={"help": "The proxy launched the vLLM it fronts, on this machine.", "flag": None},
    )
    workers: int = field(
        default=1,
        metadata={"help": "Proxy processes serving this port (`serve --workers`).", "flag": None},
    )
    vllm_sleeps: bool = field(
        default=False,
        metadata={
            "help": "The vLLM it launched has its sleep routes (--sleep-mode).",
            "flag": None,
        },
    )
    # No flag: `overnight serve` leaves it to /v1/models (vLLM's --served-model-name
    # names it when serve starts vLLM).
    base_model: str | None = field(
        default=None,
        metadata={"help": "Name the upstream serves the base model under.", "flag": None},
    )
    # See storage.writer.
    commit_interval: float = field(
        default=0.02,
        metadata={
            "help": "Group commit window of the write-ahead log, seconds (fsync at most this often)."
        },
    )
    roll_seconds: float = field(
        default=300.0,
        metadata={
            "help": "Roll the write-ahead log into Parquet after this many seconds (or 64 MiB)."
        },
    )
    # Where completion records are built and written (proxy/capture/recorder.py): the
    # serving process, or a child of it that takes the rows, --redact, the log's encoding
    # and fsync off the serving core at the price of more CPU in all (BENCHMARKS.md: on a
    # machine without a spare core it is slower). With shadow sampling or tracing on,
    # records are built in the serving process whatever this says: both need the rows.
    recorder: str = field(
        default="inline",
        metadata={
            "help": "Where completion records are built and written: inline (the serving "
            "process) or process (a recorder process beside each serving one, for a "
            "machine with cores to spare).",
            "choices": ("inline", "process"),
        },
    )
    # None stores records as they came; see proxy/capture/redact.py and examples/redact_emails.py.
    redact: str | None = field(
        default=None,
        metadata={
            "help": "Redaction hook (module:function or file.py:function) applied to each "
            "record before it is written."
        },
    )
    # Off: messages carry personal data, and a trace backend is one more place that keeps
    # them. On, they are taken from the records after --redact (proxy/observe/tracing.py).
    trace_contents: bool = field(
        default=False,
        metadata={
            "help": "Put message contents (gen_ai.input/output.messages, after --redact) "
            "on the completion spans when tracing is on (OTEL_* or LANGFUSE_* variables)."
        },
    )
    # vLLM restarted under the proxy has no adapters: this often, the proxy checks that the
    # promoted one is still served and loads it again (a 404 for it checks at once).
    upstream_check_interval: float = field(
        default=10.0,
        metadata={
            "help": "Seconds between health checks of each upstream, which also check that it "
            "still serves the promoted adapter (0: never)."
        },
    )
    # DATA/adapters.json is the promotion state of every proxy on the data directory
    # (`--workers`, or proxies on several machines sharing it): a stat this often finds a
    # promotion made through another proxy. The old adapter is unloaded no sooner than
    # twice this after a promotion, so that every proxy has switched away from it.
    state_poll_interval: float = field(
        default=1.0,
        metadata={
            "help": "Seconds between looks at DATA/adapters.json for promotions made through "
            "another proxy (0: never); with a bucket, one HEAD request each."
        },
    )

    def __post_init__(self) -> None:
        self._check_upstreams()
        check_upstream_kind(self)
        check_hosted_beside(self)
        check_shadow_sampling(self)
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if not _ALIAS.fullmatch(self.alias):
            raise ConfigError(
                f"alias must be 1-64 characters of [A-Za-z0-9._-], got {self.alias!r}"
            )
        self._check_policies()
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes must be at least 1024")
        for name in (
            "connect_timeout",
            "read_timeout",
            "keepalive_timeout",
            "header_timeout",
            "drain_timeout",
            "maintenance_hold",
            "maintenance_drain",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.commit_interval < 0 or self.roll_seconds <= 0:
            raise ConfigError("commit_interval must be >= 0 and roll_seconds > 0")
        if self.upstream_check_interval < 0 or self.state_poll_interval < 0:
            raise ConfigError(
                "upstream_check_interval and state_poll_interval must be >= 0 (0: never)"
            )
        if self.redact is not None and ":" not in self.redact:
            raise ConfigError(
                f"redact must be module:function or file.py:function, got {self.redact!r}"
            )
        if self.metrics_token == "":
            raise ConfigError("metrics_token must not be empty (unset: /metrics is open)")
        if any(not k for k in self.api_keys):
            raise ConfigError("api keys must not be empty")
        if self.keys_toml:  # parsed once: dataclasses.replace() must not add them again
            keys, tokens = parse_keys(self.keys_toml)
            object.__setattr__(self, "keys", (*self.keys, *keys))
            object.__setattr__(self, "policy_tokens", (*self.policy_tokens, *tokens))
            object.__setattr__(self, "keys_toml", "")
        check_keys(self.keys, self.policy_tokens, self.api_keys, policy_names(self))

    @property
    def policy_names(self) -> tuple[str, ...]:
        """Every policy the proxy serves, the default (`alias`) first."""
        return (self.alias, *(p for p in self.policies if p != self.alias))

    def _check_policies(self) -> None:
        """`policies` as a tuple of valid names (they name a folder: DATA/policies/NAME)."""
        names = (self.policies,) if isinstance(self.policies, str) else tuple(self.policies)
        for name in names:
            if not isinstance(name, str) or not _ALIAS.fullmatch(name) or name in (".", ".."):
                raise ConfigError(
                    f"a policy name must be 1-64 characters of [A-Za-z0-9._-], got {name!r}"
                )
        if len(set(names)) != len(names):
            raise ConfigError(f"a policy is given twice: {list(names)}")
        every = (self.alias, *(n for n in names if n != self.alias))
        # Each names a folder (DATA/policies/NAME): on a case-insensitive disk (macOS,
        # Windows) `Research` and `research` would share one promotion state, and its
        # admin token would promote and roll back the other's.
        if len({n.casefold() for n in every}) != len(every):
            raise ConfigError(f"policy names must differ in more than case: {list(every)}")
        # A request names a policy, the base model or an adapter (`NAME-v3-9c1e2a`,
        # proxy/alias/registry.py): no name may be two of these.
        if len(every) > 1 and self.base_model in every:
            raise ConfigError(
                f"policy {self.base_model!r} is the base model's name: its requests would "
                "train that policy; name the policy otherwise"
            )
        for name in every:
            for other in every:
                if other != name and re.fullmatch(rf"{re.escape(other)}-v\d+-[0-9a-f]{{6}}", name):
                    raise ConfigError(
                        f"policy {name!r} looks like an adapter of policy {other!r} "
                        f"({other}-vN-xxxxxx); name it otherwise"
                    )
        object.__setattr__(self, "policies", names)

    def _check_upstreams(self) -> None:
        """`upstreams` normalised (one URL given as text is a tuple of one), `upstream` its first."""
        urls = (self.upstreams,) if isinstance(self.upstreams, str) else tuple(self.upstreams)
        if not urls and self.upstream:
            urls = (self.upstream,)
        if not urls:
            raise ConfigError("an upstream URL is required")
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(f"upstream must be an http(s) URL, got {url!r}")
            check_upstream_url(url)
        urls = tuple(u.rstrip("/").removesuffix("/v1") for u in urls)
        if len(set(urls)) != len(urls):
            raise ConfigError(f"an upstream is given twice: {list(urls)}")
        first = self.upstream.rstrip("/").removesuffix("/v1")
        if self.upstream and first != urls[0]:
            raise ConfigError(f"upstream {self.upstream!r} is not the first of upstreams {urls}")
        object.__setattr__(self, "upstreams", urls)
        object.__setattr__(self, "upstream", urls[0])
