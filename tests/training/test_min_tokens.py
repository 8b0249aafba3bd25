"""rollout.min_tokens: the engine samples the first min_tokens response tokens with the stop tokens held back, and
the policy's log-probs there are of the same distribution (trapo/algorithm/logits.py held rows), so forced lengths
raise no health alarm on either backend."""

import pytest
from toyrun import VLLM, metrics, overrides, train


@pytest.mark.toy_run
@pytest.mark.parametrize("backend", [{}, VLLM], ids=["hf", "vllm"])
def test_forced_lengths_keep_engine_and_policy_log_probs_equal(toy_dir, tmp_path, backend):
    # 3 steps: rollout.health.steps suspect steps in a row would stop the run at step 3
    args = {"rollout.min_tokens": 32, "rollout.max_tokens": 32, "max_steps": 3, **backend}
    train(overrides(toy_dir, tmp_path, run_name="forced", **args))
    rows = metrics(tmp_path / "forced")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["truncated_frac"] == 1.0 for r in rows)  # every answer forced to the limit
    assert all(r["logprob_diff_rollout_vs_policy"] < 1e-5 for r in rows), [
        r["logprob_diff_rollout_vs_policy"] for r in rows
    ]
