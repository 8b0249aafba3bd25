"""rollout.placement separate with vLLM on the rollout rank (the toy: one training rank and one rollout rank,
as the deepspeed launcher's 2 processes): staleness 0 against the colocated vLLM trainer (conftest's
vllm_run), auto choosing vLLM; a tensor-parallel engine refused. Staleness 1, kill -9, SIGTERM and a dead
rollout rank run with either engine in test_separate_runs.py."""

import pytest
from toyrun import NOT_COMPARED, VLLM, VLLM_RUN, metrics, overrides, rows, same_weights, selections, train

pytestmark = pytest.mark.toy_run
SEPARATE = {"rollout.placement": "separate", "rollout.ranks": 1}
ONLY_SEPARATE = {"rollout_staleness", "staleness_kl", "rollout_generate_s"}  # colocated lags nothing
NOISE = "logprob_diff_rollout_vs_policy"  # the engine's log-probs beside the policy's: float rounding either way


@pytest.mark.xdist_group("vllm_run")
def test_staleness_0_writes_what_the_colocated_vllm_trainer_writes(toy_dir, tmp_path, vllm_run):
    # the default backend, auto, chooses vLLM for the rollout rank where it is installed, and says so
    run = {**VLLM_RUN, **SEPARATE, "rollout.backend": "auto"}
    out = train(overrides(toy_dir, tmp_path, run_name="separate", **run), nproc=2)
    separate = tmp_path / "separate"
    log = (separate / "log.txt").read_text()
    assert "rollout.backend auto: vllm (vLLM is installed)" in log, out.stdout[-2000:]
    assert "rollout rank 0 vllm on cpu" in log
    leave_out = NOT_COMPARED | ONLY_SEPARATE | {NOISE}
    assert rows(vllm_run, leave_out) == rows(separate, leave_out)  # loss, rewards, pass rates, gate, pushed_gb...
    assert [r[NOISE] for r in metrics(separate)] == pytest.approx([r[NOISE] for r in metrics(vllm_run)], abs=1e-6)
    assert [row["rollout_staleness"] for row in metrics(separate)] == [0] * 8
    assert selections(vllm_run) == selections(separate)
    assert same_weights(vllm_run, separate)


def test_vllm_is_named_for_the_rollout_rank_and_a_tensor_parallel_engine_refused(toy_dir, tmp_path):
    """A separate rollout rank runs one engine of its own: rollout.tensor_parallel_size > 1 is refused before
    anything starts, in one line naming the key and the fix."""
    args = overrides(toy_dir, tmp_path, run_name="tp", **VLLM, **SEPARATE, **{"rollout.tensor_parallel_size": 2})
    out = train(args, nproc=2, check=False)
    assert out.returncode == 2
    assert "rollout.tensor_parallel_size" in out.stderr and "set rollout.tensor_parallel_size=1" in out.stderr
