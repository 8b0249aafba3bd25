import math

import pytest
import torch

from trapo.logits import kl_uniform_to_policy, token_entropy, token_logprobs
from trapo.loss import group_advantages, policy_loss, rollout_is_weights


def test_group_advantages_dr_grpo_is_centered_reward():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]]))


def test_group_advantages_std_uses_unbiased_std():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), scale="std")
    std = math.sqrt(4 * 0.25 / 3)  # unbiased
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / (std + 1e-6))


@pytest.mark.parametrize("scale", ["none", "std"])
def test_equal_rewards_and_single_rollout_give_zero_advantage(scale):
    assert torch.equal(group_advantages(torch.ones(3, 8), scale), torch.zeros(3, 8))
    assert torch.equal(group_advantages(torch.tensor([[1.0], [0.0]]), scale), torch.zeros(2, 1))
    assert group_advantages(torch.zeros(0, 8), scale).shape == (0, 8)


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.ones(2, 2), "rank")
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        group_advantages(torch.ones(4))


def _example():
    # Two sequences, three positions. old log-probs 0, so ratio = exp(logprobs).
    ratios = torch.tensor([[1.0, 1.5, 0.5], [1.1, 0.7, 1.0]])
    logprobs = ratios.log().requires_grad_(True)
    old = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logprobs, old, adv, mask


# Per token, -min(r A, clip(r, 0.8, 1.2) A):
#   seq 0 (A=+1):  r=1 -> -1;  r=1.5 -> -1.2 (clipped);  r=0.5 -> -0.5       sum -2.7
#   seq 1 (A=-2):  r=1.1 -> 2.2;  r=0.7 -> 1.6 (clipped);  (masked)          sum  3.8
@pytest.mark.parametrize(
    "agg,expected",
    [("dr_grpo", 1.1 / 6), ("token_mean", 1.1 / 5), ("seq_mean", (-2.7 / 3 + 3.8 / 2) / 2)],
)
def test_policy_loss_hand_values(agg, expected):
    logprobs, old, adv, mask = _example()
    loss, metrics = policy_loss(logprobs, old, adv, mask, agg=agg)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["clip_frac"].item() == pytest.approx(2 / 5)
    assert metrics["ratio_mean"].item() == pytest.approx((1 + 1.5 + 0.5 + 1.1 + 0.7) / 5)
    k3 = sum(r - 1 - math.log(r) for r in (1, 1.5, 0.5, 1.1, 0.7)) / 5
    assert metrics["approx_kl_old"].item() == pytest.approx(k3, abs=1e-6)


def test_policy_loss_gradient_only_through_unclipped_tokens():
    logprobs, old, adv, mask = _example()
    loss, _ = policy_loss(logprobs, old, adv, mask)
    loss.backward()
    # d(-r A)/d logp = -r A where the unclipped term is the min, else 0; / (N L) = / 6.
    expected = torch.tensor([[-1.0, 0.0, -0.5], [2.2, 0.0, 0.0]]) / 6
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)


def test_clip_eps_high_widens_upper_bound_only():
    logprobs, old, adv, mask = _example()
    loss, _ = policy_loss(logprobs, old, adv, mask, clip_eps_high=0.28)
    assert loss.item() == pytest.approx((-1 - 1.28 - 0.5 + 2.2 + 1.6) / 6, abs=1e-6)


def test_gate_weight_zero_removes_terms_and_gradient_but_keeps_denominator():
    logprobs, old, adv, mask = _example()
    loss, metrics = policy_loss(logprobs, old, adv, mask, weights=torch.tensor([1.0, 0.0]))
    assert loss.item() == pytest.approx(-2.7 / 6, abs=1e-6)
    loss.backward()
    assert torch.equal(logprobs.grad[1], torch.zeros(3))
    assert metrics["clip_frac"].item() == pytest.approx(1 / 3)  # metrics over active tokens only


def test_masked_positions_get_zero_gradient_even_if_garbage():
    logprobs, old, adv, mask = _example()
    with torch.no_grad():
        logprobs[1, 2] = float("inf")
        old[1, 2] = float("-inf")
    entropy = torch.full((2, 3), float("nan"))
    entropy[mask.bool()] = 1.0
    loss, _ = policy_loss(logprobs, old, adv, mask, entropy=entropy, beta=0.1, ref_logprobs=torch.zeros(2, 3))
    loss.backward()
    assert torch.isfinite(loss)
    assert logprobs.grad[1, 2].item() == 0.0
    assert torch.isfinite(logprobs.grad).all()


