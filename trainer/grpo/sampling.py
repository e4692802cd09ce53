"""The distribution a token was sampled from: vLLM's processing of the logits, redone.

vLLM 0.32 (`vllm/v1/sample/sampler.py`, `ops/topk_topp_sampler.py`) samples from
the logits in float32, processed in this order:

1. divided by the temperature (a greedy request, temperature < 1e-5, is not: its
   logprobs are the raw log-softmax, and vLLM resets its top-k, top-p and min-p);
2. min-p: tokens whose probability is below `min_p` x the largest are dropped;
3. top-k: tokens below the k-th largest logit are dropped (ties with it are kept,
   so more than k may remain);
4. top-p: in ascending order of logit, the tokens whose cumulative probability
   (of the distribution after top-k) is at most 1 - p are dropped; the most likely
   token always stays;
5. log-softmax over what remains.

With `--logprobs-mode processed_logprobs` vLLM logs step 5's logprob of the sampled
token, and `processed_logprobs` below computes the same from the policy's logits, so
the importance ratio compares the distribution the agent actually sampled from.
The kept set is chosen without gradient (it is a discrete choice); the gradient
flows through the renormalised log-probabilities of the kept tokens (docs/grpo.md).

A request that leaves a parameter out gets the server's default: vLLM takes it from
the model's generation_config.json unless started with `--generation-config vllm`
(`server_defaults`). What the trainer does not redo (penalties, logit bias, grammar
masks of structured outputs) is named by `unreproduced`; such tokens show up as a
logprob gap.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where tensors are made: trainer/grpo/data.py stays light
    import torch

# vLLM's threshold below which a temperature means greedy (sampling_params._SAMPLING_EPS).
GREEDY_BELOW = 1e-5
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")
# Request fields vLLM applies to the logits that the trainer does not reproduce,
# with the value that means "not applied".
_NEUTRAL_EXTRAS = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
}
_MASKING_FIELDS = ("logit_bias", "bad_words", "allowed_token_ids", "structured_outputs")
# Rows whose filters (min-p, top-k, top-p) are worked out at once (`_dropped`).
FILTER_ROWS = 128


@dataclass(frozen=True)
class SamplingParams:
    """How one completion was sampled, as vLLM resolved it."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: every token
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if self.temperature < GREEDY_BELOW:
            # vLLM resets these for greedy requests, and leaves the logits untempered.
            for name, value in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
                object.__setattr__(self, name, value)
        if self.top_k < 0:
            object.__setattr__(self, "top_k", 0)

    @property
    def raw(self) -> bool:
        """Whether the processed distribution is the raw softmax."""
        return self.temperature == 1.0 and self.top_k == 0 and self.top_p >= 1.0 and self.min_p <= 0


NEUTRAL = SamplingParams()


def server_defaults(model: str | Path | None, generation_config: str = "auto") -> dict[str, Any]:
    """The sampling defaults a vLLM server applies to requests that omit them.

    As vLLM's `ModelConfig.get_diff_sampling_param`: nothing with `--generation-config
    vllm`; else the non-default values of the model's generation_config.json ("auto":
    the model's own directory, or the directory given), falling back to those derived
    from its config.json. Penalties are returned too (`unreproduced` reports them).
    """
    if generation_config == "vllm" or model is None:
        return {}
    from transformers import AutoConfig, GenerationConfig

    source = str(model) if generation_config == "auto" else generation_config
    try:
        config = GenerationConfig.from_pretrained(source).to_diff_dict()
    except OSError:
        try:
            config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(source))
            config = config.to_diff_dict()
        except OSError:
            return {}
    keys = SAMPLING_KEYS + tuple(_NEUTRAL_EXTRAS)
    return {k: config[k] for k in keys if config.get(k) is not None}


def from_request(request: dict[str, Any] | None, defaults: dict[str, Any]) -> SamplingParams:
    """A record's sampling parameters: the request's, else the server's default, else
    vLLM's neutral value (its priority: user, server default, OpenAI default)."""
    request = request or {}
    values = {}
    for key in SAMPLING_KEYS:
        value = request.get(key)
        if value is None:
            value = defaults.get(key, getattr(NEUTRAL, key))
        values[key] = int(value) if key == "top_k" else float(value)
    return SamplingParams(**values)


