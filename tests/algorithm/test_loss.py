import math

import pytest
import torch

from trapo.algorithm.logits import kl_uniform_to_policy, token_entropy, token_logprobs
from trapo.algorithm.loss import LossSpec, PolicyLoss, group_advantages, overlong_penalty, policy_loss
from trapo.training.settings import loss_spec


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


# ----------------------------------------------------------------------------- objectives

# _example under each objective (clip_eps 0.2), per-token terms and d term / d logprob:
#   grpo  above.
#   cispo -sg(min(r, 1.2)) A: weights [1, 1.2, 0.5], [1.1, 0.7] (no lower bound: 0.7 stays 0.7)
#         terms [-1, -1.2, -0.5], [2.2, 1.4]; gradient = the terms (clipped tokens keep theirs).
#   gspo  s_0 = (1 * 1.5 * 0.5)^(1/3) = 0.75^(1/3) in [0.8, 1.2], s_1 = (1.1 * 0.7)^(1/2) = 0.77^(1/2) also:
#         terms -s_0 (x3), 2 s_1 (x2); gradient -s_i A at every token of sequence i.
S0, S1 = 0.75 ** (1 / 3), 0.77**0.5
TERMS = {
    "grpo": ([[-1.0, -1.2, -0.5], [2.2, 1.6, 0.0]], [[-1.0, 0.0, -0.5], [2.2, 0.0, 0.0]]),
    "cispo": ([[-1.0, -1.2, -0.5], [2.2, 1.4, 0.0]], [[-1.0, -1.2, -0.5], [2.2, 1.4, 0.0]]),
    "gspo": ([[-S0] * 3, [2 * S1, 2 * S1, 0.0]], [[-S0] * 3, [2 * S1, 2 * S1, 0.0]]),
}


@pytest.mark.parametrize("objective", ["grpo", "gspo", "cispo"])
def test_objectives_compose_with_gate_token_weights_and_denominators(objective):
    """Each objective's hand terms, times the IS token weights and the gate, over the aggregation's denominator."""
    terms, grads = (torch.tensor(x) for x in TERMS[objective])
    tw = torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.0, float("nan")]])
    gate = torch.tensor([1.0, 0.5])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    tw_clean = torch.where(mask.bool(), tw, 0.0)
    for agg, denom in (("dr_grpo", None), ("token_mean", None), ("seq_mean", None), ("token_mean", 8.0)):
        logprobs, old, adv, m = _example()
        loss, metrics = policy_loss(
            logprobs,
            old,
            adv,
            m,
            objective=objective,
            agg=agg,
            denom=denom,
            weights=gate,
            token_weights=tw,
            entropy_coef=0.0,
        )
        loss.backward()
        per_token = gate[:, None] * tw_clean  # the factor on each token's term and gradient
        if agg == "seq_mean":
            per_token = per_token / mask.sum(dim=1, keepdim=True) / 2
        else:
            per_token = per_token / (denom or (6.0 if agg == "dr_grpo" else 5.0))
        assert loss.item() == pytest.approx((terms * per_token).sum().item(), abs=1e-6), (agg, denom)
        assert metrics["pg_loss"].item() == pytest.approx(loss.item(), abs=1e-6)
        assert torch.allclose(logprobs.grad, grads * per_token, atol=1e-6), (agg, denom)


