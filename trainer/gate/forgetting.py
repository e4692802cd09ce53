"""Forgetting: what an adapter lost of what the base model could already do.

  a reference set (general prompts bundled with overnight, references.json, and/or the
  operator's --reference JSONL) -> each prompt's reference answer (the operator's, or the
  base model's own greedy answer, generated once per base model and cached in
  DATA/references/) -> the mean per-token log-likelihood of each answer given its prompt,
  teacher-forced, under the base model, the served adapter and the candidate (one forward
  pass each, no sampling; each model's figures cached there by its weights, so a served
  adapter measured the night it was the candidate is not scored again) -> forgetting =
  base - adapter, in nats per token, averaged over the set -> the gate refuses a
  candidate over --forgetting-budget (docs/grpo.md).

The gate (verdict.py) compares the candidate with the served adapter on tonight's traffic;
this compares both with the base model on everything else, so that the drift of nights
stacked on one another stays in view across promotions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from overnight.config import TrainConfig
from overnight.errors import ConfigError
from overnight.models.tiny import is_tiny
from overnight.progress import Progress, untold
from overnight.storage import open_db
from overnight.storage.files import replace_durably
from overnight.storage.read.images import shows_images

from .prompts import GatePrompt
from .verdict import generate_replies, load_named, prompt_ids

BUNDLED = Path(__file__).with_name("references.json")
ANSWER_TOKENS = 48  # greedy tokens of a base answer: a sentence or two, as the prompts ask
BATCH = 16  # references scored together (sorted by length: little padding)
MAX_ANSWER_TOKENS = 128  # an operator's long reference is scored on its beginning
LOST = 0.5  # nats per token: a reference whose likelihood fell this far counts as lost
# `--reference imported:...`: imported history (docs/import.md). The formats are
# overnight/imports/run.py's FORMATS (the trainer does not import the importer; a test
# holds the two lists equal); IMPORTED_COUNT: the most turns one part gives by default.
IMPORTED_PREFIX = "imported:"
IMPORT_FORMATS = ("openai-jsonl", "openai-batch", "litellm", "langfuse", "otel")
IMPORTED_COUNT = 200
# Below this, two figures are the same adapter's (float sums in another order): a
# candidate over the budget is "further than the served one" only beyond it.
SAME = 1e-3


class ReferenceSetError(ConfigError):
    """A --reference the night cannot read (found before training: Night.begin)."""


@dataclass(frozen=True)
class Reference:
    messages: list[dict]
    answer: str | None  # None: the base model's own greedy answer (base_answers)
    source: str  # "bundled", the operator's file, or "imported:FORMAT" (imported history)

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.messages, sort_keys=True).encode()).hexdigest()[:20]


def resolve(spec: str, base_model: str | None) -> str | None:
    """The reference set `--reference` means for this base model; None: none measured
    (off, and auto on overnight's tiny random model: nothing learnt, nothing to lose;
    its drift on random answers would refuse nights for noise). auto elsewhere: bundled.
    A spec that cannot be read as one fails here (ReferenceSetError), whatever the model."""
    if spec == "off" or (spec == "auto" and is_tiny(base_model)):
        return None
    if spec != "auto":
        parts(spec)
    return "bundled" if spec == "auto" else spec


def parts(spec: str) -> list[str | Imported]:
    """The parts of a `--reference` spec, each `bundled`, a file's path, or an imported
    part (`imported:all` or `imported:FORMAT`, with `:N` the most references it gives);
    a malformed imported part is a ReferenceSetError naming what it accepts."""
    out: list[str | Imported] = []
    for part in (p.strip() for p in spec.split(",")):
        if part in ("off", "auto") and spec.strip() != part:
            raise ReferenceSetError(f"--reference {spec!r}: {part} is a spec alone, not a part")
        if part.startswith(IMPORTED_PREFIX):
            out.append(Imported.parse(part))
        elif part:
            out.append(part)
    return out


@dataclass(frozen=True)
class Imported:
    """`imported:FORMAT[:N]`: up to N imported turns' prompts with the answers the team's
    served model gave them (what an adapter must not lose), drawn stably by record id."""

    fmt: str  # one of IMPORT_FORMATS, or "all"
    count: int = IMPORTED_COUNT

    @classmethod
    def parse(cls, part: str) -> Imported:
        fields = part[len(IMPORTED_PREFIX) :].split(":")
        fmt, count = fields[0], fields[1] if len(fields) > 1 else str(IMPORTED_COUNT)
        if len(fields) > 2 or fmt not in ("all", *IMPORT_FORMATS) or not count.isdigit() \
                or int(count) < 1:  # fmt: skip
            raise ReferenceSetError(
                f"--reference {part!r}: want imported:all or imported:FORMAT, FORMAT one of "
                f"{', '.join(IMPORT_FORMATS)}, optionally :N (how many turns at most, "
                f"default {IMPORTED_COUNT}), e.g. imported:litellm:500"
            )
        return cls(fmt, int(count))

    @property
    def source(self) -> str:
        return f"{IMPORTED_PREFIX}{self.fmt}"


def load_references(spec: str, data_dir: Path | None = None) -> list[Reference]:
    """The reference set `--reference` names: `bundled`, a JSONL file, imported history
    read from `data_dir` (`imported:all`, `imported:FORMAT[:N]`), several (`bundled,PATH`)."""
    refs: list[Reference] = []
    for part in parts(spec):
        if part == "bundled":
            rows = json.loads(BUNDLED.read_text(encoding="utf-8"))
            refs += [Reference(r["messages"], None, "bundled") for r in rows]
        elif isinstance(part, Imported):
            if data_dir is None:
                raise ReferenceSetError(f"--reference {part.source}: no data directory to read")
            found = imported_references(Path(data_dir), part)
            if not found:
                raise ReferenceSetError(
                    f"--reference {part.source}: no imported turn in {data_dir} with a prompt "
                    "and a text answer (overnight import, docs/import.md)"
                )
            refs += found
        else:
            refs += read_jsonl(Path(part))
    if not refs:
        raise ReferenceSetError(f"--reference {spec!r} names no reference prompts")
    return refs


# What a reference can be made of among imported rows: a successful call whose request is
# a conversation without pictures (the measure goes through the tokenizer) and whose first
# choice answered in text (a tool call has no text to keep the likelihood of).
_IMPORTED = """
    SELECT request, answer, upstream FROM (
        SELECT record_id, request,
               json_extract_string(response, '$.choices[0].message.content') AS answer,
               json_extract_string(notes, '$.upstream') AS upstream
        FROM completions
        WHERE starts_with(record_id, 'imp-') AND error IS NULL AND request IS NOT NULL
    )
    WHERE {which} AND answer IS NOT NULL AND trim(answer) <> ''
    ORDER BY md5(record_id), record_id
