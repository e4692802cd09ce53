"""What every worker of the proxy sees alike, for `/metrics` (metrics.py): each policy's
adapter (and canary), and how the last nights ended, in the data directory, by policy.

Collected at scrape time by the worker that answers (nothing per worker to sum), from
the policies' registries and from the Parquet segments of `training_runs` (storage/read/runs.py):
the nights, and the cycles of `overnight learn` (whose supervisor has no port of its own:
its cycles' records are the numbers, whichever process or machine ran them).
Labels are bounded: one series per configured policy and role or status.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from overnight.proxy.alias.policies import Policies
from overnight.storage.read.runs import CYCLE_OUTCOMES, Cycles, RunsCache, RunsSummary

# The training runs are read again at most this often (a scrape comes every 15 s or so;
# a night ends once a day).
RUNS_SECONDS = 30.0
# The loop's latency, a group's finish to its adapter serving (seconds): from a cycle every
# few minutes (issue 51 aims under 10) to a nightly cron's day.
TO_SERVING_BUCKETS = (60, 120, 300, 600, 1200, 1800, 3600, 7200, 21600, 43200, 86400, 172800)


class Shared:
    """What every worker sees alike, collected by the one answering the scrape: the
    adapter behind the alias (and a canary), the last training runs."""

    def __init__(self, adapters: Policies, data_dir):
        self.adapters = adapters
        self.runs = RunsCache(data_dir, RUNS_SECONDS)  # read before each scrape (handle)
        self.summary: RunsSummary | None = None

    def describe(self) -> Iterable[Metric]:
        return []  # collected at scrape time only (nothing to check at registration)

    def collect(self) -> Iterable[Metric]:
        info = GaugeMetricFamily(
            "overnight_adapter_info",
            "1 for what each policy's alias serves: role served (or canary), the adapter's "
            "name and version (adapter empty, version 0: the base model).",
            labels=["model_name", "policy", "alias", "role", "adapter", "version"],
        )
        # One series per configured policy and role: bounded by the configuration.
        for adapters in self.adapters.registries:
            for role, adapter in (("served", adapters.current), ("canary", adapters.canary)):
                if adapter is not None or role == "served":
                    name, version = (adapter.name, adapter.version) if adapter else ("", 0)
                    labels = [adapters.base_model or "", adapters.alias, adapters.alias, role]
                    info.add_metric([*labels, name, str(version)], 1)
        yield info
        yield from self._runs()

    def _runs(self) -> Iterable[Metric]:
        summary = self.summary
        if summary is None:
            return
        counts = GaugeMetricFamily(
            "overnight_training_runs",
            "Training runs in the data directory, by status (trained, failed).",
            labels=["status"],
        )
        for status, n in sorted(summary.counts.items()):
            counts.add_metric([status], n)
        yield counts
        last = summary.last
        if last is None:
            return
        info = GaugeMetricFamily(
            "overnight_last_training_run_info",
            "1 for the newest training run: its status (trained, failed) and whether its "
            "adapter was promoted.",
            labels=["status", "promoted"],
        )
        info.add_metric([last.status, "true" if last.promoted else "false"], 1)
        yield info
        yield GaugeMetricFamily(
            "overnight_last_training_run_end_timestamp_seconds",
            "When the newest training run ended (Unix time), whatever its status.",
            value=last.ended_at,
        )
        if summary.last_trained_at is not None:
            yield GaugeMetricFamily(
                "overnight_last_successful_training_run_end_timestamp_seconds",
                "When the newest run that trained ended (Unix time): alert on its age.",
                value=summary.last_trained_at,
            )
        yield from self._policy_runs(summary)

    def _policy_runs(self, summary: RunsSummary) -> Iterable[Metric]:
        """The same, per configured policy (bounded: a run of a policy this proxy does not
        serve counts only in the totals above; one from before policies, for the default)."""
        counts = GaugeMetricFamily(
            "overnight_policy_training_runs",
            "Training runs of each policy, by status (trained, failed).",
            labels=["policy", "status"],
        )
        ended = GaugeMetricFamily(
            "overnight_policy_last_training_run_end_timestamp_seconds",
            "When each policy's newest training run ended (Unix time), whatever its status.",
            labels=["policy"],
        )
        trained = GaugeMetricFamily(
            "overnight_policy_last_successful_training_run_end_timestamp_seconds",
            "When each policy's newest run that trained ended (Unix time): alert on its age.",
            labels=["policy"],
        )
        forgetting = GaugeMetricFamily(
            "overnight_policy_forgetting_nats_per_token",
            "The newest night's forgetting on the reference set, each policy's: the mean "
            "per-token log-likelihood its served adapter and its candidate lost against the "
            "base model, and the budget the gate held the candidate to (docs/operations.md).",
            labels=["policy", "of"],
        )
        default = self.adapters.default
        cycles: dict[str, list[Cycles]] = {}
        for policy in self.adapters.names:
            nights = [summary.by_policy.get(policy)]
            if policy == default:
                nights.append(summary.by_policy.get(None))
            nights = [n for n in nights if n is not None]
            statuses: dict[str, int] = {}
            for n in nights:
                for status, count in n.counts.items():
                    statuses[status] = statuses.get(status, 0) + count
            for status, count in sorted(statuses.items()):
                counts.add_metric([policy, status], count)
            last = max((n.last.ended_at for n in nights if n.last), default=None)
            if last is not None:
                ended.add_metric([policy], last)
            good = max((n.last_trained_at for n in nights if n.last_trained_at), default=None)
            if good is not None:
                trained.add_metric([policy], good)
            measured = max((n.forgetting for n in nights if n.forgetting), default=None,
                           key=lambda f: f[0])  # fmt: skip
            for of, value in (measured[1] if measured else {}).items():
                if value is not None:
                    forgetting.add_metric([policy, of], value)
            cycles[policy] = [n.cycles for n in nights]
        yield from (counts, ended, trained, forgetting)
        yield from _cycles(cycles)


def _cycles(by_policy: dict[str, list[Cycles]]) -> Iterable[Metric]:
    """Each policy's cycles (runs under its cycle lease: `overnight learn`'s and cron's),
    from their records (storage/read/runs.py); docs/operations.md has the queries."""
    run = CounterMetricFamily(
        "overnight_policy_cycles",
        "Cycles of each policy that recorded a run, by outcome: promoted, refused (by the "
        "gate), failed, not_promoted (trained; no promotion asked, or a canary). "
        "rate()*3600: cycles per hour.",
        labels=["policy", "outcome"],
    )
    latency = HistogramMetricFamily(
        "overnight_policy_cycle_to_serving_seconds",
        "The loop's latency: for each group a promoted cycle trained, the seconds from its "
        "data being in (its finish, or the agent's last reward for it if later) to the "
        "adapter trained on it serving.",
        labels=["policy"],
    )
    asleep = CounterMetricFamily(
        "overnight_policy_cycle_asleep_seconds",
        "Seconds vLLM slept so that cycles could train and gate on its GPU (colocated).",
        labels=["policy"],
    )
    ended = GaugeMetricFamily(
        "overnight_policy_last_cycle_end_timestamp_seconds",
        "When each policy's newest cycle ended (Unix time).",
        labels=["policy"],
    )
    took = GaugeMetricFamily(
        "overnight_policy_last_cycle_duration_seconds",
        "How long each policy's newest cycle took, from its run's start to its record.",
        labels=["policy"],
    )
    for policy, parts in by_policy.items():
        if not any(c.outcomes for c in parts):
            continue
        for outcome in CYCLE_OUTCOMES:
            run.add_metric([policy, outcome], sum(c.outcomes.get(outcome, 0) for c in parts))
        waits = [w for c in parts for w in c.waits]
        buckets = [(floatToGoString(b), sum(w <= b for w in waits)) for b in TO_SERVING_BUCKETS]
        latency.add_metric([policy], [*buckets, ("+Inf", len(waits))], sum(waits))
        asleep.add_metric([policy], sum(c.asleep for c in parts))
        last = max((c.last for c in parts if c.last), default=None)
        if last is not None:
            ended.add_metric([policy], last[0])
            took.add_metric([policy], last[1])
    yield from (run, latency, asleep, ended, took)