def test_gspo_clips_the_whole_sequence_on_its_geometric_mean_ratio():
    # seq 0 (A=+1): token ratios [1, 1.1025]: s = 1.05 inside [0.9, 1.1], unclipped: terms -1.05, gradient -1.05
    # seq 1 (A=+2): [0.9, 1.2, 1.6]: s = 1.728^(1/3) = 1.2 > 1.1, clipped: terms -2.2, no gradient, even for
    #               the 0.9 token that GRPO's token clip would leave alone
    # seq 2 (A=-1): [0.8, 0.8]: s = 0.8 < 0.9 with A < 0, clipped: terms 0.9, no gradient
    ratios = torch.tensor([[1.0, 1.1025, 1.0], [0.9, 1.2, 1.6], [0.8, 0.8, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
    logprobs = ratios.log().requires_grad_(True)
    adv = torch.tensor([1.0, 2.0, -1.0])
    loss, m = policy_loss(logprobs, torch.zeros(3, 3), adv, mask, objective="gspo", clip_eps=0.1, agg="seq_mean")
    assert loss.item() == pytest.approx((-1.05 - 2.2 + 0.9) / 3, abs=1e-6)
    loss.backward()
    expected = torch.tensor([[-1.05 / 2 / 3] * 2 + [0.0], [0.0] * 3, [0.0] * 3])
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)
    assert m["clip_frac"].item() == pytest.approx(5 / 7)  # every token of sequences 1 and 2
    assert m["ratio_mean"].item() == pytest.approx((2 * 1.05 + 3 * 1.2 + 2 * 0.8) / 7, abs=1e-6)
    # the token form equals the paper's sequence-level objective -1/N sum_i min(s_i A_i, clip(s_i) A_i)
    lp = ratios.log().requires_grad_(True)
    s = ((lp * mask).sum(1) / mask.sum(1)).exp()
    paper = -torch.minimum(s * adv, s.clamp(0.9, 1.1) * adv).mean()
    paper.backward()
    assert paper.item() == pytest.approx(loss.item(), abs=1e-6)
    assert torch.allclose(lp.grad * mask, logprobs.grad, atol=1e-6)


def test_cispo_gradient_is_the_clipped_is_weighted_reinforce_gradient():
    """-sg(clip(r)) A pi / sg(pi) (ours, value -w A) and the paper's -sg(clip(r)) A log pi: the same gradient."""
    logprobs, old, adv, mask = _example()
    loss, m = policy_loss(logprobs, old, adv, mask, objective="cispo", clip_eps_high=0.3)
    loss.backward()
    lp = logprobs.detach().clone().requires_grad_(True)
    w = (lp - old).exp().clamp(max=1.3).detach()
    paper = (-(w * adv[:, None] * lp) * mask).sum() / 6
    paper.backward()
    assert torch.allclose(logprobs.grad, lp.grad, atol=1e-6)
    assert loss.item() == pytest.approx((-1.0 - 1.3 - 0.5 + 2.2 + 1.4) / 6, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(1 / 5)  # the 1.5: its weight is capped at 1.3
    with pytest.raises(ValueError, match="objective"):
        policy_loss(logprobs, old, adv, mask, objective="ppo")


@pytest.mark.parametrize("objective", ["gspo", "cispo"])
def test_objectives_on_policy_equal_grpo_values(objective):
    """pi_theta = pi_old: every ratio is 1, nothing clips, and all three objectives give GRPO's loss and gradient
    (-A per token) -- the paper's one-update-per-batch setting."""
    results = []
    for obj in ("grpo", objective):
        lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 5.0]], requires_grad=True)
        loss, m = policy_loss(
            lp,
            lp.detach(),
            torch.tensor([1.0, -2.0]),
            torch.tensor([[1, 1, 1], [1, 1, 0]]),
            objective=obj,
            agg="token_mean",
        )
        loss.backward()
        results.append((loss.item(), lp.grad, m["clip_frac"].item()))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-7) and results[1][2] == 0.0
    assert torch.allclose(results[0][1], results[1][1], atol=1e-7)


# ----------------------------------------------------------------------------- overlong (DAPO)


def test_overlong_penalty_hand_values():
    # L_max = 10, L_cache = 4: free up to 6, then a ramp (6 - |y|) / 4, -1 at 10 and beyond
    lengths = torch.tensor([[3, 6, 7], [9, 10, 12]])
    assert torch.allclose(overlong_penalty(lengths, 10, 4), torch.tensor([[0.0, 0.0, -0.25], [-0.75, -1.0, -1.0]]))
    assert torch.allclose(overlong_penalty(lengths, 10, 4, factor=0.5)[1], torch.tensor([-0.375, -0.5, -0.5]))
    assert overlong_penalty(torch.tensor([5]), 5, 5).item() == -1.0  # buffer = L_max: the ramp starts at 0
    for bad in (0, 11):
        with pytest.raises(ValueError, match="buffer"):
            overlong_penalty(lengths, 10, bad)


