"""rollout.placement separate with vLLM on the rollout rank (the toy: one training rank and one rollout rank,
as the deepspeed launcher's 2 processes): staleness 0 against the colocated vLLM trainer (conftest's
vllm_run); staleness 1, its kill -9 and resume, a SIGTERM to the group and its resume; a rollout rank that
dies. The hf rollout rank's own tests: test_separate_runs.py."""

import os
import signal
import time

import pytest
from toyrun import NOT_COMPARED, VLLM, VLLM_RUN, Ranks, metrics, overrides, rows, same_weights, selections, train

pytestmark = pytest.mark.toy_run
SEPARATE = {"rollout.placement": "separate", "rollout.ranks": 1}
STALE = {**VLLM_RUN, **SEPARATE, "rollout.max_staleness": 1}
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


@pytest.fixture(scope="module")
def stale_vllm_run(toy_dir, tmp_path_factory):
    """An uninterrupted separate vLLM run at rollout.max_staleness 1."""
    out = tmp_path_factory.mktemp("stale_vllm")
    train(overrides(toy_dir, out, run_name="stale", **STALE), nproc=2)
    return out / "stale"


def test_staleness_1_lags_one_update_and_resumes_exactly_after_kill_9(toy_dir, tmp_path, stale_vllm_run):
    m = metrics(stale_vllm_run)
    assert [row["rollout_staleness"] for row in m] == [0] + [1] * 7  # round 1: the initial weights
    assert abs(m[0]["staleness_kl"]) < 1e-5 < max(abs(row["staleness_kl"]) for row in m[1:])
    args = overrides(toy_dir, tmp_path, run_name="killed", **STALE)
    ranks = Ranks(args, nproc=2)
    log = tmp_path / "killed" / "metrics.jsonl"
    try:
        deadline = time.time() + 300
        while (
            time.time() < deadline
            and ranks.procs[0].poll() is None
            and (not log.is_file() or len(log.read_text().splitlines()) < 5)
        ):
            time.sleep(0.1)
        assert ranks.procs[0].poll() is None and len(log.read_text().splitlines()) >= 5, "no kill after step 5"
    finally:
        os.killpg(ranks.pgid, signal.SIGKILL)  # the training rank and the rollout rank with its engine
        ranks.wait()
    train([*args, "resume_from=latest"], nproc=2)
    assert rows(tmp_path / "killed") == rows(stale_vllm_run)
    assert selections(tmp_path / "killed") == selections(stale_vllm_run)
    assert same_weights(tmp_path / "killed", stale_vllm_run)


def test_vllm_is_named_for_the_rollout_rank_and_a_tensor_parallel_engine_refused(toy_dir, tmp_path):
    """A separate rollout rank runs one engine of its own: rollout.tensor_parallel_size > 1 is refused before
    anything starts, in one line naming the key and the fix."""
    args = overrides(toy_dir, tmp_path, run_name="tp", **VLLM, **SEPARATE, **{"rollout.tensor_parallel_size": 2})
    out = train(args, nproc=2, check=False)
    assert out.returncode == 2
    assert "rollout.tensor_parallel_size" in out.stderr and "set rollout.tensor_parallel_size=1" in out.stderr


def test_sigterm_to_the_group_saves_the_round_in_flight_and_resumes_equal(toy_dir, tmp_path, stale_vllm_run):
    import torch

    args = overrides(toy_dir, tmp_path, run_name="term", **STALE)
    ranks = Ranks(args, nproc=2)
    log = tmp_path / "term" / "metrics.jsonl"
    deadline = time.time() + 300
    while (
        time.time() < deadline
        and ranks.procs[0].poll() is None
        and (not log.is_file() or len(log.read_text().splitlines()) < 3)
    ):
        time.sleep(0.05)
    os.killpg(ranks.pgid, signal.SIGTERM)  # the training rank and the rollout rank with its engine
    err = ranks.wait(timeout=300).stderr
    stopped_at = len(log.read_text().splitlines())
    assert stopped_at < 8 and f"stopped by a signal after step {stopped_at}" in err, err[-3000:]
    state = torch.load(tmp_path / "term" / "checkpoints" / f"step-{stopped_at}" / "trainer_state.pt", weights_only=True)
    assert [version for _, version, _ in state["rounds_in_flight"]] == [stopped_at - 1]  # the next round, one behind
    train([*args, "resume_from=latest"], nproc=2)
    assert rows(tmp_path / "term") == rows(stale_vllm_run)
    assert same_weights(tmp_path / "term", stale_vllm_run)


def test_a_dead_vllm_rollout_rank_stops_the_run_in_one_line_naming_it(toy_dir, tmp_path):
    args = overrides(toy_dir, tmp_path, run_name="dead", **STALE, dist_timeout_minutes=1)
    ranks = Ranks(args, nproc=2)
    trainer, rollout = ranks.procs
    log = tmp_path / "dead" / "metrics.jsonl"
    deadline = time.time() + 300
    while (
        time.time() < deadline
        and trainer.poll() is None
        and (not log.is_file() or len(log.read_text().splitlines()) < 2)
    ):
        time.sleep(0.1)
    rollout.send_signal(signal.SIGKILL)
    rollout.wait()
    trainer.wait(timeout=120)
    out = ranks.wait()
    assert trainer.returncode == 3, out.stderr[-2000:]
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "rollout link" in line]
    assert len(lines) == 1 and "rollout rank 0 (link rank 1) stopped answering" in lines[0], out.stdout + out.stderr
