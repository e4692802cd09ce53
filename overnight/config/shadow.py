"""Shadow sampling's options (proxy/shadow/sampler.py): siblings asked of vLLM for a
served single-call turn, so that a single call makes a group to learn from.

These fields are ProxyConfig's (it inherits them); the check runs in its __post_init__.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError


@dataclass(frozen=True)
class ShadowSampling:
    # Off unless asked: it costs upstream compute.
    shadow_samples: int = field(
        default=0,
        metadata={
            "help": "Siblings asked of vLLM for a served single-call turn, after its answer "
            "was sent, at low priority (0: no shadow sampling)."
        },
    )
    shadow_rate: float = field(
        default=1.0,
        metadata={"help": "Fraction of eligible turns shadow-sampled (random per turn)."},
    )
    # A burst beyond this is dropped (and counted), never waited for.
    shadow_queue: int = field(
        default=256, metadata={"help": "Turns waiting for shadow sampling at most."}
    )
    # One request of K siblings at a time keeps vLLM's batch (CPU: each step's cost) small.
    shadow_concurrency: int = field(
        default=1, metadata={"help": "Shadow sibling requests in flight at once."}
    )
    # vLLM's priority orders only what waits; a running sibling shares every batch step
    # with the served requests (on a CPU each step costs more with each sequence), so by
    # default siblings run only while no served request is in flight on their replica.
    shadow_max_served: int = field(
        default=0,
        metadata={
            "help": "Shadow requests run while a replica has at most this many served requests "
            "in flight; one running when more arrive is cancelled and asked again (raise it "
            "on a GPU, where a batch costs little more than one request)."
        },
    )
    # Started the instant an answer is written, a sibling request competes with that
    # answer's delivery and with a served request the proxy has read but not yet
    # forwarded (measured: bench/shadow_latency.py); an agent's next call often
    # comes moments after its answer, too.
    shadow_quiet: float = field(
        default=0.02,
        metadata={
            "help": "Seconds a replica must have been without served requests (beyond "
            "--shadow-max-served), and no served turn answered, before a shadow request "
            "starts on it (0: at once)."
        },
    )
    # vLLM serves lower values first (`--scheduling-policy priority`; ignored under fcfs).
    shadow_priority: int = field(
        default=10, metadata={"help": "vLLM priority of shadow requests (served turns: 0)."}
    )


def check_shadow_sampling(config: ShadowSampling) -> None:
    if config.shadow_samples < 0 or not 0.0 <= config.shadow_rate <= 1.0:
        raise ConfigError("shadow_samples must be >= 0 and shadow_rate within [0, 1]")
    if config.shadow_queue < 1 or config.shadow_concurrency < 1 or config.shadow_max_served < 0:
        raise ConfigError(
            "shadow_queue and shadow_concurrency must be at least 1, shadow_max_served >= 0"
        )
