"""`overnight serve --model M --vllm-replicas N`: how each replica is started, and the
proxy in front of all of them (no vLLM started here; tests/test_serve_process.py has
the real processes)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from overnight.cli.serve import with_priority_scheduling, with_replicas
from overnight.config import ProxyConfig, VLLMConfig
from overnight.errors import ConfigError
from overnight.proxy.launch.launcher import LaunchError, replica_configs, vllm_command


def test_each_replica_gets_its_port_log_and_gpus():
    config = VLLMConfig(
        model="m",
        port=9000,
        replicas=2,
        log_path=Path("/d/logs/vllm.log"),
        extra_args=("--tensor-parallel-size", "2"),
    )
    replicas = replica_configs(config, on_cpu=False, environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert [(c.port, str(c.log_path), env) for c, env in replicas] == [
        (9000, "/d/logs/vllm-0.log", {"CUDA_VISIBLE_DEVICES": "4,5"}),
        (9001, "/d/logs/vllm-1.log", {"CUDA_VISIBLE_DEVICES": "6,7"}),
    ]
    second = vllm_command(replicas[1][0], replicas[1][0].port)
    assert second[second.index("--port") + 1] == "9001" and "--enable-lora" in second
    # Without CUDA_VISIBLE_DEVICES: the first devices, one each.
    one_each = replica_configs(VLLMConfig(model="m", port=9000, replicas=3), False, {})
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in one_each] == ["0", "1", "2"]
    # On a CPU there is nothing to pin; one replica is the config itself.
    on_cpu = replica_configs(VLLMConfig(model="m", port=9000, replicas=2), True, {})
    assert [env for _, env in on_cpu] == [{}, {}]
    alone = VLLMConfig(model="m", port=9000)
    assert replica_configs(alone, False, {}) == [(alone, {})]


def test_too_few_gpus_or_replicas_are_refused():
    config = VLLMConfig(model="m", port=9000, replicas=2, extra_args=("-tp=2",))
    with pytest.raises(LaunchError, match="need 4 devices"):
        replica_configs(config, on_cpu=False, environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ConfigError, match="at least 1"):
        VLLMConfig(model="m", replicas=0)


def test_the_proxy_fronts_every_replica_and_taken_ports_move_them_all(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    vllm = VLLMConfig(model="m", port=base, replicas=2)
    proxy = ProxyConfig(upstream=vllm.url, data_dir=tmp_path)
    moved_proxy, replicas = with_replicas(proxy, vllm)
    assert moved_proxy.upstreams == (f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}")
    with socket.socket() as taken:  # another program holds the second replica's port
        taken.bind(("127.0.0.1", base + 1))
        moved_proxy, replicas = with_replicas(proxy, vllm)
    ports = [c.port for c, _ in replicas]
    assert base + 1 not in ports and ports[1] == ports[0] + 1
    assert moved_proxy.upstreams == tuple(c.url for c, _ in replicas)
    assert moved_proxy.upstream == replicas[0][0].url


def test_shadow_sampling_starts_vllm_with_the_priority_policy():
    # Shadow siblings ask for a low priority, which vLLM ignores under its default policy.
    config = with_priority_scheduling(VLLMConfig(model="m", port=8001))
    assert "--scheduling-policy=priority" in vllm_command(config, config.port)
    mine = VLLMConfig(model="m", port=8001, extra_args=("--scheduling-policy=fcfs",))
    assert with_priority_scheduling(mine) == mine  # the operator's own choice wins
