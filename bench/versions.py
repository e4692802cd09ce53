"""Two versions of overnight side by side in one run: proxy overhead and the GRPO step.

    python bench/versions.py --base 598cae5 --head HEAD
    python bench/versions.py --base HEAD --head WORKTREE --rounds 3 --json bench/results/versions.json

Each ref is unpacked once with `git archive` into .cache/bench-versions/<sha>/ (WORKTREE:
the tracked and untracked, not ignored, files of this checkout, copied afresh each run).
The parts at the repository's top level (proxy/, storage/, ...) are installed as
`overnight.<part>` through pyproject.toml's package-dir, so each tree gets symlinks
overnight/<part> -> ../<part>; every process for a version then runs with PYTHONPATH and
cwd set to its tree, which the path finder resolves before the editable install's
meta-path finder. That finder would still serve a part the tree lacks from this checkout,
so a sitecustomize on the same PYTHONPATH (.cache/bench-versions/isolate/) removes it;
checked at start in a subprocess per tree (`overnight.proxy.__file__`).

Proxy: as bench/proxy_overhead.py (same bodies, same pinning): each version's
`overnight serve --upstream` on core 0, logging on, in front of one fake vLLM (the head
tree's) that shares core 1 with wrk. Only one proxy runs at a time; the order alternates
between rounds (base, head; head, base; ...) so that drift of the shared machine hits
both, and direct calls are measured in every round. GRPO step: each tree's own
bench/grpo_step.py, alternating the same way, on one shared tiny model. Medians over the
rounds, and head/base ratios.

This script imports nothing from either version, so it can compare any two refs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench-versions"
# On every version's PYTHONPATH, after its tree: drops the editable install's meta-path
# finder, which would otherwise serve `overnight.<part>` from this checkout for any part
# the tree lacks (overnight.view, say, in a tree from before it existed).
GUARD = CACHE / "isolate" / "sitecustomize.py"
GUARD_CODE = """# Written by bench/versions.py: the tree under benchmark imports its own code only.
import sys

sys.meta_path[:] = [
    f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")
]
"""
WORKTREE = "WORKTREE"
# As bench/proxy_overhead.py: a client key, a plain agent's request, 12-token answers.
API_KEY = "sk-bench-0123456789abcdef0123456789abcdef"
MESSAGES = [
    {"role": "system", "content": "You are a helpful agent."},
    {"role": "user", "content": "Which city is warmest today? Use the tools."},
]
SCENARIOS = [("json", 1), ("json", 16), ("sse", 1), ("sse", 16)]
STARTUP_S = 120.0


@dataclass
class Version:
    label: str  # "base" or "head"
    ref: str
    sha: str  # the commit, or "<HEAD sha>+worktree"
    tree: Path

    def env(self) -> dict[str, str]:
        # Replaced, not prepended: a PYTHONPATH naming the checkout would win otherwise.
        return dict(os.environ, PYTHONPATH=f"{self.tree}{os.pathsep}{GUARD.parent}")


# ---------------------------------------------------------------- trees


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def materialise(label: str, ref: str) -> Version:
    """The ref's files in their own tree, laid out to import as the installed package."""
    if ref == WORKTREE:
        sha = git("rev-parse", "HEAD").strip()[:12] + "+worktree"
        tree = CACHE / "worktree"
        shutil.rmtree(tree, ignore_errors=True)  # the working tree changes between runs
        copy_worktree(tree)
    else:
        sha = git("rev-parse", "--verify", f"{ref}^{{commit}}").strip()
        tree = CACHE / sha
        if not tree.exists():  # unpacked beside, then renamed: never half a tree
            partial = Path(tempfile.mkdtemp(prefix=f"{sha}.", dir=CACHE))
            archive = subprocess.Popen(["git", "archive", sha], cwd=ROOT, stdout=subprocess.PIPE)
            subprocess.run(["tar", "-x", "-C", str(partial)], stdin=archive.stdout, check=True)
            if archive.wait() != 0:
                raise SystemExit(f"git archive {ref} failed")
            partial.rename(tree)
    link_parts(tree)
    return Version(label, ref, sha, tree)


def copy_worktree(tree: Path) -> None:
    listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is skipped
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tree / name)


