"""Training data from records, advantages, and the GRPO loss against numbers by hand."""

from __future__ import annotations

import math

import pytest
import torch

from overnight.trainer.grpo.data import DataError, Turn, group_advantages, merge_turns
from overnight.trainer.grpo.loss import LossConfig, Normalisation, policy_loss, token_weights

# -- samples from logged turns ---------------------------------------------------------


def test_turns_that_extend_each_other_become_one_sequence():
    t1 = Turn(prompt_ids=[1, 2, 3], completion_ids=[10, 11], logprobs=[-0.1, -0.2])
    # The agent resent the history plus a tool result (40, 41) and got another reply.
    t2 = Turn(prompt_ids=[1, 2, 3, 10, 11, 40, 41], completion_ids=[12], logprobs=[-0.3])
    (s,) = merge_turns("r", "g", [t1, t2])
    assert s.tokens == [1, 2, 3, 10, 11, 40, 41, 12]
    assert s.trained == [False, False, False, True, True, False, False, True]
    assert s.behaviour_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3]
    assert (s.turns, s.trained_tokens) == (2, 3)


def test_a_turn_that_does_not_extend_starts_a_new_sequence():
    t1 = Turn([1, 2], [10], [-0.1])
    rewritten = Turn([1, 2, 99, 5], [12], [-0.3])  # history changed: 99 instead of 10
    a, b = merge_turns("r", "g", [t1, rewritten])
    assert a.tokens == [1, 2, 10] and b.tokens == [1, 2, 99, 5, 12]
    assert b.trained == [False, False, False, False, True]


def test_turns_that_cannot_be_trained_say_why():
    with pytest.raises(DataError, match="2 completion tokens but 1 logprobs"):
        Turn([1], [10, 11], [-0.1])
    with pytest.raises(DataError, match="without completion"):
        Turn([1], [], [])
    with pytest.raises(DataError, match="not finite"):
        Turn([1], [10], [float("-inf")])


def test_group_advantages_by_hand():
    adv = group_advantages({"a": 1.0, "b": 0.0, "c": 0.0, "d": 1.0})
    # mean 0.5; sample std sqrt((4 x 0.25) / 3) = 0.577350
    assert adv.mean == 0.5 and adv.std == pytest.approx(0.577350, abs=1e-6)
    assert adv.advantages["a"] == pytest.approx(0.866025, abs=1e-5)
    assert adv.advantages["b"] == pytest.approx(-0.866025, abs=1e-5)
    plain = group_advantages({"a": 1.0, "b": 0.0}, scale_by_std=False)
    assert plain.advantages == {"a": 0.5, "b": -0.5}
    assert group_advantages({"a": 0.3, "b": 0.3, "c": 0.3}) is None  # no variance: no signal
    assert group_advantages({"a": 1.0}) is None


# -- the loss ------------------------------------------------------------------------
#
# Two sequences packed: [s0 t0, s0 t1, s1 context, s1 t0, s1 t1, s1 t2].
# s0: advantage +1, ratios 1.0 and 1.5.  s1: advantage -0.5, ratios 0.5, 1.0 and 4.0.
# With clip 0.2/0.28 and dual clip 3, the surrogates per trained token are:
#   s0: min(1.0, 1.0) = 1.0;            min(1.5, 1.28) = 1.28          -> losses -1.0, -1.28
#   s1: min(-0.25, 0.8 x -0.5 = -0.4) = -0.4 (clipped)                 -> loss 0.4
#       -0.5                                                           -> loss 0.5
#       min(-2.0, -0.64) = -2.0, dual clip max(-2.0, 3 x -0.5) = -1.5  -> loss 1.5

BEHAVIOUR = torch.tensor([-1.0, -1.0, 0.0, -1.0, -1.0, -1.0])
LOGP = BEHAVIOUR + torch.tensor([0.0, math.log(1.5), 0.0, math.log(0.5), 0.0, math.log(4.0)])
TRAINED = torch.tensor([True, True, False, True, True, True])
ADV = torch.tensor([1.0, 1.0, -0.5, -0.5, -0.5, -0.5])
SEQ = torch.tensor([0, 0, 1, 1, 1, 1])


