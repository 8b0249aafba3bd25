"""Policy pieces that need no model."""

import pytest

from trapo.policy import Policy


def test_reference_logprobs_need_a_reference_model():
    policy = Policy.__new__(Policy)  # loss.beta = 0: no reference model was loaded
    policy.engine, policy.ref = object(), None
    with pytest.raises(ValueError, match="loaded only when loss.beta > 0"):
        policy.with_logprobs([], "ref_logprobs")
