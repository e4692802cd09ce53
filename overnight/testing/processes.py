"""Start `overnight serve` (and the fake vLLM) as real processes: started, healthy, stopped.

The process tests (SIGTERM, SIGKILL), the demo and the benchmarks need the command a
user types, in its own process, rather than the app in-process. This is the one place
that starts it: a free port, output to a log file, a deadline for becoming healthy
(with the log's tail in the error when it does not), and a stop that cannot hang
(SIGTERM, which lets the proxy commit and compact its log and stop vLLM, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from overnight.proxy.launch.launcher import LaunchError, free_port, wait_healthy

# Beside vLLM's own log (logs/vllm.log, written by `serve --model`).
SERVE_LOG = Path("logs") / "serve.log"
# The proxy alone starts in a second or two; a cold machine can take ten times that.
PROXY_STARTUP_S = 120.0
# Stopping commits and compacts the log, and stops vLLM when serve started it.
STOP_TIMEOUT_S = 120.0


@dataclass
class Spawned:
    """A server process that answered its health check: its base URL and its log."""

    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT, no trailing slash
    log_path: Path | None

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then SIGKILL if it is still running after `timeout`; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def log_tail(self, chars: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-chars:].decode(errors="replace")

    def __enter__(self) -> Spawned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn(
    command: Sequence[str],
    url: str,
    *,
    health: str = "/health",
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    startup_timeout: float = PROXY_STARTUP_S,
) -> Spawned:
    """Run `command` and wait until `url + health` answers; LaunchError if it does not.

    Output goes to `log_path` (appended: a restart on the same data keeps the first
    run's lines), or nowhere when None.
    """
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = log_path.open("ab")
    else:
        out = subprocess.DEVNULL
    try:
        process = subprocess.Popen(
            list(command),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
        )
    finally:
        if log_path is not None:
            out.close()  # the child holds its own copy
    spawned = Spawned(process, url, log_path)
    try:
        healthy = wait_healthy(url + health, startup_timeout, process)
    except LaunchError:  # it exited while starting
        healthy = False
    if not healthy:
        code = process.poll()
        spawned.stop()  # a serve that started vLLM stops it on SIGTERM: give it the time
        if code is not None:
            state = f"exited with code {code} while starting"
        else:
            state = f"no answer at {url}{health} in {startup_timeout:.0f} s"
        raise LaunchError(
            f"{' '.join(command)}: {state}"
            + (f"\n--- {log_path} ---\n{spawned.log_tail()}" if log_path else "")
        )
    return spawned


def spawn_serve(
    data_dir: str | Path,
    *args: str,
    port: int | None = None,
    log_level: str = "WARNING",
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    startup_timeout: float = PROXY_STARTUP_S,
    prefix: Sequence[str] = (),
) -> Spawned:
    """`overnight serve ARGS --port P --data DATA_DIR`, healthy, on loopback.

    `args` say what it fronts (`"--upstream", url` or `"--model", path, ...`) and any
    other flag. Its output goes to `log_path`, by default DATA_DIR/logs/serve.log.
    `prefix` wraps the command (`taskset -c 0` in the benchmarks).
    """
    port = port or free_port()
    command = [*prefix, sys.executable, "-m", "overnight.cli", "serve", *args]
    command += ["--port", str(port), "--data", str(data_dir), "--log-level", log_level]
    return spawn(
        command,
        f"http://127.0.0.1:{port}",
        env=env,
        log_path=log_path or Path(data_dir) / SERVE_LOG,
        startup_timeout=startup_timeout,
    )


def spawn_fake_upstream(
    *args: str,
    port: int | None = None,
    log_path: Path | None = None,
    prefix: Sequence[str] = (),
) -> Spawned:
    """The fake vLLM (`python -m overnight.testing.fake_upstream ARGS`) in its own process."""
    port = port or free_port()
    command = [*prefix, sys.executable, "-m", "overnight.testing.fake_upstream"]
    command += ["--port", str(port), *args]
    return spawn(command, f"http://127.0.0.1:{port}", log_path=log_path, startup_timeout=60)


def serve_local_model(
    data_dir: str | Path,
    model_dir: str | Path,
    name: str,
    *args: str,
    port: int | None = None,
    log_level: str = "WARNING",
) -> Spawned:
    """`overnight serve --model MODEL_DIR` on vLLM's CPU backend in float32, served as
    `name`, started and healthy: the demo's and the tests' way to a local model.

    `args`: more flags of `overnight serve`. Stop it with `.stop()` (SIGTERM: it commits
    its log and stops vLLM). vLLM's output goes to DATA_DIR/logs/vllm.log, the proxy's to
    DATA_DIR/logs/serve.log.
    """
    # vLLM sizes its CPU KV cache from free memory and can refuse to start on a busy
    # machine; 1 GiB is plenty for these small models' short conversations.
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    return spawn_serve(
        data_dir,
        *("--model", str(model_dir), "--served-model-name", name, "--vllm-arg=--dtype=float32"),
        *args,
        port=port,
        log_level=log_level,
        env=env,
        startup_timeout=900,  # CPU start-up compiles kernels and profiles memory: minutes
    )


def serve_tiny(
    model_dir: str | Path,
    data_dir: str | Path,
    port: int | None = None,
    log_level: str = "WARNING",
    max_model_len: int = 4096,
    extra: tuple[str, ...] = (),
) -> Spawned:
    """The tiny model (built first if missing) behind `overnight serve`, as `tiny`, with
    adapters up to rank 8: the benchmarks' and some tests' float32 server."""
    from overnight.models.tiny import build_tiny_model

    build_tiny_model(model_dir)
    return serve_local_model(
        data_dir,
        model_dir,
        "tiny",
        *("--max-lora-rank", "8", f"--vllm-arg=--max-model-len={max_model_len}", *extra),
        port=port,
        log_level=log_level,
    )


def run_overnight(*args: str, show: Callable[[str], None] | None = None) -> str:
    """Run `overnight ARGS`; its output, and each line passed to `show` as it comes (a
    night's steps print their rate and time left: the demo's progress)."""
    command = [sys.executable, "-m", "overnight.cli", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # each line as it is printed, not at the end
    # stderr to a file, not a pipe read after stdout: a full pipe would block the child.
    with tempfile.TemporaryFile("w+") as errors:
        with subprocess.Popen(command, text=True, stdout=subprocess.PIPE, stderr=errors,
                              env=env) as process:  # fmt: skip
            lines = []
            for line in process.stdout:  # type: ignore[union-attr]
                lines.append(line)
                if show is not None:
                    show(line.rstrip("\n"))
        errors.seek(0)
        stderr = errors.read()
    out = "".join(lines)
    if process.returncode != 0:
        raise RuntimeError(f"overnight {args[0]} failed:\n{out[-2000:]}{stderr[-2000:]}")
    return out