"""


def imported_references(data_dir: Path, part: Imported) -> list[Reference]:
    """Up to `part.count` imported turns of `part.fmt` (notes' `upstream`, docs/import.md)
    as references: the request's messages and the imported answer, each prompt once,
    drawn in the order of their record ids' md5 (the same set every night while the
    history stays the same; a new import adds a few, it does not reshuffle the rest)."""
    if part.fmt == "all":
        which, params = "starts_with(upstream, ?)", [IMPORTED_PREFIX]
    else:
        which, params = "upstream = ?", [part.source]
    con = open_db(data_dir)
    try:
        cursor = con.execute(_IMPORTED.format(which=which), params)
        refs, seen = [], set()
        while len(refs) < part.count and (rows := cursor.fetchmany(256)):
            for request_text, answer, upstream in rows:
                ref = _imported_reference(request_text, answer, upstream)
                if ref is not None and ref.key not in seen and len(refs) < part.count:
                    seen.add(ref.key)
                    refs.append(ref)
    finally:
        con.close()
    return refs


def _imported_reference(request_text: str, answer: str, source: str) -> Reference | None:
    try:
        request = json.loads(request_text)
    except ValueError:
        return None
    messages = request.get("messages") if isinstance(request, dict) else None
    if not messages or not isinstance(messages, list) or shows_images(messages):
        return None
    return Reference(messages, answer, source)


def read_jsonl(path: Path) -> list[Reference]:
    """The operator's set: one JSON object a line, `messages` (a chat, or `prompt`: one user
    message) and `reference` (the answer whose likelihood is kept; absent: the base model's)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ReferenceSetError(f"--reference {path}: {e.strerror or e}") from e
    refs = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            answer = row.get("reference")
            if not isinstance(messages, list) or not (answer is None or isinstance(answer, str)):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ReferenceSetError(
                f'--reference {path} line {n}: want {{"messages": [...], "reference": '
                '"..."}} (or "prompt" for one user message; no reference: the base model\'s)'
            ) from None
        refs.append(Reference(messages, answer, str(path)))
    return refs


# -- the base model's answers, once per base model -------------------------------------


def model_identity(base_model: str) -> str:
    """What names a base model's weights: its config and its weight files' sizes and
    ends (a local folder), or its name (the hub's). A changed model answers anew."""
    folder = Path(base_model)
    digest = hashlib.sha256()
    if not folder.is_dir():
        digest.update(base_model.encode())
        return digest.hexdigest()[:20]
    for path in sorted(folder.iterdir()):
        if path.name == "config.json" or path.suffix in (".safetensors", ".bin", ".json"):
            size = path.stat().st_size
            digest.update(f"{path.name}:{size}".encode())
            with path.open("rb") as f:
                digest.update(f.read(65536))
                f.seek(max(0, size - 65536))
                digest.update(f.read())
    return digest.hexdigest()[:20]


def base_answers(
    data_dir: Path, base_model: str, model, tokenizer, refs, device, say=None
) -> list[str]:
    """Each reference's answer: the operator's, else the base model's greedy one, read from
    DATA/references/{model}.json or generated (adapters disabled) and added to it; `say`:
    where the generation's progress lines go (None: nowhere)."""
    cache_path = Path(data_dir) / "references" / f"{model_identity(base_model)}.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    missing = [r for r in refs if r.answer is None and r.key not in cache]
    if missing:
        prompts = [GatePrompt(r.key, r.messages, [], 0.0, 1.0, ANSWER_TOKENS) for r in missing]
        progress = Progress(say, "forgetting: generated", len(missing), "base answers")
        with model.disable_adapter():  # greedy: no seed used
            answers = generate_replies(model, tokenizer, prompts, 0, device, None, progress.advance)
        progress.finish()
        cache.update({r.key: a for r, a in zip(missing, answers, strict=True)})
        _save(cache_path, cache)
    return [r.answer if r.answer is not None else cache[r.key] for r in refs]


class Figures:
    """Each reference's figure (loglik) under each model on `model` (an adapter's name, or
    None: the base model, adapters disabled), read from DATA/references/{model}.loglik.json
    where that model scored the same tokens in the same dtype before, and added to it
    where not. The base model's figures are the same every night; an adapter's are keyed
    by its weights (adapter_identity), so the served adapter, scored the night it was the
    candidate, is read back: a night scores one model, not three."""

    def __init__(self, data_dir: Path, base_model: str, model, encoded, device: str) -> None:
        self.path = Path(data_dir) / "references" / f"{model_identity(base_model)}.loglik.json"
        self.cache = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.model, self.encoded, self.device = model, encoded, device
        self.dtype = next(model.parameters()).dtype
        self._keys: dict[str | None, list[str]] = {}

    def keys(self, adapter: str | None) -> list[str]:
        if adapter not in self._keys:
            weights = "" if adapter is None else adapter_identity(self.model, adapter)
            self._keys[adapter] = [
                hashlib.sha256(
                    f"{weights}{self.dtype}:{self.device}:{begins}:{ids}".encode()
                ).hexdigest()[:24]
                for ids, begins in self.encoded
            ]
        return self._keys[adapter]

    def missing(self, adapter: str | None) -> int:
        return sum(key not in self.cache for key in self.keys(adapter))

    def of(self, adapter: str | None, pad: int, advance: Callable[[int], None] = untold):
        """`adapter`'s figures, those not cached scored now (`advance`: told how many)."""
        keys = self.keys(adapter)
        missing = [i for i, key in enumerate(keys) if key not in self.cache]
        if missing:
            with _scoring(self.model, adapter):
                values = loglik(self.model, [self.encoded[i] for i in missing], pad,
                                self.device, advance)  # fmt: skip
            self.cache.update({keys[i]: float(v) for i, v in zip(missing, values, strict=True)})
            _save(self.path, self.cache)
        return np.asarray([self.cache[key] for key in keys])


def adapter_identity(model, adapter: str) -> str:
    """What names the adapter `adapter` on `model` (a peft model): a digest of its LoRA
    weights as loaded (their names without the adapter's, shapes and values), so that the
    same adapter is the same whatever it is called or wherever its files are."""
    import torch

    digest = hashlib.sha256()
    marker = f".{adapter}."
    for name, tensor in sorted(model.state_dict().items()):
        if marker in name:
            digest.update(f"{name.replace(marker, '.')}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.detach().to(torch.float32).cpu().numpy().tobytes())
    return digest.hexdigest()[:20] + ":"


def _scoring(model, adapter: str | None):
    """A context in which `model` answers as `adapter` (None: the base model)."""
    if adapter is None:
        return model.disable_adapter()
    model.set_adapter(adapter)
    return contextlib.nullcontext()


def _save(path: Path, cache: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, ensure_ascii=False, indent=0))
    replace_durably(tmp, path)


# -- the measure --------------------------------------------------------------------------


def encode(tokenizer, refs: list[Reference], answers: list[str]) -> list[tuple[list[int], int]]:
    """(prompt + answer token ids, where the answer starts) per reference; the answer as the
    chat template's assistant turn would hold it, closed by the end-of-sequence token."""
    out = []
    for ref, answer in zip(refs, answers, strict=True):
        prompt = prompt_ids(tokenizer, GatePrompt("", ref.messages, [], 0.0, 1.0, 0))
        reply = tokenizer(answer, add_special_tokens=False)["input_ids"][:MAX_ANSWER_TOKENS]
        if tokenizer.eos_token_id is not None:
            reply = [*reply, tokenizer.eos_token_id]
        out.append((prompt + reply, len(prompt)))
    return out


def loglik(
    model, encoded: list[tuple[list[int], int]], pad: int, device: str,
    advance: Callable[[int], None] = untold,
) -> np.ndarray:  # fmt: skip
    """Each reference's mean per-token log-likelihood of its answer, teacher-forced, under
    whichever adapter `model` has active (right-padded, BATCH at a time); `advance`: told
    how many each batch scored (overnight/progress.py)."""
    import torch

    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
    out = np.zeros(len(encoded))
    for start in range(0, len(order), BATCH):
        members = order[start : start + BATCH]
        batch = [encoded[i] for i in members]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in batch], device=device)
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch],
                            device=device)  # fmt: skip
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        for row, (x, begins) in enumerate(batch):
            targets = ids[row, begins : len(x)]
            logprobs = torch.log_softmax(logits[row, begins - 1 : len(x) - 1], dim=-1)
            out[members[row]] = logprobs.gather(1, targets[:, None]).mean().item()
        advance(len(batch))
    return out