def test_overlong_penalty_shifts_group_advantages():
    """Added to the rewards before the group advantages: a correct but long response earns less than a short one."""
    rewards = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    lengths = torch.tensor([[4, 9, 4, 10]])
    adv = group_advantages(rewards + overlong_penalty(lengths, 10, 4))
    # rewards + R_len = [1, 0.25, 0, -1], mean 0.0625
    assert torch.allclose(adv, torch.tensor([[0.9375, 0.1875, -0.0625, -1.0625]]))


def test_update_shapes_rewards_only_with_soft_penalty():
    """trapo.training.update.shaped_advantages: the hand values above under loss.overlong=soft_penalty, plain Dr.GRPO
    advantages (and a zero penalty) otherwise; an empty rank gives [0, G]."""
    from trapo.config import load_config
    from trapo.training.update import shaped_advantages

    base = ["toy.enabled=true", "rollout.n=4", "rollout.max_tokens=10"]
    soft = loss_spec(load_config(None, [*base, "loss.overlong=soft_penalty", "loss.overlong_buffer=4"]))
    adv, penalty = shaped_advantages([[1.0, 1.0, 0.0, 0.0]], [[4, 9, 4, 10]], soft, 4)
    assert torch.allclose(adv, torch.tensor([[0.9375, 0.1875, -0.0625, -1.0625]]))
    assert torch.allclose(penalty, torch.tensor([[0.0, -0.75, 0.0, -1.0]]))
    plain = loss_spec(load_config(None, base))
    adv, penalty = shaped_advantages([[1.0, 1.0, 0.0, 0.0]], [[4, 9, 4, 10]], plain, 4)
    assert torch.equal(adv, torch.tensor([[0.5, 0.5, -0.5, -0.5]])) and not penalty.any()
    adv, penalty = shaped_advantages([], [], soft, 4)
    assert adv.shape == (0, 4) and penalty.shape == (0, 4)


def test_overlong_mask_leaves_the_denominators():
    from trapo.engine.batch import build_sequences

    seqs = build_sequences(
        prompts=[[1, 2], [3]],
        responses=[[[5, 6, 7], [8]], [[9, 9], [4, 4, 4, 4]]],
        advantages=[[0.5, -0.5], [0.0, 0.0]],
        gate=[1.0, 0.0],
        labeled=[True, False],
        truncated=[[True, False], [False, True]],
    )
    assert [s.truncated for s in seqs] == [True, False, False, True]

    def loss_counts(seqs, drop_truncated=False):  # the update's call (trapo.training.update)
        loss = PolicyLoss(spec("loss.overlong=mask") if drop_truncated else spec())
        return loss.counts([len(s.ids) - s.prompt_len for s in seqs], [s.truncated for s in seqs])

    assert loss_counts(seqs) == {"sequences": 4, "tokens": 3 + 1 + 2 + 4}  # gated ones count, as before
    assert loss_counts(seqs, drop_truncated=True) == {"sequences": 2, "tokens": 1 + 2}
    assert [s.truncated for s in build_sequences([[1]], [[[2]]], [[0.0]], [1.0], [True])] == [False]
    # ... and the update itself (Policy.trainable)
    import dataclasses

    from trapo.config import Config
    from trapo.engine.policy import Policy

    policy = object.__new__(Policy)  # the real method on a loss spec alone: no model needed to filter
    cfg = Config()
    cfg.train.skip_zero_advantage = False
    policy.loss = PolicyLoss(loss_spec(cfg))
    assert policy.trainable(seqs) == seqs[:2]  # the gated question's two leave
    policy.loss = PolicyLoss(dataclasses.replace(policy.loss.spec, overlong="mask"))
    assert policy.trainable(seqs) == seqs[1:2]  # and the truncated response


# ----------------------------------------------------------------------------- the loss spec


def spec(*overrides: str) -> LossSpec:
    from trapo.config import load_config

    return loss_spec(load_config(None, ["toy.enabled=true", "rollout.max_tokens=10", *overrides]))


