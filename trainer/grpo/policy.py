"""The policy being trained: the base model with a LoRA adapter, and its logprobs.

Sequences are packed end to end into rows, with position ids restarting at each
sequence; transformers (5.x) turns such position ids into a block-diagonal causal
mask, so no token attends across sequences, and only row ends are padded.

The rollouts of a group share their prompt. With `share_prompts`, a row holds that
prompt once, followed by each rollout's remaining tokens; position ids continue from
the prompt's end in every branch, and a mask lets each branch see the prompt and
itself only, so every logprob is the one the sequence would get alone. Which mask,
and when sharing pays at all, is attention.py's: a flex-attention block mask, an
explicit one (sdpa, eager) where it costs less than repeating the prompt, or the
prompt repeated (any other kernel). Long rows are forwarded one at a time.

The vocabulary projection is applied only where a sampled token is predicted, a
chunk of tokens at a time (head.py): context positions (system, user, tool output)
never materialise their logits, and the trained ones only a chunk's at once.
Gradient checkpointing is checkpointing.py's.

A sample that saw images (a vision-language model's) goes in a row without sharing its
prompt: image tokens are placeholders, so equal ids are not the same picture. Its
images' features take their tokens' places in the embeddings (images.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from overnight.config import TrainConfig
from overnight.errors import ConfigError

from .attention import VARLEN, explicit_mask, flex_mask, kernel, row_passes
from .data import Sample
from .head import chunked_logprobs
from .images import VisionInputs, image_embeddings, is_vision_config
from .sampling import NEUTRAL, SamplingParams, sampling_tensors

# A shared prompt shorter than this is repeated: the mask costs more than it saves.
MIN_SHARED_PROMPT = 8
LOGIT_CHUNK_TOKENS = TrainConfig.logit_chunk_tokens


def torch_dtype(name: str) -> torch.dtype:
    """TrainConfig.dtype as a torch dtype. auto: bfloat16 where the GPU has it (half the
    memory, tensor cores), else float32 (the CPU, and where logprobs must match vLLM's)."""
    if name == "auto":
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return getattr(torch, name)


def load_policy(
    base_model: str | Path,
    adapter: str | Path | None = None,
    *,
    trainable: bool = False,
    dtype: torch.dtype = torch.float32,
    attention: str = "auto",
):
    """The base model, with `adapter` (a peft directory) applied if given; `attention`:
    TrainConfig.attention (auto: transformers' default, sdpa)."""
    from peft import PeftModel

    options = {} if attention == "auto" else {"attn_implementation": attention}
    try:
        model = load_base(base_model, dtype, **options)
    except (ImportError, ValueError) as e:
        if attention not in VARLEN:
            raise
        # transformers' own words say which part is missing (the package, CUDA, a dtype).
        raise ConfigError(
            f"--attention {attention} cannot be used here: {e} (it needs a CUDA GPU and "
            "the flash-attn package; --attention sdpa or flex_attention work without it)"
        ) from e
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=trainable)
    return model


def load_base(base_model: str | Path, dtype: torch.dtype, **options):
    """The base model from its folder: a causal LM, or a vision-language model with its
    vision tower (the same output projection and decoder stack, for `_parts`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = is_vision_config(AutoConfig.from_pretrained(base_model))
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    return auto.from_pretrained(base_model, dtype=dtype, **options)


def _parts(model):
    """(decoder stack, output projection) of a causal LM, peft-wrapped or not."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model, inner.get_output_embeddings()


@dataclass
class _Unit:
    """What is placed in a row together: a prompt (maybe empty) and branches after it."""

    prefix: int  # tokens of the first member that every member shares
    members: list[int]  # sample indices

    def size(self, samples: list[Sample]) -> int:
        return self.prefix + sum(len(samples[i].tokens) - self.prefix for i in self.members)


