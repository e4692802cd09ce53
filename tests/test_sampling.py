"""The distribution vLLM sampled from (trainer/grpo/sampling.py), against numbers worked by hand.

Logits [2, 1, 0, -1] over a four-token vocabulary throughout. At temperature 1 the
probabilities are 0.6439, 0.2369, 0.0871, 0.0321.
"""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")

from overnight.trainer.grpo.sampling import (  # noqa: E402
    SamplingParams,
    from_request,
    processed_logprobs,
    sampling_tensors,
    server_defaults,
    unreproduced,
)

from .helpers import json_server  # noqa: E402

LOGITS = [2.0, 1.0, 0.0, -1.0]


def logprob(token: int, kept: list[int], temperature: float = 1.0) -> float:
    """By hand: the tempered logit minus the log-sum-exp over the kept tokens."""
    x = [v / temperature for v in LOGITS]
    return x[token] - math.log(sum(math.exp(x[i]) for i in kept))


def ours(token: int, **params) -> float:
    p = sampling_tensors([SamplingParams(**params)])
    out = processed_logprobs(torch.tensor([LOGITS]), torch.tensor([token]), **p)
    return out.item()


def test_neutral_is_the_raw_log_softmax():
    for token in range(4):
        assert ours(token) == pytest.approx(logprob(token, [0, 1, 2, 3]), abs=1e-6)


def test_temperature_divides_the_logits():
    assert ours(0, temperature=0.5) == pytest.approx(logprob(0, [0, 1, 2, 3], 0.5), abs=1e-6)
    assert ours(3, temperature=1.3) == pytest.approx(logprob(3, [0, 1, 2, 3], 1.3), abs=1e-6)


def test_top_k_keeps_the_k_largest():
    assert ours(1, top_k=2) == pytest.approx(logprob(1, [0, 1]), abs=1e-6)
    assert ours(0, top_k=1) == pytest.approx(0.0, abs=1e-6)
    assert ours(2, top_k=4) == pytest.approx(logprob(2, [0, 1, 2, 3]), abs=1e-6)  # k = V: off
    assert ours(2, top_k=-1) == pytest.approx(logprob(2, [0, 1, 2, 3]), abs=1e-6)  # -1: off


def test_top_k_keeps_ties_with_the_kth():
    p = sampling_tensors([SamplingParams(top_k=2)])
    tied = torch.tensor([[2.0, 1.0, 1.0, -1.0]])
    out = processed_logprobs(tied, torch.tensor([1]), **p).item()
    assert out == pytest.approx(1.0 - math.log(math.exp(2) + 2 * math.exp(1)), abs=1e-6)


def test_top_p_drops_the_tail_whose_mass_is_at_most_one_minus_p():
    # Ascending cumulative mass: 0.0321, 0.1192, 0.3561, 1. With p = 0.8 the tail
    # up to 0.2 goes (tokens 3 and 2); with p = 0.9 only token 3 (0.0321 <= 0.1).
    assert ours(1, top_p=0.8) == pytest.approx(logprob(1, [0, 1]), abs=1e-6)
    assert ours(2, top_p=0.9) == pytest.approx(logprob(2, [0, 1, 2]), abs=1e-6)
    assert ours(0, top_p=0.01) == pytest.approx(0.0, abs=1e-6)  # the top token always stays


def test_top_p_applies_after_temperature():
    # At temperature 2 the probabilities are 0.4309, 0.2614, 0.1585, 0.0962 (ascending
    # cumulative 0.0962, 0.2547, 0.5123): p = 0.8 drops token 3 only.
    assert ours(2, temperature=2.0, top_p=0.8) == pytest.approx(
        logprob(2, [0, 1, 2], 2.0), abs=1e-6
    )


def test_top_p_is_taken_over_the_top_k_renormalised_distribution():
    # After top-k 3: 0.6652, 0.2447, 0.0900 (ascending cumulative 0.0900, 0.3348).
    # top-p 0.66 drops up to 0.34: tokens 2 and 1 go. Over the full distribution
    # (cumulative 0.3561 for token 1) token 1 would have stayed.
    assert ours(0, top_k=3, top_p=0.66) == pytest.approx(0.0, abs=1e-6)
    assert ours(0, top_p=0.66) == pytest.approx(logprob(0, [0, 1]), abs=1e-6)


def test_combined_temperature_top_k_top_p():
    # T = 0.5: logits 4, 2, 0, -2; top-k 3 leaves 0.8668, 0.1173, 0.0159;
    # top-p 0.95 drops up to 0.05: token 2 goes.
    assert ours(1, temperature=0.5, top_k=3, top_p=0.95) == pytest.approx(
        logprob(1, [0, 1], 0.5), abs=1e-6
    )


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    # 0.1 x 0.6439 = 0.0644: token 3 (0.0321) goes.
    assert ours(2, min_p=0.1) == pytest.approx(logprob(2, [0, 1, 2]), abs=1e-6)