def test_loss_spec_clip_range_per_objective():
    """GSPO runs its own small range on the sequence ratio (the paper's 3e-4 / 4e-4), not loss.clip_eps."""
    grpo = spec("loss.clip_eps=0.25", "loss.clip_eps_high=0.3")
    assert (grpo.clip_eps, grpo.clip_eps_high) == (0.25, 0.3)
    gspo = spec("loss.objective=gspo", "loss.clip_eps=0.25", "loss.clip_eps_high=0.3")
    assert (gspo.clip_eps, gspo.clip_eps_high) == (3e-4, 4e-4)
    gspo = spec("loss.objective=gspo", "loss.gspo_clip_eps=1e-3", "loss.gspo_clip_eps_high=2e-3")
    assert (gspo.clip_eps, gspo.clip_eps_high) == (1e-3, 2e-3)
    assert (spec("loss.objective=cispo").clip_eps, spec("loss.objective=cispo").clip_eps_high) == (0.2, None)


@pytest.mark.parametrize(
    "overrides, inert",
    [
        (["loss.entropy_coef=0.0"], True),  # Dr.GRPO alone: the A-weighted term is all there is
        ([], False),  # the default entropy bonus 0.01 still pulls on a zero-advantage sequence
        (["loss.entropy_coef=0.0", "loss.beta=0.01"], False),  # and so does the KL term
    ],
)
def test_loss_spec_zero_advantage_sequences(overrides, inert):
    s = spec(*overrides)
    assert s.zero_advantage_no_gradient is inert and s.skips_zero_advantage is inert
    assert s.trains(0.0, 1.0, False) is not inert and s.carries_signal(0.0) is not inert
    assert s.trains(-0.5, 1.0, False) and s.carries_signal(0.5)
    assert not s.trains(0.5, 0.0, False)  # gate M = 0: nothing to train, whatever the advantage
    forced = spec(*overrides, "train.skip_zero_advantage=true")  # skipped even where not exact
    assert forced.skips_zero_advantage and not forced.trains(0.0, 1.0, False)
    kept = spec(*overrides, "train.skip_zero_advantage=false")
    assert not kept.skips_zero_advantage and kept.trains(0.0, 1.0, False)
    assert kept.carries_signal(0.0) is not inert  # the work counts still know it adds nothing


def test_loss_spec_overlong_and_denominators():
    """L_max = rollout.max_tokens = 10; soft_penalty's L_cache defaults to L_max // 5 = 2."""
    none, mask, soft = spec(), spec("loss.overlong=mask"), spec("loss.overlong=soft_penalty")
    assert not none.drops_truncated and none.trains(0.5, 1.0, True) and not none.penalizes_length
    assert mask.drops_truncated and not mask.trains(0.5, 1.0, True) and not mask.penalizes_length
    assert soft.penalizes_length and not soft.drops_truncated and soft.overlong_buffer == 2
    lengths = torch.tensor([[8, 9, 10]])
    assert torch.equal(soft.length_penalty(lengths), torch.tensor([[0.0, -0.5, -1.0]]))  # free to 8, then a ramp
    assert not none.length_penalty(lengths).any() and not mask.length_penalty(lengths).any()
    # dr_grpo: N * L_max; token_mean: the response tokens; seq_mean: N
    assert none.denominator(4, 30) == 40.0
    assert spec("loss.agg=token_mean").denominator(4, 30) == 30.0
    assert spec("loss.agg=seq_mean").denominator(4, 30) == 4.0
    assert spec("loss.beta=0.01").needs_reference and not none.needs_reference


# ----------------------------------------------------------------------------- the loss component


