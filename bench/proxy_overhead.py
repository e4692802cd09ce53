"""Proxy overhead, side by side in one run: direct calls, overnight, LiteLLM's proxy.

All three front the same fake vLLM, in its own process (overnight.testing.fake_upstream: vLLM's
response shapes, no model), so what differs is the proxy alone. Following the
capture issue: the proxy under test is pinned to core 0; the load generator (wrk)
and the fake upstream share core 1. overnight runs as `overnight serve --upstream`
with logging on (every request is fsynced to its log and counted afterwards).
LiteLLM's proxy runs from its own virtual environment (.cache/bench-litellm, made on
first use), one worker, no callbacks, no database.

    python bench/proxy_overhead.py                 # everything, about 4 minutes
    python bench/proxy_overhead.py --skip-litellm  # without the reference
    python bench/proxy_overhead.py --only common --rounds 5 --duration 3 [--profile DIR]
    python bench/proxy_overhead.py --only observe --rounds 5 --duration 3

`--only common` measures the common path alone (a plain agent's whole chat completion at
c1 and c16: direct, overnight, the bare aiohttp forwarder), the three in turn each round,
and prints each round and the medians; `--profile DIR` then samples the proxy with py-spy
under the c16 load (DIR/overnight.txt: collapsed stacks) and prints where its time went.
`--only observe` runs the same path through one proxy per OBSERVE variant (an integration
on or off: Prometheus metrics, then OpenTelemetry tracing with metrics on, exporting to a
loopback OTLP sink, bench/otlp_sink.py, on the load generator's core; and the records
written by a recorder process, `--recorder process`, moved to that core), in turn each round,
and prints each one's ratio to the variant it adds to, per round and their median, with
the proxy's CPU per request (/proc: all its threads, the exporter's too), which a busy
shared machine disturbs far less than requests per second.

The agent in the main scenarios is a plain client (it asks for neither token ids
nor logprobs), so overnight adds them upstream and removes them again: its common,
slower path. A second scenario has the client ask for both (forwarded verbatim).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from overnight.proxy.launch.launcher import free_port, wait_healthy  # noqa: E402
from overnight.testing.processes import spawn_serve  # noqa: E402

LITELLM_VERSION = "1.110.2"
# Both proxies check a client key (LiteLLM refuses to start without a master key).
API_KEY = "sk-bench-0123456789abcdef0123456789abcdef"
# `--only observe`: one proxy each, the same traffic in turn; name -> (serve flags, env,
# the variant it is compared with: its cost). "{sink}" is the loopback OTLP collector's URL
# (bench/otlp_sink.py), started when a variant names it.
OBSERVE = {
    "metrics off": (("--no-metrics",), {}, None),
    "metrics on": ((), {}, "metrics off"),
    # the records built and written by a recorder process (capture/recorder.py), which
    # runs on the load generator's core: what it saves the serving core, and costs there
    "recorder process": (("--recorder", "process"), {}, "metrics on"),
    "tracing on": ((), {"OTEL_EXPORTER_OTLP_ENDPOINT": "{sink}"}, "metrics on"),
    # what tracing costs where no span is sampled: ids and vLLM's traceparent only
    "tracing, none sampled": (
        (),
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "{sink}", "OTEL_TRACES_SAMPLER": "always_off"},
        "metrics on",
    ),
}
MESSAGES = [
    {"role": "system", "content": "You are a helpful agent."},
    {"role": "user", "content": "Which city is warmest today? Use the tools."},
]


@dataclass
class Result:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int = 0
    cpu_us: float | None = None  # the proxy's CPU per request (--only common, observe)
    helper_cpu_us: float | None = None  # its recorder process's, on another core


def pinned(core: int, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", str(core), *cmd] if shutil.which("taskset") else cmd


def start(
    cmd: list[str], health: str, env: dict | None = None, log: Path | None = None
) -> subprocess.Popen:
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    if not wait_healthy(health, 120, proc):
        raise SystemExit(f"{health} did not come up in 120 s")
    return proc


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()
    return float(value) * _UNITS[unit]


def wrk_script(script: Path, body: dict) -> Path:
    """wrk's Lua script: POST `body` as an agent with a client key and a rollout group."""
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = [[{json.dumps(body)}]]\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        'wrk.headers["X-Rollout-Group"] = "bench"\n'
        f'wrk.headers["Authorization"] = "Bearer {API_KEY}"\n'
    )
    return script


