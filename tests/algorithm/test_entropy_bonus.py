"""The entropy bonus on hand-built tensors: how it grows with response length under each loss.agg and
loss.entropy_agg (docs/policy-update.md), and the adaptive coefficient (trapo/algorithm/entropy_control.py)."""

import pytest
import torch

from trapo.algorithm.entropy_control import EntropyControl
from trapo.algorithm.loss import LossSpec, loss_denominator, policy_loss
from trapo.config import ConfigError, load_config
from trapo.training.settings import loss_spec

L_MAX = 4  # rollout.max_tokens: dr_grpo's constant denominator is N * L_MAX = 8


def bonus(length: int, agg: str, entropy_agg: str = "loss") -> tuple[float, torch.Tensor]:
    """(the bonus, d bonus / d H per token) of 2 responses of `length` tokens, every token's entropy 1 nat.
    logprobs = old and advantages 0, so the loss is -coef * bonus alone; coef = 1."""
    mask = torch.zeros(2, L_MAX)
    mask[:, :length] = 1.0
    lp = torch.zeros(2, L_MAX)
    entropy = torch.ones(2, L_MAX, requires_grad=True)
    denom = loss_denominator(agg, 2, int(mask.sum()), L_MAX)
    loss, metrics = policy_loss(
        lp, lp, torch.zeros(2), mask, agg=agg, denom=denom, entropy=entropy, entropy_coef=1.0, entropy_agg=entropy_agg
    )
    loss.backward()
    assert metrics["entropy"] == 1.0  # the measured mean entropy does not depend on the aggregation
    return -loss.item(), -entropy.grad


@pytest.mark.parametrize(
    "agg, entropy_agg, short, long",
    [
        ("dr_grpo", "loss", 4 / 8, 8 / 8),  # sum(H) / (N * L_MAX): twice the tokens, twice the bonus
        ("dr_grpo", "token_mean", 1.0, 1.0),  # sum(H) / tokens: the mean, whatever the length
        ("token_mean", "loss", 4 / 4, 8 / 8),
        ("seq_mean", "loss", (2 / 2 + 2 / 2) / 2, (4 / 4 + 4 / 4) / 2),
    ],
)
def test_the_bonus_grows_with_length_only_under_dr_grpo_aggregated_like_the_loss(agg, entropy_agg, short, long):
    (b_short, g_short), (b_long, g_long) = bonus(2, agg, entropy_agg), bonus(4, agg, entropy_agg)
    assert (b_short, b_long) == pytest.approx((short, long))
    if (agg, entropy_agg) == ("dr_grpo", "loss"):
        # every response token, the extra ones included, is paid the same 1 / (N * L_MAX) per nat
        assert torch.equal(g_long, torch.full((2, L_MAX), 1 / 8))
        assert torch.equal(g_short[:, :2], torch.full((2, 2), 1 / 8)) and not g_short[:, 2:].any()
    if (agg, entropy_agg) == ("dr_grpo", "token_mean"):
        assert torch.allclose(g_short[:, :2], torch.full((2, 2), 1 / 4)) and torch.allclose(
            g_long, torch.full((2, 4), 1 / 8)
        )


def test_token_mean_bonus_over_micro_batches_adds_up_to_the_full_batch():
    """entropy_denom: the full batch's token count, so the halves' bonuses add up to the whole's."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    entropy = torch.tensor([[0.5, 1.0, 1.5, 9.0], [2.0, 9.0, 9.0, 9.0]])
    lp = torch.zeros(2, 4)

    def run(rows, **kw):
        loss, _ = policy_loss(
            lp[rows],
            lp[rows],
            torch.zeros(len(rows)),
            mask[rows],
            entropy=entropy[rows],
            entropy_coef=1.0,
            entropy_agg="token_mean",
            denom=8.0,
            **kw,
        )
        return -loss.item()

    whole = run([0, 1])
    assert whole == pytest.approx((0.5 + 1.0 + 1.5 + 2.0) / 4)
    assert run([0], entropy_denom=4.0) + run([1], entropy_denom=4.0) == pytest.approx(whole)
    with pytest.raises(ValueError, match="entropy_agg must be one of"):
        policy_loss(lp, lp, torch.zeros(2), mask, entropy=entropy, entropy_agg="sum")


def spec(*overrides: str) -> LossSpec:
    return loss_spec(load_config(None, ["toy.enabled=true", "rollout.max_tokens=10", *overrides]))


def test_loss_spec_entropy_rules():
    today = spec()
    assert today.entropy_agg == "loss" and today.entropy_target is None
    assert today.entropy_denominator(4, 17) == today.denominator(4, 17) == 40.0  # dr_grpo: N * L_max
    mean = spec("loss.entropy_agg=token_mean")
    assert mean.entropy_denominator(4, 17) == 17.0 and mean.denominator(4, 17) == 40.0
    # an adaptive coefficient may leave 0 again: a zero-advantage sequence is no longer exactly inert
    adaptive = spec("loss.entropy_coef=0.0", "loss.entropy_target=0.3")
    assert not adaptive.zero_advantage_no_gradient and spec("loss.entropy_coef=0.0").zero_advantage_no_gradient


@pytest.mark.parametrize(
    "override, key",
    [
        ("loss.entropy_agg=sum", "loss.entropy_agg"),
        ("loss.entropy_target=-1", "loss.entropy_target"),
        ("loss.entropy_coef=-0.01", "loss.entropy_coef"),
        ("rollout.rambling.truncated=1.5", "rollout.rambling.truncated"),
        ("rollout.rambling.entropy_factor=1.0", "rollout.rambling.entropy_factor"),
        ("rollout.rambling.stop_steps=0", "rollout.rambling.stop_steps"),
    ],
)
def test_bad_entropy_and_rambling_settings_are_one_line_errors(override, key):
    with pytest.raises(ConfigError, match=f"key '{key}'") as err:
        load_config(None, ["toy.enabled=true", override])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="loss.entropy_coef_max"):  # the start must lie in the clamp
        load_config(None, ["toy.enabled=true", "loss.entropy_target=0.3", "loss.entropy_coef=0.1"])


def test_the_adaptive_coefficient_steps_toward_the_target_and_is_clamped():
    """Hand-computed: target 0.5 nats, start 0.01, step 0.004, clamp [0, 0.02]."""
    lo = load_config(
        None,
        ["toy.enabled=true", "loss.entropy_target=0.5", "loss.entropy_coef_step=0.004", "loss.entropy_coef_max=0.02"],
    ).loss
    control = EntropyControl.from_config(lo)
    assert control.coef == 0.01
    expected = [
        (0.3, 0.014),  # below the target: up
        (0.3, 0.018),
        (0.3, 0.02),  # clamped at entropy_coef_max
        (1.2, 0.016),  # rambling: down
        (None, 0.016),  # no trained token: unchanged
        (0.5, 0.016),  # on target: unchanged
        (1.2, 0.012),
        (1.2, 0.008),
        (1.2, 0.004),
        (1.2, 0.0),
        (1.2, 0.0),  # clamped at 0
    ]
    for entropy, coef in expected:
        assert control.update(entropy) == pytest.approx(coef, abs=1e-12)
    resumed = EntropyControl.from_config(lo)
    resumed.load_state_dict(control.state_dict())
    assert resumed == control and resumed.update(0.1) == pytest.approx(0.004)
    assert EntropyControl.from_config(load_config(None, ["toy.enabled=true"]).loss) is None  # fixed coefficient
