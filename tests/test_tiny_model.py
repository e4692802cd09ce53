"""The tiny model builder: deterministic, and loadable by transformers with its template."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from overnight.models.tiny import build_tiny_model

pytestmark = pytest.mark.slow


def digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_same_seed_same_model_other_seed_other_weights(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4)
    assert digest(a) == digest(b)
    assert digest(a)["model.safetensors"] != digest(c)["model.safetensors"]
    # A second build into a complete directory reuses it.
    before = (a / "model.safetensors").stat().st_mtime_ns
    build_tiny_model(a, seed=3)
    assert (a / "model.safetensors").stat().st_mtime_ns == before


def test_processes_building_at_once_build_it_once(tmp_path):
    # Test workers and the demo may ask together: one builds, the others wait and reuse it.
    # Each process says when it builds (both see no model when they start).
    out = tmp_path / "shared"
    code = (
        "import sys; import overnight.models.tiny as t; build = t._build; "
        "t._build = lambda *a: (print('built', flush=True), build(*a)); "
        "t.build_tiny_model(sys.argv[1], seed=5)"
    )
    builders = [
        subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    said = [b.communicate(timeout=240)[0] for b in builders]
    assert [b.returncode for b in builders] == [0, 0]
    assert "".join(said).count("built") == 1
    assert digest(out) == digest(build_tiny_model(tmp_path / "alone", seed=5))


def test_it_loads_and_renders_tool_conversations(tiny_model_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.head_dim == 64 and config.initializer_range == 0.1  # vLLM CPU; learnable
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "content": "r"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>' in text
    assert "<tool_response>\nr\n</tool_response>" in text and text.endswith(
        "<|im_start|>assistant\n"
    )
    assert tokenizer.convert_tokens_to_ids("<tool_call>") != tokenizer.unk_token_id
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))