def link_parts(tree: Path) -> None:
    """overnight/<part> -> ../<dir> for each package-dir entry of that tree's pyproject."""
    pyproject = tomllib.loads((tree / "pyproject.toml").read_text())
    package_dir = pyproject["tool"]["setuptools"].get("package-dir", {})
    for package, directory in package_dir.items():
        parent, _, part = package.rpartition(".")
        if parent != "overnight" or not (tree / directory).is_dir():
            continue
        link = tree / "overnight" / part
        if not link.is_symlink() and not link.exists():
            link.symlink_to(Path("..") / directory)


def check_imports(version: Version) -> str:
    """Where `overnight.proxy` comes from in this version's processes; must be its tree.

    A part the tree lacks must not be found at all (the guard removed the editable finder).
    """
    code = (
        "import sys, overnight.proxy, overnight.storage\n"
        "assert not [f for f in sys.meta_path if 'editable' in getattr(f, '__module__', '')]\n"
        "print(overnight.proxy.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=version.tree,
        env=version.env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(out).resolve().is_relative_to(version.tree.resolve()):
        raise SystemExit(f"{version.label}: overnight.proxy imports from {out}, not {version.tree}")
    return out


# ---------------------------------------------------------------- servers


def pinned(core: int, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", str(core), *cmd] if shutil.which("taskset") else cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A process in its own session that answered `/health`; stop() cannot hang."""

    def __init__(self, cmd: list[str], port: int, version: Version, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                cmd,
                cwd=version.tree,
                env=version.env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # it answered
            except OSError:
                time.sleep(0.2)
        tail = self.log.read_bytes()[-2000:].decode(errors="replace")
        raise SystemExit(f"{' '.join(self.process.args)} did not come up\n{tail}")

    def stop(self) -> None:
        """SIGTERM (the proxy commits and compacts its log), SIGKILL after 60 s."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass


def start(cmd: list[str], version: Version, log: Path, stops: list[Callable[[], None]]) -> Server:
    port = free_port()
    server = Server([part.replace("{port}", str(port)) for part in cmd], port, version, log)
    stops.append(server.stop)  # registered before the wait: a failed start is stopped too
    server.wait_healthy()
    return server


# ---------------------------------------------------------------- wrk

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()
    return float(value) * _UNITS[unit]


def wrk(url: str, body: dict, connections: int, duration: float, work: Path) -> dict:
    """One wrk run pinned to core 1 (as bench/proxy_overhead.py): req/s, p50, p99, errors."""
    script = work / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = [[{json.dumps(body)}]]\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        'wrk.headers["X-Rollout-Group"] = "bench"\n'
        f'wrk.headers["Authorization"] = "Bearer {API_KEY}"\n'
    )
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--latency", "-s", str(script)]
    out = subprocess.run(
        pinned(1, [*cmd, url + "/v1/chat/completions"]), capture_output=True, text=True, check=True
    ).stdout
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "p50_ms": _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1)),
        "p99_ms": _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1)),
        "errors": (int(bad.group(1)) if bad else 0) + (sum(map(int, sock.groups())) if sock else 0),
    }


def ensure_wrk() -> None:
    if shutil.which("wrk"):
        return
    print("wrk is missing: apt-get install -y wrk", flush=True)
    subprocess.run(["apt-get", "install", "-y", "wrk"], check=False)
    if not shutil.which("wrk"):
        raise SystemExit("wrk is needed: apt-get install wrk")


# ---------------------------------------------------------------- proxy rounds


def order(versions: list[Version], round_: int) -> list[Version]:
    """base, head in even rounds; head, base in odd ones."""
    return versions if round_ % 2 == 0 else versions[::-1]


def proxy_rounds(args, versions: list[Version], work: Path, stops: list) -> dict:
    """{scenario: {"direct"|"base"|"head": [one result per round]}}, plus stats per version."""
    head = versions[1]
    module = "overnight.testing.fake_upstream"
    if not (head.tree / "overnight" / "testing" / "fake_upstream.py").exists():
        module = "overnight.fake_upstream"  # before the layout change
    fake_cmd = [sys.executable, "-m", module, "--port", "{port}", "--tokens", str(args.tokens)]
    fake = start(pinned(1, fake_cmd), head, work / "fake.log", stops)
    results: dict = {f"{k}/c{c}": {"direct": [], "base": [], "head": []} for k, c in SCENARIOS}
    results["stats"] = {"base": [], "head": []}

    def measure(label: str, url: str) -> None:
        for kind, connections in SCENARIOS:
            body = {"model": "policy", "messages": MESSAGES, "max_tokens": args.tokens}
            body["stream"] = kind == "sse"
            if args.warmup > 0:
                wrk(url, body, connections, args.warmup, work)
            r = wrk(url, body, connections, args.duration, work)
            results[f"{kind}/c{connections}"][label].append(r)
            print(
                f"  {f'{kind}/c{connections}':<9}{label:<7}{r['rps']:>9.0f} req/s  "
                f"p50 {r['p50_ms']:7.3f} ms  p99 {r['p99_ms']:7.3f} ms  errors {r['errors']}",
                flush=True,
            )

    for round_ in range(args.rounds):
        print(f"proxy, round {round_ + 1} of {args.rounds}", flush=True)
        measure("direct", fake.url)
        for version in order(versions, round_):
            results["stats"][version.label].append(
                serve_and_measure(version, fake.url, work, stops, measure)
            )
    fake.stop()
    return results


def serve_and_measure(version: Version, upstream: str, work: Path, stops: list, measure) -> dict:
    """This version's proxy alone on core 0, fresh data, measured, its stats read, stopped."""
    data = Path(tempfile.mkdtemp(prefix=f"{version.label}-", dir=work))
    cmd = [sys.executable, "-m", "overnight.cli", "serve", "--upstream", upstream]
    cmd += ["--data", str(data), "--api-key", API_KEY, "--port", "{port}", "--log-level", "WARNING"]
    proxy = start(pinned(0, cmd), version, work / f"{version.label}.log", stops)
    try:
        measure(version.label, proxy.url)
        time.sleep(0.5)  # the last group commit
        with urllib.request.urlopen(proxy.url + "/admin/stats", timeout=10) as r:
            stats = json.loads(r.read())
    finally:
        proxy.stop()
    shutil.rmtree(data, ignore_errors=True)
    return {k: stats.get(k) for k in ("requests", "rows_committed")}


# ---------------------------------------------------------------- GRPO step

_TIMING = re.compile(r"^([A-Za-z][^:\n]*):\s+([\d.]+) ms\s*$", re.M)


def grpo_once(version: Version, args) -> dict[str, float]:
    """The tree's own bench/grpo_step.py; its `name: N ms` lines."""
    cmd = [sys.executable, "bench/grpo_step.py", "--repeats", str(args.repeats)]
    cmd += ["--model-dir", str(CACHE / "tiny-model")]  # one model for both versions
    run = subprocess.run(
        cmd, cwd=version.tree, env=version.env(), capture_output=True, text=True, timeout=3600
    )
    timings = {name.strip(): float(ms) for name, ms in _TIMING.findall(run.stdout)}
    if run.returncode != 0 or not timings:
        raise SystemExit(
            f"{version.label} grpo_step.py failed:\n{run.stdout}\n{run.stderr[-3000:]}"
        )
    print(
        f"  {version.label:<5} " + ", ".join(f"{k} {v:.1f} ms" for k, v in timings.items()),
        flush=True,
    )
    return timings


def grpo_rounds(args, versions: list[Version]) -> dict:
    """{"base"|"head": [one {name: ms} per round]}."""
    results: dict = {"base": [], "head": []}
    for round_ in range(args.rounds):
        print(f"GRPO step, round {round_ + 1} of {args.rounds}", flush=True)
        for version in order(versions, round_):
            results[version.label].append(grpo_once(version, args))
    return results


# ---------------------------------------------------------------- report


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def added_p50(runs: dict, label: str) -> float:
    """Median over rounds of the p50 added over direct calls measured in the same round."""
    direct = [r["p50_ms"] for r in runs["direct"]]
    return median([r["p50_ms"] - d for r, d in zip(runs[label], direct, strict=True)])


def proxy_rows(proxy: dict) -> list[tuple[str, float, float, float | None]]:
    """(name, base, head, direct) medians: req/s, and p50 added over direct."""
    rows = []
    for kind, c in SCENARIOS:
        runs = proxy[f"{kind}/c{c}"]
        rps = {k: median([r["rps"] for r in v]) for k, v in runs.items()}
        rows.append((f"{kind} c{c}: req/s", rps["base"], rps["head"], rps["direct"]))
        added = (added_p50(runs, "base"), added_p50(runs, "head"))
        rows.append((f"{kind} c{c}: added p50 over direct (ms)", *added, None))
    return rows


def grpo_rows(grpo: dict) -> list[tuple[str, float, float, float | None]]:
    names = [n for n in grpo["base"][0] if n in grpo["head"][0]]
    rows = []
    for name in names:
        base, head = (median([r[name] for r in grpo[k]]) for k in ("base", "head"))
        rows.append((f"{name} (ms)", base, head, None))
    packed, plain = "GRPO step, packed", "plain forward+backward"
    if packed in names and plain in names:  # within one process: less exposed to drift
        ratio = {k: median([r[packed] / r[plain] for r in v]) for k, v in grpo.items()}
        rows.append(("packed GRPO / plain", ratio["base"], ratio["head"], None))
    return rows


def report(results: dict, versions: list[Version], args) -> None:
    base, head = versions
    rows = []
    if "proxy" in results:
        rows += proxy_rows(results["proxy"])
    if "grpo" in results:
        rows += grpo_rows(results["grpo"])
    print(f"\nbase = {base.ref} ({base.sha[:12]}), head = {head.ref} ({head.sha})")
    print(f"medians of {args.rounds} round(s); proxy: {args.duration:g} s per wrk run")
    print(f"{'':<42}{'base':>10}{'head':>10}{'head/base':>11}{'direct':>10}")
    for name, b, h, direct in rows:
        ratio = h / b if b else float("nan")
        d = f"{direct:>10.0f}" if direct is not None else ""
        digits = 1 if min(b, h) >= 100 else 3  # req/s and ms of a GRPO step; ms added
        print(f"{name:<42}{b:>10.{digits}f}{h:>10.{digits}f}{ratio:>11.3f}{d}")
    if "proxy" in results:
        proxy = results["proxy"]
        for label in ("base", "head"):
            errors = sum(r["errors"] for k, v in proxy.items() if k != "stats" for r in v[label])
            stats = proxy["stats"][label]
            committed = sum(s["rows_committed"] or 0 for s in stats)
            requests = sum(s["requests"] or 0 for s in stats)
            print(f"{label}: failed requests {errors}, rows committed {committed}/{requests}")
    results["table"] = [
        {"name": n, "base": b, "head": h, "head_over_base": h / b if b else None, "direct": d}
        for n, b, h, d in rows
    ]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="git ref (default HEAD)")
    parser.add_argument("--head", default=WORKTREE, help=f"git ref or {WORKTREE} (default)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk measurement")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of wrk before each")
    parser.add_argument("--tokens", type=int, default=12, help="tokens per response")
    parser.add_argument("--repeats", type=int, default=3, help="grpo_step.py --repeats")
    parser.add_argument("--skip-proxy", action="store_true")
    parser.add_argument("--skip-grpo", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # A SIGTERM to this script unwinds through the finally below, which stops the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    GUARD.parent.mkdir(parents=True, exist_ok=True)
    GUARD.write_text(GUARD_CODE)
    versions = [materialise("base", args.base), materialise("head", args.head)]
    results: dict = {"versions": {}}
    for v in versions:
        where = check_imports(v)
        print(f"{v.label}: {v.ref} = {v.sha}; overnight.proxy from {where}", flush=True)
        results["versions"][v.label] = {"ref": v.ref, "sha": v.sha, "tree": str(v.tree)}
    results["settings"] = {k: str(v) for k, v in vars(args).items()}
    work = Path(tempfile.mkdtemp(prefix="overnight-versions-"))
    stops: list[Callable[[], None]] = []
    try:
        if not args.skip_proxy:
            ensure_wrk()
            results["proxy"] = proxy_rounds(args, versions, work, stops)
        if not args.skip_grpo:
            results["grpo"] = grpo_rounds(args, versions)
    finally:
        for halt in reversed(stops):
            halt()
        shutil.rmtree(work, ignore_errors=True)
    report(results, versions, args)


if __name__ == "__main__":
    main()