def engine_path(spec, world, on_gpu, logprobs, mask, adv, weights, counts, old=None, engine_lp=None, ref=None, **kw):
    """The per-micro-batch path `Policy.update` ran before the loss was one component: its on-policy rule,
    rollout importance weights, divide-by-world step and token-weighted sums, kept here to compare against."""
    from trapo.algorithm.importance import resolve_mode, rollout_is_weights

    entropy, entropy_coef = kw.get("entropy"), kw.get("entropy_coef")
    mode = resolve_mode(spec.rollout_is, on_gpu)
    denom = spec.denominator(int(counts["sequences"]), int(counts["tokens"])) / world
    entropy_denom = spec.entropy_denominator(int(counts["sequences"]), int(counts["tokens"])) / world
    coef = spec.entropy_coef if entropy_coef is None else entropy_coef
    old = logprobs.detach() if old is None else old
    is_weights, is_metrics = None, {}
    if engine_lp is not None and mode != "off":
        is_weights, is_metrics = rollout_is_weights(
            old, engine_lp, mask, mode=mode, cap=spec.rollout_is_cap, lower=spec.rollout_is_lower
        )
    loss, metrics = policy_loss(
        logprobs,
        old,
        adv,
        mask,
        clip_eps=spec.clip_eps,
        clip_eps_high=spec.clip_eps_high,
        objective=spec.objective,
        weights=weights,
        agg=spec.agg,
        denom=denom,
        entropy=entropy,
        entropy_coef=coef,
        entropy_agg=spec.entropy_agg,
        entropy_denom=entropy_denom,
        token_weights=is_weights,
        ref_logprobs=ref,
        beta=spec.beta,
    )
    tokens = mask.sum()
    diff = torch.where(mask, (old - engine_lp).abs(), 0.0).sum() if engine_lp is not None else 0.0
    return loss, {
        "loss": loss.detach(),
        "pg_loss": metrics["pg_loss"],
        "entropy": metrics.get("entropy", 0.0) * tokens,
        "clip_frac": metrics["clip_frac"] * tokens,
        "trained_tokens": tokens,
        "logprob_diff": diff,
        "logprob_gap": torch.where(mask, engine_lp - old, 0.0).sum() if engine_lp is not None else 0.0,
        "logprob_tokens": tokens if engine_lp is not None else 0.0,
        "is_weight": is_metrics.get("is_weight_mean", 0.0) * tokens,
        "is_capped": is_metrics.get("is_capped_frac", 0.0) * tokens,
        "is_tokens": tokens if is_weights is not None else 0.0,
        "is_masked": is_metrics.get("is_masked_frac", 0.0) * tokens,
        "is_masked_seqs": is_metrics.get("is_masked_seqs", 0.0),
        "is_seqs": is_metrics.get("is_seqs", 0.0),
        "kl_ref": metrics.get("kl_ref", 0.0) * tokens,
        "kl_tokens": tokens if "kl_ref" in metrics else 0.0,
    }


@pytest.mark.parametrize(
    "overrides, world, on_gpu, given",
    [
        ([], 1, False, ()),  # the toy's setting: on-policy, no importance weights on CPU
        (["loss.entropy_coef=0.01"], 3, True, ("engine",)),  # rollout_is unset: truncate on a GPU
        (["loss.agg=token_mean", "loss.rollout_is=token_mask"], 2, False, ("old", "engine")),
        (["loss.objective=gspo", "loss.agg=seq_mean", "loss.rollout_is=sequence_mask"], 4, False, ("engine",)),
        (["loss.objective=cispo", "loss.beta=0.05", "loss.clip_eps_high=0.28"], 2, False, ("old", "ref")),
        (["loss.entropy_agg=token_mean", "loss.entropy_coef=0.02", "loss.rollout_is=off"], 8, True, ("engine",)),
        (["loss.clip_eps=0.1", "loss.entropy_coef=0.01"], 1, False, ("old", "engine", "coef")),
    ],
)
def test_policy_loss_component_equals_the_engines_former_path(overrides, world, on_gpu, given):
    """Random tensors: the component's loss, gradient and sums are bit for bit those of the former path."""
    gen = torch.Generator().manual_seed(len(overrides) * 10 + world)
    n, length = 6, 9
    mask = torch.rand(n, length, generator=gen) < 0.8
    mask[0] = False  # an empty response
    base = -torch.rand(n, length, generator=gen) * 3
    extra = {
        "old": base + 0.1 * torch.randn(n, length, generator=gen),
        "engine": base + 0.3 * torch.randn(n, length, generator=gen),
        "ref": base + 0.2 * torch.randn(n, length, generator=gen),
    }
    args = dict(
        adv=torch.randn(n, generator=gen),
        weights=torch.tensor([1.0, 0.0, 1.0, 0.5, 1.0, 1.0]),
        counts={"sequences": 24.0, "tokens": 150.0},
        entropy=torch.rand(n, length, generator=gen),
        entropy_coef=0.003 if "coef" in given else None,
    )
    s = spec(*overrides)
    results = []
    for path in ("former", "component"):
        logprobs = base.clone().requires_grad_(True)
        tensors = {k: extra[k] if k in given else None for k in ("old", "engine", "ref")}
        if path == "former":
            loss, sums = engine_path(
                s,
                world,
                on_gpu,
                logprobs,
                mask,
                args["adv"],
                args["weights"],
                args["counts"],
                old=tensors["old"],
                engine_lp=tensors["engine"],
                ref=tensors["ref"],
                entropy=args["entropy"],
                entropy_coef=args["entropy_coef"],
            )
        else:
            loss, sums = PolicyLoss(s, world, on_gpu=on_gpu)(
                logprobs,
                mask,
                args["adv"],
                args["weights"],
                counts=args["counts"],
                old_logprobs=tensors["old"],
                engine_logprobs=tensors["engine"],
                ref_logprobs=tensors["ref"],
                entropy=args["entropy"],
                entropy_coef=args["entropy_coef"],
            )
        loss.backward()
        results.append((loss.detach(), logprobs.grad, sums))
    (former, former_grad, former_sums), (new, new_grad, new_sums) = results
    assert torch.equal(former, new) and torch.equal(former_grad, new_grad)
    assert former_sums.keys() == new_sums.keys()
    for key in former_sums:
        assert torch.equal(torch.as_tensor(former_sums[key]), torch.as_tensor(new_sums[key])), key