def _common_prefix(sequences: list[list[int]]) -> int:
    shortest = min(len(s) for s in sequences)
    for n in range(shortest):
        if any(s[n] != sequences[0][n] for s in sequences[1:]):
            return n
    return shortest


def _units(samples: list[Sample], capacity: int | None, share_prompts: bool) -> list[_Unit]:
    """Each sample alone, or (sharing) the samples of a group under their common prompt.

    A group's branches are split into as many units as keep each within `capacity`
    (the longest sample), so rows stay as short as without sharing: attention under an
    explicit mask costs the square of a row's length. None (flex attention, whose block
    mask skips what nobody attends to): a group's branches stay in one unit.
    """
    if not share_prompts:
        return [_Unit(0, [i]) for i in range(len(samples))]
    by_group: dict[str, list[int]] = {}
    alone = []  # a sample with images: equal placeholder ids may be other pictures
    for i, s in enumerate(samples):
        if s.vision is not None:
            alone.append(_Unit(0, [i]))
            continue
        by_group.setdefault(s.group_id, []).append(i)
    units = []
    for members in by_group.values():
        # Every branch keeps at least one token after the prompt (the one it predicts).
        prefix = min(
            _common_prefix([samples[i].tokens for i in members]),
            min(len(samples[i].tokens) for i in members) - 1,
        )
        if len(members) < 2 or prefix < MIN_SHARED_PROMPT:
            units += [_Unit(0, [i]) for i in members]
            continue
        parts: list[list[int]] = [[]]
        for i in members:
            size = prefix + sum(len(samples[m].tokens) - prefix for m in parts[-1] + [i])
            if parts[-1] and capacity is not None and size > capacity:
                parts.append([])
            parts[-1].append(i)
        units += [_Unit(prefix, part) if len(part) > 1 else _Unit(0, part) for part in parts]
    return units + alone


def pack(
    samples: list[Sample], row_tokens: int = 0, share_prompts: bool = False, attention: str = "sdpa"
) -> dict[str, torch.Tensor]:
    """Samples packed into rows of `row_tokens` (at least the longest sample): (B, L).

    Attention on the CPU (and in any kernel without variable-length support) costs the
    square of a row's length, so one long row of everything would cost far more than
    padding; rows about as long as the longest sequence keep both attention and padding
    small. Units are placed first-fit, largest first; padding goes at row ends, as a
    block of its own that nothing attends to and nothing is trained on. `attention`
    (the model's kernel) decides the shared prompts' mask: sdpa and eager get an
    explicit one here; flex attention gets its block mask from `block` and `parent`
    where the model runs (`trained_logprobs`); flash attention (`VARLEN`) gets every
    sample in one row and no mask, the sequences told apart by their position ids.
    """
    capacity = max(row_tokens, max(len(s.tokens) for s in samples))
    if attention in VARLEN:  # one row: each sequence costs its own square, padding nothing
        capacity, share_prompts = sum(len(s.tokens) for s in samples), False
    flex = attention == "flex_attention"
    units = _units(samples, None if flex else capacity, share_prompts)
    rows = _first_fit(units, samples, capacity)
    layout = _Layout(samples, len(rows), max(sum(u.size(samples) for u in row) for row in rows))
    for r, row in enumerate(rows):
        layout.fill_row(r, row)
    shared = any(u.prefix for u in units)
    return layout.batch(shared=shared, explicit=shared and not flex)


def row_shapes(
    samples: list[Sample], share_prompts: bool, row_tokens: int = 0
) -> list[tuple[int, int, bool]]:
    """The rows `pack` would make, as (tokens, sequences, under a shared-prompt mask)."""
    capacity = max(row_tokens, max(len(s.tokens) for s in samples))
    rows = _first_fit(_units(samples, capacity, share_prompts), samples, capacity)
    return [
        (sum(u.size(samples) for u in row), len(row), any(u.prefix for u in row)) for row in rows
    ]


