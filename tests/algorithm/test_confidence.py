import math

import pytest
import torch

from trapo.algorithm.rewards import self_certainty_reward, sentence_likelihood_reward, token_entropy_reward

# One response of two tokens (plus one padded position with wild logits).
# Position 0: uniform over 2 -> p = [.5, .5]; position 1: p = [.75, .25].
LOGITS = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [100.0, -100.0]]])
MASK = torch.tensor([[1, 1, 0]])


def test_self_certainty_hand_value():
    # KL(U || p) = 0 at position 0, .5 ln(.5/.75) + .5 ln(.5/.25) = .5 ln(4/3) at position 1.
    expected = (0.0 + 0.5 * math.log(4 / 3)) / 2
    assert self_certainty_reward(LOGITS, MASK).item() == pytest.approx(expected, abs=1e-6)


def test_token_entropy_hand_value():
    h0 = math.log(2)
    h1 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert token_entropy_reward(LOGITS, MASK).item() == pytest.approx(-(h0 + h1) / 2, abs=1e-6)


def test_sentence_likelihood_hand_value():
    logprobs = torch.tensor([[math.log(0.5), math.log(0.75), -50.0]])
    assert sentence_likelihood_reward(logprobs, MASK).item() == pytest.approx(math.log(0.375), abs=1e-6)


def test_confident_response_scores_higher_on_all_three():
    sharp = torch.tensor([[[5.0, 0.0, 0.0]]])
    flat = torch.zeros(1, 1, 3)
    mask = torch.ones(1, 1)
    assert self_certainty_reward(sharp, mask) > self_certainty_reward(flat, mask)
    assert token_entropy_reward(sharp, mask) > token_entropy_reward(flat, mask)
    lp_sharp = torch.log_softmax(sharp, -1)[..., 0]
    lp_flat = torch.log_softmax(flat, -1)[..., 0]
    assert sentence_likelihood_reward(lp_sharp, mask) > sentence_likelihood_reward(lp_flat, mask)


def test_empty_response_scores_zero():
    mask = torch.zeros(1, 3)
    assert self_certainty_reward(LOGITS, mask).item() == 0.0
    assert token_entropy_reward(LOGITS, mask).item() == 0.0