def wrk(url: str, body: dict, connections: int, duration: float, workdir: Path) -> Result:
    script = wrk_script(workdir / "post.lua", body)
    cmd = pinned(
        1,
        ["wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--latency", "-s", str(script), url],
    )
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    socket = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(bad.group(1)) if bad else 0) + (sum(map(int, socket.groups())) if socket else 0)
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    return Result(rps, p50, p99, errors, requests)


def recorder_on(core: int, url: str) -> int | None:
    """Move overnight's recorder process (proxy/capture/recorder.py), all its threads, to
    `core`; its pid, or None without one. Started by a proxy pinned to core 0 it would
    inherit core 0, where a deployment's scheduler would never keep it: it goes to the
    load generator's core instead, and its CPU is reported beside the proxy's."""
    request = urllib.request.Request(
        url + "/admin/stats", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        pid = (json.loads(r.read()).get("recorder") or {}).get("pid")
    if pid is not None and shutil.which("taskset"):
        subprocess.run(
            ["taskset", "-a", "-p", "-c", str(core), str(pid)], check=True, capture_output=True
        )
    return pid


def cpu_seconds(pid: int) -> float:
    """The CPU a process has used so far, all its threads (user and system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measured(
    pid: int,
    url: str,
    body: dict,
    connections: int,
    duration: float,
    work: Path,
    helper: int | None = None,
):
    """wrk's result, with the proxy's CPU per request over the same seconds: on a shared
    machine a far steadier measure of what a variant costs than its requests per second.
    `helper`: a process of the proxy's on another core (its recorder), measured alike."""
    before = cpu_seconds(pid)
    helper_before = cpu_seconds(helper) if helper else 0.0
    result = wrk(url, body, connections, duration, work)
    result.cpu_us = (cpu_seconds(pid) - before) / max(result.requests, 1) * 1e6
    if helper:
        spent = cpu_seconds(helper) - helper_before
        result.helper_cpu_us = spent / max(result.requests, 1) * 1e6
    return result


# `litellm[proxy]` pins a `litellm-proxy` package the registry does not have; the proxy
# code ships inside `litellm`, so its extra's other requirements are installed by name.
LITELLM_PROXY_DEPS = [
    "gunicorn",
    "uvicorn",
    "uvloop",
    "fastapi",
    "starlette",
    "backoff",
    "pyyaml",
    "rq",
    "orjson",
    "apscheduler",
    "fastapi-sso",
    "pyjwt",
    "python-multipart",
    "cryptography",
    "pynacl",
    "websockets",
    "boto3",
    "mcp>=2.3.0,<3",
    "pydantic>=2.12",
    "litellm-proxy-extras",
    "litellm-enterprise",
    "restrictedpython",
    "rich<14",
    "inquirerpy",
    "tomlkit",
    "semver",
    "expression",
    "backports-zstd",
    "polars",
    "soundfile",
    "azure-identity",
    "azure-storage-blob",
]


def litellm_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not (venv / "bin" / "litellm").exists():
        print(
            f"creating {venv} with litellm=={LITELLM_VERSION} and its proxy's needs (once)",
            flush=True,
        )
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                f"litellm=={LITELLM_VERSION}",
                *LITELLM_PROXY_DEPS,
            ],
            check=True,
        )
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    parser.add_argument(
        "--tokens", type=int, default=12, help="tokens per response (12: ~1.5 KB with logprobs)"
    )
    parser.add_argument("--skip-litellm", action="store_true")
    parser.add_argument("--litellm-venv", type=Path, default=ROOT / ".cache" / "bench-litellm")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--only",
        choices=["common", "observe"],
        help="common: the common path alone; observe: it with integrations on and off",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --only common/observe")
    parser.add_argument("--profile", type=Path, help="--only common: py-spy's samples here")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        raise SystemExit("wrk is needed: apt-get install wrk")

    work = Path(tempfile.mkdtemp(prefix="overnight-bench-"))
    stops: list[Callable[[], object]] = []  # the servers started so far, each one's stop
    try:
        if args.only == "common":
            results = run_common(args, work, stops)
        elif args.only == "observe":
            results = run_observe(args, work, stops)
        else:
            results = run_all(args, work, stops)
    finally:
        for halt in reversed(stops):
            halt()
    if args.only is None:
        report(results, args)
    elif args.json:  # --only common, --only observe
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    shutil.rmtree(work, ignore_errors=True)