def _first_fit(units: list[_Unit], samples: list[Sample], capacity: int) -> list[list[_Unit]]:
    """Units in rows of `capacity` tokens (a longer unit gets a row of its own size)."""
    rows: list[list[_Unit]] = []
    room: list[int] = []
    for unit in sorted(units, key=lambda u: -u.size(samples)):
        n = unit.size(samples)
        slot = next((r for r, free in enumerate(room) if free >= n), None)
        if slot is None:
            rows.append([])
            room.append(max(capacity, n))
            slot = len(rows) - 1
        rows[slot].append(unit)
        room[slot] -= n
    return rows


class _Layout:
    """The packed tensors, filled a row at a time."""

    def __init__(self, samples: list[Sample], rows: int, width: int) -> None:
        self.samples, self.width = samples, width
        self.ids = torch.zeros(rows, width, dtype=torch.long)
        self.positions = torch.zeros(rows, width, dtype=torch.long)
        # Who may attend to whom, for the explicit mask: each token's block, and the
        # block of the prompt it hangs off (-1: none).
        self.block = torch.zeros(rows, width, dtype=torch.long)
        self.parent = torch.full((rows, width), -1, dtype=torch.long)
        self.blocks = 0
        self.lengths = [0] * rows  # tokens before each row's padding
        # (sample, token position, flat index, flat index of its predictor, logprob,
        # how the token was sampled)
        self.entries: list[tuple[int, int, int, int, float, SamplingParams]] = []
        self.with_images: list[int] = []  # samples that saw images, in row order

    def fill_row(self, r: int, row: list[_Unit]) -> None:
        col = 0
        for unit in row:
            prompt_block = -1
            if unit.prefix:
                first = self.samples[unit.members[0]]
                self.ids[r, col : col + unit.prefix] = torch.tensor(first.tokens[: unit.prefix])
                self.positions[r, col : col + unit.prefix] = torch.arange(unit.prefix)
                self.block[r, col : col + unit.prefix] = prompt_block = self.blocks
                self.blocks += 1
            prompt_col = col
            col += unit.prefix
            for i in unit.members:
                col = self._branch(r, col, i, unit.prefix, prompt_col, prompt_block)
        self.lengths[r] = col
        self.positions[r, col:] = torch.arange(self.width - col)  # padding: its own block
        self.block[r, col:] = self.blocks
        self.blocks += 1

    def _branch(
        self, r: int, col: int, i: int, prefix: int, prompt_col: int, prompt_block: int
    ) -> int:
        """Sample i's tokens after the shared `prefix` at `col`; the column after them."""
        s = self.samples[i]
        assert not s.trained[0], "a sequence cannot start with a trained token (it is prompt)"
        if s.vision is not None:
            self.with_images.append(i)
        branch = s.tokens[prefix:]
        n = len(branch)
        self.ids[r, col : col + n] = torch.tensor(branch)
        self.positions[r, col : col + n] = torch.arange(prefix, prefix + n)
        self.block[r, col : col + n] = self.blocks
        self.parent[r, col : col + n] = prompt_block
        self.blocks += 1
        base = r * self.width
        for j, (t, lp) in enumerate(zip(s.trained, s.behaviour_logprobs, strict=True)):
            if not t:
                continue
            params = s.sampling[j] if s.sampling else NEUTRAL
            if j < prefix:  # a sampled token every member shares
                flat = base + prompt_col + j
                self.entries.append((i, j, flat, flat - 1, lp, params))
            else:
                flat = base + col + j - prefix
                # A branch's first token is predicted from the prompt's last.
                before = flat - 1 if j > prefix else base + prompt_col + j - 1
                self.entries.append((i, j, flat, before, lp, params))
        return col + n

    def batch(self, shared: bool, explicit: bool) -> dict[str, torch.Tensor]:
        # Trained tokens in sample order, whatever the row (the first two fields are unique).
        entries = sorted(self.entries, key=lambda e: e[:2])
        batch = {
            "input_ids": self.ids,  # (B, L)
            "position_ids": self.positions,  # (B, L)
            "row_lengths": torch.tensor(self.lengths, dtype=torch.long),  # (B,) before padding
            "trained_index": torch.tensor([e[2] for e in entries], dtype=torch.long),  # (N,) flat
            "predictor_index": torch.tensor([e[3] for e in entries], dtype=torch.long),  # (N,)
            "behaviour_logprobs": torch.tensor([e[4] for e in entries]),  # (N,)
            "sequence_index": torch.tensor(
                [e[0] for e in entries], dtype=torch.long
            ),  # (N,) sample
            **sampling_tensors([e[5] for e in entries]),  # (N,) each: temperature, top_k, ...
            # The samples whose images' features fill the image tokens, in row order.
            "image_samples": torch.tensor(self.with_images, dtype=torch.long),
        }
        if shared:
            batch["block"], batch["parent"] = self.block, self.parent  # (B, L) each
        if explicit:
            batch["attention_mask"] = explicit_mask(self.block, self.parent)  # (B, 1, L, L)
        return batch