def loss_of(config: LossConfig, logp=LOGP, ref=None, keep=slice(None)) -> tuple[float, dict]:
    per_sequence = token_weights([2, 3], config)
    weights = torch.tensor([per_sequence[s] for s in SEQ.tolist()]) * TRAINED
    loss, stats = policy_loss(
        logp[keep],
        BEHAVIOUR[keep],
        ADV[keep],
        weights[keep],
        TRAINED[keep],
        config,
        sequence_index=SEQ[keep] - SEQ[keep].min(),
        ref_logp=None if ref is None else ref[keep],
    )
    return loss.item(), stats


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        (
            "grpo",
            ((-1.0 - 1.28) / 2 + (0.4 + 0.5 + 1.5) / 3) / 2,
        ),  # -0.17: per-sequence means, averaged
        ("dapo", (-1.0 - 1.28 + 0.4 + 0.5 + 1.5) / 5),  # 0.024: over the 5 trained tokens
        (
            "dr_grpo",
            (-1.0 - 1.28 + 0.4 + 0.5 + 1.5) / (4 * 2),
        ),  # 0.015: constant 4 tokens x 2 sequences
    ],
)
def test_each_normalisation_against_numbers_by_hand(variant, expected):
    loss, stats = loss_of(LossConfig(variant=variant, max_tokens=4))
    assert loss == pytest.approx(expected, abs=1e-6)
    assert stats["tokens"] == 5 and stats["clipped_fraction"] == pytest.approx(
        2 / 5
    )  # 1.5 up, 0.5 down
    assert stats["dual_clipped_fraction"] == pytest.approx(1 / 5) and stats[
        "ratio_max"
    ] == pytest.approx(4.0)


def test_without_dual_clip_a_large_ratio_counts_in_full():
    loss, _ = loss_of(LossConfig(variant="dapo", dual_clip=None))
    assert loss == pytest.approx((-1.0 - 1.28 + 0.4 + 0.5 + 2.0) / 5, abs=1e-6)  # 0.124


def test_sequence_level_ratios_by_hand():
    # s0: ratio sqrt(1.5) = 1.224745 (inside the clip) -> -1.224745 per token.
    # s1: ratio (0.5 x 1 x 4)^(1/3) = 1.259921 -> -0.5 x 1.259921 -> +0.629961 per token.
    loss, _ = loss_of(LossConfig(variant="dapo", level="sequence"))
    assert loss == pytest.approx((2 * -1.224745 + 3 * 0.629961) / 5, abs=1e-5)


def test_kl_to_the_base_model_by_hand():
    # ref = logp + ln 2 everywhere: k3 = 2 - ln 2 - 1 = 0.306853 per token, x 0.1.
    base, _ = loss_of(LossConfig(variant="dapo"))
    with_kl, stats = loss_of(LossConfig(variant="dapo", kl_coef=0.1), ref=LOGP + math.log(2))
    assert with_kl - base == pytest.approx(0.1 * 0.306853, abs=1e-6)
    assert stats["ref_kl"] == pytest.approx(0.306853, abs=1e-6)


@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_add_up_to_the_batch(variant):
    config = LossConfig(variant=variant, max_tokens=4)
    whole, _ = loss_of(config)
    first, _ = loss_of(config, keep=slice(0, 2))
    second, _ = loss_of(config, keep=slice(2, 6))
    assert first + second == pytest.approx(whole, abs=1e-6)


def test_gradients_flow_only_through_unclipped_trained_tokens():
    logp = LOGP.clone().requires_grad_(True)
    config = LossConfig(variant="dapo")
    weights = torch.tensor([0.2, 0.2, 0.0, 0.2, 0.2, 0.2])
    loss, _ = policy_loss(logp, BEHAVIOUR, ADV, weights, TRAINED, config)
    loss.backward()
    # d(-r A w)/d logp = -r A w where the unclipped branch is active:
    # s0 t0: -1 x 1 x 0.2 = -0.2; s1 t1: -1 x -0.5 x 0.2 = 0.1; clipped / masked tokens: 0.
    assert logp.grad.tolist() == pytest.approx([-0.2, 0.0, 0.0, 0.0, 0.1, 0.0], abs=1e-6)


def test_unknown_variants_fail_loudly():
    with pytest.raises(
        ValueError, match="unknown loss variant 'ppo'; choose one of grpo, dr_grpo, dapo"
    ):
        LossConfig(variant="ppo")
    assert Normalisation.parse("dr_grpo") is Normalisation.DR_GRPO


def test_a_dual_clip_inside_the_clip_window_is_refused():
    # Below 1 + clip_high TRL's delta would also cap positive-advantage tokens; ours would not.
    with pytest.raises(ValueError, match="dual_clip must be at least 1 \\+ clip_high = 1.28"):
        LossConfig(clip_high=0.28, dual_clip=1.2)
    assert LossConfig(clip_high=0.28, dual_clip=1.28).dual_clip == 1.28
    assert LossConfig(dual_clip=None).dual_clip is None