def test_entropy_bonus_and_k3_kl_terms():
    lp = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    ref = torch.full((1, 2), math.log(2.0))
    entropy = torch.tensor([[0.5, 1.5]])
    base, _ = policy_loss(lp, lp, torch.zeros(1), mask)
    assert base.item() == 0.0
    loss, m = policy_loss(lp, lp, torch.zeros(1), mask, ref_logprobs=ref, beta=0.1, entropy=entropy)
    k3 = 2.0 - math.log(2.0) - 1.0  # exp(d) - d - 1 with d = log 2
    assert m["kl_ref"].item() == pytest.approx(k3, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * (2 * k3) / 2 - 0.01 * (0.5 + 1.5) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp, torch.zeros(1), mask, beta=0.1)


def test_denom_override_makes_microbatches_sum_to_full_batch():
    logprobs, old, adv, mask = _example()
    full, _ = policy_loss(logprobs, old, adv, mask, agg="token_mean")
    parts = [
        policy_loss(logprobs[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], agg="token_mean", denom=5)[0]
        for i in range(2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-6)


def test_empty_batch_and_shape_errors():
    empty = torch.zeros(0, 4)
    loss, _ = policy_loss(empty, empty, torch.zeros(0), empty)
    assert loss.item() == 0.0
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="agg"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), agg="sum")


def test_logit_statistics_hand_values():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])  # p = [.5,.5], [.75,.25]
    assert torch.allclose(
        token_entropy(logits), torch.tensor([[math.log(2), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]])
    )
    assert torch.allclose(kl_uniform_to_policy(logits), torch.tensor([[0.0, 0.5 * math.log(4 / 3)]]), atol=1e-6)
    assert torch.allclose(
        token_logprobs(logits, torch.tensor([[1, 0]])), torch.tensor([[math.log(0.5), math.log(0.75)]])
    )


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


def test_token_weights_scale_pg_terms_only():
    logprobs, old, adv, mask = _example()
    tw = torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.0, float("nan")]])  # NaN at padding is ignored
    ent = torch.ones(2, 3)
    ref = torch.full((2, 3), math.log(2.0))
    loss, m = policy_loss(
        logprobs, old, adv, mask, token_weights=tw, entropy=ent, beta=0.1, ref_logprobs=ref + logprobs.detach()
    )
    # pg terms from the hand table above, times w: -1*2, -1.2*0.5, -0.5*1, 2.2*1.5, 1.6*1.
    pg = (-2.0 - 0.6 - 0.5 + 3.3 + 1.6) / 6
    k3 = 2.0 - math.log(2.0) - 1.0  # unweighted: 5 tokens
    assert m["pg_loss"].item() == pytest.approx(pg, abs=1e-6)
    assert loss.item() == pytest.approx(pg + 0.1 * 5 * k3 / 6 - 0.01 * 5 / 6, abs=1e-6)
    loss.backward()
    # d/d logp of the weighted pg term is w * (unclipped grad); k3's gradient is unweighted:
    # d/dlp [exp(ref - lp) - (ref - lp) - 1] with ref - lp = log 2 held = -(2 - 1) = -1.
    expected = torch.tensor([[-1.0 * 2.0, 0.0, -0.5], [2.2 * 1.5, 0.0, 0.0]]) / 6 + 0.1 * -1.0 * mask / 6
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)
    assert torch.isfinite(logprobs.grad).all()


def test_token_weights_none_equals_all_ones():
    results = []
    for tw in (None, torch.ones(2, 3)):
        logprobs, old, adv, mask = _example()
        loss, _ = policy_loss(logprobs, old, adv, mask, token_weights=tw, entropy=torch.ones(2, 3), agg="token_mean")
        loss.backward()
        results.append((loss.detach(), logprobs.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_token_weights_shape_error():
    logprobs, old, adv, mask = _example()
    with pytest.raises(ValueError, match="token_weights"):
        policy_loss(logprobs, old, adv, mask, token_weights=torch.ones(2))
    with pytest.raises(ValueError, match="token_weights"):
        policy_loss(logprobs, old, adv, mask, token_weights=torch.ones(3, 2))