def run_all(args, work: Path, stops: list[Callable[[], object]]) -> dict:
    # One piece on purpose: the servers, then every scenario in the order the table
    # prints them; splitting it would scatter the benchmark's plan.
    py = sys.executable

    def serve(core: int, cmd: list[str], health: str = "/health", **kw) -> str:
        port = free_port()
        cmd = [part.replace("{port}", str(port)) for part in cmd]
        base = f"http://127.0.0.1:{port}"
        proc = start(pinned(core, cmd), base + health, **kw)
        stops.append(lambda: stop(proc))
        return base

    def overnight(kind: str, upstream: str) -> str:
        """`overnight serve --upstream` on core 0, logging on (DATA/logs/serve.log)."""
        flags = ("--upstream", upstream, "--api-key", API_KEY)
        proxy = spawn_serve(work / kind, *flags, prefix=pinned(0, []))
        stops.append(proxy.stop)
        return proxy.url

    fake = ["-m", "overnight.testing.fake_upstream", "--port", "{port}"]
    fake += ["--tokens", str(args.tokens)]
    up = {
        "plain": serve(1, [py, *fake]),
        "delay20": serve(1, [py, *fake, "--delay", "0.02"]),
        "jitter": serve(1, [py, *fake, "--delay", "0.02", "--jitter", "0.5"]),
    }
    ours, bare = {}, {}
    for kind, upstream in up.items():
        ours[kind] = overnight(kind, upstream)
        bare[kind] = serve(
            0,
            [
                py,
                str(ROOT / "bench" / "bare_forwarder.py"),
                "--port",
                "{port}",
                "--upstream",
                upstream,
            ],
        )
    targets = {"direct": up["plain"], "overnight": ours["plain"], "bare-aiohttp": bare["plain"]}
    if not args.skip_litellm:
        config = work / "litellm.yaml"
        config.write_text(
            "model_list:\n  - model_name: policy\n    litellm_params:\n"
            f"      model: openai/fake-base\n      api_base: {up['plain']}/v1\n      api_key: unused\n"
            f"general_settings:\n  master_key: {API_KEY}\n"
        )
        litellm = litellm_python(args.litellm_venv).parent / "litellm"
        env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True")
        targets["litellm"] = serve(
            0,
            [str(litellm), "--config", str(config), "--port", "{port}", "--num_workers", "1"],
            health="/health/liveliness",
            env=env,
            log=work / "litellm.log",
        )

    plain = {"model": "policy", "messages": MESSAGES, "max_tokens": args.tokens}
    asking = {**plain, "logprobs": True, "return_token_ids": True}
    request = urllib.request.Request(
        up["plain"] + "/v1/chat/completions",
        data=json.dumps(asking).encode(),
        headers={"Content-Type": "application/json"},
    )
    size = len(urllib.request.urlopen(request).read())
    print(f"upstream response with token ids and logprobs: {size} bytes", flush=True)
    results: dict = {"response_bytes": size, "duration_s": args.duration}

    def measure(
        key: str, target_url: str, body: dict, connections: int, path: str = "chat/completions"
    ) -> None:
        wrk(f"{target_url}/v1/{path}", body, connections, 2, work)  # warm up
        r = wrk(f"{target_url}/v1/{path}", body, connections, args.duration, work)
        results[key] = r.__dict__
        print(
            f"{key:<40} {r.rps:>9.0f} req/s  p50 {r.p50_ms:7.3f} ms  p99 {r.p99_ms:7.3f} ms"
            f"  errors {r.errors}",
            flush=True,
        )

    for stream in (False, True):
        body = {**plain, "stream": stream}
        kind = "sse" if stream else "json"
        for name, target in targets.items():
            if stream and name == "bare-aiohttp":
                continue  # it buffers whole answers; not an SSE reference
            measure(f"{kind}/c1/{name}", target, body, 1)
            measure(f"{kind}/c16/{name}", target, body, 16)
    for kind in ("delay20", "jitter"):
        measure(f"json/c16/direct/{kind}", up[kind], plain, 16)
        measure(f"json/c16/overnight/{kind}", ours[kind], plain, 16)
        measure(f"json/c16/bare-aiohttp/{kind}", bare[kind], plain, 16)
    for name in ("direct", "overnight"):
        measure(f"json-asking/c1/{name}", targets[name], asking, 1)
        measure(f"json-asking/c16/{name}", targets[name], asking, 16)
    # The other chat APIs agents use (the fake answers them as the scripted agent),
    # recorded in the chat shape (docs/wire.md): Messages relayed verbatim; Responses
    # with the token-id fields added and hidden again (the fake ignores them, so this
    # measures adding them and the hiding pass over an answer that needs none).
    apis = {
        "responses": {
            "model": "policy",
            "input": MESSAGES[1:],
            "instructions": MESSAGES[0]["content"],
        },
        "messages": {"model": "policy", "max_tokens": args.tokens, "system": MESSAGES[0]["content"]}
        | {"messages": MESSAGES[1:]},
    }
    for api, api_body in apis.items():
        for stream in (False, True):
            kind = f"{api}-{'sse' if stream else 'json'}"
            for name in ("direct", "overnight"):
                body = {**api_body, "stream": stream}
                measure(f"{kind}/c1/{name}", targets[name], body, 1, api)
                measure(f"{kind}/c16/{name}", targets[name], body, 16, api)

    time.sleep(0.5)  # the last group commit
    with urllib.request.urlopen(ours["plain"] + "/admin/stats") as r:
        results["overnight_stats"] = json.loads(r.read())
    return results