@dataclass
class Forgetting:
    """How far the served adapter and the candidate moved from the base model on the
    reference set: mean (base - adapter) per-token log-likelihood, in nats per token."""

    references: int
    budget: float
    base_loglik: float  # the base model's mean per-token log-likelihood of the answers
    served: float  # the served adapter's forgetting (0: the base model is served)
    candidate: float
    served_lost: float  # share of references down by more than LOST nats per token
    candidate_lost: float
    seconds: float = 0.0
    over: bool = False  # the candidate forgets more than the budget (and than the served)
    served_path: str | None = None  # which adapters were measured (the watch reads them)
    candidate_path: str | None = None

    def line(self) -> str:
        return (
            f"forgetting on {self.references} reference answers: candidate "
            f"{self.candidate:+.3f} nats/token vs the base model ({self.candidate_lost:.0%} of "
            f"them down by more than {LOST}), served {self.served:+.3f}; budget "
            f"{self.budget:g}"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def measure(
    config: TrainConfig,
    data_dir: Path,
    base_model: str,
    candidate: Path,
    served: str | None,
    spec: str | None = None,
    say=print,
) -> Forgetting:
    """The reference set (`spec`, resolved; None: config.reference as given) scored under
    the base model, the served adapter (None: the base model itself) and the candidate,
    one model in memory with both adapters on it; `say`: progress lines now and then
    (overnight/progress.py)."""
    began = time.monotonic()
    refs = load_references(spec or config.reference, data_dir)
    adapters = {"candidate": candidate, "served": served}
    model, tokenizer, device = load_named(base_model, adapters, config)
    answers = base_answers(data_dir, base_model, model, tokenizer, refs, device, say)
    encoded = encode(tokenizer, refs, answers)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # Each model's pass where its figures are not cached (Figures): the base model's once,
    # the served adapter's the night it was the candidate.
    figures = Figures(data_dir, base_model, model, encoded, device)
    models = [None, "candidate", *(["served"] if served is not None else [])]
    scoring = Progress(say, "forgetting: scored", sum(map(figures.missing, models)),
                       "reference answers")  # fmt: skip
    base, *scored = (figures.of(m, pad, scoring.advance) for m in models)
    drift = {"candidate": base - scored[0]}
    drift["served"] = base - scored[1] if served is not None else np.zeros_like(base)
    if scoring.total:
        scoring.finish()
    else:
        say(f"forgetting: the {len(refs)} reference answers' figures read from the cache "
            "(every model scored them before)")  # fmt: skip
    result = Forgetting(
        len(refs), config.forgetting_budget, float(base.mean()),
        float(drift["served"].mean()), float(drift["candidate"].mean()),
        float((drift["served"] > LOST).mean()), float((drift["candidate"] > LOST).mean()),
        time.monotonic() - began,
    )  # fmt: skip
    result.over = result.candidate > result.budget and result.candidate > result.served + SAME
    result.served_path, result.candidate_path = served, str(candidate)
    return result


def judge(verdict, forgetting: Forgetting) -> None:
    """The gate's verdict with forgetting in it: a candidate over the budget is refused
    whatever its task reward, unless it forgets less than the served adapter (a step back
    towards the base model is never refused for being not far enough); --gate off only
    records it."""
    verdict.forgetting = forgetting.as_dict()
    clause = forgetting.line()
    if forgetting.over and verdict.mode != "off":
        verdict.refuse(f"forgets more than the budget: {clause} (--forgetting-budget)")
    else:
        verdict.reason += f"; {clause}"


# -- the watch: an adapter served over the budget -------------------------------------------


def recorded(data_dir: Path, path: str | None) -> float | None:
    """The newest forgetting measured for the adapter at `path`, as the candidate or as
    the served adapter of a night (None: never measured; the base model: 0)."""
    if path is None:
        return 0.0
    con = open_db(data_dir)
    try:
        rows = con.execute(
            "SELECT json_extract_string(metrics, '$.gate.forgetting.candidate_path'), "
            "json_extract_string(metrics, '$.gate.forgetting.served_path'), "
            "CAST(json_extract(metrics, '$.gate.forgetting.candidate') AS DOUBLE), "
            "CAST(json_extract(metrics, '$.gate.forgetting.served') AS DOUBLE) "
            "FROM training_runs WHERE json_extract(metrics, '$.gate.forgetting') IS NOT NULL "
            "ORDER BY ended_at DESC"
        ).fetchall()
    finally:
        con.close()
    for candidate_path, served_path, candidate, served in rows:
        if served_path == path:
            return served
        if candidate_path == path:
            return candidate
    return None


def over_budget(data_dir: Path, current: str, before: str | None, budget: float) -> str | None:
    """Why the watch rolls back the adapter at `current`: its recorded forgetting is over
    the budget and more than its predecessor's (a step back is never undone); None when
    it is not, or when either was never measured."""
    if budget is None:
        return None
    now = recorded(data_dir, current)
    if now is None or now <= budget:
        return None
    then = recorded(data_dir, before)
    if then is None or now <= then:
        return None
    return (
        f"it forgets {now:+.3f} nats/token of the reference answers against the base model, "
        f"over --forgetting-budget {budget:g} and more than its predecessor "
        f"({before or 'the base model'}: {then:+.3f})"
    )