def test_greedy_logs_the_raw_distribution():
    params = SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.2)
    assert params == SamplingParams()  # vLLM resets them for greedy requests
    assert ours(2, temperature=0.0) == pytest.approx(logprob(2, [0, 1, 2, 3]), abs=1e-6)


def test_a_sampled_token_outside_the_kept_set_stays_finite():
    out = ours(3, top_k=2)  # cannot have been sampled so: a gap, not an infinite ratio
    assert math.isfinite(out)
    assert out == pytest.approx(logprob(3, [0, 1, 3]), abs=1e-6)


def test_gradient_flows_through_the_kept_tokens_only():
    logits = torch.tensor([LOGITS], requires_grad=True)
    p = sampling_tensors([SamplingParams(top_k=2)])
    processed_logprobs(logits, torch.tensor([0]), **p).backward()
    kept = [math.exp(logprob(i, [0, 1])) for i in (0, 1)]
    expected = [1 - kept[0], -kept[1], 0.0, 0.0]  # d log p0 / d logits over the kept pair
    assert logits.grad[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_rows_with_different_parameters_in_one_batch():
    params = [SamplingParams(), SamplingParams(temperature=0.5, top_k=2), SamplingParams(top_p=0.8)]
    out = processed_logprobs(
        torch.tensor([LOGITS] * 3), torch.tensor([2, 1, 1]), **sampling_tensors(params)
    )
    expected = [logprob(2, [0, 1, 2, 3]), logprob(1, [0, 1], 0.5), logprob(1, [0, 1])]
    assert out.tolist() == pytest.approx(expected, abs=1e-6)


def test_request_values_then_server_defaults_then_neutral():
    defaults = {"temperature": 0.7, "top_k": 20, "top_p": 0.8}
    assert from_request({"temperature": 1.3}, defaults) == SamplingParams(1.3, 20, 0.8, 0.0)
    assert from_request({"top_k": None}, defaults) == SamplingParams(0.7, 20, 0.8, 0.0)
    assert from_request({}, {}) == SamplingParams()
    assert from_request(None, {"min_p": 0.05}) == SamplingParams(min_p=0.05)


def test_server_defaults_follow_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05})
    )
    defaults = server_defaults(tmp_path)
    assert defaults == {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}
    assert server_defaults(tmp_path, "vllm") == {}  # `--generation-config vllm`
    assert unreproduced({}, defaults) == ["repetition_penalty"]
    assert unreproduced({"repetition_penalty": 1.0}, defaults) == []


def test_unreproduced_names_logit_processing_the_trainer_cannot_redo():
    request = {
        "logit_bias": {"5": 3},
        "response_format": {"type": "json_schema", "json_schema": {}},
        "tool_choice": "required",
    }
    assert unreproduced(request, {}) == ["logit_bias", "response_format", "tool_choice"]
    assert unreproduced({"tool_choice": "auto", "response_format": {"type": "text"}}, {}) == []


@pytest.mark.slow
def test_equals_vllms_own_top_k_top_p():
    """Random logits and parameters: our kept set and logprobs are vLLM 0.32's."""
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    generator = torch.Generator().manual_seed(0)
    n, vocab = 64, 1000
    logits = torch.randn(n, vocab, generator=generator) * 3
    temperature = torch.rand(n, generator=generator) * 1.5 + 0.3
    top_k = torch.randint(0, 60, (n,), generator=generator)
    top_p = torch.rand(n, generator=generator) * 0.9 + 0.1
    theirs = topk_topp.apply_top_k_top_p(
        logits / temperature[:, None], torch.where(top_k > 0, top_k, vocab), top_p
    ).log_softmax(-1)
    targets = torch.multinomial(theirs.exp(), 1, generator=generator).squeeze(1)
    out = processed_logprobs(logits, targets, temperature, top_k, top_p, torch.zeros(n))
    assert out.tolist() == pytest.approx(theirs.gather(1, targets[:, None]).squeeze(1).tolist())


@pytest.mark.parametrize(
    ("logprob", "verdict", "says"),
    [(0.0, True, "processed logprobs"), (-2.31, False, "raw logprobs (a top_k=1 probe got -2.31")],
)
def test_serve_upstream_checks_the_logprobs_mode(logprob, verdict, says):
    """`overnight serve --upstream` probes vLLM once: top_k 1 leaves one token, whose
    processed logprob is 0 exactly."""
    from overnight.proxy.launch.launcher import check_logprobs_mode

    asked = []

    def upstream(method: str, path: str, body: dict | None) -> tuple[int, dict]:
        if method == "GET":
            return 200, {"data": [{"id": "m"}]}
        asked.append(body)
        return 200, {"choices": [{"logprobs": {"token_logprobs": [logprob]}}]}

    with json_server(upstream) as url:
        ok, line = check_logprobs_mode(url)
    assert ok is verdict and says in line
    assert asked[0]["top_k"] == 1 and asked[0]["model"] == "m" and asked[0]["max_tokens"] == 1
    unreachable = check_logprobs_mode("http://127.0.0.1:9", timeout=1)
    assert unreachable[0] is None and "could not check" in unreachable[1]