def run_common(args, work: Path, stops: list[Callable[[], object]]) -> dict:
    """The common path, round by round: a plain agent's whole chat completion at c1 and
    c16, direct, through overnight and through the bare forwarder, each in turn."""
    py = sys.executable
    port = free_port()
    fake = [py, "-m", "overnight.testing.fake_upstream", "--port", str(port)]
    upstream = f"http://127.0.0.1:{port}"
    proc = start(pinned(1, [*fake, "--tokens", str(args.tokens)]), upstream + "/health")
    stops.append(lambda: stop(proc))
    flags = ("--upstream", upstream, "--api-key", API_KEY)
    proxy = spawn_serve(work / "plain", *flags, prefix=pinned(0, []))
    stops.append(proxy.stop)
    port = free_port()
    forwarder = [py, str(ROOT / "bench" / "bare_forwarder.py"), "--port", str(port)]
    bare_proc = start(
        pinned(0, [*forwarder, "--upstream", upstream]), f"http://127.0.0.1:{port}/health"
    )
    stops.append(lambda: stop(bare_proc))
    targets = {
        "direct": upstream,
        "overnight": proxy.url,
        "bare-aiohttp": f"http://127.0.0.1:{port}",
    }
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": args.tokens}
    # The CPU per request of the two on core 0 (direct's is the fake vLLM's: not counted).
    pids = {"overnight": proxy.pid, "bare-aiohttp": bare_proc.pid}
    rounds: list[dict] = []
    for url in targets.values():  # warm up
        wrk(f"{url}/v1/chat/completions", body, 16, 2, work)
    for i in range(args.rounds):
        row = {}
        for c in (1, 16):
            for name, url in targets.items():
                path = f"{url}/v1/chat/completions"
                if name in pids:
                    row[f"c{c}/{name}"] = measured(pids[name], path, body, c, args.duration, work)
                else:
                    row[f"c{c}/{name}"] = wrk(path, body, c, args.duration, work)
        rounds.append(row)
        ratio = row["c16/overnight"].rps / row["c16/bare-aiohttp"].rps
        added = row["c1/overnight"].p50_ms - row["c1/direct"].p50_ms
        bare_added = row["c1/bare-aiohttp"].p50_ms - row["c1/direct"].p50_ms
        print(
            f"round {i + 1}: c16 req/s overnight {row['c16/overnight'].rps:.0f}, bare"
            f" {row['c16/bare-aiohttp'].rps:.0f} ({ratio:.3f}x); c1 added p50 overnight"
            f" {added:.3f} ms, bare {bare_added:.3f} ms; c16 CPU/request overnight"
            f" {row['c16/overnight'].cpu_us:.0f} µs, bare {row['c16/bare-aiohttp'].cpu_us:.0f} µs",
            flush=True,
        )

    summary = {
        "c16 req/s overnight": median([r["c16/overnight"].rps for r in rounds]),
        "c16 req/s bare-aiohttp": median([r["c16/bare-aiohttp"].rps for r in rounds]),
        "c16 overnight / bare (per round, median)": median(
            [r["c16/overnight"].rps / r["c16/bare-aiohttp"].rps for r in rounds]
        ),
        "c1 p50 direct (ms)": median([r["c1/direct"].p50_ms for r in rounds]),
        "c1 p50 overnight (ms)": median([r["c1/overnight"].p50_ms for r in rounds]),
        "c1 p50 bare-aiohttp (ms)": median([r["c1/bare-aiohttp"].p50_ms for r in rounds]),
        "c1 p50 overnight - bare (per round, median, ms)": median(
            [r["c1/overnight"].p50_ms - r["c1/bare-aiohttp"].p50_ms for r in rounds]
        ),
        "c16 CPU µs/request overnight": median([r["c16/overnight"].cpu_us for r in rounds]),
        "c16 CPU µs/request bare-aiohttp": median([r["c16/bare-aiohttp"].cpu_us for r in rounds]),
        "c16 CPU bare / overnight (per round, median)": median(
            [r["c16/bare-aiohttp"].cpu_us / r["c16/overnight"].cpu_us for r in rounds]
        ),
    }
    print()
    for name, value in summary.items():
        print(f"{name:<52}{value:>10.3f}")
    errors = sum(r.errors for row in rounds for r in row.values())
    print(f"{'failed requests':<52}{errors:>10}")
    if args.profile:
        profile(proxy.pid, f"{proxy.url}/v1/chat/completions", body, args, work)
    return {
        "rounds": [{k: v.__dict__ for k, v in row.items()} for row in rounds],
        "summary": summary,
        "errors": errors,
    }


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def run_observe(args, work: Path, stops: list[Callable[[], object]]) -> dict:
    """The common path (a plain agent's whole chat completion, c1 and c16) through one
    proxy per OBSERVE variant, each in turn every round; each compared with the variant
    it adds to (tracing on with metrics on), round by round."""
    port = free_port()
    fake = [sys.executable, "-m", "overnight.testing.fake_upstream", "--port", str(port)]
    upstream = f"http://127.0.0.1:{port}"
    proc = start(pinned(1, [*fake, "--tokens", str(args.tokens)]), upstream + "/health")
    stops.append(lambda: stop(proc))
    sink = None
    if any("{sink}" in v for _, env, _ in OBSERVE.values() for v in env.values()):
        port = free_port()
        cmd = [sys.executable, str(ROOT / "bench" / "otlp_sink.py"), "--port", str(port)]
        sink_proc = start(pinned(1, cmd), f"http://127.0.0.1:{port}/health")
        stops.append(lambda: stop(sink_proc))
        sink = f"http://127.0.0.1:{port}"
    targets, traced, pids, helpers = {}, [], {}, {}
    for i, (name, (flags, env, _)) in enumerate(OBSERVE.items()):
        env = {k: v.replace("{sink}", sink or "") for k, v in env.items()}
        proxy = spawn_serve(
            work / f"observe-{i}",
            "--upstream",
            upstream,
            "--api-key",
            API_KEY,
            *flags,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, **env},
            prefix=pinned(0, []),
        )
        stops.append(proxy.stop)
        targets[name], pids[name] = proxy.url, proxy.pid
        helpers[name] = recorder_on(1, proxy.url)
        if "OTEL_EXPORTER_OTLP_ENDPOINT" in env and env.get("OTEL_TRACES_SAMPLER") != "always_off":
            traced.append(proxy.url)
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": args.tokens}
    for url in targets.values():  # warm up
        wrk(f"{url}/v1/chat/completions", body, 16, 2, work)
    compared = [(name, base) for name, (_, _, base) in OBSERVE.items() if base in targets]
    rounds = []
    for i in range(args.rounds):
        # Every other round in the reverse order: a machine that gets busier or quieter
        # during a round then favours neither the first variant nor the last.
        order = list(targets.items())[:: -1 if i % 2 else 1]
        row = {
            f"c{c}/{name}": measured(
                pids[name],
                f"{url}/v1/chat/completions",
                body,
                c,
                args.duration,
                work,
                helpers[name],
            )
            for c in (1, 16)
            for name, url in order
        }
        rounds.append(row)
        ratios = ", ".join(f"{name} / {base} {row[f'c16/{name}'].rps / row[f'c16/{base}'].rps:.3f}x"
                           for name, base in compared)  # fmt: skip
        print(f"round {i + 1}: " + ", ".join(f"{k} {r.rps:.0f} req/s p50 {r.p50_ms:.3f} ms"
                                             f" {r.cpu_us:.0f} µs CPU/req" for k, r in row.items())
              + f"; c16 {ratios}", flush=True)  # fmt: skip
    summary = {}
    for name in targets:
        summary[f"c16 req/s {name}"] = median([r[f"c16/{name}"].rps for r in rounds])
        summary[f"c1 p50 {name} (ms)"] = median([r[f"c1/{name}"].p50_ms for r in rounds])
        summary[f"c16 CPU µs/request {name}"] = median([r[f"c16/{name}"].cpu_us for r in rounds])
        if helpers[name] is not None:
            summary[f"c16 CPU µs/request {name}'s recorder (core 1)"] = median(
                [r[f"c16/{name}"].helper_cpu_us for r in rounds]
            )
    for name, base in compared:
        summary[f"c16 {name} / {base} (per round, median)"] = median(
            [r[f"c16/{name}"].rps / r[f"c16/{base}"].rps for r in rounds]
        )
        summary[f"c1 p50 {name} - {base} (per round, median, ms)"] = median(
            [r[f"c1/{name}"].p50_ms - r[f"c1/{base}"].p50_ms for r in rounds]
        )
        # The throughput a CPU-bound proxy would keep: the base's CPU per request over its.
        summary[f"c16 CPU {base} / {name} (per round, median)"] = median(
            [r[f"c16/{base}"].cpu_us / r[f"c16/{name}"].cpu_us for r in rounds]
        )
    print()
    for name, value in summary.items():
        print(f"{name:<56}{value:>10.3f}")
    errors = sum(r.errors for row in rounds for r in row.values())
    print(f"{'failed requests':<56}{errors:>10}")
    spans = None
    if sink is not None:
        spans, requests = exported_spans(sink, traced)
        print(f"{'spans at the sink / traced requests':<56}{f'{spans}/{requests}':>10}")
    return {
        "rounds": [{k: v.__dict__ for k, v in row.items()} for row in rounds],
        "summary": summary,
        "errors": errors,
        "spans_exported": spans,
    }


