"""Rollout importance correction (trapo/algorithm/importance.py): truncate, token_mask, sequence_mask by hand; the
geometric mean of sequence_mask; the top-p warning; the logged fractions."""

import math

import pytest
import torch

from trapo.algorithm.importance import resolve_mode, rollout_is_weights, top_p_bias_warning
from trapo.engine.policy import UPDATE_SUMS
from trapo.training.metrics import step_values


def _logprobs(ratios, pad_value=float("-inf")):
    """(old, engine, mask) with pi_old / pi_engine = ratios; None entries are padding (garbage there)."""
    old = torch.tensor([[-1.0 - 0.1 * j for j in range(len(row))] for row in ratios])
    log_r = torch.tensor([[0.0 if r is None else math.log(r) for r in row] for row in ratios])
    mask = torch.tensor([[r is not None for r in row] for row in ratios])
    engine = torch.where(mask, old - log_r, pad_value)
    return old, engine, mask


def test_rollout_is_weights_hand_values():
    # log(pi_old / pi_engine) per token; the third of row 0 exceeds the cap C = 2.
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])
    engine = old - torch.tensor([[0.0, math.log(1.5), math.log(3.0)], [math.log(0.5), 0.0, 0.0]])
    engine[1, 2] = float("-inf")  # padding may hold garbage
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w, m = rollout_is_weights(old, engine, mask, cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 1.5, 2.0], [0.5, 1.0, 0.0]]), atol=1e-6)
    assert not w.requires_grad
    assert m["is_weight_mean"].item() == pytest.approx((1.0 + 1.5 + 2.0 + 0.5 + 1.0) / 5, abs=1e-6)
    assert m["is_capped_frac"].item() == pytest.approx(1 / 5)
    assert m["is_masked_frac"].item() == 0.0 and m["is_masked_seqs"].item() == 0  # truncate drops nothing
    w, m = rollout_is_weights(old, engine, mask, cap=5.0)
    assert w[0, 2].item() == pytest.approx(3.0, abs=1e-5)
    assert m["is_capped_frac"].item() == 0.0


def test_rollout_is_weights_carry_no_gradient_and_reject_bad_input():
    old = torch.zeros(2, 3, requires_grad=True)
    w, _ = rollout_is_weights(old, torch.zeros(2, 3), torch.ones(2, 3))
    assert w.grad_fn is None and not w.requires_grad
    with pytest.raises(ValueError, match="engine_logprobs"):
        rollout_is_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        rollout_is_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 3))
    with pytest.raises(ValueError, match="old_logprobs"):
        rollout_is_weights(torch.zeros(6), torch.zeros(6), torch.ones(6))
    with pytest.raises(ValueError, match="cap"):
        rollout_is_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), cap=0.0)


def test_token_mask_drops_tokens_outside_the_band_and_keeps_the_ratio_inside():
    old, engine, mask = _logprobs([[1.0, 1.5, 3.0], [0.4, 1.0, None]])
    w, m = rollout_is_weights(old, engine, mask, mode="token_mask", cap=2.0)  # lower = 1 / 2
    assert torch.allclose(w, torch.tensor([[1.0, 1.5, 0.0], [0.0, 1.0, 0.0]]), atol=1e-6)
    assert m["is_weight_mean"].item() == pytest.approx(3.5 / 5, abs=1e-6)
    assert m["is_masked_frac"].item() == pytest.approx(2 / 5)
    assert (m["is_masked_seqs"].item(), m["is_seqs"].item()) == (2, 2)
    assert m["is_capped_frac"].item() == pytest.approx(1 / 5)  # the 3.0, above the cap
    w, m = rollout_is_weights(old, engine, mask, mode="token_mask", cap=2.0, lower=0.3)
    assert torch.allclose(w, torch.tensor([[1.0, 1.5, 0.0], [0.4, 1.0, 0.0]]), atol=1e-6)
    assert m["is_masked_frac"].item() == pytest.approx(1 / 5) and m["is_masked_seqs"].item() == 1