def batch_images(samples: list[Sample], batch: dict[str, torch.Tensor]) -> list[VisionInputs]:
    """The images of a packed batch's samples, in the order their tokens lie in the rows,
    each made once for all of the batch's passes."""
    return [samples[i].vision.held() for i in batch["image_samples"].tolist()]


def trained_logprobs(
    model,
    batch: dict[str, torch.Tensor],
    chunk: int = LOGIT_CHUNK_TOKENS,
    images: list[VisionInputs] = (),
) -> torch.Tensor:
    """Logprob under `model` of each trained token of a packed batch: (N,), in the
    distribution it was sampled from (temperature, top-k, top-p: trainer/grpo/sampling.py),
    the vocabulary projected `chunk` tokens at a time. `images`: `batch_images`."""
    decoder, head = _parts(model)
    hidden = _predictor_states(model, decoder, batch, images)  # (N, H)
    targets = batch["input_ids"].reshape(-1)[batch["trained_index"]]  # (N,)
    params = tuple(batch[k] for k in ("temperature", "top_k", "top_p", "min_p"))
    return chunked_logprobs(head, hidden, targets, params, chunk)


def _predictor_states(model, decoder, batch: dict[str, torch.Tensor], images) -> torch.Tensor:
    """The last hidden state at each trained token's predictor (N, H), over the row
    passes attention.py lays out (one, or a long row at a time)."""
    ids, positions = batch["input_ids"], batch["position_ids"]
    embeds = image_embeddings(decoder, ids, list(images), batch["trained_index"])
    width = ids.shape[1]
    flex = kernel(model) == "flex_attention"
    mask = batch.get("attention_mask")
    if flex and "block" in batch:
        mask = flex_mask(batch["block"], batch["parent"])
    if mask is not None and kernel(model) == "eager":
        # eager adds the mask to the scores; sdpa takes booleans.
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
    index = batch["predictor_index"]
    row, col = index // width, index % width
    parts, order = [], []
    for first, end, cut in row_passes(batch["row_lengths"].tolist(), flex):
        part_mask = mask
        if mask is not None and not flex:
            part_mask = mask[first:end, :, :cut, :cut]
        given = (
            {"input_ids": ids[first:end, :cut]}
            if embeds is None
            else {"inputs_embeds": embeds[first:end, :cut]}
        )
        hidden = decoder(
            **given,
            position_ids=positions[first:end, :cut],
            attention_mask=part_mask,
            use_cache=False,
        ).last_hidden_state  # (rows, cut, H)
        mine = ((row >= first) & (row < end)).nonzero().squeeze(1)
        local = (row[mine] - first) * cut + col[mine]
        parts.append(hidden.reshape(-1, hidden.shape[-1])[local])
        order.append(mine)
    if len(parts) == 1:
        return parts[0]
    # Back in the batch's order of trained tokens.
    return torch.cat(parts)[torch.argsort(torch.cat(order))]
