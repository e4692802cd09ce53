"""A tiny Qwen2-style chat model built locally, for tests, the demo and benchmarks.

Models cannot be downloaded on the machines this project is tested on, so we build
one: a byte-level BPE tokenizer trained with `tokenizers` on text generated here, a
Qwen2 chat template with Hermes-style tool calls (what vLLM's `hermes` parser reads),
and randomly initialised weights. Everything is deterministic from the seed, and the
result is a plain Hugging Face directory that vLLM serves and transformers/peft load.

Two measured constraints shape the config: vLLM's CPU attention rejects head_dim 16
(64 works), and a randomly initialised model only learns under RL when its logits can
move, which needs `initializer_range` around 0.1 rather than the usual 0.02.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not special: vLLM's hermes parser must see them in the decoded text.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]

# Qwen2.5's template, trimmed: system prompt, tools block, tool calls and results.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, \
"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set fn = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "and",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "be",
    "this",
    "from",
    "or",
    "have",
    "not",
    "are",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "been",
    "has",
    "if",
    "more",
    "will",
    "one",
    "which",
    "do",
    "their",
    "time",
    "would",
    "about",
    "some",
    "them",
    "out",
    "up",
    "into",
    "its",
    "than",
    "then",
    "could",
    "two",
    "first",
    "way",
    "use",
    "water",
    "call",
    "who",
    "oil",
    "now",
    "find",
    "long",
    "down",
    "day",
    "did",
    "get",
    "come",
    "made",
    "may",
    "part",
    "number",
    "word",
    "answer",
    "search",
    "document",
    "tool",
    "result",
    "query",
    "email",
    "weather",
    "city",
    "temperature",
    "count",
    "add",
    "sum",
    "yes",
    "no",
    "true",
    "false",
    "red",
    "green",
    "blue",
    "cat",
    "dog",
    "bird",
    "fish",
    "tree",
    "house",
    "river",
    "mountain",
]


MARKER = "overnight-tiny.json"  # written last: the model is whole
VISION_MARKER = "overnight-tiny-vision.json"  # the tiny vision-language model's (tiny_vision.py)


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """Varied text: words, numbers, JSON and chat markup, so merges cover all of them."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        kind = i % 4
        if kind == 0:
            out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 20))))
        elif kind == 1:
            out.append(" ".join(str(rng.randint(0, 999)) for _ in range(rng.randint(3, 10))))
        elif kind == 2:
            args = {rng.choice(_WORDS): rng.choice(_WORDS) for _ in range(2)}
            out.append(json.dumps({"name": rng.choice(_WORDS), "arguments": args}))
        else:
            out.append(f"<|im_start|>user\n{rng.choice(_WORDS).capitalize()}?<|im_end|>")
    return out


def build_tokenizer(seed: int, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    fast.add_tokens(TOOL_TOKENS)
    return fast


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    vocab_size: int = 2048,
    hidden_size: int = 128,
    layers: int = 2,
    initializer_range: float = 0.1,
) -> Path:
    """Write the model to `out_dir` (reused when already complete); returns the path."""
    recipe = {
        "seed": seed,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "layers": layers,
        "initializer_range": initializer_range,
    }
    return build_once(Path(out_dir), MARKER, recipe, _build)


def build_once(out: Path, marker_name: str, recipe: dict, build) -> Path:
    """`build(out, marker, recipe)` unless `out` already holds a model of this recipe
    (its marker file, written last, says so); returns `out`."""
    from filelock import FileLock

    marker = out / marker_name
    if _built(marker, recipe):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Test workers, the demo and a benchmark may all ask at once: one builds, the others
    # wait for it and find the marker, which is written last.
    with FileLock(out.parent / f".{out.name}.lock"):
        if not _built(marker, recipe):
            build(out, marker, recipe)
    return out


def is_tiny(model_dir: str | Path | None) -> bool:
    """Whether `model_dir` is a tiny random model built here (its marker file)."""
    if model_dir is None:
        return False
    return any((Path(model_dir) / marker).is_file() for marker in (MARKER, VISION_MARKER))


def _built(marker: Path, recipe: dict) -> bool:
    return marker.exists() and json.loads(marker.read_text()) == recipe


def _build(out: Path, marker: Path, recipe: dict) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    seed, hidden_size = recipe["seed"], recipe["hidden_size"]
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed, recipe["vocab_size"])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=recipe["layers"],
        num_attention_heads=hidden_size // 64,  # head_dim 64: the CPU kernel needs it
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        initializer_range=recipe["initializer_range"],
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id, config.bos_token_id],
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    marker.write_text(json.dumps(recipe))