def exported_spans(sink: str, proxies: list[str]) -> tuple[int, int]:
    """(spans the sink decoded, requests the traced proxies served), once the exporters'
    last batch (at most OTEL_BSP_SCHEDULE_DELAY, 5 s, after the last request) is in."""
    requests = 0
    for url in proxies:
        with urllib.request.urlopen(url + "/admin/stats") as r:
            requests += json.loads(r.read())["requests"]
    for _ in range(40):
        with urllib.request.urlopen(sink + "/health") as r:
            spans = int(r.read())
        if spans >= requests:
            break
        time.sleep(0.25)
    return spans, requests


def profile(pid: int, url: str, body: dict, args, work: Path) -> None:
    """py-spy's samples of the proxy under c16 load; prints the top frames by share."""
    spy = shutil.which("py-spy")
    if spy is None:
        print("py-spy not found: no profile")
        return
    args.profile.mkdir(parents=True, exist_ok=True)
    out = args.profile / "overnight.txt"
    seconds = max(args.duration, 4)
    record = [spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "400"]
    said = args.profile / "py-spy.log"  # py-spy's own words, for when it wrote nothing
    with open(said, "wb") as log:
        spying = subprocess.Popen(
            [*record, "--format", "raw", "--output", str(out), "--nonblocking"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        time.sleep(0.5)
        wrk(url, body, 16, seconds, work)
        spying.wait(60)
    if not out.exists():
        print(f"py-spy wrote no samples (exit {spying.returncode}): {said.read_text()[-500:]}")
        return
    total, own, inside = 0, {}, {}
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        n = int(count)
        total += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in set(frames):
            inside[frame] = inside.get(frame, 0) + n
    print(f"\npy-spy: {total} samples of pid {pid} ({out})")
    for title, table in (("own time", own), ("in the stack", inside)):
        print(f"-- by {title}")
        for frame, n in sorted(table.items(), key=lambda kv: -kv[1])[:25]:
            print(f"{100 * n / total:6.1f}%  {frame[:150]}")


def report(results: dict, args) -> None:
    # One piece on purpose: the targets table, row by row, as the issue states them.
    r = results
    rows = []

    def check(name: str, value: float, op: str, limit: float) -> None:
        ok = value <= limit if op == "<=" else value >= limit
        rows.append((name, f"{value:.3f}", f"{op} {limit}", "PASS" if ok else "FAIL"))

    def info(name: str, value: float) -> None:
        rows.append((name, f"{value:.3f}", "", "info"))

    for kind in ("json", "sse"):
        added = r[f"{kind}/c1/overnight"]["p50_ms"] - r[f"{kind}/c1/direct"]["p50_ms"]
        check(f"{kind}: added p50 latency at c1 (ms)", added, "<=", 0.5)
        check(f"{kind}: requests/s at c16, no delay", r[f"{kind}/c16/overnight"]["rps"], ">=", 2000)
        if f"{kind}/c1/litellm" in r:
            lit_added = r[f"{kind}/c1/litellm"]["p50_ms"] - r[f"{kind}/c1/direct"]["p50_ms"]
            check(
                f"{kind}: throughput vs LiteLLM at c16 (x)",
                r[f"{kind}/c16/overnight"]["rps"] / r[f"{kind}/c16/litellm"]["rps"],
                ">=",
                15,
            )
            check(f"{kind}: added latency / LiteLLM's at c1", added / lit_added, "<=", 0.05)
    info(
        "json: bare aiohttp forwarder, added p50 at c1 (ms)",
        r["json/c1/bare-aiohttp"]["p50_ms"] - r["json/c1/direct"]["p50_ms"],
    )
    info(
        "json: overnight / bare aiohttp forwarder, req/s at c16",
        r["json/c16/overnight"]["rps"] / r["json/c16/bare-aiohttp"]["rps"],
    )
    check(
        "json: vs direct at c16, 20 ms upstream",
        r["json/c16/overnight/delay20"]["rps"] / r["json/c16/direct/delay20"]["rps"],
        ">=",
        0.95,
    )
    info(
        "json: bare aiohttp vs direct at c16, 20 ms upstream",
        r["json/c16/bare-aiohttp/delay20"]["rps"] / r["json/c16/direct/delay20"]["rps"],
    )
    info(
        "json: vs direct at c16, 10-30 ms upstream",
        r["json/c16/overnight/jitter"]["rps"] / r["json/c16/direct/jitter"]["rps"],
    )
    for api in ("responses", "messages"):
        for kind in (f"{api}-json", f"{api}-sse"):
            if f"{kind}/c1/overnight" not in r:
                continue
            added = r[f"{kind}/c1/overnight"]["p50_ms"] - r[f"{kind}/c1/direct"]["p50_ms"]
            info(f"{kind}: added p50 latency at c1 (ms)", added)
            info(f"{kind}: requests/s at c16", r[f"{kind}/c16/overnight"]["rps"])
    stats = r["overnight_stats"]
    rows.append(
        (
            "overnight rows committed / requests",
            f"{stats['rows_committed']}/{stats['requests']}",
            "= all",
            "PASS" if stats["rows_committed"] == stats["requests"] else "FAIL",
        )
    )
    errors = sum(v["errors"] for v in r.values() if isinstance(v, dict) and "errors" in v)
    rows.append(
        ("failed requests in all runs", str(errors), "= 0", "PASS" if errors == 0 else "FAIL")
    )
    print(f"\n{'target':<56}{'measured':<14}{'limit':<12}")
    for name, value, limit, verdict in rows:
        print(f"{name:<56}{value:<14}{limit:<12}{verdict}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": r, "targets": rows}, indent=2))


if __name__ == "__main__":
    main()