def test_sequence_mask_uses_the_geometric_mean_of_token_ratios():
    old, engine, mask = _logprobs(
        [
            [1.5, 1.5, 1.5, 1.5],  # s = 1.5: kept, although the product 5.06 is far above the cap
            [4.0, 4.0, 1.0, None],  # s = 16^(1/3) = 2.52 > 2: dropped
            [0.25, 1.0, 4.0, 1.0],  # s = 1: kept whole, although two tokens lie outside [0.5, 2]
            [0.3, 0.5, None, None],  # s = sqrt(0.15) = 0.387 < 0.5: dropped
        ]
    )
    w, m = rollout_is_weights(old, engine, mask, mode="sequence_mask", cap=2.0)
    expected = torch.tensor([[1.5] * 4, [0.0] * 4, [1.0] * 4, [0.0] * 4])
    assert torch.allclose(w, expected, atol=1e-5)
    assert m["is_masked_frac"].item() == pytest.approx(5 / 13)  # 3 + 2 of 13 tokens
    assert (m["is_masked_seqs"].item(), m["is_seqs"].item()) == (2, 4)
    assert m["is_weight_mean"].item() == pytest.approx((4 * 1.5 + 4 * 1.0) / 13, abs=1e-6)
    assert m["is_capped_frac"].item() == pytest.approx(3 / 13)  # token ratios above 2: two 4s, one 4
    # the same sequences by token: row 2 loses its 0.25 and its 4
    w, _ = rollout_is_weights(old, engine, mask, mode="token_mask", cap=2.0)
    assert torch.allclose(w[2], torch.tensor([0.0, 1.0, 0.0, 1.0]), atol=1e-6)


def test_mask_modes_are_detached_and_finite_with_garbage_padding():
    old, engine, mask = _logprobs([[1.2, None], [None, None]], pad_value=float("nan"))
    old.requires_grad_(True)
    for mode in ("truncate", "token_mask", "sequence_mask"):
        w, m = rollout_is_weights(old, engine, mask, mode=mode)
        assert not w.requires_grad and torch.isfinite(w).all()
        assert w[0, 0].item() == pytest.approx(1.2, abs=1e-6) and w[0, 1] == 0 and (w[1] == 0).all()
        assert m["is_seqs"].item() == 1  # an empty row is no sequence
    with pytest.raises(ValueError, match="mode"):
        rollout_is_weights(old, engine, mask, mode="off")
    with pytest.raises(ValueError, match="lower"):
        rollout_is_weights(old, engine, mask, mode="token_mask", cap=2.0, lower=3.0)


def test_resolve_mode_and_top_p_warning():
    assert resolve_mode(None, on_gpu=True) == "truncate" and resolve_mode(None, on_gpu=False) == "off"
    assert resolve_mode("sequence_mask", on_gpu=False) == "sequence_mask"
    # YAML 1.1 reads `off` as false; true is the earlier boolean switch's truncate
    assert resolve_mode(False, on_gpu=True) == "off" and resolve_mode(True, on_gpu=False) == "truncate"
    with pytest.raises(ValueError):
        resolve_mode("sequence", on_gpu=False)
    assert top_p_bias_warning("off", 0.9) is None and top_p_bias_warning("truncate", 1.0) is None
    line = top_p_bias_warning("token_mask", 0.9)
    assert "\n" not in line and "rollout.top_p=0.9" in line and "nucleus" in line


def test_top_p_bias_is_the_nucleus_mass():
    """What the warning states, on vLLM's own top-p rule (sort ascending, drop the cumulative mass <= 1 - p,
    log_softmax over the rest): the engine's log-prob of a kept token is log p - log Z."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = logits.softmax(-1)
    processed = apply_top_k_top_p_pytorch(logits.clone(), None, torch.tensor([0.8])).log_softmax(-1)
    kept = torch.isfinite(processed)
    z = p[kept].sum()
    assert kept.tolist() == [[True, True, False, False]] and z < 1  # 0.665 + 0.245 = 0.91 >= 0.8
    ratio = (p.log() - processed)[kept]  # pi_old / pi_engine for the kept tokens
    assert torch.allclose(ratio, z.log().expand_as(ratio), atol=1e-6)


def test_step_values_report_masked_fractions_and_overlong_penalty():
    t = dict.fromkeys(UPDATE_SUMS, 0.0)
    t.update(
        labeled_questions=1,
        labeled_pass_sum=1.0,
        unlabeled_questions=0,
        unlabeled_pass_sum=0.0,
        unlabeled_reward_sum=0.0,
        unlabeled_in_loss=0,
        pseudo_known=0,
        pseudo_right=0.0,
        response_tokens=10,
        truncated=1,
        responses=8,
        grading_timeouts=0,
        grading_budget_cut=0,
        grading_failed=0,
    )
    off = step_values(t, world=1, updates=1, applied=True, unlabeled=True)
    assert off["rollout_is_masked_frac"] is None and off["rollout_is_masked_seq_frac"] is None
    assert off["overlong_penalty_mean"] is None
    t.update(
        is_tokens=40.0, is_masked=10.0, is_masked_seqs=3.0, is_seqs=8.0, overlong_penalty=-2.0, overlong_responses=8.0
    )
    v = step_values(t, world=1, updates=1, applied=True, unlabeled=True)
    assert v["rollout_is_masked_frac"] == 0.25 and v["rollout_is_masked_seq_frac"] == 3 / 8
    assert v["overlong_penalty_mean"] == -0.25
