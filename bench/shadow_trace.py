"""What a served request met at the upstream: bench/shadow_latency.py's diagnosis.

The shadowed proxy writes a JSON line per sibling request event to the file named by
OVERNIGHT_SHADOW_TRACE (proxy/shadow/sampler.py: send, first bytes back, cancel, done, closed,
stored), timed by time.monotonic(), the clock the benchmark times served requests by.
Each served request of the shadow arm is put in one of these states by what its
replica was doing when the request was sent:

- idle: no sibling request open, none closed in the last AFTER_S;
- after: no sibling request open, one closed within AFTER_S before (its rows being
  built and written by the proxy, vLLM freeing it);
- prefill: a sibling request sent, no token of it back yet (vLLM's prefill, a step
  that cannot be cut short, or the request still on its way in);
- decode: a sibling request streaming tokens (cancelled once the proxy sees the
  served request; its connection closed then, vLLM aborts it at its next write).

Counted per state: how many, their p50 and p99, and how many are slow (over the plain
arm's p99 of the same run); the sibling requests sent while a served request was on its
way, in its first half (the proxy had read it but not yet forwarded it, so it did not
count as in flight) or its second (its answer was written, not yet read by the client);
each proxy's event-loop stalls; the slowest requests with their sibling's timings.
"""

from __future__ import annotations

import bisect
import json
import re
import time
from pathlib import Path