def test_policy_loss_component_hand_values():
    """The on-policy rule (no old log-probs: every ratio is 1), the divide-by-world step, the sums."""
    logprobs, _, adv, mask = _example()
    mask = mask.bool()
    loss_fn = PolicyLoss(spec(), world=2)  # dr_grpo, L_max = 10
    counts = {"sequences": 2, "tokens": 5}
    loss, sums = loss_fn(logprobs, mask, adv, torch.ones(2), counts=counts)
    # per token -A: seq 0 three tokens of -1, seq 1 two of +2: sum 1; over N * L_max / world = 2 * 10 / 2
    assert loss.item() == pytest.approx(1 / 10)
    assert sums["clip_frac"].item() == 0.0 and sums["trained_tokens"].item() == 5  # ratios of 1 never clip
    assert sums["loss"].item() == pytest.approx(0.1) and sums["logprob_tokens"] == 0.0 and sums["kl_tokens"] == 0.0
    alone, _ = PolicyLoss(spec(), world=1)(logprobs, mask, adv, torch.ones(2), counts=counts)
    # x world: DeepSpeed averages the ranks' gradients, and the loss is their sum
    assert loss.item() == pytest.approx(2 * alone.item())
    # the sampler's log-probs 0.5 above pi_old (0 here): |diff| 0.5 and a gap of +0.5 per token
    engine = {"old_logprobs": torch.zeros(2, 3), "engine_logprobs": torch.full((2, 3), 0.5)}
    _, sums = loss_fn(logprobs, mask, adv, torch.ones(2), counts=counts, **engine)
    assert sums["logprob_diff"].item() == pytest.approx(2.5) and sums["logprob_gap"].item() == pytest.approx(2.5)
    assert sums["is_tokens"] == 0.0  # loss.rollout_is unset: off on CPU, where both sides run the same math ...
    _, sums = PolicyLoss(spec(), world=2, on_gpu=True)(logprobs, mask, adv, torch.ones(2), counts=counts, **engine)
    assert sums["is_tokens"].item() == 5 and sums["is_weight"].item() == pytest.approx(5 * math.exp(-0.5))  # truncate


def test_policy_loss_component_counts_by_the_overlong_rule():
    lengths, cut = [3, 1, 2, 4], [True, False, False, True]
    assert PolicyLoss(spec()).counts(lengths, cut) == {"sequences": 4, "tokens": 10}
    assert PolicyLoss(spec("loss.overlong=soft_penalty")).counts(lengths, cut) == {"sequences": 4, "tokens": 10}
    assert PolicyLoss(spec("loss.overlong=mask")).counts(lengths, cut) == {"sequences": 2, "tokens": 3}
    assert PolicyLoss(spec("loss.overlong=mask")).counts([], []) == {"sequences": 0, "tokens": 0}