def unreproduced(request: dict[str, Any] | None, defaults: dict[str, Any]) -> list[str]:
    """What vLLM applied to this request's logits that `processed_logprobs` does not redo."""
    request = request or {}
    out = []
    for key, neutral in _NEUTRAL_EXTRAS.items():
        value = request.get(key)
        value = defaults.get(key, neutral) if value is None else value
        if value != neutral:
            out.append(key)
    out += [key for key in _MASKING_FIELDS if request.get(key)]
    response_format = (request.get("response_format") or {}).get("type")
    if response_format in ("json_object", "json_schema"):
        out.append("response_format")  # a grammar mask on the logits
    tool_choice = request.get("tool_choice")
    if tool_choice == "required" or isinstance(tool_choice, dict):
        out.append("tool_choice")  # vLLM constrains the call to its JSON schema
    return out


def sampling_tensors(params: list[SamplingParams]) -> dict[str, torch.Tensor]:
    """Per-token parameters as tensors (N,), the names `processed_logprobs` takes."""
    import torch

    return {
        "temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32),
        "top_k": torch.tensor([p.top_k for p in params], dtype=torch.long),
        "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32),
        "min_p": torch.tensor([p.min_p for p in params], dtype=torch.float32),
    }


def processed_logprobs(
    logits: torch.Tensor,  # (N, V) the policy's, any float dtype
    targets: torch.Tensor,  # (N,) the sampled tokens
    temperature: torch.Tensor,  # (N,)
    top_k: torch.Tensor,  # (N,) 0: off
    top_p: torch.Tensor,  # (N,) 1: off
    min_p: torch.Tensor,  # (N,) 0: off
) -> torch.Tensor:
    """Logprob of each target under the distribution vLLM sampled it from: (N,).

    The sampled token is always kept: if vLLM's processing had dropped it, the logged
    parameters do not describe how it was sampled (a grammar mask, say), and keeping it
    makes that show as a logprob gap rather than an infinite ratio.
    """
    import torch

    logits = processed_logits(logits, targets, temperature, top_k, top_p, min_p)
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)


def processed_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    in_place: bool = False,
) -> torch.Tensor:
    """The logits vLLM sampled from: float32, tempered, its dropped tokens at -inf (N, V).

    `in_place` reuses a float32 `logits` outside autograd (trainer/grpo/head.py, whose
    memory is a few of these (N, V) tensors): the same values, one allocation fewer.
    """
    import torch

    divisor = temperature.clamp(min=GREEDY_BELOW)[:, None]
    if in_place and logits.dtype == torch.float32:
        logits = logits.div_(divisor)
    else:
        logits = logits.float() / divisor  # (N, V)
    if bool((top_k > 0).any() or (top_p < 1).any() or (min_p > 0).any()):
        with torch.no_grad():
            dropped = _dropped(logits.detach(), top_k, top_p, min_p)  # (N, V)
            dropped.scatter_(1, targets[:, None], False)
        if in_place:
            logits.masked_fill_(dropped, float("-inf"))
        else:
            logits = logits.masked_fill(dropped, float("-inf"))
    return logits


def _dropped(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Where vLLM's min-p, then top-k, then top-p set the tempered logits to -inf: (N, V).

    A block of rows at a time: top-p sorts every row (values, int64 indices, softmax,
    cumulative sum: ~24 bytes per logit), which for a chunk of 1024 tokens of a 152k
    vocabulary would be 3.7 GB; 128 rows take 470 MB. Every step is row by row, so the
    blocks change nothing."""
    import torch

    dropped = torch.zeros_like(logits, dtype=torch.bool)
    for start in range(0, logits.shape[0], FILTER_ROWS):
        rows = slice(start, start + FILTER_ROWS)
        dropped[rows] = _dropped_rows(logits[rows], top_k[rows], top_p[rows], min_p[rows])
    return dropped


def _dropped_rows(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    import torch

    vocab = logits.shape[1]
    dropped = torch.zeros_like(logits, dtype=torch.bool)
    rows = (min_p > 0).nonzero().squeeze(1)
    if rows.numel():
        probs = logits[rows].softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * min_p[rows, None]
        dropped[rows] = probs < floor
    rows = ((top_k > 0) & (top_k < vocab)).nonzero().squeeze(1)
    if rows.numel():
        x = logits[rows].masked_fill(dropped[rows], float("-inf"))
        k = top_k[rows]
        kth = x.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # (n, 1)
        dropped[rows] |= x < kth
    rows = (top_p < 1).nonzero().squeeze(1)
    if rows.numel():
        x = logits[rows].masked_fill(dropped[rows], float("-inf"))
        ascending, order = x.sort(dim=-1, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1 - top_p[rows, None]
        drop_sorted[:, -1] = False  # the most likely token always stays
        dropped[rows] |= torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return dropped