def events(trace: Path) -> list[dict]:
    return [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []


def stalls(trace: Path) -> list[tuple[float, float]]:
    """The proxy's event-loop stalls: (from, to)."""
    return [(e["t"] - e["ms"] / 1000, e["t"]) for e in events(trace) if e["event"] == "stall"]


def attempts(trace: Path) -> list[dict]:
    """The sibling requests of the trace, each {send, first, cancel, done, closed, key}."""
    out: list[dict] = []
    open_: dict[str, dict] = {}
    stored: list[float] = []
    for e in events(trace):
        event, key, t = e["event"], e["key"], e["t"]
        if event == "send":
            open_[key] = {"key": key, "send": t, "first": None, "cancel": None, "done": None}
        elif event == "stored":
            stored.append(t)
        elif key in open_:
            if event == "closed":
                out.append({**open_.pop(key), "closed": t})
            elif open_[key].get(event) is None:
                open_[key][event] = t
    out.sort(key=lambda a: a["send"])
    for a in out:
        a["stored"] = stored
    return out


VLLM_LINE = re.compile(r"^(\d+\.\d+) INFO \S+ (?:Added request (\S+)\.|Request (\S+) aborted\.)")


def vllm_requests(log: Path) -> tuple[list[float], list[float], list[float]]:
    """From vLLM's log (`--vllm-log`): when served (chat) requests reached the engine,
    when sibling requests did, when sibling requests were aborted; time.monotonic()."""
    offset = time.time() - time.monotonic()
    served, siblings, aborted = [], [], []
    for line in log.read_text(errors="replace").splitlines():
        m = VLLM_LINE.match(line)
        if not m:
            continue
        t = float(m[1]) - offset
        if m[2] is not None:
            (served if "chatcmpl" in m[2] else siblings).append(t)
        elif "chatcmpl" not in m[3]:
            aborted.append(t)
    return served, siblings, aborted


# How long after a sibling request closed a served request counts as sent "after" it.
AFTER_S = 0.1


def state_at(t: float, runs: list[dict]) -> tuple[str, dict | None]:
    """What the sibling side was doing at `t`: idle, after, prefill or decode, and the
    sibling request concerned."""
    latest = None
    for a in runs:
        if a["send"] <= t < a["closed"]:
            return ("prefill" if a["first"] is None or t < a["first"] else "decode"), a
        if a["closed"] <= t and (latest is None or a["closed"] > latest["closed"]):
            latest = a
    if latest is not None and t - latest["closed"] < AFTER_S:
        return "after", latest
    return "idle", None


def analyse(requests: list[dict], traces: dict[str, Path], vllm_log: Path | None = None) -> dict:
    """`requests` as bench/shadow_latency.py timed them; `traces` by arm (those whose
    name starts with "shadow" sample siblings)."""
    aborted = _match_engine(requests, vllm_log) if vllm_log is not None else None
    stalled = {arm: stalls(path) for arm, path in traces.items()}
    plain = sorted(r["ms"] for r in requests if r["arm"] == "plain")
    limit = plain[min(len(plain) - 1, round(0.99 * len(plain)) - 1)]
    for r in requests:  # the longest stall of its own proxy while it was in flight
        spans = (b - a for a, b in stalled[r["arm"]] if a < r["ended"] and b > r["sent"])
        r["stall"] = max(spans, default=0)
    runs = {arm: attempts(path) for arm, path in traces.items() if arm.startswith("shadow")}
    arms = {arm: _shadow_arm(requests, arm, sibs, limit) for arm, sibs in runs.items()}
    slow = [s for a in arms.values() for s in a.pop("slow")]
    engine = _engine(requests, runs["shadow"], aborted) if aborted is not None else {}
    return {
        "plain_p99_ms": limit,
        "shadow_arms": arms,
        "stalls": {
            arm: _figures([(b - a) * 1000 for a, b in v], None) for arm, v in stalled.items()
        },
        "slow_during_a_stall": {
            arm: sum(r["ms"] > limit and r["stall"] > 0 for r in requests if r["arm"] == arm)
            for arm in traces
        },
        "slow": sorted(slow, key=lambda s: -s["ms"]),
        **engine,
    }


def _shadow_arm(requests: list[dict], arm: str, runs: list[dict], limit: float) -> dict:
    """A shadow arm's served requests by state, and its siblings sent while a served
    request was on its way: in its first half (the proxy had not forwarded it yet) or
    its second (its answer was written, not yet read by the client)."""
    states: dict[str, list[float]] = {"idle": [], "after": [], "prefill": [], "decode": []}
    halves = {"first": 0, "second": 0}
    slow: list[dict] = []
    for r in requests:
        if r["arm"] != arm:
            continue
        state, a = state_at(r["sent"], runs)
        r["state"] = state
        states[state].append(r["ms"])
        for x in runs:
            if r["sent"] < x["send"] < r["ended"]:
                halves["first" if x["send"] - r["sent"] < r["ended"] - x["send"] else "second"] += 1
        if r["ms"] > limit:
            slow.append(
                {
                    "arm": arm,
                    **_describe(r, state, a, runs),
                    "stall_ms": round(r["stall"] * 1000, 1),
                }
            )
    cancels = [a["closed"] - a["cancel"] for a in runs if a["cancel"] is not None]
    return {
        "states": {k: _figures(v, limit) for k, v in states.items()},
        "sibling_requests": len(runs),
        "cancelled": len(cancels),
        "cancel_to_closed_ms": _figures([c * 1000 for c in cancels], None),
        "siblings_sent_during_a_served_request": halves,
        "slow": slow,
    }


def _match_engine(requests: list[dict], log: Path) -> list[float]:
    """Sets each request's `engine`: when it reached vLLM's engine (s after it was
    sent; the first served arrival after it, unclaimed). Returns the siblings' aborts."""
    served, _, aborted = vllm_requests(log)
    free = sorted(served)
    for r in sorted(requests, key=lambda r: r["sent"]):
        i = bisect.bisect_left(free, r["sent"])
        if i < len(free) and free[i] < r["ended"]:
            r["engine"] = free.pop(i) - r["sent"]
    return aborted


def _engine(requests: list[dict], runs: list[dict], aborted: list[float]) -> dict:
    """When requests reached the engine, by arm and state; a sibling's cancel to its abort."""
    delays = []
    for a in runs:
        if a["cancel"] is not None:
            i = bisect.bisect_left(aborted, a["cancel"] - 0.001)
            if i < len(aborted) and aborted[i] < a["cancel"] + 2:
                delays.append((aborted[i] - a["cancel"]) * 1000)
    to_engine = {
        arm: _figures(
            [r["engine"] * 1000 for r in requests if r["arm"] == arm and "engine" in r], None
        )
        for arm in sorted({r["arm"] for r in requests})
    }
    by_state = {
        state: _figures(
            [r["engine"] * 1000 for r in requests if r.get("state") == state and "engine" in r],
            None,
        )
        for state in ("idle", "after", "prefill", "decode")
    }
    return {
        "cancel_to_abort_ms": _figures(delays, None),
        "sent_to_engine_ms": to_engine,
        "shadow_sent_to_engine_ms_by_state": by_state,
    }


def _figures(values: list[float], limit: float | None) -> dict:
    if not values:
        return {"n": 0}
    v = sorted(values)
    out = {
        "n": len(v),
        "p50": round(v[len(v) // 2], 1),
        "p99": round(v[min(len(v) - 1, round(0.99 * len(v)) - 1)], 1),
        "max": round(v[-1], 1),
    }
    if limit is not None:
        out["over_plain_p99"] = sum(x > limit for x in v)
    return out


def _describe(r: dict, state: str, a: dict | None, runs: list[dict]) -> dict:
    ms = lambda x: None if x is None else round((x - r["sent"]) * 1000, 1)  # noqa: E731
    out = {"ms": round(r["ms"], 1), "state": state, "round": r["round"]}
    if "engine" in r:
        out["engine_ms"] = round(r["engine"] * 1000, 1)
    if r.get("first") is not None:
        out["first_ms"] = ms(r["first"])
    if a is not None:  # the sibling request's events, relative to the served request's send
        out["sibling"] = {k: ms(a[k]) for k in ("send", "first", "cancel", "closed")}
    during = [ms(x["send"]) for x in runs if r["sent"] < x["send"] < r["ended"]]
    if during:  # sibling requests sent while it was on its way
        out["siblings_sent_at_ms"] = during
    near = [ms(t) for t in a["stored"] if r["sent"] <= t <= r["ended"]] if a else []
    if near:
        out["rows_stored_at_ms"] = near
    return out


def report(found: dict) -> None:
    print(f"slow = over the plain arm's p99 ({found['plain_p99_ms']:.1f} ms)")
    for arm, a in found["shadow_arms"].items():
        for state, f in a["states"].items():
            print(f"  {arm}: sent while siblings {state:7s}: {f}")
        print(
            f"  {arm}: sibling requests {a['sibling_requests']}, cancelled {a['cancelled']}, "
            f"cancel -> connection closed {a['cancel_to_closed_ms']}, sent while a served "
            f"request was on its way, in its half: {a['siblings_sent_during_a_served_request']}"
        )
    for key in ("cancel_to_abort_ms", "sent_to_engine_ms", "shadow_sent_to_engine_ms_by_state"):
        if key in found:
            print(f"  {key}: {found[key]}")
    print(f"  event-loop stalls (10 ms late or more): {found['stalls']}")
    print(f"  slow requests during a stall of their own proxy: {found['slow_during_a_stall']}")
    for s in found["slow"][:12]:
        print(f"  slow: {s}")
